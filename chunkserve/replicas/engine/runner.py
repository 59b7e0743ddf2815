"""Runs one scheduled batch through the model: flatten tokens, plan attention, forward, sample.

On CUDA a step of a graphed token count runs its forward from the pieces between its attentions
(`chunkserve.replicas.engine.piecewise`), and with `decode_graphs` a decode-only step from the CUDA graph of its
padded batch size (`chunkserve.replicas.engine.cuda_graph`), unless the engine runs eagerly (`enforce_eager`).
A step runs as vLLM v1 shows it: `forward` queues the model and the sampling rows' logits,
`masks` makes the guided rows' grammar bitmask (whose matchers need the tokens of the step in
flight: the engine collects them between the two), `sample` queues the draw and returns;
`collect` waits for its tokens (at once, or after the next step's sample: the engine's
asynchronous scheduling). Nothing before `collect` waits for the device."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import torch

from chunkserve.replicas.engine.attention import Attention
from chunkserve.replicas.engine.cuda_graph import DecodeGraphs, batch_sizes
from chunkserve.replicas.engine.distributed import broadcast_from_first
from chunkserve.replicas.engine.guided import allow, fill_bitmask, mask_logits
from chunkserve.replicas.engine.penalties import Gathered, Penalties
from chunkserve.replicas.engine.piecewise import PiecewiseGraphs
from chunkserve.replicas.engine.sampler import sample_ids, token_logprobs
from chunkserve.replicas.engine.sequence import MAY_THINK, THINKING, Batch, Sequence, Status
from chunkserve.replicas.engine.stats import EngineStats
from chunkserve.replicas.engine.transfer import to_device

if TYPE_CHECKING:
    from chunkserve.replicas.engine.config import EngineConfig
    from chunkserve.replicas.model.config import ModelConfig
    from chunkserve.replicas.model.llama import LlamaForCausalLM


class Launched(NamedTuple):
    """A step whose forward and sampling are queued on the device (ModelRunner.sample).

    Each sampling sequence got a placeholder output token, -1 - i for samplers[i], at
    output_ids[slots[i]], until the engine collects the step; a later step that runs that
    position takes the token from `tokens` on the device."""

    samplers: list[Sequence]
    slots: list[int]
    tokens: torch.Tensor | None  # [S] int64 on the device
    host: torch.Tensor | None  # [S] int64 on the host (pinned on CUDA), filled once `done` has passed
    done: torch.cuda.Event | None  # CUDA: recorded after the copy to `host`
    logprobs: StepLogprobs | None = None  # on the host too (filled once `done` has passed), if any row asked


class StepLogprobs(NamedTuple):
    """The logprobs of a step's rows that asked for them (SamplingParams.logprobs)."""

    rows: list[int]  # their places among the step's samplers
    values: torch.Tensor  # [W, 1 + k] float32: the drawn token's logprob, then the k most likely tokens'
    ids: torch.Tensor  # [W, k] int64: those tokens

    def to_host(self, pinned: bool) -> StepLogprobs:
        """Copies on the host, not waited for (pinned: page-locked, for the asynchronous copy)."""
        copies = [
            torch.empty(x.shape, dtype=x.dtype, pin_memory=pinned).copy_(x, non_blocking=pinned)
            for x in (self.values, self.ids)
        ]
        return StepLogprobs(self.rows, *copies)

    def entries(self, samplers: list[Sequence]) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
        """Per row (its place among the samplers): (the drawn token's logprob, its request's k
        most likely (token, logprob)). Reads the host copies."""
        values, ids = self.values.tolist(), self.ids.tolist()
        out = {}
        for row, vals, top in zip(self.rows, values, ids):
            k = samplers[row].params.logprobs
            out[row] = (vals[0], tuple(zip(top[:k], vals[1 : k + 1])))
        return out


class Forwarded(NamedTuple):
    """A step whose forward is queued (ModelRunner.forward): its sampling rows, their logits, and
    what the draw reads of them, taken before the step in flight is collected."""

    samplers: list[Sequence]  # the rows that sample: decodes, then prefills ending their prompt
    logits: torch.Tensor | None  # [S, V] float32 on the device (None: nothing samples)
    penalized: Gathered | None  # the penalized rows' token counts (None: no row penalizes)
    counters: list[int]  # per row, its outputs so far: the index of the token it draws
    row_keys: list  # per row, its request's draw key
    banned: list[tuple[int, tuple[int, ...]]]  # rows short of min_tokens, the stops they may not draw


class Masks(NamedTuple):
    """The guided rows' grammar bitmask (ModelRunner.masks)."""

    rows: list[int]  # their places among the step's samplers
    words: torch.Tensor  # [G, ceil(V / 32)] int32 on the host (pinned on CUDA): bit t = token t allowed


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attention: Attention,
        config: EngineConfig,
        model_config: ModelConfig,
        counters: EngineStats | None = None,
    ):
        """config: the engine's, resolved (EngineConfig.resolved): with piecewise_graphs the
        forward's pieces between attentions as CUDA graphs (chunkserve.replicas.engine.piecewise;
        plain calls on the CPU or eager: the tests), with decode_graphs whole-step graphs per
        padded batch size up to max_num_seqs, over fixed TPP plans (chunkserve.replicas.engine.
        cuda_graph; plain calls on the CPU). model_config: the vocabulary and EOS ids. counters:
        the engine's, where host waits and graph replays are counted (None: one of its own)."""
        device = config.torch_device
        self.model, self.attention, self.device, self.tp_size = model, attention, device, config.tp_size
        self.vocab_size, self.eos_token_ids = model_config.vocab_size, tuple(model_config.eos_token_ids)
        self.counters = EngineStats() if counters is None else counters
        self.penalties = Penalties(self.vocab_size, device)  # penalized requests' token counts
        cuda_graphs = device.type == "cuda" and not config.enforce_eager
        self.graphs = None
        if config.decode_graphs:
            sizes = batch_sizes(config.max_num_seqs)
            attention.fix_plans(sizes)
            self.graphs = DecodeGraphs(model, attention, sizes, graphs=cuda_graphs, counters=self.counters)
        self.pieces = (
            PiecewiseGraphs(
                model, attention.pool, config.max_num_batched_tokens, graphs=cuda_graphs, counters=self.counters
            )
            if config.piecewise_graphs
            else None
        )

    @torch.inference_mode()
    def sample(self, fwd: Forwarded, masks: Masks | None) -> Launched:
        """Queue the step's draw (the guided rows' logits masked first) and return at once,
        nothing waited for (see Launched)."""
        samplers, logits = fwd.samplers, fwd.logits
        if logits is None:
            return Launched([], [], None, None, None)
        if masks is not None:  # tokens outside a guided row's grammar at -inf, before anything reads the logits
            logits = mask_logits(logits, masks.rows, masks.words)
        tokens = sample_ids(logits, [s.params for s in samplers], fwd.row_keys, fwd.counters, fwd.penalized, fwd.banned)
        if self.tp_size > 1:  # rank 0's tokens everywhere: ranks whose logits differ in the last bit agree
            broadcast_from_first(tokens)
        if fwd.penalized is not None:
            self.penalties.record(fwd.penalized, tokens)
        asked = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
        logprobs = None
        if asked:
            k = max(samplers[i].params.logprobs for i in asked)
            logprobs = StepLogprobs(asked, *token_logprobs(logits, asked, tokens, k)).to_host(tokens.is_cuda)
        host, done = tokens, None
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        slots, finished = [], Status.FINISHED
        for i, seq in enumerate(samplers):
            out = seq.output_ids
            slots.append(len(out))
            if seq.status is not finished:  # (one that finished at the collect before the masks keeps no placeholder)
                out.append(-1 - i)
        return Launched(samplers, slots, tokens, host, done, logprobs)

    def masks(self, fwd: Forwarded) -> Masks | None:
        """The grammar bitmask of the step's guided rows (None: none), from their matchers as
        they stand: the step in flight must have been collected (its tokens advanced them)."""
        samplers = fwd.samplers
        # (a thinking row is free: SamplingParams.think)
        guided = [i for i, s in enumerate(samplers) if s.matcher is not None and s.thinking != THINKING]
        if not guided:
            return None
        words = fill_bitmask(
            [samplers[i].matcher for i in guided],
            self.vocab_size,
            self.eos_token_ids,
            pinned=self.device.type == "cuda",
        )
        for row, i in enumerate(guided):
            if samplers[i].thinking == MAY_THINK:  # its first token may open thinking instead
                allow(words, row, samplers[i].params.think[0])
        return Masks(guided, words)

    @staticmethod
    def _prompt_logprob_rows(batch: Batch) -> list[tuple[Sequence, int, int, int]]:
        """(sequence, first row, first prompt position, rows) of the prefill pieces whose prompt
        logprobs are due: each row's logits score the next prompt token."""
        out, row = [], len(batch.decodes)
        for seq, n in batch.prefills:
            start = seq.num_computed
            last = min(start + n, len(seq.prompt_ids) - 1)  # (the last prompt token predicts an output)
            if seq.params.prompt_logprobs is not None and last > start:
                out.append((seq, row, start, last - start))
            row += n
        return out

    _PROMPT_LOGPROB_ROWS = 512  # rows whose logits [rows, V] float32 exist at once

    def _prompt_logprobs(self, hidden: torch.Tensor, pieces: list[tuple[Sequence, int, int, int]]) -> None:
        """Each piece's prompt tokens' logprobs into its sequence (read back now: waits for the
        device; only steps holding such pieces)."""
        for seq, row, start, n in pieces:
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None] * len(seq.prompt_ids)
            k = seq.params.prompt_logprobs
            for r0 in range(0, n, self._PROMPT_LOGPROB_ROWS):
                r1 = min(n, r0 + self._PROMPT_LOGPROB_ROWS)
                logits = self.model.compute_logits(hidden[row + r0 : row + r1])  # [R, V]
                nxt = to_device(seq.prompt_ids[start + r0 + 1 : start + r1 + 1], self.device)
                values, ids = token_logprobs(logits, list(range(r1 - r0)), nxt, k)
                for i, (vals, top) in enumerate(zip(values.tolist(), ids.tolist())):
                    seq.prompt_logprobs[start + r0 + i + 1] = (vals[0], tuple(zip(top, vals[1:])))

    def _stop_ids(self, p) -> tuple[int, ...]:
        """The tokens that would end a request of params p: its stop_token_ids (those in the
        vocabulary: no others can be drawn), EOS unless ignore_eos."""
        return tuple(t for t in p.stop_token_ids if 0 <= t < self.vocab_size) + (
            () if p.ignore_eos else self.eos_token_ids
        )

    def collect(self, launched: Launched) -> tuple[list[int], dict[int, tuple]]:
        """The launched step's sampled tokens, samplers' order (waits for the device), and the
        logprobs (StepLogprobs.entries) of the rows that asked, by their place."""
        if launched.host is None:
            return [], {}
        t = time.perf_counter()
        if launched.done is not None:
            launched.done.synchronize()
        ids = launched.host.tolist()
        self.counters.wait_s += time.perf_counter() - t  # (a step's time less these: the host's own)
        return ids, ({} if launched.logprobs is None else launched.logprobs.entries(launched.samplers))

    @torch.inference_mode()
    def forward(self, batch: Batch, prev: Launched | None) -> Forwarded:
        """Queue the batch's forward and its sampling rows' logits, nothing waited for (but a
        piece of a prompt whose logprobs were asked for: they are read back as it runs). prev:
        the step launched before, not collected yet, whose placeholder tokens this step's inputs
        may hold. What the draw takes from the rows (keys, penalty slots, output counts, banned
        stops) is read here, before the engine collects prev: a row may finish there."""
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
        input_ids = to_device(ids, self.device)
        prompt_rows = self._prompt_logprob_rows(batch)
        if prev is not None and prev.tokens is not None and min(ids) < 0:
            # placeholders of prev's tokens (Launched): taken on the device, not waited for
            input_ids = torch.where(input_ids < 0, prev.tokens[(-1 - input_ids).clamp(min=0)], input_ids)
        hidden = self.graphs.forward(input_ids, attn) if self.graphs is not None else None
        if hidden is None and self.pieces is not None:
            hidden = self.pieces.forward(input_ids, attn)
        if hidden is None:
            hidden = self.model(input_ids, attn.positions, attn)
        attn.keep_key_bounds()  # (sparse prefill: the key bounds of the chunks this step filled)
        if prompt_rows:
            self._prompt_logprobs(hidden, prompt_rows)
        if not samplers:
            return Forwarded([], None, None, [], [], [])
        # [S, V] float32; a decode-only step samples every row (no gather). (Indexing by the list
        # itself would copy it from pageable memory: the host would wait for the steps queued.)
        logits = self.model.compute_logits(
            hidden if len(last_rows) == row else hidden.index_select(0, to_device(last_rows, self.device))
        )
        # each sampling sequence draws with its request's key and the index of the token drawn
        # (its outputs so far), whether it runs sync, async, after a preemption or in any batch
        counters = [len(s.output_ids) for s in samplers]
        # rows short of their min_tokens: their stop tokens cannot be drawn yet
        banned = [
            (i, self._stop_ids(s.params)) for i, (s, n) in enumerate(zip(samplers, counters)) if n < s.params.min_tokens
        ]
        return Forwarded(
            samplers, logits, self.penalties.gather(samplers), counters, [s.draw_key for s in samplers], banned
        )
