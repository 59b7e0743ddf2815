"""Runs one scheduled batch through the model: flatten tokens, plan attention, forward, sample."""

from __future__ import annotations

import torch

from replicas.attention import ReferenceAttention, plan_step
from replicas.kv_pool import KVPool
from replicas.sampler import sample
from replicas.scheduler import Batch
from replicas.sequence import Sequence


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool, device: torch.device):
        self.model, self.pool, self.device = model, pool, device
        self.sm_scale = model.config.head_dim ** -0.5

    @torch.inference_mode()
    def run(self, batch: Batch, generators: dict[str, torch.Generator]) -> dict[Sequence, int]:
        """Forward the batch's new tokens; returns the next token of every sequence whose pending
        tokens all ran this step (a decode, or the last piece of a prefill)."""
        plan = plan_step(batch, self.pool.chunk_size, self.device)
        ids, last_rows, samplers, row = [], [], [], 0
        for seq, n in batch.items:
            ids.extend(seq.token_at(i) for i in range(seq.num_computed, seq.num_computed + n))
            row += n
            if seq.num_computed + n == seq.num_tokens:
                last_rows.append(row - 1)
                samplers.append(seq)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, plan.positions, ReferenceAttention(self.pool, plan, self.sm_scale))
        if not samplers:
            return {}
        logits = self.model.compute_logits(hidden[last_rows])  # [S, V] float32
        tokens = sample(logits, [s.params for s in samplers], [generators.get(s.request_id) for s in samplers])
        return dict(zip(samplers, tokens))
