"""The token counts that presence, frequency and repetition penalties read, kept on the device.

A penalized request (``SamplingParams.penalized``) gets a slot (``Sequence.penalty_slot``) the
first time it samples: a row of ``counts`` ([slots, V] int32: how often it has generated each
token) and of ``prompt`` ([slots, V] bool: its prompt's tokens). Each step gathers the sampling rows' slots for the sampler and
then adds each row's sampled token to its counts, on the device, from the step's token tensor:
nothing waits for the tokens, so under asynchronous scheduling the counts already hold the token
still in flight, and tensor-parallel ranks count the tokens rank 0 broadcast. The engine releases
a slot when its request finishes or is aborted; a released slot is zeroed when it is taken again
(in stream order, after the steps that wrote it). A preempted request keeps its slot: its
outputs are kept too. vLLM keeps the same per-request bins in its persistent batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from chunkserve.replicas.engine.sequence import Sequence
from chunkserve.replicas.engine.transfer import to_device


class Gathered(NamedTuple):
    """The penalized rows of a step's sampling batch."""

    rows: list[int]  # their indices among the sampling rows
    slots: torch.Tensor  # [P] their slots
    counts: torch.Tensor  # [P, V] int32 their output tokens' counts (before this step's token)
    prompt: torch.Tensor  # [P, V] bool their prompt tokens


class Penalties:
    def __init__(self, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        self._free: list[int] = []  # the slots no sequence holds (the others: their penalty_slot)
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)

    def gather(self, seqs: list[Sequence]) -> Gathered | None:
        """The penalized rows among the step's sampling sequences (None: there are none)."""
        rows = [i for i, s in enumerate(seqs) if s.params.penalized]
        if not rows:
            return None
        slots = to_device([self._slot_of(seqs[i]) for i in rows], self.device)
        return Gathered(rows, slots, self.counts[slots], self.prompt[slots])

    def record(self, gathered: Gathered, tokens: torch.Tensor) -> None:
        """Add each penalized row's sampled token (tokens: [S] on the device) to its counts."""
        picked = tokens[to_device(gathered.rows, self.device)]
        self.counts.index_put_((gathered.slots, picked), torch.ones_like(picked, dtype=torch.int32), accumulate=True)

    def release(self, seq: Sequence) -> None:
        """The sequence's slot, if it holds one, back to the free ones (it leaves the engine)."""
        if seq.penalty_slot is not None:
            self._free.append(seq.penalty_slot)
            seq.penalty_slot = None

    @property
    def in_use(self) -> int:
        """Slots that sequences hold."""
        return self.counts.shape[0] - len(self._free)

    def _slot_of(self, seq: Sequence) -> int:
        slot = seq.penalty_slot
        if slot is not None:
            return slot
        if not self._free:
            self._grow()
        slot = seq.penalty_slot = self._free.pop()
        self.counts[slot].zero_()
        self.prompt[slot].zero_()
        self.prompt[slot, to_device(seq.prompt_ids, self.device)] = True
        # (a request samples for the first time with no outputs yet; any it had come from a
        # known list, placeholders of tokens in flight excepted)
        done = [t for t in seq.output_ids if t >= 0]
        if done:
            ids = to_device(done, self.device)
            self.counts[slot].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        return slot

    def _grow(self) -> None:
        old = self.counts.shape[0]
        n = max(8, 2 * old)
        counts = torch.zeros(n, self.vocab, dtype=torch.int32, device=self.device)
        prompt = torch.zeros(n, self.vocab, dtype=torch.bool, device=self.device)
        counts[:old], prompt[:old] = self.counts, self.prompt
        self.counts, self.prompt = counts, prompt
        self._free.extend(range(n - 1, old - 1, -1))
