"""One model replica: the engine core, and the shell that runs it as a Serve deployment.

engine/          the engine core (no process, Ray or HTTP): LLMEngine.step() and its parts
model/           Llama-family models: weights, tensor-parallel layers, tokenizers, presets
deployment       LLMReplica, the Serve deployment: requests in, token streams out
engine_process   the engine in a process of its own, driven over one pipe
parallel         tensor parallelism: one process per rank, each with a whole engine
direct_stream    an ingress's requests and their outputs over a TCP stream, past Serve's handles
wire             the typed messages between ingress, replica, engine process and ranks
tools            engine benchmarks and profiles (bench, bench_host_tier, profile_decode, ...)
"""
