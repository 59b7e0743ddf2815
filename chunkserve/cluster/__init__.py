"""The Serve application: its HTTP API, tenants, metrics, and the tools that deploy and load-test it.

app           build_app: a Serve config's args -> OpenAIIngress in front of LLMReplica deployments
config        AppConfig, the `args:` of configs/*.yaml (pydantic, the edge)
ingress       OpenAIIngress: the routes, each read top-down (key -> prompts -> replica calls -> response)
prompts       a request body -> checked token prompts and GenerateRequests (templates, limits, salt)
replica_calls calling the replicas: direct stream or Serve handle, deadline, one retry, n choices
responses     outputs -> OpenAI bodies and SSE (echo, logprobs, reasoning, tool calls, usage)
errors        APIError, OpenAI's error body, and the app's error handlers
front         HTTPFront: an ingress replica serving its app on a port of its own (SO_REUSEPORT)
protocol      OpenAI request and response schemas; tool_calls, reasoning, logprobs: their text forms
tenants       who a request is for, whom its cached prompts are shared with, its limits
metrics       the chunkserve_* Prometheus series of every replica
local         LocalCluster: a multi-node Ray cluster on one machine
loadtest      `python -m chunkserve.cluster.loadtest`: workloads, clients, peers, reports
tools         benchmarks over the cluster (compare_routers)
"""
