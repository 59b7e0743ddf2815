"""TPP decode planning: a decode batch (rows in prefix-tree DFS order) into the device work lists
``chunkserve.kernels.tpp``'s kernels read (DESIGN §7).

``build_plan`` cuts the work of both phases into pieces of about equal size, enough of them to fill
the GPU a few times over (phase 1: a run of a shared segment's chunks for a tile of its rows;
phase 2: a run of one row's private chunks), groups them into launches with their query tiles,
and uploads the items, chunk runs and partial slots in one copy. ``TppPlan`` holds them, reused
by every layer until the tree changes. ``_launch_config`` is the attend kernel's tile config per
query tile, which the planner needs too (how many programs fit on a multiprocessor).

The knobs are read at call time from this module (tests and the tools set them here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from chunkserve.kernels.heads import PagedHeads
from chunkserve.kernels.reference import TreePlan, build_tree_plan

__all__ = ["FixedPlans", "FixedShape", "TppPlan", "build_fixed_plan", "build_plan"]

# The knobs below were picked on the H200 (`python -m chunkserve.kernels.tools.bench decode` / `sweep`); the
# measurements behind each are in chunkserve/kernels/tools/records/README.md ("TPP tuning"). Tests set them.
# How the work is cut: pieces per multiprocessor to aim at over all KV heads, and the least
# work worth a piece of its own.
_PROGRAMS_PER_SM = 2
_MIN_PIECE_TOKENS = 256
# Each phase in a launch of its own (phase-2 pieces then use a G-row tile, not phase 1's).
_SPLIT_PHASES = True
# Phase 1 beside a phase 2 (split launches): cut into about this many pieces per KV head, not
# _PROGRAMS_PER_SM per multiprocessor, and no piece longer than phase 2's longest (build_plan).
_P1_BESIDE_PIECES = 4
# MHA (G = 1) phase 1 beside a phase 2 whose longest piece is at least as long as every segment:
# one piece per row tile (the segment whole), so each row folds one phase-1 partial.
_P1_BESIDE_WHOLE_MHA = True
# Phase-1 query tile: rows * G up to this many query vectors per piece.
_P1_MAX_M = 64
# Phase 1 with no phase 2 beside it (every row's chunks shared): a 32-vector tile launches as
# _P1_ALONE_M vectors, whose dots sm90 runs on warpgroup MMA (64 rows a warpgroup), and a
# segment that one row tile reads is cut for _P1_ALONE_PROGRAMS_PER_SM programs per
# multiprocessor (fewer partials to merge); not for fewer live vectors, nor beside a phase 2.
_P1_ALONE_M = 64
_P1_ALONE_PROGRAMS_PER_SM = 1
# Phase 2 this many times phase 1's chunk reads or more: phase-1 tiles launch lean (see
# TppPlan.lean_phase1).
_LEAN_RATIO = 8
# A row's one phase-2 piece folds in its phase-1 partials only if it has this many at most; a
# row with more stores its own partial too and leaves them all to the merge launch, which loads
# them in one vector where the fold takes one (an L2 round trip) at a time.
_FOLD_MAX = 4
# Short private parts, many of them: a phase-2 program takes _ROWS rows, one after another in
# one streaming loop (_attend_rows_kernel), where every phase-2 piece is a row's whole private
# part of _ROWS_MAX_CHUNKS chunks at most that ends the row (no partials of its own), there are
# _ROWS_MIN_PROGRAMS phase-2 programs (pieces * Hkv) or more, and the rows' G-vector groups fill
# one 16-vector tile at most. Each program's start (its item, q, the first block's latency) is
# paid once per _ROWS rows, and the pipeline runs on across row boundaries.
_ROWS = 4
_ROWS_MAX_CHUNKS = 4
_ROWS_MIN_PROGRAMS = 1024
# Item fields (int32 rows of the plan's piece list), in kernel argument order.
_FIELDS = 10  # phase (1 or 2), row0, nrows, chunk0 (into chunks), nchunks, end, slot, fold0, nfold, chunks[chunk0]
# phase 1: rows row0 .. row0 + nrows - 1 (end 0); phase 2: row row0 (nrows 1), tokens through
# its last chunk `end` (masks the tail). The rows store partials to slots
# slot_list[slot : slot + nrows], or (slot -1) their output directly, after folding in the
# partials at slots fold0 .. fold0 + nfold - 1 (written by an earlier launch).
_MERGE_FIELDS = 3  # row, first partial slot, number of partials
# A fixed plan's counts (phase-1 pieces, phase-2 pieces, merge rows) lie this many int32 apart:
# each a 16-byte aligned pointer of its own (chunkserve.kernels.launch takes the alignment as given)
_COUNTS_APART = 4


@dataclass(frozen=True)
class TppPlan:
    """Device work lists for one decode batch; reused by every layer until the tree changes.

    ``seq_lens: [B]`` int32 (a fixed plan's: [max_rows], the rows past B unread) may be bumped
    in place between steps (``plan.seq_lens += 1``) as long as every row's new tokens stay inside the private chunks the plan covers: its partial
    tail chunk, and with ``build_plan(reserved=True)`` the reserved chunks of its table past its
    length. Anything else (a row joins or leaves, grows past them) needs a new plan. The partial
    buffers belong to the plan, so one plan serves one stream at a time.
    """

    tree: TreePlan
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    chunk_size: int
    seq_lens: Tensor  # [B] int32
    items: Tensor  # [I, 10] int32 pieces, one program each, see _FIELDS; the same for every KV head
    # attend launches: (first item, items, query tile BLOCK_M, live query vectors per tile at
    # most, phase of its pieces: 1, 2 or 0 for both)
    launches: tuple[tuple[int, int, int, int, int], ...]
    chunks: Tensor  # int32 chunk ids: each segment's run, then each row's private run
    slot_list: Tensor  # int32 partial slots: a piece with slot s >= 0 stores its row r to slot_list[s + r]
    merge_items: Tensor  # [R, 3] int32 rows whose output the merge writes (row, slot0, count)
    block_p: int  # partials the merge folds per step (most a row has, a power of two <= 16)
    # Tiles launched lean: one K/V buffer less, so more programs fit on a multiprocessor (see
    # _launch_config). Phase 1 where phase 2 reads _LEAN_RATIO times its chunks or more (phase-2
    # programs then fit beside phase 1's); phase 2 where, beside a phase 1, its programs would
    # not fit in one wave otherwise.
    lean_phase1: bool
    lean_phase2: bool
    most_folds: int  # phase-1 partials the most a phase-2 piece folds (picks the fold compiled)
    # phase-2 rows per program (_attend_rows_kernel, see _ROWS) where > 1; tpp_decode still runs a
    # row per program where a chunk's block passes _ROWS_BLOCK_BYTES (the dtype is known only there)
    rows_per_program: int
    part_o: Tensor  # [P, Hq, D] fp32 partial outputs (normalised); a row's slots are contiguous
    part_lse: Tensor  # [P, Hq] fp32 their log2-sum-exp2
    # A fixed plan's (build_fixed_plan): int32 counts, _COUNTS_APART apart (phase-1 pieces,
    # phase-2 pieces, merge rows; see count); each launch's grid is its capacity and programs
    # past its count return
    counts: Tensor | None = None
    max_rows: int | None = None  # a fixed plan's padded batch: q may have up to this many rows
    # TppDecoder's launches for the plan, per kind of call (shapes, strides, dtypes, devices);
    # fixed plans of one padded batch share one (their launches are the same)
    launch_cache: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def count(self, i: int) -> Tensor:
        """A fixed plan's i-th count (0: phase-1 pieces, 1: phase-2 pieces, 2: merge rows), as the
        pointer its launch reads."""
        assert self.counts is not None
        return self.counts[i * _COUNTS_APART :]

    @property
    def batch_size(self) -> int:
        return len(self.tree.seq_lens)

    @property
    def programs(self) -> int:
        """Attend programs (pieces) per KV head, over all launches."""
        return sum(launch[1] for launch in self.launches)

    def phase_items(self, phase: int) -> int:
        return int((self.items[:, 0] == phase).sum()) if self.items.numel() else 0


def _next_pow2(n: int) -> int:
    """The least power of two >= n (triton.next_power_of_2's, without importing Triton)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _rows_per_program(items: list[tuple], g: int, hkv: int) -> int:
    """Phase-2 rows per program (see _ROWS): > 1 only where phases launch apart and every phase-2
    piece is a whole row's private part of _ROWS_MAX_CHUNKS chunks at most that ends the row
    (slot -1). Their chunk runs then lie back to back in row order, as one program reads them."""
    two = [it for it in items if it[0] == 2]
    if _ROWS < 2 or _ROWS * g > 16 or not _SPLIT_PHASES or len(two) * hkv < max(1, _ROWS_MIN_PROGRAMS):
        return 1
    if any(it[6] != -1 or it[4] > _ROWS_MAX_CHUNKS for it in two):
        return 1
    assert all(b[3] == a[3] + a[4] for a, b in zip(two, two[1:])), "phase-2 chunk runs back to back"
    return _ROWS


def _even(total: int, n: int) -> list[tuple[int, int]]:
    """[0, total) cut into n near-equal (start, length) pieces."""
    if n == 1:
        return [(0, total)]
    bounds = [total * i // n for i in range(n + 1)]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def _pieces(total: int, piece: int) -> list[tuple[int, int]]:
    """[0, total) cut into ceil(total / piece) near-equal (start, length) pieces."""
    return _even(total, max(1, -(-total // max(1, piece))))


def _phase1_tile(rows: int, g: int) -> int:
    """Phase-1 query tile (vectors) for a segment of `rows` rows: rows * G, 16 to _P1_MAX_M (G more)."""
    return max(16, min(_next_pow2(rows * g), max(_P1_MAX_M, _next_pow2(g))))


def _phase2_tile(g: int) -> int:
    """Phase-2 query tile (vectors): one row's G heads, 16 at least."""
    return max(16, _next_pow2(g))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a token parallelism so that small tests still split


@dataclass(frozen=True)
class FixedShape:
    """The launches of every fixed plan of one padded batch (`FixedPlans`): what a CUDA graph of
    a decode step bakes in. Phase 1 and phase 2 launch apart, `cap1` and `cap2` programs per KV
    head (each launch's programs past its plan's pieces return at once), the merge `rows`."""

    rows: int  # padded batch: the rows' query tensor has this many
    block_m1: int  # phase-1 query tile (vectors): as for a segment shared by every row
    block_m2: int
    cap1: int
    cap2: int
    lean_phase2: bool


class FixedPlans:
    """Device buffers that TPP plans of fixed launches are written into (`build_fixed_plan`):
    one set per engine, for every padded batch size in `sizes` (a plan of B rows takes the least
    size >= B). A CUDA graph captured over a decode step of one size replays for any plan of
    that size (chunkserve/replicas/engine/cuda_graph.py), as vLLM's graphs per padded batch do: the pieces, chunk
    runs, partial slots, merge rows and counts are data in these buffers, rewritten by each
    plan's one upload, while the grids, constexprs and pointers stay.

    Capacities, tight (a launch's programs past its pieces cost a program's start each): phase
    1 room for two levels of row tiles over every row and per_head pieces more, phase 2 a piece
    per row and per_head / 2 more. An item of n chunks is cut into ``max(1, round(n / target))``
    pieces at most, so ``target >= total / (capacity - items)`` fits: a plan whose pieces do not
    is cut that much coarser, and one whose items alone do not fit (a deeper tree, tenants' own
    prefixes past the room) is left to the plain planner (`build_fixed_plan` returns None).
    The launches' grids are (Hkv, capacity), heads inner, a launch's idle programs first: they
    return before its pieces start, so the launch after it (programmatic dependent launch) waits
    for its pieces' start as for a plain plan's.
    """

    def __init__(
        self,
        device: torch.device | str,
        sizes: Sequence[int],
        heads: PagedHeads,
        *,
        num_chunks: int,
    ):
        num_q_heads, num_kv_heads, head_dim, chunk_size = (
            heads.num_q_heads,
            heads.num_kv_heads,
            heads.head_dim,
            heads.chunk_size,
        )
        _check_heads(num_q_heads, num_kv_heads, head_dim, chunk_size)
        self.device = device = torch.device(device)
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.chunk_size = chunk_size
        g = num_q_heads // num_kv_heads
        self.per_head = max(1, _PROGRAMS_PER_SM * _num_sms(device) // num_kv_heads)
        self.shapes: dict[int, FixedShape] = {}
        for n in sorted(set(sizes)):
            m1, m2 = _phase1_tile(n, g), _phase2_tile(g)
            pps2 = _num_sms(device) * _programs_per_sm(head_dim, m2, 2, g)
            self.shapes[n] = FixedShape(
                n,
                m1,
                m2,
                2 * -(-n // max(1, m1 // g)) + self.per_head,
                n + self.per_head // 2,
                g > 1 and num_kv_heads * n > pps2,
            )
        big = max(self.shapes.values(), key=lambda s: s.rows)
        self.max_slots = max(s.cap1 * max(1, s.block_m1 // g) + s.cap2 for s in self.shapes.values())
        # int32 regions, each 16-byte aligned (chunkserve.kernels.launch takes the alignment as given):
        # counts (3, 16 bytes apart), seq_lens, merge rows, partial slots, items, chunk runs
        sizes_ = (
            3 * _COUNTS_APART,
            big.rows,
            3 * big.rows,
            self.max_slots,
            10 * max(s.cap1 + s.cap2 for s in self.shapes.values()),
            num_chunks,
        )
        self.starts = np.cumsum([0] + [-(-n // 4) * 4 for n in sizes_]).tolist()
        self.buffer = torch.zeros(self.starts[-1], dtype=torch.int32, device=device)
        f32: dict[str, Any] = dict(dtype=torch.float32, device=device)
        self.part_o = torch.empty(self.max_slots, num_q_heads, head_dim, **f32)
        self.part_lse = torch.empty(self.max_slots, num_q_heads, **f32)
        self.launch_caches: dict[int, dict] = {n: {} for n in self.shapes}

    def size_for(self, rows: int) -> int | None:
        """The least padded batch size holding `rows`, None past the largest."""
        return next((n for n in self.shapes if n >= rows), None)

    def region(self, i: int, n: int | None = None) -> Tensor:
        start = self.starts[i]
        return self.buffer[start : start + (self.starts[i + 1] - start if n is None else n)]

    def idle(self, rows: int) -> TppPlan:
        """A plan of padded batch `rows` with nothing to do (every count 0): what a graph is
        captured over (its content is the next plan's, uploaded before each replay)."""
        self.region(0).zero_()
        return self._plan(self.shapes[rows], build_tree_plan([], [], self.chunk_size))

    def upload(self, lists: list[list[int]]) -> None:
        """Each region's values from its start, by one copy up to the last value (see _to_device)."""
        end = self.starts[len(lists) - 1] + len(lists[-1])
        host = np.zeros(end, dtype=np.int32)
        for values, start in zip(lists, self.starts):
            host[start : start + len(values)] = values
        src = torch.from_numpy(host)
        if self.device.type == "cuda":
            src = src.pin_memory()
        self.buffer[:end].copy_(src, non_blocking=self.device.type == "cuda")

    def _plan(self, shape: FixedShape, tree: TreePlan) -> TppPlan:
        items = self.region(4, 10 * (shape.cap1 + shape.cap2)).view(-1, _FIELDS)
        return TppPlan(
            tree=tree,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            chunk_size=self.chunk_size,
            seq_lens=self.region(1, shape.rows),  # (rows past the batch's: never read)
            items=items,
            launches=(
                (0, shape.cap1, shape.block_m1, shape.block_m1, 1),
                (shape.cap1, shape.cap2, shape.block_m2, self.num_q_heads // self.num_kv_heads, 2),
            ),
            chunks=self.region(5),
            slot_list=self.region(3),
            merge_items=self.region(2, 3 * shape.rows).view(-1, _MERGE_FIELDS),
            block_p=16,  # (the merge loops over more)
            lean_phase1=False,
            lean_phase2=shape.lean_phase2,
            most_folds=_FOLD_MAX,
            rows_per_program=1,
            part_o=self.part_o,
            part_lse=self.part_lse,
            counts=self.region(0),
            max_rows=shape.rows,
            launch_cache=self.launch_caches[shape.rows],
        )


def build_plan(
    chunk_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    chunk_size: int,
    device: torch.device | str,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    target_programs: int | None = None,
    tree: TreePlan | None = None,
    reserved: bool = False,
) -> TppPlan:
    """Plan TPP decode for a batch whose rows are in prefix-tree DFS order.

    chunk_tables[r], seq_lens[r]: as in ``chunkserve.kernels.reference.build_tree_plan`` (which finds the
    shared segments and raises ValueError on tables that do not form contiguous row ranges).
    The heads fix the phase-1 row tiles (rows * G query vectors per tile); ``target_programs``
    (default: ``_PROGRAMS_PER_SM`` per multiprocessor) is how many attend programs, over all KV
    heads, the work is cut into at least, no piece shorter than ``_MIN_PIECE_TOKENS`` tokens
    unless its whole item is. ``tree``: ``build_tree_plan`` of the same tables (and `reserved`),
    if already at hand. `reserved`: the rows' table entries past their lengths are read too
    (masked by ``seq_lens``), so the plan stays valid while the rows grow into them.
    """
    _check_heads(num_q_heads, num_kv_heads, head_dim, chunk_size)
    if tree is None:
        tree = build_tree_plan(chunk_tables, seq_lens, chunk_size, reserved=reserved)
    plan = _build(tree, chunk_size, torch.device(device), num_q_heads, num_kv_heads, head_dim, target_programs)
    assert plan is not None
    return plan


def build_fixed_plan(
    chunk_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    fixed: FixedPlans,
    *,
    tree: TreePlan | None = None,
    reserved: bool = False,
) -> TppPlan | None:
    """``build_plan`` into `fixed`'s buffers, with the launches of the least padded batch size
    holding the rows (`FixedPlans`); None where none holds them or the plan does not fit its
    capacities. The plan uploaded replaces the buffers' last one (queued on the current stream,
    after the work that read it)."""
    if tree is None:
        tree = build_tree_plan(chunk_tables, seq_lens, fixed.chunk_size, reserved=reserved)
    size = fixed.size_for(len(tree.seq_lens))
    if size is None:
        return None
    return _build(
        tree, fixed.chunk_size, fixed.device, fixed.num_q_heads, fixed.num_kv_heads, fixed.head_dim, None, fixed, size
    )


def _check_heads(num_q_heads: int, num_kv_heads: int, head_dim: int, chunk_size: int) -> None:
    if num_q_heads <= 0 or num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    if chunk_size not in (16, 32, 64, 128):
        raise ValueError(f"chunk_size must be 16, 32, 64 or 128, got {chunk_size}")


def _build(
    tree: TreePlan,
    c: int,
    device: torch.device,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    target_programs: int | None,
    fixed: FixedPlans | None = None,
    size: int = 0,
) -> TppPlan | None:
    """build_plan's work; with `fixed`, the launches of its padded batch `size` (None: no fit)."""
    g, hkv = num_q_heads // num_kv_heads, num_kv_heads
    b = len(tree.seq_lens)
    shape = fixed.shapes[size] if fixed is not None else None
    split = _SPLIT_PHASES or shape is not None

    # whole work items: each segment's row tiles (phase 1), each row's private chunks (phase 2)
    max_rows = max((s.row_end - s.row_start for s in tree.segments), default=1)
    block_m1 = _phase1_tile(max_rows, g)
    alone = not any(tree.private_chunks) and shape is None  # phase 1 only (see _P1_ALONE_M)
    one_tile = max_rows * g <= block_m1
    if alone and block_m1 == 32:
        block_m1 = _P1_ALONE_M
    if shape is not None:
        block_m1 = shape.block_m1
    chunks: list[int] = []
    whole = []  # (phase, row0, nrows, chunk0, nchunks, [position of each chunk] for phase 2)
    for seg in tree.segments:
        whole += [
            (1, seg.row_start + t0, nt, len(chunks), len(seg.chunk_ids), None)
            for t0, nt in _pieces(seg.row_end - seg.row_start, max(1, block_m1 // g))
        ]
        chunks.extend(seg.chunk_ids)
    for r, (ids, positions) in enumerate(zip(tree.private_chunks, tree.private_positions)):
        if ids:
            whole.append((2, r, 1, len(chunks), len(ids), positions))
            chunks.extend(ids)

    # cut them into pieces of about equal size, one program each: at least _PROGRAMS_PER_SM per
    # multiprocessor over all KV heads, no piece under _MIN_PIECE_TOKENS unless its item is. Both
    # phases in one launch (one query tile for both), or each phase in a launch of its own tile.
    pps = _P1_ALONE_PROGRAMS_PER_SM if alone and (one_tile or g > 1) else _PROGRAMS_PER_SM
    per_head = fixed.per_head if fixed is not None else max(1, (target_programs or pps * _num_sms(device)) // hkv)
    block_m2 = _phase2_tile(g)
    if split:
        groups = [
            ([i for i, w in enumerate(whole) if w[0] == p], m, live, p)
            for p, m, live in ((1, block_m1, block_m1), (2, block_m2, g))
        ]
    else:
        groups = [(list(range(len(whole))), *((block_m1, block_m1) if tree.segments else (block_m2, g)), 0)]
    least = -(-_MIN_PIECE_TOKENS // c)

    def cut(ids: list[int], target: int) -> list[tuple[int, int, int]]:
        # round, not ceil: an item a bit over the target stays whole (cutting all of them in two
        # doubles the programs, which can then need a second wave)
        return [
            (i, c0, n)
            for i in ids
            for c0, n in _even(whole[i][4], max(1, min(round(whole[i][4] / target), whole[i][4] // least)))
        ]

    targets = {phase: -(-sum(whole[i][4] for i in ids) // per_head) for ids, _, _, phase in groups if ids}
    reads = {
        p: sum(w[4] for w in whole if w[0] == p) for p in (1, 2)
    }  # chunks each phase reads (phase 1: per row tile)
    if len(targets) == 2 and _P1_BESIDE_PIECES:
        # Beside phase 2, phase 1 streams in the slots phase 2 leaves. Cut as finely as alone,
        # its programs kept phase-2 programs out of their first wave, and each row folded more
        # partials. A piece longer than phase 2's longest would outlast it (records: "TPP tuning").
        longest2 = max(n for *_, n in cut(groups[1][0], targets[2]))
        targets[1] = max(targets[1], min(-(-reads[1] // _P1_BESIDE_PIECES), longest2))
        if g == 1 and _P1_BESIDE_WHOLE_MHA and all(whole[i][4] <= longest2 for i in groups[0][0]):
            targets[1] = max(whole[i][4] for i in groups[0][0])  # see _P1_BESIDE_WHOLE_MHA

    def order(p: tuple[int, int, int]) -> tuple[int, int]:
        # a segment's row tiles read the same chunks: launch their pieces of one chunk run next
        # to each other, so the later tiles find those chunks in L2
        return (1, whole[p[0]][3] + p[1]) if whole[p[0]][0] == 1 else (2, 0)

    pieces: list[tuple[int, int, int]] = []  # (whole item, first chunk, chunks)
    launches = []
    for ids, block_m, live, phase in groups:
        if ids:
            got = sorted(cut(ids, targets[phase]), key=order)
            launches.append((len(pieces), len(got), block_m, live, phase))
            pieces += got
    counts = {phase: n for _, n, _, _, phase in launches}
    if shape is not None:  # cut coarser where a phase's pieces pass its capacity (see FixedPlans)
        for ids, _, _, phase in groups:
            cap = shape.cap1 if phase == 1 else shape.cap2
            if counts.get(phase, 0) <= cap:
                continue
            if len(ids) > cap:
                return None
            first = counts.get(1, 0) if phase == 2 else 0
            got = sorted(cut(ids, max(targets[phase], -(-reads[phase] // max(1, cap - len(ids))))), key=order)
            pieces[first : first + counts[phase]] = got
            counts[phase] = len(got)
    assert shape is None or (counts.get(1, 0) <= shape.cap1 and counts.get(2, 0) <= shape.cap2)

    # partial slots, a row's contiguous. A row whose private part is one piece gets its output
    # from that piece: directly when the row reads nothing else, or after folding in its phase-1
    # partials (_FOLD_MAX at most) when phase 1 ran in an earlier launch. The merge kernel folds
    # every other row's.
    n1, n2 = [0] * b, [0] * b
    for i, _, _ in pieces:
        phase, r0, nrows = whole[i][:3]
        for r in range(r0, r0 + nrows):
            (n1 if phase == 1 else n2)[r] += 1
    finish = [n2[r] == 1 and (n1[r] == 0 or split and n1[r] <= _FOLD_MAX) for r in range(b)]
    base, merge_items, slots = [], [], 0
    for r in range(b):
        base.append(slots)
        count = n1[r] + (0 if finish[r] else n2[r])
        if not finish[r]:  # a row with nothing to read merges zero partials: its output is 0
            merge_items.append((r, slots, count))
        slots += count
    nxt = list(base)
    items: list[tuple] = []
    slot_list: list[int] = []
    for i, c0, n in pieces:
        phase, r0, nrows, chunk0, _, positions = whole[i]
        if phase == 1:
            items.append((1, r0, nrows, chunk0 + c0, n, 0, len(slot_list), 0, 0, chunks[chunk0 + c0]))
            slot_list += nxt[r0 : r0 + nrows]
            for r in range(r0, r0 + nrows):
                nxt[r] += 1
            continue
        assert positions is not None  # (a phase-2 piece's: its chunks' places)
        end = (positions[c0 + n - 1] + 1) * c
        if finish[r0]:
            items.append((2, r0, 1, chunk0 + c0, n, end, -1, base[r0], n1[r0], chunks[chunk0 + c0]))
        else:
            items.append((2, r0, 1, chunk0 + c0, n, end, len(slot_list), 0, 0, chunks[chunk0 + c0]))
            slot_list.append(nxt[r0])
            nxt[r0] += 1
    flat_items = [x for it in items for x in it]
    flat_merge = [x for it in merge_items for x in it]
    if fixed is not None and shape is not None:
        if slots > fixed.max_slots or len(chunks) > fixed.starts[6] - fixed.starts[5]:
            return None
        p1 = 10 * counts.get(1, 0)  # phase-2 pieces from item cap1 on
        flat_items = flat_items[:p1] + [0] * (10 * shape.cap1 - p1) + flat_items[p1:]
        head = [0] * (2 * _COUNTS_APART + 1)
        head[::_COUNTS_APART] = counts.get(1, 0), counts.get(2, 0), len(merge_items)
        fixed.upload([head, list(tree.seq_lens), flat_merge, slot_list, flat_items, chunks])
        return fixed._plan(shape, tree)
    lens, items_t, chunks_t, slots_t, merge_t = _to_device(
        device, list(tree.seq_lens), flat_items, chunks, slot_list, flat_merge
    )
    f32: dict[str, Any] = dict(dtype=torch.float32, device=device)
    return TppPlan(
        tree=tree,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        chunk_size=c,
        seq_lens=lens,
        items=items_t.view(-1, _FIELDS),
        chunks=chunks_t,
        slot_list=slots_t,
        launches=tuple(launches),
        merge_items=merge_t.view(-1, _MERGE_FIELDS),
        block_p=min(16, _next_pow2(max([1] + [n for _, _, n in merge_items]))),
        lean_phase1=reads[2] >= _LEAN_RATIO * reads[1] > 0,
        lean_phase2=bool(reads[1])
        and g > 1
        and hkv * sum(whole[i][0] == 2 for i, _, _ in pieces)
        > (_num_sms(device) * _programs_per_sm(head_dim, block_m2, 2, g)),
        most_folds=max((it[8] for it in items if it[0] == 2), default=0),
        rows_per_program=_rows_per_program(items, g, hkv),
        part_o=torch.empty(slots, num_q_heads, head_dim, **f32),
        part_lse=torch.empty(slots, num_q_heads, **f32),
    )


def _to_device(device: torch.device, *lists: list[int]) -> list[Tensor]:
    """int32 lists as device tensors, by one copy that does not wait for the device: a plain copy
    from pageable memory waits for every step queued before it, where the engine plans the next
    step while the device runs this one. Each tensor starts 16 bytes into the buffer past the one
    before: the pointer alignment the launches' keys take as given (chunkserve.kernels.launch)."""
    sizes = [len(x) for x in lists]
    starts = np.cumsum([0] + [-(-n // 4) * 4 for n in sizes]).tolist()
    host = np.zeros(starts[-1], dtype=np.int32)
    for values, start, n in zip(lists, starts, sizes):
        host[start : start + n] = values
    buf = torch.from_numpy(host)
    buf = buf.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else buf.to(device)
    return [buf[start : start + n] for start, n in zip(starts, sizes)]


def _launch_config(head_dim: int, block_m: int, elem_bytes: int, live: int, lean: bool = False) -> dict:
    """BLOCK_N (keys per step), warps and pipeline stages of the attend kernel for a query tile of
    block_m vectors, at most `live` of them real (``python -m chunkserve.kernels.tools.bench sweep`` compares others).
    lean: one K/V buffer less where that helps more programs fit (``TppPlan.lean_phase1/2``)."""
    if head_dim >= 256:
        cfg = dict(BLOCK_N=32, num_warps=8 if block_m > 16 else 4, num_stages=2)
    else:
        # One real query vector (MHA phase 2): a single K/V buffer and more programs per SM.
        # Lean: a 64-vector phase-1 tile (82 instead of 115 KB of shared memory) lets two
        # phase-2 programs start beside each phase-1 program; a GQA phase-2 tile (5 instead of 3
        # programs per SM) after a phase 1 avoids a second wave. The 32-vector MHA phase-1 tile
        # leaves room beside it already. (Records: "TPP tuning".)
        lean = lean and (live < block_m or block_m >= 64)
        cfg = dict(BLOCK_N=64, num_warps=4, num_stages=2 if live == 1 or lean else 3)
    # K and V tiles of every stage in shared memory: keep them under 128 KB (fp32 caches)
    per_stage = 2 * cfg["BLOCK_N"] * head_dim * elem_bytes
    cfg["num_stages"] = max(1, min(cfg["num_stages"], (128 << 10) // per_stage))
    return cfg


def _shared_bytes(head_dim: int, block_m: int, elem_bytes: int, cfg: dict) -> int:
    """Shared memory of a pointer-loop attend tile under launch config cfg: the K/V buffers
    (num_stages - 1 of [BLOCK_N, D] each), the q and p tiles. Exact for the 16-row tiles
    (tests/test_sm90_report.py compares it with the sm90 compile)."""
    bn, stages = cfg["BLOCK_N"], cfg["num_stages"]
    return (max(1, stages - 1) * 2 * bn * head_dim + block_m * head_dim + block_m * bn) * elem_bytes


def _programs_per_sm(head_dim: int, block_m: int, elem_bytes: int, live: int) -> int:
    """How many attend programs of this tile (its default config) fit on an sm90 multiprocessor
    by shared memory: 227 KB, 1 KB of it per program for the driver."""
    smem = _shared_bytes(head_dim, block_m, elem_bytes, _launch_config(head_dim, block_m, elem_bytes, live))
    return max(1, (227 << 10) // (smem + 1024))
