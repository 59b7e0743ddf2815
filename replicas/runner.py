"""Runs one scheduled batch through the model: flatten tokens, plan attention, forward, sample.

On CUDA a decode-only step's forward runs from a CUDA graph of its decode plan
(`replicas.cuda_graph`) unless the engine runs eagerly (`enforce_eager`)."""

from __future__ import annotations

import time

import torch

from replicas.attention import Attention
from replicas.cuda_graph import DecodeGraphs
from replicas.sampler import sample_ids
from replicas.scheduler import Batch
from replicas.sequence import Sequence


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attention: Attention, device: torch.device, *,
                 enforce_eager: bool = False, tp_size: int = 1):
        self.model, self.attention, self.device, self.tp_size = model, attention, device, tp_size
        self.graphs = (DecodeGraphs(model, attention.pool.chunk_size)
                       if device.type == "cuda" and not enforce_eager else None)
        # seconds the host spent waiting for the device's sampled tokens: a step's time less this
        # is the host's own time in it (replicas.bench's host_ms_per_step)
        self.wait_s = 0.0

    @torch.inference_mode()
    def run(self, batch: Batch, generators: dict[str, torch.Generator]) -> dict[Sequence, int]:
        """Forward the batch's new tokens; returns the next token of every sequence whose pending
        tokens all ran this step (a decode, or the last piece of a prefill)."""
        attn = self.attention.plan(batch)
        # decodes: one token each (the sequence's last: its only one pending), and each samples
        ids = [(seq.output_ids or seq.prompt_ids)[-1] for seq in batch.decodes]
        samplers = list(batch.decodes)
        last_rows, row = list(range(len(ids))), len(ids)
        for seq, n in batch.prefills:
            ids.extend(seq.token_at(i) for i in range(seq.num_computed, seq.num_computed + n))
            row += n
            if seq.num_computed + n == seq.num_tokens:
                last_rows.append(row - 1)
                samplers.append(seq)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.graphs.forward(input_ids, attn) if self.graphs is not None else None
        if hidden is None:
            hidden = self.model(input_ids, attn.positions, attn)
        if not samplers:
            return {}
        # [S, V] float32; a decode-only step samples every row (no gather)
        logits = self.model.compute_logits(hidden if len(last_rows) == row else hidden[last_rows])
        tokens = sample_ids(logits, [s.params for s in samplers], [generators.get(s.request_id) for s in samplers])
        if self.tp_size > 1:  # rank 0's tokens everywhere: ranks whose logits differ in the last bit agree
            from replicas.parallel import broadcast_from_first  # (parallel builds on the engine)
            broadcast_from_first(tokens)
        t = time.perf_counter()
        ids = tokens.tolist()  # waits for the device
        self.wait_s += time.perf_counter() - t
        return dict(zip(samplers, ids))
