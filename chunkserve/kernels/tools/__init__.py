"""Tools over the kernels package (benchmarks, simulators, reports): run as commands, never
imported by the runtime."""
