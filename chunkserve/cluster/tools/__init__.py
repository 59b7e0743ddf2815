"""Tools over the cluster package (benchmarks, simulators, reports): run as commands, never
imported by the runtime."""
