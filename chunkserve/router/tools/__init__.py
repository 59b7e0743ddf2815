"""Tools over the router package, run as commands, never imported by the runtime.

simulate      N replicas behind k routers, per policy and workload (discrete events)
bench_events  what a router's index pays to follow N replicas' caches
"""
