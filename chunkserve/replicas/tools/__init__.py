"""Tools over the replicas package (benchmarks, simulators, reports): run as commands, never
imported by the runtime."""
