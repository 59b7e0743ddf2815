"""GPU kernels (Triton, FlashInfer), each beside its plain-torch reference.

tpp, tpp_plan, tpp_torch   two-phase partition decode attention over the prefix tree: the
                           Triton kernels, their work lists, the batched-torch CPU path
reference                  plain-torch attention over the chunked cache: the oracle
block_union, block_union_triton
                           block-union sparse KV selection for long prefills; its Triton kernels
paged_prefill, fi_decode   FlashInfer's paged prefill and decode over our chunk pool
heads                      PagedHeads: the shape those wrappers and tpp_plan's fixed plans take
norm_rope                  fused RMSNorm, rotary embedding, SiLU-and-multiply, the K/V store
nucleus, philox            top-p without a sort; counter-based random numbers
launch                     launching compiled Triton kernels past the dispatcher
tools                      kernel benchmarks, timelines, sm90 reports
"""
