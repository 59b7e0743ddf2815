"""One request inside a replica: its tokens, its place in the prefix tree, its sampling params."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkserve.replicas.engine.guided import Guide

if TYPE_CHECKING:
    from chunkserve.replicas.engine.prefix_tree import Node


# Temperatures below this sample greedily, as in vLLM (its _SAMPLING_EPS). Far smaller ones turn
# logits / temperature into inf in float32 and the probabilities into NaN (torch.multinomial,
# which the sampler once drew with, raised on them for every row of the step's batch).
GREEDY_BELOW_TEMPERATURE = 1e-5
SEED_RANGE = range(-(2**63), 2**64)  # as torch.Generator.manual_seed; the sampler's key is the seed mod 2**64
MAX_LOGPROBS = 20  # most likely tokens a request may ask the logprobs of, per token (OpenAI: top_logprobs <= 20)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_BELOW_TEMPERATURE (0 too): greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = whole vocabulary
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # OpenAI's: each token's logit less presence_penalty if the request has generated it and
    # frequency_penalty times how often; vLLM's: a token of the prompt or the output has its logit
    # divided by repetition_penalty where positive, multiplied where negative (chunkserve.replicas.engine.penalties)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # sampling keeps the tokens whose probability (after temperature) reaches min_p times the
    # most likely one's (vLLM's; greedy rows ignore it)
    min_p: float = 0.0
    # OpenAI's: (token id, bias) pairs, each bias added to the token's logit before anything else
    # (a dict is taken too)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: until this many tokens are out, EOS (unless ignore_eos) and stop_token_ids cannot be
    # drawn and stop strings are not looked for
    min_tokens: int = 0
    # each generated token's log-probability under the model (its raw logits: before penalties,
    # bias and temperature, as vLLM's default) and the logprobs most likely tokens' (0 .. 20);
    # None: no logprobs
    logprobs: int | None = None
    # vLLM's: the same for each prompt token after the first (the logprob of token i given the
    # tokens before it); such a request computes its whole prompt (no prefix-cache hit)
    prompt_logprobs: int | None = None
    # structured outputs (chunkserve.replicas.engine.guided): the output kept inside a JSON schema, regex, choice
    # or grammar; None: free text
    guided: Guide | None = None
    # with `guided`, a reasoning model's thinking left free before the grammar (vLLM's structured
    # outputs under a reasoning parser): (start, end) token ids of its tags. start None: the
    # output opens thinking (the prompt opened it), free until `end`; else its first token may be
    # `start` (thinking, free until `end`) besides the grammar's. The grammar holds what follows
    # `end` (the tags themselves go to neither). None: the grammar holds the whole output.
    think: tuple[int | None, int] | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = list(self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias)
        for pair in bias:
            t, b = pair if isinstance(pair, tuple) and len(pair) == 2 else (None, None)
            if (
                isinstance(t, bool)
                or not isinstance(t, int)
                or t < 0
                or isinstance(b, bool)
                or not isinstance(b, (int, float))
                or not -100 <= b <= 100
            ):
                raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {pair!r}")
        object.__setattr__(self, "logit_bias", tuple(sorted(bias)))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, int)
            or not (0 <= self.min_tokens <= (self.max_tokens if isinstance(self.max_tokens, int) else 0))
        ):
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens!r}], got {self.min_tokens!r}"
            )
        # membership at every generated token (LLMEngine._settle): a set, not a scan of the tuple
        object.__setattr__(self, "stop_token_set", frozenset(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and self.seed in SEED_RANGE):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if self.guided is not None:
            if not isinstance(self.guided, Guide):
                raise ValueError(
                    f"guided must be a chunkserve.replicas.engine.guided.Guide, got {type(self.guided).__name__}"
                )
            if self.min_tokens:  # a grammar that has ended allows nothing but the EOS min_tokens bans
                raise ValueError("min_tokens cannot be combined with guided decoding")
        if self.think is not None:
            start, end = self.think if isinstance(self.think, tuple) and len(self.think) == 2 else (-1, -1)
            if self.guided is None or not _token_id(end) or not (start is None or _token_id(start)):
                raise ValueError(
                    f"think must be (start token id or None, end token id) with guided, got {self.think!r}"
                )
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a non-negative integer, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the request's logits depend on the tokens it has seen (the penalties)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


@dataclass(frozen=True)
class Tenancy:
    """Whose request it is, as far as the engine cares (DESIGN §2): the cache namespace it shares
    in and its place in admission."""

    tenant: str | None = None  # None: no tenant table (one anonymous tenant)
    # the prefix tree it matches and fills (PrefixTree.roots): None shares with every unsalted
    # request; the ingress sets it from the tenant's cache policy and the request's cache_salt
    cache_salt: str | None = None
    priority: int = 0  # admission: lower first (vLLM's priority), then the tenant with fewer running

    def __post_init__(self):
        for name in ("tenant", "cache_salt"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"{name} must be a string or None, got {type(v).__name__}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")


# Sequence.thinking: where a guided row with SamplingParams.think stands
GUIDED, MAY_THINK, THINKING = 0, 1, 2  # the grammar holds its tokens; its first may open thinking; thinking


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order key: FCFS, and the newest is preempted first
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V is in the cache
    # chunk table = [n.chunk_id for n in nodes] + private: a path in the tree, then chunks being
    # filled that are not in the tree yet (the partial tail, or full ones awaiting insertion)
    nodes: list[Node] = field(default_factory=list)
    private: list[int] = field(default_factory=list)
    # bumped whenever a chunk id already in the table changes (a filled chunk deduplicated on
    # its way into the tree, the table dropped): with the table's length, what decode plans key on
    table_version: int = 0
    num_cached_prompt: int | None = None  # prompt tokens served from the cache at first admission
    num_cached_prompt_host: int = 0  # of them, copied back from the host tier (PrefixTree.load)
    # with params.prompt_logprobs: per prompt token, (its logprob, the most likely tokens' (id,
    # logprob)), None for the first and for those not computed yet
    prompt_logprobs: list | None = None
    _path: tuple = field(default=(None, ()), repr=False)  # path_ids() cache: ((len, version), ids)
    # params.guided's grammar state (an xgrammar GrammarMatcher, set by the engine): it has taken
    # every output token so far (but a reasoning model's thinking: params.think)
    matcher: Any = field(default=None, repr=False)
    thinking: int = GUIDED  # GUIDED, MAY_THINK or THINKING (params.think)
    # a sampling request's draw key (chunkserve.replicas.engine.sampler): its seed, or one from the engine's seed
    # and its arrival; None for greedy requests
    draw_key: int | None = None
    # a penalized request's row of the penalties' token counts (chunkserve.replicas.engine.penalties: taken at its
    # first sampling step, given back when it leaves the engine); None: it holds none
    penalty_slot: int | None = None
    finish_reason: str | None = None
    tenancy: Tenancy = Tenancy()  # its tenant, cache salt and priority
    # chained keys of its prompt's full chunks under its salt (the scheduler's, made once: what
    # finds a chunk another running sequence is computing); None: not made yet
    chunk_keys: list[int] | None = field(default=None, repr=False)

    @property
    def guided(self) -> bool:
        """Whether the request is guided (params.guided), on every tensor-parallel rank: only
        rank 0 holds its matcher."""
        return self.params.guided is not None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def ends_by_length(self, outputs: int, max_model_len: int) -> bool:
        """The length rule: with `outputs` tokens generated the sequence is done, by max_tokens or
        the context (the engine ends it with "length"; the scheduler runs it no further)."""
        return outputs >= self.params.max_tokens or len(self.prompt_ids) + outputs >= max_model_len

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return self.num_tokens - self.num_computed

    def path_ids(self) -> tuple[int, ...]:
        """The node ids of the sequence's tree path (cached: the scheduler sorts rows by them
        every step). `nodes` is set at admission, when it was empty (new, or released: a release
        bumps table_version), and only grows by appends after that, so (length, version) names
        its contents."""
        key = (len(self.nodes), self.table_version)
        if self._path[0] != key:
            self._path = (key, tuple(n.id for n in self.nodes))
        return self._path[1]

    @property
    def chunk_table(self) -> list[int]:
        return [n.chunk_id for n in self.nodes] + self.private

    @property
    def num_chunks(self) -> int:
        """len(chunk_table): the chunks the sequence holds, in the tree and private."""
        return len(self.nodes) + len(self.private)

    def chunk_at(self, k: int) -> int:
        """chunk_table[k] without building the table (prefill pieces; Attention.plan's per-step
        loop over decode rows inlines it)."""
        n = len(self.nodes)
        return self.nodes[k].chunk_id if k < n else self.private[k - n]

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]


@dataclass
class Batch:
    """What one step runs (Scheduler.schedule): its decode rows and prefill pieces."""

    decodes: list[Sequence] = field(default_factory=list)  # DFS order, one new token each
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)

    @property
    def items(self) -> list[tuple[Sequence, int]]:
        """Rows of the flattened token batch: decodes first, then prefill pieces."""
        return [(s, 1) for s in self.decodes] + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)
