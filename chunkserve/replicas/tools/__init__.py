"""Tools over the replicas package, run as commands, never imported by the runtime.

bench                  engine throughput on shared-prefix batches, Poisson arrivals
bench_host_tier        the host tier: hits, loads, recompute
bench_sampler          sampling cost per step
bench_sparse_accuracy  block-union sparse prefill's accuracy on a trained model, through the engine
bench_wire             the wire messages' cost: build, check and pickle, against a tagged tuple
profile_decode         where a decode (or mixed) step's time goes
"""
