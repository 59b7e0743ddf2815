"""The load test: multi-tenant shared-prefix traffic over HTTP, from one process or a Ray cluster.

    python -m chunkserve.cluster.loadtest --workload gsp --request-rate 8 --num-prompts 256
    python -m chunkserve.cluster.loadtest --workload tenants --sweep 2,4,8 --goodput ttft:2,tpot:50 --plot plots/
    python -m chunkserve.cluster.loadtest --address auto --workload gsp --request-rate 64    # clients on every node

A run sends a seeded workload (`workloads`: gsp, tenants, prefix_repetition, random, or a
JSON-lines trace) at Poisson or gamma arrivals (`--request-rate`, `--burstiness`), optionally
capped (`--max-concurrency`), as streaming OpenAI requests (`client`), and prints one JSON
report per run (`metrics`: vLLM's `bench serve` keys where the metric is the same, plus cached
fraction, per-tenant hit rates, per-replica load, errors by kind, goodput, client overhead).
Tenants: each tenant's requests may carry its own API key (`--tenant-key-prefix`: PREFIX + the
tenant's label; `--tenant-keys FILE`: a JSON object label -> key) and its label as `cache_salt`
(`--cache-salt-per-tenant`); a 429 is recorded as a rate-limited rejection with its
Retry-After. The report's `tenants` is the client's view per tenant, `server_tenants` the
server's: its `chunkserve_tenant_*` counters on /metrics (`--metrics-key`) before and after the
run, their growth summed over replicas ({} for a server without them).
`--sweep` runs several rates, `--search-goodput` finds the highest rate meeting SLOs,
`--save-result` keeps the reports with their per-request lists, `--plot` draws them.
With `--address` the requests are shared among client actors on the cluster's nodes
(`distributed`), each sending to its node's Serve proxy or to `--url`. Prompts are real text
where the server tokenizes (`/tokenize`, `/detokenize`: `render`), token ids otherwise.

Files: workloads.py (specs and arrivals), render.py (specs -> requests), client.py (sending
and records), metrics.py (the report), distributed.py (Ray client actors), capacity.py (the
client's own limit), plots.py, cli.py. A tool: the runtime never imports it.
"""
