"""Block-union sparse prefill's accuracy on a real trained model, on the CPU (issue #28).

    python -m chunkserve.replicas.tools.bench_sparse_accuracy [--lengths 2048 3072] [--depths 3] [--piece 1024]
        [--configs alpha=0.1 budget=0.1 budget=0.25,block=64,window=2] [--threads 2] [--model smollm2-135m]

Each prompt is real text (the filler, below) with "The magic number is NNNN." planted at a depth,
then a question about it, in the model's chat template. It is prefilled in pieces of `--piece`
tokens (max_num_batched_tokens) by a dense engine and by one engine per configuration (a
BlockUnion spec: `alpha=` or `budget=`, and block / sink / window / subgroup; min_context is
the piece, so every piece after the first goes sparse). One JSON line per (configuration, prompt
length), over the `--depths` prompts of that length (depths (i + 0.5) / n of the text):

- attention mass, from the dense run: per layer and sparse piece, the dense softmax of the
  piece's queries over its keys, summed per chunk; the selector applied to those same queries
  and the dense keys' block bounds keeps some blocks per page list. ``mass``: the share of the
  dense mass on the kept blocks and the piece's own chunks (mean over layers, ``_worst`` the
  worst layer); ``ctx_mass``: the share of the mass on the context blocks that falls on kept
  ones. ``oracle_*``: the same for the oracle, which keeps as many blocks per list as the
  selector but the ones dense attention weighs most (summed over the list's heads and rows):
  the ceiling of any selection of that size. ``needle_lists`` / ``oracle_needle_lists``: the
  share of (layer, list) pairs, over pieces after the needle, whose kept blocks hold it.
- ``dense_found`` / ``found``: prompts whose greedy answer (16 tokens) holds the number, dense
  and sparse; ``found_where_dense``: of the prompts dense answers, those sparse answers too.
- ``agree_32``: equal leading tokens of the first 32 greedy tokens (EOS ignored), sparse against
  dense, on the middle-depth prompt of the length.
- ``pages_ratio``: (chunk, KV head) pages the sparse pieces' layers read over those they would
  read dense (the engine's sparse_pages_read / sparse_pages_dense): the attention's work kept.

The filler: Newton's Opticks (public domain), which apache-tvm-ffi ships as a test text
(tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt), from its first chapter on; without it
(``--filler generated``, or that package absent) sentences drawn from fixed word lists with a
fixed seed. The line says which. Progress goes to stderr. Each prefill of a few thousand tokens
takes tens of seconds on 2 cores (the plain-torch attention, float32, grows with the square of
the length): the default grid (2 lengths x 3 depths x dense and 3 configurations) takes 10-15
minutes; `--depths 5 --lengths 2048 4096 6144 --piece 2048` is the issue's setting, hours.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from chunkserve.kernels import block_union, reference
from chunkserve.kernels.block_union import BlockUnion

NEEDLE = " The magic number is {}. "
QUESTION = "What is the magic number mentioned in the text above? Answer with the number."
DEFAULT_CONFIGS = ("alpha=0.1", "budget=0.1", "budget=0.25")
ANSWER_TOKENS, AGREE_TOKENS = 16, 32


# ---------------------------------------------------------------------------------------------
# Attention mass: what a selection keeps of dense attention
# ---------------------------------------------------------------------------------------------


def chunk_mass(
    q: Tensor, k: Tensor, v: Tensor, context_len: int, c: int, sm_scale: float, group: int | None = None
) -> tuple[Tensor, Tensor]:
    """Dense causal attention of a piece, and where its weight falls. q: [T, Hq, D] at positions
    context_len.. ; k, v: [Hkv, total, D] (total = context_len + T) -> (out [T, Hq, D] as
    chunkserve.kernels.reference.prefill_attention_ref, M [NG, Hq, ceil(total / c)] float32: each head's
    softmax weights summed over each group of `group` rows (one group of all T by default) and
    each chunk's keys; a head's row in a group sums to the group's rows)."""
    t_new, hq, d = q.shape
    hkv, total, _ = k.shape
    g, used = hq // hkv, -(-total // c)
    group = t_new if group is None else group
    k, v = k.float(), v.float()
    qf = q.float().permute(1, 0, 2).reshape(hkv, g, t_new, d)
    out = torch.empty(hkv, g, t_new, d)
    mass = torch.zeros(-(-t_new // group), hkv, g, used * c)
    tile = max(1, (1 << 24) // max(1, hq * total))  # bounds the [Hkv, G, tile, total] scores
    for g0 in range(0, t_new, group):
        for t0 in range(g0, min(t_new, g0 + group), tile):
            t1 = min(t_new, g0 + group, t0 + tile)
            w = torch.matmul(qf[:, :, t0:t1], k[:, None].transpose(-1, -2)) * sm_scale  # [Hkv, G, t, total]
            qpos = torch.arange(context_len + t0, context_len + t1)
            w = w.masked_fill(torch.arange(total) > qpos[:, None], float("-inf"))
            p = torch.softmax(w, dim=-1)
            out[:, :, t0:t1] = torch.matmul(p, v[:, None])
            mass[g0 // group, ..., :total] += p.sum(2)
    return out.reshape(hq, t_new, d).permute(1, 0, 2), mass.view(-1, hq, used, c).sum(-1)


def list_mass(mass: Tensor, sub: int, context_chunks: int, block_chunks: int) -> tuple[Tensor, Tensor]:
    """mass [Hq, used] per head and chunk -> (per page list (entry e: heads [e * sub, (e + 1) * sub))
    and context block [E, NB], the mass on the piece's own chunks [E])."""
    hq, _ = mass.shape
    per_list = mass.view(hq // sub, sub, -1).sum(1)
    nb = -(-context_chunks // block_chunks)
    ctx = torch.nn.functional.pad(per_list[:, :context_chunks], (0, nb * block_chunks - context_chunks))
    return ctx.view(-1, nb, block_chunks).sum(-1), per_list[:, context_chunks:].sum(1)


def oracle_keep(block_mass: Tensor, counts: Tensor) -> Tensor:
    """block_mass [E, NB], counts [E] -> keep [E, NB]: each list's counts[e] heaviest blocks."""
    order = block_mass.argsort(dim=1, descending=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(order.shape[1]).expand_as(order).contiguous())
    return ranks < counts[:, None]


def kept_mass(block_mass: Tensor, own: Tensor, keep: Tensor) -> dict[str, float]:
    """Sums for one (piece, layer): the mass on kept context blocks, on all context blocks, in all
    (kept + own) and overall (every weight: the rows times the heads)."""
    ctx_kept = float((block_mass * keep).sum())
    return {
        "ctx_kept": ctx_kept,
        "ctx": float(block_mass.sum()),
        "kept": ctx_kept + float(own.sum()),
        "all": float(block_mass.sum() + own.sum()),
    }


def select(q: Tensor, k: Tensor, context_len: int, cfg: BlockUnion, c: int, sub: int, sm_scale: float) -> Tensor:
    """The selector's blocks for a piece's queries q [T, Hq, D] at positions context_len.. given
    its keys k [Hkv, >= context_len + T, D]: the engine's CPU path
    (chunkserve.replicas.engine.attention.Attention.sparse_prefill) from chunk key bounds -> keep [S * E, NB] bool,
    span after span (block_union.piece_spans), each span's row zero past the blocks it sees."""
    hkv, _, d = k.shape
    spans = block_union.piece_spans(context_len, q.shape[0], cfg.span_rows(context_len))
    k0, bc = spans[-1][0] // c, cfg.block // c
    chunks = k[:, : k0 * c].reshape(hkv, k0, c, d).transpose(0, 1)  # [k0, Hkv, c, D]
    keys = block_union.block_keys(block_union.chunk_key_bounds_ref(chunks), torch.arange(k0), bc)  # the pool's
    limits = block_union.query_limits(context_len, q.shape[0], c, cfg)
    agg = block_union.block_scores(q, keys, cfg, sub, sm_scale, limits, context_len)
    e = agg.shape[0] // len(spans)
    rows = [block_union.context_blocks(ctx, c, cfg.block) for ctx, _ in spans for _ in range(e)]
    return block_union.select_blocks(agg, cfg, rows)


def summarise(per_layer: dict[int, dict[str, float]], prefix: str = "") -> dict[str, float]:
    """Per layer sums -> mean and worst layer of the kept share, overall and on the context."""
    whole = [s["kept"] / s["all"] for s in per_layer.values()]
    ctx = [s["ctx_kept"] / s["ctx"] for s in per_layer.values() if s["ctx"] > 0]
    r = lambda x: round(x, 4)
    return {
        f"{prefix}mass": r(sum(whole) / len(whole)),
        f"{prefix}mass_worst": r(min(whole)),
        f"{prefix}ctx_mass": r(sum(ctx) / len(ctx)),
        f"{prefix}ctx_mass_worst": r(min(ctx)),
    }


class MassProbe:
    """Stands in for a dense engine's StepAttention (Attention.plan's result): a step with one
    prefill piece whose context is at least `start` tokens attends through `chunk_mass`, and
    each configuration's selection and the oracle's are scored against its weights per layer
    into `sums[config][kind][layer]` (kind: "sel" or "oracle"), span by span (each span's
    context: every chunk before the one holding its first token); anything else attends as is.
    The prompt's last `dense_tail` tokens (prompt_len, set per prompt) attend densely and are
    neither selected nor scored, as in the engine."""

    def __init__(self, engine, cfgs: dict[str, BlockUnion], start: int):
        self.engine, self.cfgs, self.start = engine, cfgs, start
        a = engine.attention
        self.c, self.scale, self.hkv = a.pool.chunk_size, a.sm_scale, a.pool.kv.shape[3]
        self.subs = {
            name: block_union.subgroup_size(a.num_q_heads, self.hkv, cfg.subgroup) for name, cfg in cfgs.items()
        }
        self.needle: tuple[int, int] | None = None  # the planted sentence's token span, for needle_lists
        self.prompt_len = 0  # the prompt being prefilled: its last piece keeps a dense tail
        self.sums: dict = {name: {"sel": {}, "oracle": {}} for name in cfgs}
        self.needle_hits: dict = {name: {"sel": [0, 0], "oracle": [0, 0]} for name in cfgs}
        plan = a.plan
        a.plan = lambda batch: _ProbedStep(plan(batch), self)

    def piece(self, layer: int, q: Tensor, k: Tensor, v: Tensor, context_len: int) -> Tensor:
        c, t = self.c, q.shape[0]
        last = context_len + t == self.prompt_len
        rows = {name: t - (min(t, cfg.dense_tail) if last else 0) for name, cfg in self.cfgs.items()}
        group = math.gcd(
            t, *rows.values(), *(cfg.span_rows(context_len) or t for cfg in self.cfgs.values())
        )  # (0 counts as none)
        out, mass = chunk_mass(q, k, v, context_len, c, self.scale, group)
        for name, cfg in self.cfgs.items():
            n = rows[name]
            if not cfg.applies(context_len, c) or not n:
                continue
            sub, bc = self.subs[name], cfg.block // c
            keep = select(q[:n], k, context_len, cfg, c, sub, self.scale)
            parts = block_union.piece_spans(context_len, n, cfg.span_rows(context_len))
            e = keep.shape[0] // len(parts)
            for j, (ctx, m_rows) in enumerate(parts):
                k0, g0 = ctx // c, (ctx - context_len) // group
                m = mass[g0 : g0 + -(-m_rows // group)].sum(0)  # (a short last span: its groups hold only its rows)
                bm, own = list_mass(m, sub, k0, bc)
                kp = keep[j * e : (j + 1) * e, : bm.shape[1]]
                for kind, kk in {"sel": kp, "oracle": oracle_keep(bm, kp.sum(1))}.items():
                    acc = self.sums[name][kind].setdefault(
                        layer, dict.fromkeys(("ctx_kept", "ctx", "kept", "all"), 0.0)
                    )
                    for key, val in kept_mass(bm, own, kk).items():
                        acc[key] += val
                    if self.needle is not None and self.needle[1] <= k0 * c:  # the needle is in the context
                        blocks = range(self.needle[0] // cfg.block, (self.needle[1] - 1) // cfg.block + 1)
                        hit = self.needle_hits[name][kind]
                        hit[0] += int(kk[:, list(blocks)].any(1).sum())
                        hit[1] += kk.shape[0]
        return out


class _ProbedStep:
    # not the step's: the model then rotates q and k itself and calls `forward`, which this wraps
    forward_rope = None

    def __init__(self, step, probe: MassProbe):
        self._step, self._probe = step, probe

    def __getattr__(self, name):
        return getattr(self._step, name)

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor | None = None) -> Tensor:
        s, spans = self._step, self._step.prefills
        if s.num_decodes or len(spans) != 1 or spans[0].context_len < self._probe.start:
            return s.forward(layer, q, k, v, out)
        pool = s.attention.pool
        pool.write(layer, s.chunk_idx, s.offset, k, v)
        span = spans[0]
        total = span.context_len + span.num_new
        kk = reference.gather_kv(pool.k(layer), span.chunk_ids, total)
        vv = reference.gather_kv(pool.v(layer), span.chunk_ids, total)
        o = self._probe.piece(layer, q, kk, vv, span.context_len).to(q.dtype).contiguous()
        if out is None:
            return o
        out.copy_(o)
        return out


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------

_WORDS = {
    "subject": [
        "The old farmer",
        "A young teacher",
        "The river",
        "My neighbour",
        "The small boat",
        "The city council",
        "A tired traveller",
        "The gardener",
        "The orchestra",
        "Our family",
        "The baker",
        "A grey cat",
    ],
    "verb": [
        "walked past",
        "looked at",
        "painted",
        "remembered",
        "carried",
        "followed",
        "repaired",
        "described",
        "admired",
        "visited",
        "ignored",
        "cleaned",
    ],
    "object": [
        "the quiet harbour",
        "a wooden bridge",
        "the empty market",
        "an old church",
        "the morning train",
        "the green hills",
        "a narrow street",
        "the village school",
        "the broken fence",
        "a field of wheat",
    ],
    "tail": [
        "before the rain came",
        "on a cold afternoon",
        "while the bells rang",
        "after a long winter",
        "without saying a word",
        "as the sun went down",
        "in the early spring",
        "for the last time",
    ],
}


def filler_text(kind: str = "auto", chars: int = 80_000) -> tuple[str, str]:
    """(text, its name): Newton's Opticks from apache-tvm-ffi's data, or generated sentences."""
    if kind in ("auto", "opticks"):
        spec = importlib.util.find_spec("tvm_ffi")
        path = (
            Path(spec.origin).parent / "3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"
            if spec and spec.origin
            else None
        )
        if path is not None and path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            start = text.find("BOOK I.")  # past the title pages and contents
            body = " ".join(text[max(0, start) :].split())  # one paragraph: line breaks cost tokens
            return body[:chars], "opticks"
        if kind == "opticks":
            raise ValueError("the Opticks text needs apache-tvm-ffi installed (or --filler generated)")
    rng, out, n = random.Random(0), [], 0
    while n < chars:
        s = (
            f"{rng.choice(_WORDS['subject'])} {rng.choice(_WORDS['verb'])} {rng.choice(_WORDS['object'])} "
            f"{rng.choice(_WORDS['tail'])}."
        )
        out.append(s)
        n += len(s) + 1
    return " ".join(out), "generated"


def needle_prompt(tok, filler_ids: list[int], length: int, depth: float, number: int) -> tuple[list[int], tuple]:
    """A chat prompt of `length` tokens: the filler's first tokens with the needle sentence planted
    after the sentence end nearest `depth` of the text, then the question -> (ids, the needle's
    token span)."""
    doc = "\x00"  # split the template around the document
    chat = tok.apply_chat_template([{"role": "user", "content": f"{doc}\n\n{QUESTION}"}], add_generation_prompt=True)
    head, tail = (tok.encode(part, add_special_tokens=False) for part in chat.split(doc))
    needle = tok.encode(NEEDLE.format(number), add_special_tokens=False)
    n = length - len(head) - len(tail) - len(needle)
    if n <= 0 or n > len(filler_ids):
        raise ValueError(f"a {length}-token prompt needs {n} filler tokens, the filler has {len(filler_ids)}")
    text = filler_ids[:n]
    ends = [i + 1 for i in range(n) if tok.decode([text[i]]).rstrip().endswith(".")] or [0]
    at = min(ends, key=lambda i: abs(i - depth * n))
    start = len(head) + at
    return head + text[:at] + needle + text[at:] + tail, (start, start + len(needle))


def leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def run(args) -> list[dict]:
    from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams

    torch.set_num_threads(args.threads)
    cfgs = {spec: BlockUnion.from_spec(spec, args.piece) for spec in args.configs}
    opts = {
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_tokens": max(args.lengths) + 2 * AGREE_TOKENS + 64,
        "max_num_batched_tokens": args.piece,
        "enable_prefix_sharing": False,
    }
    t0 = time.time()
    dense = LLMEngine.from_model(args.model, **opts)
    probe = MassProbe(dense, cfgs, args.piece)
    engines = {spec: LLMEngine.from_model(args.model, sparse_prefill=cfg, **opts) for spec, cfg in cfgs.items()}
    tok = dense.tokenizer
    text, filler = filler_text(args.filler)
    filler_ids = tok.encode(text, add_special_tokens=False)
    log = lambda *a: print(f"[{time.time() - t0:6.0f}s]", *a, file=sys.stderr, flush=True)
    log(f"engines loaded, filler {filler} ({len(filler_ids)} tokens)")
    depths = [(i + 0.5) / args.depths for i in range(args.depths)]
    mid = min(range(len(depths)), key=lambda i: abs(depths[i] - 0.5))
    lines = []
    for length in args.lengths:
        t_len = time.time()
        for name in cfgs:
            probe.sums[name] = {"sel": {}, "oracle": {}}
            probe.needle_hits[name] = {"sel": [0, 0], "oracle": [0, 0]}
        found: dict[str, list[bool]] = {name: [] for name in cfgs}
        dense_found, agree, pages = [], {}, {name: [0, 0] for name in cfgs}
        for i, depth in enumerate(depths):
            number = random.Random(length * 100 + i).randrange(1000, 10000)
            ids, span = needle_prompt(tok, filler_ids, length, depth, number)
            params = (
                SamplingParams(max_tokens=AGREE_TOKENS, temperature=0, ignore_eos=True)
                if i == mid
                else SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0)
            )
            probe.needle, probe.prompt_len = span, len(ids)
            ref = dense.generate([ids], params)[0]
            dense_found.append(str(number) in tok.decode(ref[:ANSWER_TOKENS]))
            log(f"len {length} depth {depth:.2f} dense: {tok.decode(ref[:ANSWER_TOKENS])!r}")
            for name, eng in engines.items():
                c = eng.counters
                before = c.sparse_pages_read, c.sparse_pages_dense
                got = eng.generate([ids], params)[0]
                pages[name][0] += c.sparse_pages_read - before[0]
                pages[name][1] += c.sparse_pages_dense - before[1]
                found[name].append(str(number) in tok.decode(got[:ANSWER_TOKENS]))
                if i == mid:
                    agree[name] = leading_equal(got, ref)
                log(f"len {length} depth {depth:.2f} {name}: {tok.decode(got[:ANSWER_TOKENS])!r}")
        for name, cfg in cfgs.items():
            line = {
                "config": name,
                "block": cfg.block,
                "sink": cfg.sink,
                "window": cfg.window,
                "subgroup": cfg.subgroup,
                "span": cfg.span,
                "dense_tail": cfg.dense_tail,
                "spread": cfg.spread,
                "fold": cfg.fold,
                "alpha": None if cfg.budget is not None else cfg.alpha,
                "budget": cfg.budget,
                "length": length,
                "piece": args.piece,
                "min_context": cfg.min_context,
                "filler": filler,
                "depths": [round(d, 3) for d in depths],
            }
            if probe.sums[name]["sel"]:
                line.update(summarise(probe.sums[name]["sel"]))
                line.update(summarise(probe.sums[name]["oracle"], "oracle_"))
            for kind, key in (("sel", "needle_lists"), ("oracle", "oracle_needle_lists")):
                hit, of = probe.needle_hits[name][kind]
                line[key] = round(hit / of, 4) if of else None
            both = sum(d and s for d, s in zip(dense_found, found[name]))
            line.update(
                {
                    "dense_found": sum(dense_found),
                    "found": sum(found[name]),
                    "found_where_dense": f"{both}/{sum(dense_found)}",
                    "agree_32": agree.get(name),
                    "pages_ratio": round(pages[name][0] / pages[name][1], 4) if pages[name][1] else None,
                    "seconds_length": round(time.time() - t_len),
                }
            )
            print(json.dumps(line), flush=True)
            lines.append(line)
    log("done")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 3072])
    ap.add_argument("--depths", type=int, default=3, help="needle depths per length: (i + 0.5) / n")
    ap.add_argument("--piece", type=int, default=1024, help="prefill piece (max_num_batched_tokens) and min_context")
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), help="BlockUnion specs: alpha=0.1,block=64")
    ap.add_argument("--filler", choices=("auto", "opticks", "generated"), default="auto")
    ap.add_argument("--threads", type=int, default=2)
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
