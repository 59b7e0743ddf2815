"""Next-token sampling: greedy rows in one argmax, the others with temperature, top-k and top-p
applied to all of them together, and every draw in one launch: a few batched ops per step, not
about ten per row (figures: chunkserve/cluster/loadtest/records/README.md, 'Figures behind the code').

Each sampling row draws with its own 64-bit key and counter (the engine: the request's seed, or
one made from the engine's seed and the request's arrival, and the index of the token drawn):
its token is the argmax of probs / -log(u) (an exponential race, what torch.multinomial draws
one token by) with u the row's counter-based uniforms (``chunkserve.kernels.philox``). A row's token so
depends only on its probabilities, key and counter, not on the rest of the batch: what
``sample_row_ref`` gives for that row alone. (Per-row torch generators cost a few launches per
row per step, which made a large batch's sampled decode steps several times as long as greedy
ones.)

Every row's logits first get its logit_bias, then its penalties (repetition, frequency, presence:
vLLM's order, greedy rows too), from the token counts the engine keeps on the device
(``chunkserve.replicas.engine.penalties``); sampling rows then divide by their temperature and drop what min_p drops.
Top-k keeps the tokens that reach the row's k-th largest logit. Top-p then keeps a token unless
the tokens more likely than it already hold top_p of the probability (summed in float64): tied
tokens stay or go together, and the most likely token always stays. On CUDA the cut is searched
for without a sort (``chunkserve.kernels.nucleus``): among the k + 1 largest logits where every top-p row
has top-k, over the whole vocabulary otherwise. Elsewhere a row with top-k finds its cut among
its k + 1 largest logits unless ties of its k-th value reach past them (a host sync, free on the
CPU), and other top-p rows are sorted whole. On CUDA the search beats the sort, and top-k rows
skip the candidates' host sync.

Nothing here waits for the device on CUDA: row indices, keys and parameters go through pinned
memory.
"""

from __future__ import annotations

import torch

from chunkserve.kernels.nucleus import nucleus_floor, nucleus_floor_ref
from chunkserve.kernels.philox import uniform, uniform_ref
from chunkserve.replicas.engine.penalties import Gathered
from chunkserve.replicas.engine.sequence import SamplingParams
from chunkserve.replicas.engine.transfer import to_device


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    keys: list[int | None],
    counters: list[int],
    penalties: Gathered | None = None,
    banned: list[tuple[int, tuple[int, ...]]] = (),
) -> list[int]:
    """One token id per row of logits: [N, V] float32, one row per sequence that samples this step.

    keys[i]: row i's 64-bit key (an int in SEED_RANGE, taken mod 2**64), or None for one drawn
    from torch's global RNG; counters[i]: its draw's number (the engine: the output's index).
    Greedy rows read neither. penalties: the token counts of the rows whose params penalize
    (chunkserve.replicas.engine.penalties.Gathered), None if none does. banned: (row, token ids) that row must not
    draw this step (min_tokens: its stop tokens)."""
    return sample_ids(logits, params, keys, counters, penalties, banned).tolist()


def sample_ids(
    logits: torch.Tensor,
    params: list[SamplingParams],
    keys: list[int | None],
    counters: list[int],
    penalties: Gathered | None = None,
    banned: list[tuple[int, tuple[int, ...]]] = (),
) -> torch.Tensor:
    """``sample`` left on logits' device: [N] int64 token ids."""
    logits = _adjust(logits, params, penalties, banned)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return logits.argmax(dim=-1)  # ties -> lowest id, like transformers' greedy search
    # row indices as device tensors (transfer.to_device): Python lists as indices would be
    # copied to the device blocking, waiting for the steps queued before this one
    dev = logits.device
    every = len(rows) == len(params)  # (then no copies of the rows in and out: [N, V] each)
    index = None if every else to_device(rows, dev)
    probs = _probs([params[i] for i in rows], logits if every else logits.index_select(0, index))  # [S, V]
    u = uniform(
        to_device([_key(keys[i]) for i in rows], dev, torch.int64),
        to_device([counters[i] for i in rows], dev, torch.int64),
        probs.shape[-1],
    )
    if every:
        return _race(probs, u)
    return logits.argmax(dim=-1).index_copy_(0, index, _race(probs, u))


def token_logprobs(
    logits: torch.Tensor, rows: list[int], tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' log-probabilities under their raw logits (vLLM's default: before bias, penalties
    and temperature): ([W, 1 + k] float32: the drawn token's, then the k most likely tokens', and
    [W, k] int64: those tokens), W = len(rows). logits: [S, V]; tokens: [S] drawn."""
    every = len(rows) == logits.shape[0]
    index = None if every else to_device(rows, logits.device)
    lp = torch.log_softmax(logits if every else logits[index], dim=-1)  # [W, V]
    drawn = lp.gather(1, (tokens if every else tokens[index])[:, None])  # [W, 1]
    if not k:
        return drawn, torch.empty(len(rows), 0, dtype=torch.long, device=logits.device)
    top = lp.topk(k, dim=-1)
    return torch.cat([drawn, top.values], dim=1), top.indices


def unseeded_key(engine_seed: int, arrival: int) -> int:
    """The key of a request without a seed: SplitMix64's mix of the engine's seed and the
    request's arrival number, reproducible for a given engine seed and request order, and far
    from the small seeds that requests tend to give."""
    m = 2**64 - 1
    z = (engine_seed * 1_000_003 + arrival + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _key(key: int | None) -> int:
    """A row's key as the int64 of its low 64 bits (None: a fresh one from torch's global RNG)."""
    if key is None:
        return int(torch.randint(-(2**63), 2**63 - 1, ()))
    key %= 2**64
    return key - 2**64 if key >= 2**63 else key


def _adjust(
    logits: torch.Tensor,
    params: list[SamplingParams],
    penalties: Gathered | None,
    banned: list[tuple[int, tuple[int, ...]]],
) -> torch.Tensor:
    """The logits every row's choice starts from, greedy rows' too (vLLM's order): logit_bias
    added, then the penalties: repetition (a token of the prompt or the output: divided by it
    where positive, multiplied where not), frequency (times the token's count) and presence (if
    it occurs) subtracted; banned tokens -inf. The input itself where no row has any of them."""
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if not biased and penalties is None and not banned:
        return logits
    dev = logits.device
    logits = logits.clone()
    if banned:
        rows = [r for r, ids in banned for _ in ids]
        ids = [t for _, ids in banned for t in ids]
        logits[to_device(rows, dev), to_device(ids, dev)] = float("-inf")
    if biased:
        rows = [i for i in biased for _ in params[i].logit_bias]
        ids = [t for i in biased for t, _ in params[i].logit_bias]
        bias = [b for i in biased for _, b in params[i].logit_bias]
        logits.index_put_(
            (to_device(rows, dev), to_device(ids, dev)), to_device(bias, dev, logits.dtype), accumulate=True
        )
    if penalties is not None:
        rows = to_device(penalties.rows, dev)
        p = [params[i] for i in penalties.rows]
        rep, freq, pres = (
            to_device([getattr(x, name) for x in p], dev, logits.dtype)[:, None]
            for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")
        )
        counts = penalties.counts.to(logits.dtype)
        out = counts > 0
        sub = logits[rows]  # [P, V]
        sub = torch.where(penalties.prompt | out, torch.where(sub > 0, sub / rep, sub * rep), sub)
        logits[rows] = sub - freq * counts - pres * out.to(logits.dtype)
    return logits


def _race(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The exponential race over [..., V]: argmax of probs / -log(u) (u in (0, 1), so -log(u) > 0
    and tokens of probability 0 never win), a draw from probs. Consumes u."""
    return probs.div(u.log_().neg_()).argmax(-1)


def _probs(params: list[SamplingParams], logits: torch.Tensor) -> torch.Tensor:
    """Sampling probabilities of S rows: logits [S, V] / temperature, top-k then top-p applied."""
    dev, v = logits.device, logits.shape[-1]
    logits = logits / to_device([p.temperature for p in params], dev, logits.dtype)[:, None]
    if any(p.min_p for p in params):  # (vLLM's order: before top-k and top-p)
        min_p = to_device([p.min_p for p in params], dev, logits.dtype)[:, None]
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    ks = [p.top_k if 0 < p.top_k < v else 0 for p in params]  # 0: whole vocabulary
    cand = None
    if any(ks):
        # one top-k of the largest k + 1: each row's k-th largest value, and the candidates of
        # its nucleus (past its k-th, top-k leaves only ties of it: the nucleus needs no sort)
        cand = torch.topk(logits, min(v, max(ks) + 1), dim=-1).values  # [S, kmax + 1], descending
        kth = cand.gather(1, to_device([max(k, 1) - 1 for k in ks], dev)[:, None])  # [S, 1]
        kth = kth.masked_fill(to_device([k == 0 for k in ks], dev, torch.bool)[:, None], float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))  # ties with the k-th stay
        cand = cand.masked_fill(cand < kth, float("-inf"))
    nucleus = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        every = len(nucleus) == len(params)  # (then no copies of the rows in and out: [S, V] each)
        rows = to_device(nucleus, dev)
        sub = logits if every else logits[rows]  # [P, V]
        top_p = to_device([params[j].top_p for j in nucleus], dev, torch.float64)[:, None]
        lse = sub.logsumexp(-1, keepdim=True)  # [P, 1]
        if sub.is_cuda:  # the cut searched for without a sort, and nothing asked of the device
            # every nucleus row with top-k: searched among its candidates alone (the mass above
            # any value from the k-th up is all theirs, and below the k-th the cut keeps the
            # same tokens), else every row whole
            part = cand[rows] if all(ks[j] for j in nucleus) else sub
            floor = nucleus_floor(part, (part - lse).exp(), top_p)
        elif cand is None:  # no row has top-k: every top-p row sorted whole (the kernel's reference)
            floor = nucleus_floor_ref(sub, (sub - lse).exp(), top_p)
        else:
            floor, found = _nucleus_floor(cand[rows], lse, top_p, v)
            # (a host sync, free on the CPU)
            if not bool(found.all()):  # rows without top-k (or past their candidates): sorted whole
                rest = (~found).nonzero()[:, 0]
                floor[rest] = nucleus_floor_ref(sub[rest], (sub[rest] - lse[rest]).exp(), top_p[rest])
        if every:  # (logits is this function's own tensor: the division made it)
            logits.masked_fill_(logits < floor, float("-inf"))
        else:
            logits[rows] = sub.masked_fill(sub < floor, float("-inf"))
    return logits.softmax(-1)


def _nucleus_floor(
    cand: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor, v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p over P rows among candidates: each row's lowest logit that stays, [P, 1], and
    whether that cut was found among them, [P] (False: a row needs more of them).

    cand: [P, K] each row's K largest logits, descending (-inf: filtered out), of rows of v whose
    log-sum-exp is lse: [P, 1]; top_p: [P, 1] float64. A token stays unless the tokens more likely
    than it already reach top_p: tokens of one value stay or go together, and the most likely
    always stays (chunkserve.kernels.nucleus.nucleus_floor_ref: the same over whole rows).
    """
    probs = (cand - lse).exp().double()  # [P, K]
    before = probs.cumsum(-1) - probs  # the mass of the candidates before each one
    # a prefix of each row, at least one long. The first of a run of equal values has the mass
    # strictly above the value before it, so the floor, its value, keeps the whole run.
    keep = (before < top_p) & (cand > float("-inf"))
    n = keep.sum(-1, keepdim=True)
    found = (n[:, 0] < cand.shape[-1]) | (cand[:, -1] == float("-inf")) | (cand.shape[-1] == v)
    return cand.gather(1, n - 1), found


def sample_row_ref(
    logits: torch.Tensor,
    p: SamplingParams,
    key: int,
    counter: int,
    prompt: list[int] = (),
    outputs: list[int] = (),
    banned: tuple[int, ...] = (),
) -> int:
    """One row alone (logits: [V]); the plain reference that ``sample`` batches. prompt, outputs:
    the row's tokens so far, which its penalties read; banned: tokens it must not draw."""
    if banned or p.logit_bias:
        logits = logits.clone()
        logits[list(banned)] = float("-inf")
        for t, b in p.logit_bias:
            logits[t] += b
    if p.penalized:
        counts = torch.bincount(torch.tensor(list(outputs), dtype=torch.long), minlength=logits.numel())
        counts = counts.to(logits.device, logits.dtype)
        seen = counts > 0
        seen[list(prompt)] = True
        logits = torch.where(
            seen, torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty), logits
        )
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.greedy:
        return int(logits.argmax())
    logits = logits / p.temperature
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        # the distinct values, descending, and each one's probability mass (all its tokens')
        values, counts = torch.unique_consecutive(torch.sort(logits, descending=True).values, return_counts=True)
        mass = (values - logits.logsumexp(-1)).exp().double() * counts
        above = mass.cumsum(0) - mass  # the mass of the values above each
        keep = (above < p.top_p) & (values > float("-inf"))
        logits = logits.masked_fill(logits < values[keep][-1], float("-inf"))
    probs = logits.softmax(-1)
    u = uniform_ref(torch.tensor([_key(key)]), torch.tensor([counter]), probs.numel())[0]
    return int(_race(probs, u.to(probs.device)))
