"""chunkserve: prefix-sharing LLM serving on Ray Serve (DESIGN.md).

Layers point down: `chunkserve.cluster` (the Serve app, its HTTP API, the load test) ->
`chunkserve.replicas` (the engine of one replica) -> `chunkserve.kernels` (attention and sampling
kernels, each beside its plain-torch reference); `chunkserve.router` (prefix-aware routing) beside.
"""
