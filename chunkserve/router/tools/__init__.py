"""Tools over the router package (benchmarks, simulators, reports): run as commands, never
imported by the runtime."""
