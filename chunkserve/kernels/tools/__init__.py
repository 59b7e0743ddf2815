"""Tools over the kernels package, run as commands, never imported by the runtime.

bench, bench_prefill, bench_dense_prefill
                      side-by-side kernel benchmarks (JSON lines)
timeline              per-program timelines of the TPP kernels on the GPU
sm90_report           what the attend kernel compiles to on sm90
"""
