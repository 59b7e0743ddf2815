"""Tools over the cluster package, run as commands, never imported by the runtime.

compare_routers   the prefix router against Serve's power of two over real Serve
"""
