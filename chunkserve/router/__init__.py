"""Prefix-aware routing, beside the layers: which replica a prompt goes to.

hashing        chained, process-independent hashes of a prompt's leading chunks
events         a replica's chunk-tree changes as numbered deltas; the relay that serves them
frames         length-prefixed pickle frames and listening sockets: the direct streams' and peers' wire
index          one router's map  chain of hashes -> replicas holding a prefix of it
policy         the choice: rendezvous placement, cache affinity, load bounded as work
serve_router   PrefixAffinityRouter, the policy as Ray Serve's request router
direct         this process's routers for the ingress's direct streams
peers          routers that book each other's decisions (router.share_decisions)
tools          the routing simulator (simulate) and the events benchmark (bench_events)
"""
