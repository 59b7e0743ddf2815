"""The load test: multi-tenant shared-prefix traffic over HTTP, from one process or a Ray cluster.

    python -m chunkserve.cluster.loadtest --workload gsp --request-rate 8 --num-prompts 256
    python -m chunkserve.cluster.loadtest --workload tenants --sweep 2,4,8 --goodput ttft:2,tpot:50 --plot plots/
    python -m chunkserve.cluster.loadtest --address auto --workload gsp --request-rate 64    # clients on every node
    python -m chunkserve.cluster.loadtest --dataset conversation_trace.jsonl --replay --trace-window 0:600

A run sends a seeded workload (`workloads`: gsp, tenants, prefix_repetition, random, or a
trace) at Poisson or gamma arrivals (`--request-rate`, `--burstiness`), optionally capped
(`--max-concurrency`), or at a trace's own times (`--replay`, `--replay-speed`), as streaming
OpenAI requests (`client`), and prints one JSON report per run (`metrics`: vLLM's `bench
serve` keys where the metric is the same, plus cached fraction, per-tenant hit rates,
per-replica load, errors by kind, goodput, client overhead).
Tenants: each tenant's requests may carry its own API key (`--tenant-key-prefix`: PREFIX + the
tenant's label; `--tenant-keys FILE`: a JSON object label -> key) and its label as `cache_salt`
(`--cache-salt-per-tenant`); a 429 is recorded as a rate-limited rejection with its
Retry-After. The report's `tenants` is the client's view per tenant, `server_tenants` the
server's: its `chunkserve_tenant_*` counters on /metrics (`--metrics-key`) before and after the
run, their growth summed over replicas ({} for a server without them). Likewise the router's
predictions of cached tokens: `predictions` per response (its prediction header against its
usage), `server_router` from the `chunkserve_router_*` counters.
`--sweep` runs several rates, `--search-goodput` finds the highest rate meeting SLOs,
`--save-result` keeps the reports with their per-request lists, `--plot` draws them.
With `--address` the requests are shared among client actors on the cluster's nodes
(`distributed`), each sending to its node's Serve proxy or to `--url` (a server bound to
127.0.0.1 only stops the run, saying to use `--url`). Every request names the model
(`--model`, else the server's `/v1/models`; a run that cannot learn it stops). Prompts are real text
where the server tokenizes (`/tokenize`, `/detokenize`: `render`), token ids otherwise.

Traces (`--dataset`): our JSON lines (`prompt` or `messages`), or Mooncake's and Alibaba
Bailian's block traces (`traces`): per line `timestamp` (Mooncake ms, Bailian s),
`input_length`, `output_length` and `hash_ids`, each id a block of `--trace-block-size` tokens
(Mooncake 512, Bailian 16; the last block partial) that is the same tokens wherever it recurs,
so the trace's prefix sharing is replayed; Bailian's `chat_id` / `parent_chat_id` / `turn` are
kept as session labels. `--trace-window START:END` (seconds of the trace) and
`--max-input-len` (counted in the report) choose what is sent.

Files: workloads.py (specs and arrivals), traces.py (block traces, windows), render.py (specs
-> requests), client.py (sending and records), metrics.py (the report), distributed.py (Ray
client actors), capacity.py (the client's own limit), peer.py (serve a peer such as vLLM and load it), stack.py
(serve one of our configs and load it), plots.py, cli.py. A tool: the runtime never imports it.
"""
