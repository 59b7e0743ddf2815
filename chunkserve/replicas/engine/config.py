"""EngineConfig: one engine's settings, handed whole to its parts, its run-mode switches resolved
once (`resolved()`): after it no part decides "auto" or None for itself."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from chunkserve.kernels.block_union import BlockUnion

BACKENDS = ("auto", "reference", "torch", "triton")  # attention backends

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    model: str  # Hugging Face directory or preset name (chunkserve/replicas/model/presets/<name>.json)
    chunk_size: int = 64
    enable_prefix_sharing: bool = True
    kv_cache_tokens: int | None = None  # pool size; None: 32768 on CPU, a share of free memory on GPU
    gpu_memory_utilization: float = 0.9  # share of free GPU memory the pool may take (when sized automatically)
    # The host tier (DESIGN §6): tokens of K/V kept in host memory (pinned on CUDA; on the CPU a
    # second tensor) for chunks the pool evicts; a request matching them copies them back instead
    # of recomputing them. 0: none (evicted chunks are dropped). Every tensor-parallel rank holds
    # its own heads' share of each chunk.
    host_cache_tokens: int = 0
    # With a host tier: tokens of cached chunks kept copied to host ahead of their eviction while
    # the pool runs short (PrefixTree.write_ahead), so that an eviction copies nothing and the step
    # that evicts waits for no copy. None: two steps' worth (2 x max_num_batched_tokens), at most
    # half the host tier or half the pool; 0: none (each spill copies as it evicts).
    host_write_ahead_tokens: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context, capped by the pool
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto (float32 on CPU, bfloat16 on GPU, whatever the checkpoint) | float32 | float16 | bfloat16
    dtype: str = "auto"
    seed: int = 0  # preset weights and requests' default sampling seeds
    tp_rank: int = 0
    tp_size: int = 1
    attention_backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | triton | torch | reference
    # triton backend, eager engines (enforce_eager): decode a batch with nothing shared through
    # FlashInfer's paged decode (GQA, 16-bit caches, flashinfer installed), faster there than TPP
    # without a phase 1. Engines with CUDA graphs decode it through TPP: a whole-step graph through
    # TPP beats an eager step through FlashInfer (not yet compared under the piecewise graphs,
    # between whose pieces either could run; figures: chunkserve/cluster/loadtest/records/README.md,
    # 'Figures behind the code').
    flashinfer_fallback: bool = True
    # triton backend: a step's prefill spans through FlashInfer's paged prefill, one launch per
    # layer over the pool as it is (16-bit caches, head size 64/128/256, flashinfer installed;
    # chunkserve/kernels/paged_prefill.py), not the plain-torch reference span by span, which takes several
    # times as long (figures: chunkserve/cluster/loadtest/records/README.md, 'Figures behind the code')
    flashinfer_prefill: bool = True
    # CUDA: False runs steps' forwards from CUDA graphs (the piecewise graphs below; whole-step
    # graphs too with decode_graphs); True launches every kernel from Python (vLLM's option)
    enforce_eager: bool = False
    # The forward's pieces between attentions as CUDA graphs per token-count bucket, for the steps
    # no whole-step graph runs (mixed steps, decode plans no fixed plan holds): chunkserve/replicas/engine/piecewise.py.
    # None: on CUDA with the triton backend unless enforce_eager; True on the CPU runs the same
    # pieces as plain calls (tests); False: those steps run eagerly.
    piecewise_graphs: bool | None = None
    # Decode-only steps replay a whole-step CUDA graph per padded batch size up to max_num_seqs,
    # captured when the engine is built and valid for any TPP plan of its size (fixed plans:
    # chunkserve/replicas/engine/cuda_graph.py); decode steps whose plan does not fit one, and mixed steps, run
    # from the piecewise graphs. None: on CUDA with the triton backend unless enforce_eager;
    # True on the CPU (triton backend) runs the same path as plain calls (tests); False: every
    # step from the piecewise graphs (figures: chunkserve/cluster/loadtest/records/README.md, call N).
    decode_graphs: bool | None = None
    # With decode_graphs, a step holding prefill tokens replays the decode graph of its token
    # count too where it fits (at most max_num_seqs tokens, dense pieces): each prefill token a
    # decode row of the TPP plan, of its causal length, FlashInfer's prefill not launched
    # (Attention._plan_rows). False: such steps run from the piecewise graphs.
    graph_mixed_steps: bool = True
    # Prepare and queue each step while the device runs the one before, collecting that one's
    # tokens after (vLLM's option of the name); None: on for CUDA, off elsewhere (the CPU runs
    # the step itself: nothing to overlap). A sequence's next step is then scheduled before its
    # last token is known: one that ends on a stop token has run one token more, which is
    # dropped (never emitted or counted); one that ends by length does not. A step's host work
    # then hides behind the device's, most where it is longest, sampling rows (figures:
    # chunkserve/cluster/loadtest/records/README.md, 'Figures behind the code').
    async_scheduling: bool | None = None
    # Block-union sparse prefill (DESIGN §8, chunkserve/kernels/block_union.py): a prefill piece after at
    # least sparse_prefill.min_context cached tokens attends only the context blocks its queries
    # score high on (approximate attention: outputs change). None (default): every prefill is
    # dense, exact. A dict is taken as BlockUnion's fields; BlockUnion(budget=...) is planned once
    # a step, and prefills a long prompt faster than dense (figures:
    # chunkserve/cluster/loadtest/records/README.md, 'Figures behind the code'). The pool then keeps each
    # chunk's key bounds per layer ([max | min] per dimension, in K's dtype: 2/c of K's size again).
    sparse_prefill: BlockUnion | dict | None = None

    def __post_init__(self):
        if isinstance(self.sparse_prefill, dict):
            object.__setattr__(self, "sparse_prefill", BlockUnion(**self.sparse_prefill))
        if self.chunk_size not in (16, 32, 64, 128):
            raise ValueError(f"chunk_size must be 16, 32, 64 or 128, got {self.chunk_size}")
        if self.sparse_prefill is not None:
            self.sparse_prefill.check_chunk_size(self.chunk_size)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.host_cache_tokens, bool) or not isinstance(self.host_cache_tokens, int):
            raise ValueError(f"host_cache_tokens must be an integer, got {self.host_cache_tokens!r}")
        if self.host_cache_tokens < 0:
            raise ValueError(f"host_cache_tokens must be >= 0 (0: no host tier), got {self.host_cache_tokens}")
        w = self.host_write_ahead_tokens
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise ValueError(f"host_write_ahead_tokens must be None or an integer >= 0, got {w!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.chunk_size:
            raise ValueError(
                f"kv_cache_tokens must hold at least one chunk ({self.chunk_size}), got {self.kv_cache_tokens}"
            )

    def resolved(self) -> EngineConfig:
        """This config with every run-mode switch decided for the device it runs on (the
        engine's own, built once): device and dtype named, the attention backend chosen, the
        graphs, FlashInfer's decode fallback and asynchronous scheduling on or off. A part reads
        these as they are."""
        device = resolve_device(self.device)
        cuda = device.type == "cuda"
        backend = self.attention_backend
        if backend == "auto":
            backend = "triton" if cuda else "torch"
        dtype = self.dtype if self.dtype != "auto" else ("float32" if device.type == "cpu" else "bfloat16")
        triton = backend == "triton"
        # whole-step decode graphs run over fixed TPP plans: the triton backend, not eager
        decode_graphs = (
            (cuda if self.decode_graphs is None else self.decode_graphs) and triton and not self.enforce_eager
        )
        piecewise = self.piecewise_graphs
        if piecewise is None:
            piecewise = cuda and triton and not self.enforce_eager
        return dataclasses.replace(
            self,
            device=str(device),
            dtype=dtype,
            attention_backend=backend,
            # (with graphs, a step through TPP beats an eager step through FlashInfer's decode)
            flashinfer_fallback=self.flashinfer_fallback and self.enforce_eager and triton,
            flashinfer_prefill=self.flashinfer_prefill and triton,
            piecewise_graphs=piecewise,
            decode_graphs=decode_graphs,
            graph_mixed_steps=self.graph_mixed_steps and decode_graphs,
            async_scheduling=cuda if self.async_scheduling is None else self.async_scheduling,
        )

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """(resolved configs: a dtype named)"""
        return DTYPES[self.dtype]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available")
    return dev
