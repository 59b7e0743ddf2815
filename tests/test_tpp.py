"""chunkserve/kernels/tpp.py: Triton TPP decode vs chunkserve/kernels/reference.py on random prefix trees.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set in conftest.py; small shapes);
`pytest -m gpu` runs the larger cases for real on a CUDA device.
"""

from __future__ import annotations

import random

import pytest
import torch
import triton

from chunkserve.kernels import tpp, tpp_plan
from chunkserve.kernels.heads import PagedHeads
from chunkserve.kernels.reference import decode_attention_ref, tpp_decode_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def random_forest(rng: random.Random, c: int, max_rows: int, depth: int):
    """Chunk tables of a DFS-ordered batch over a random prefix forest, with lengths.

    Every internal node is a run of 1-3 full chunks shared by its subtree; leaves hold 1-3 rows
    that may add private full chunks and a partial tail, or end exactly on a chunk boundary
    (nothing private); a lone row is a tree with nothing shared; a row may hold a reserved
    extra chunk past its length; chunk ids are shuffled so no two neighbours are adjacent.
    """
    count = [0]
    tables, lens = [], []

    def new(n):
        count[0] += n
        return list(range(count[0] - n, count[0]))

    def grow(prefix, level):
        path = prefix + new(rng.randint(1, 3))
        if level < depth and rng.random() < 0.85:
            for _ in range(rng.randint(2, 3)):
                if len(tables) < max_rows:
                    grow(path, level + 1)
            return
        for _ in range(rng.randint(1, 3)):
            if len(tables) >= max_rows:
                return
            table = path + new(rng.randint(0, 2))
            n = len(table) * c
            if rng.random() < 0.7:  # partial tail chunk
                tail = rng.randint(1, c - 1)
                table += new(1)
                n += tail
            if rng.random() < 0.3:  # reserved next chunk, not read
                table += new(1)
            tables.append(table)
            lens.append(n)

    while len(tables) < max_rows:
        grow([], 1)
    perm = list(range(count[0]))
    rng.shuffle(perm)
    return [[perm[x] for x in t] for t in tables], lens, count[0]


def make_case(seed, dtype, head_dim, groups, c, rows, depth=3, hkv=2, device=DEVICE):
    rng = random.Random(seed)
    tables, lens, num_chunks = random_forest(rng, c, rows, depth)
    g = torch.Generator().manual_seed(seed)
    shape = (num_chunks + 1, hkv, c, head_dim)
    k = torch.randn(shape, generator=g).to(dtype).to(device)
    v = torch.randn(shape, generator=g).to(dtype).to(device)
    q = torch.randn(len(tables), groups * hkv, head_dim, generator=g).to(dtype).to(device)
    return q, k, v, tables, lens


def plan_for(q, k, tables, lens, **kw):
    return tpp.build_plan(
        tables, lens, k.shape[2], q.device, num_q_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=q.shape[2], **kw
    )


def check(q, k, v, tables, lens, plan, sm_scale=None):
    got = tpp.tpp_decode(q, k, v, plan, sm_scale)
    want = decode_attention_ref(q, k, v, tables, lens, sm_scale)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = TOL[q.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    return got


# (dtype, head_dim, groups, chunk_size, rows, seed): together every dtype, head dim, GQA ratio
# and chunk size, on trees of depth >= 3 with partial tails; small enough for the interpreter
CPU_CASES = [
    (torch.float16, 64, 1, 16, 9, 1),
    (torch.bfloat16, 64, 4, 32, 12, 2),
    (torch.float16, 128, 8, 16, 7, 3),
    (torch.bfloat16, 128, 1, 64, 5, 4),
    (torch.float16, 256, 4, 16, 4, 5),
    (torch.bfloat16, 256, 1, 128, 3, 6),
    (torch.float32, 64, 8, 32, 10, 7),
    (torch.float16, 64, 4, 128, 2, 8),
    (torch.bfloat16, 64, 8, 16, 24, 9),
    (torch.float16, 64, 1, 16, 1, 10),
]


@pytest.mark.parametrize(
    "dtype,head_dim,groups,c,rows,seed",
    CPU_CASES,
    ids=[f"{str(a[0])[6:]}-d{a[1]}-g{a[2]}-c{a[3]}-b{a[4]}" for a in CPU_CASES],
)
def test_matches_reference_on_random_trees(dtype, head_dim, groups, c, rows, seed):
    q, k, v, tables, lens = make_case(seed, dtype, head_dim, groups, c, rows)
    plan = plan_for(q, k, tables, lens)
    got = check(q, k, v, tables, lens, plan)
    # the two-phase reference agrees on the same plan too (same partition, same rounding of q/kv)
    torch.testing.assert_close(
        got.float(), tpp_decode_ref(q, k, v, plan.tree).float(), atol=TOL[dtype], rtol=TOL[dtype]
    )


def test_forced_split_k_in_both_phases(monkeypatch):
    # pieces of one chunk: every segment and every multi-chunk private part is cut
    monkeypatch.setattr(tpp_plan, "_MIN_PIECE_TOKENS", 1)
    q, k, v, tables, lens = make_case(11, torch.float32, 64, 4, 16, 8, depth=4)
    plan = plan_for(q, k, tables, lens, target_programs=1 << 20)
    items = plan.items.tolist()
    rows2 = [it[1] for it in items if it[0] == 2]
    assert any(rows2.count(r) > 1 for r in rows2)  # some row's private part is cut
    assert plan.phase_items(1) > len(plan.tree.segments)  # segments cut into pieces
    assert plan.programs > 8
    check(q, k, v, tables, lens, plan, sm_scale=0.3)


@pytest.mark.parametrize("split", [False, True])
def test_phases_in_one_or_two_launches(monkeypatch, split):
    monkeypatch.setattr(tpp_plan, "_SPLIT_PHASES", split)
    monkeypatch.setattr(tpp_plan, "_MIN_PIECE_TOKENS", 16)
    q, k, v, tables, lens = make_case(15, torch.float16, 64, 4, 16, 12, depth=3)
    plan = plan_for(q, k, tables, lens, target_programs=64)
    assert [launch[2:] for launch in plan.launches] == ([(64, 64, 1), (16, 4, 2)] if split else [(64, 64, 0)])
    phases = plan.items[:, 0].tolist()
    launched = [phases[a : a + n] for a, n, *_ in plan.launches]
    assert sum(map(len, launched)) == len(phases) > len(plan.tree.segments) + len(tables)  # cut
    assert launched == ([[1] * phases.count(1), [2] * phases.count(2)] if split else [phases])
    check(q, k, v, tables, lens, plan)


@pytest.mark.parametrize("split", [False, True])
def test_phase1_row_tiles(monkeypatch, split):
    monkeypatch.setattr(tpp_plan, "_SPLIT_PHASES", split)
    # 40 rows sharing one segment with G = 4: 160 query vectors, tiles of at most 64
    c, d, hkv, g = 16, 64, 1, 4
    gen = torch.Generator().manual_seed(12)
    tables = [[0, 1, 2 + r] for r in range(40)]
    lens = [2 * c + 1 + r % 7 for r in range(40)]
    k, v = (torch.randn(45, hkv, c, d, generator=gen).to(DEVICE) for _ in range(2))
    q = torch.randn(40, g * hkv, d, generator=gen).to(DEVICE)
    plan = plan_for(q, k, tables, lens, target_programs=1)
    assert plan.launches[0][2] == 64 and plan.phase_items(1) == 3  # 40 rows in 3 tiles of <= 16
    # one piece per item (nothing cut). With the phases in two launches each row's phase-2 piece
    # folds in its tile's partial; in one launch the merge kernel folds both partials.
    assert plan.programs == 3 + 40
    assert plan.merge_items.shape[0] == (0 if split else 40)
    assert plan.items[:, 8].tolist() == [0] * 3 + [int(split)] * 40
    check(q, k, v, tables, lens, plan)


@pytest.mark.parametrize("fold_max", [0, 4])
def test_rows_with_many_phase1_partials_merge_them_in_the_merge_launch(monkeypatch, fold_max):
    monkeypatch.setattr(tpp_plan, "_ROWS", 1)  # a row per phase-2 program: the plain kernel's fold
    # 6 rows over a 5-chunk shared segment cut into 5 one-chunk phase-1 pieces (5 partials per
    # row) and one private chunk each: a row's phase-2 piece folds in at most _FOLD_MAX
    # partials; past that it stores its own partial and the merge launch folds all six
    monkeypatch.setattr(tpp_plan, "_FOLD_MAX", fold_max)
    monkeypatch.setattr(tpp_plan, "_MIN_PIECE_TOKENS", 1)
    c, d, hkv, g = 16, 64, 2, 2
    gen = torch.Generator().manual_seed(23)
    tables = [[0, 1, 2, 3, 4, 5 + r] for r in range(6)]
    lens = [5 * c + 1 + r for r in range(6)]
    k, v = (torch.randn(11, hkv, c, d, generator=gen).to(DEVICE) for _ in range(2))
    q = torch.randn(6, g * hkv, d, generator=gen).to(DEVICE)
    plan = plan_for(q, k, tables, lens, target_programs=10)  # 5 per KV head: one-chunk pieces
    assert plan.phase_items(1) == 5 and plan.phase_items(2) == 6
    folds = plan.items[plan.items[:, 0] == 2, 8].tolist()
    assert folds == [0] * 6 and plan.merge_items[:, 2].tolist() == [6] * 6
    check(q, k, v, tables, lens, plan)
    monkeypatch.setattr(tpp_plan, "_FOLD_MAX", 5)
    plan = plan_for(q, k, tables, lens, target_programs=10)
    assert plan.items[plan.items[:, 0] == 2, 8].tolist() == [5] * 6 and plan.merge_items.shape[0] == 0
    check(q, k, v, tables, lens, plan)


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("vec_min", [0, 3, 4])
def test_rows_fold_their_phase1_partials_in_one_load(monkeypatch, vec_min, g):
    # a row's finishing phase-2 piece loads all its phase-1 partials (3 here) in one block when
    # it has _FOLD_VEC_MIN (G = 1: [FOLD_P, D]) or _FOLD_VEC_MIN_GQA (G = 4: [M, FOLD_P, D]) of
    # them (3); otherwise (0: never, 4) the loop folds the same partials one at a time
    monkeypatch.setattr(tpp, "_FOLD_VEC_MIN" if g == 1 else "_FOLD_VEC_MIN_GQA", vec_min)
    monkeypatch.setattr(tpp_plan, "_ROWS", 1)  # a row per phase-2 program: the plain kernel's fold
    monkeypatch.setattr(tpp_plan, "_MIN_PIECE_TOKENS", 1)
    c, d, hkv = 16, 64, 2
    gen = torch.Generator().manual_seed(29)
    tables = [[0, 1, 2, 3 + r] for r in range(5)]
    lens = [3 * c + 1 + 3 * r for r in range(5)]
    k, v = (torch.randn(8, hkv, c, d, generator=gen).to(torch.float16).to(DEVICE) for _ in range(2))
    q = torch.randn(5, g * hkv, d, generator=gen).to(torch.float16).to(DEVICE)
    plan = plan_for(q, k, tables, lens, target_programs=1 << 20)
    assert plan.phase_items(1) == 3 and plan.merge_items.shape[0] == 0
    assert [it[8] for it in plan.items.tolist() if it[0] == 2] == [3] * 5 and plan.most_folds == 3
    check(q, k, v, tables, lens, plan, sm_scale=0.4)


ROWS_CASES = [
    (torch.float16, 64, 1, 16, 31),
    (torch.bfloat16, 128, 1, 64, 32),
    (torch.float16, 64, 2, 32, 33),
    (torch.float32, 64, 1, 16, 34),
    (torch.bfloat16, 64, 4, 16, 35),
]


@pytest.mark.parametrize(
    "dtype,head_dim,groups,c,seed", ROWS_CASES, ids=[f"{str(a[0])[6:]}-d{a[1]}-g{a[2]}-c{a[3]}" for a in ROWS_CASES]
)
def test_short_private_parts_take_several_rows_per_program(monkeypatch, dtype, head_dim, groups, c, seed):
    # every row's private part whole, at most _ROWS_MAX_CHUNKS chunks and ending the row, enough
    # of them: one phase-2 program streams _ROWS rows one after another, each folding its own
    # phase-1 partials (11 rows: the last program has fewer)
    monkeypatch.setattr(tpp_plan, "_FOLD_MAX", 16)
    monkeypatch.setattr(tpp_plan, "_ROWS_MAX_CHUNKS", 8)
    monkeypatch.setattr(tpp_plan, "_ROWS_MIN_PROGRAMS", 2)
    q, k, v, tables, lens = make_case(seed, dtype, head_dim, groups, c, 11, depth=3)
    plan = plan_for(q, k, tables, lens, target_programs=1 << 20)
    two = [it for it in plan.items.tolist() if it[0] == 2]
    assert plan.rows_per_program == tpp_plan._ROWS == 4
    assert len(two) % plan.rows_per_program and max(it[8] for it in two) > 1  # a short program, folds
    assert c * head_dim * q.element_size() <= tpp._ROWS_BLOCK_BYTES  # so the rows kernel runs
    check(q, k, v, tables, lens, plan, sm_scale=0.35)
    # a row per program where a private part is longer, or some row leaves partials to a merge,
    # or the programs are fewer
    for name, value in (
        ("_ROWS_MAX_CHUNKS", max(it[4] for it in two) - 1),
        ("_FOLD_MAX", 1),
        ("_ROWS_MIN_PROGRAMS", len(two) * k.shape[1] + 1),
    ):
        with monkeypatch.context() as m:
            m.setattr(tpp_plan, name, value)
            assert plan_for(q, k, tables, lens, target_programs=1 << 20).rows_per_program == 1, name


def test_items_a_little_over_the_target_stay_whole(monkeypatch):
    # four rows of 9 private chunks each, nothing shared: 36 chunks over the programs wanted
    monkeypatch.setattr(tpp_plan, "_MIN_PIECE_TOKENS", 1)
    c, d, g = 16, 64, 4
    gen = torch.Generator().manual_seed(16)
    tables = [list(range(9 * r, 9 * r + 9)) for r in range(4)]
    lens = [9 * c - r for r in range(4)]
    k, v = (torch.randn(36, 1, c, d, generator=gen).to(DEVICE) for _ in range(2))
    q = torch.randn(4, g, d, generator=gen).to(DEVICE)
    # 5 wanted: pieces of about 8 chunks. A row of 9 is nearer one piece than two, so it stays
    # whole (cutting each in two would double the programs past the target)
    plan = plan_for(q, k, tables, lens, target_programs=5)
    assert plan.programs == 4 and plan.merge_items.shape[0] == 0
    check(q, k, v, tables, lens, plan)
    # 8 wanted: pieces of about 5 chunks, two per row, merged
    plan = plan_for(q, k, tables, lens, target_programs=8)
    assert plan.programs == 8 and plan.merge_items.shape[0] == 4
    check(q, k, v, tables, lens, plan)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize(
    "dtype,head_dim,c", [(torch.float16, 128, 64), (torch.bfloat16, 64, 128), (torch.float16, 256, 32)]
)
def test_blocks_by_tma_or_by_pointers(monkeypatch, dtype, head_dim, c, split):
    # K/V blocks through TMA descriptors (BLOCK_N <= c: a box of rows inside a chunk, several
    # boxes per chunk when c > BLOCK_N) give what the masked pointer loads give: phase 1's whole
    # chunks, and with both phases in one launch also the rows' private runs (partial tail
    # blocks masked)
    monkeypatch.setattr(tpp_plan, "_MIN_PIECE_TOKENS", 1)
    monkeypatch.setattr(tpp_plan, "_SPLIT_PHASES", split)
    q, k, v, tables, lens = make_case(17, dtype, head_dim, 4, c, 6, depth=3)
    assert any(n % c for n in lens)  # partial tails
    plan = plan_for(q, k, tables, lens, target_programs=16)
    assert plan.phase_items(1) >= len(plan.tree.segments) > 0 and len(plan.launches) == (2 if split else 1)
    made = []
    real = tpp.TensorDescriptor.from_tensor
    monkeypatch.setattr(tpp.TensorDescriptor, "from_tensor", lambda *a: made.append(a) or real(*a))
    by_tma = check(q, k, v, tables, lens, plan)
    assert len(made) == 2 and made[0][1][0] <= c  # K and V, for the launch holding phase 1
    monkeypatch.setattr(tpp, "_TMA", False)
    by_ptr = check(q, k, v, tables, lens, plan)
    assert len(made) == 2
    # the same bits under the interpreter; compiled for sm90 the two load paths feed different
    # MMA instructions and an output may round an ulp apart (seen on the H200, 1 of 6144
    # elements, with the kernels of 9df99d3 too), so there they agree within an ulp or two
    ulps = 0 if not by_tma.is_cuda else 2 * 2.0 ** -(8 if dtype == torch.bfloat16 else 10)
    torch.testing.assert_close(by_tma, by_ptr, atol=ulps / 64, rtol=ulps)


@pytest.mark.parametrize("tma,split", [(True, True), (True, False), (False, True)])
def test_slots_past_a_rows_length_are_never_read(monkeypatch, tma, split):
    # a tail chunk's slots past the row's length (and unused chunks) hold NaN: the output must
    # not see them (p = 0 times a NaN value is NaN, so V must be masked, not only the scores).
    # One launch for both phases: tails by TMA
    monkeypatch.setattr(tpp, "_TMA", tma)
    monkeypatch.setattr(tpp_plan, "_SPLIT_PHASES", split)
    q, k, v, tables, lens = make_case(18, torch.float16, 128, 4, 64, 6, depth=3)
    used = torch.zeros(k.shape[0], k.shape[2], dtype=torch.bool)
    for table, n in zip(tables, lens):
        for j, cid in enumerate(table):
            used[cid, : max(0, min(64, n - 64 * j))] = True
    assert not used.all()
    for cache in (k, v):  # [chunk, slot] of every KV head
        cache.transpose(1, 2)[~used.to(cache.device)] = float("nan")
    got = check(q, k, v, tables, lens, plan_for(q, k, tables, lens, target_programs=16))
    assert torch.isfinite(got).all()


def test_lean_tiles(monkeypatch):
    # 32 rows, G = 4, one shared segment: two 64-vector row tiles. Phase 2 reading 16x the
    # chunks phase 1 does makes phase 1's tiles lean (one K/V buffer less); 2x does not
    monkeypatch.setattr(tpp_plan, "_num_sms", lambda device: 132)

    def plan(shared, private, rows=32):
        tables = [
            list(range(shared)) + list(range(shared + private * r, shared + private * (r + 1))) for r in range(rows)
        ]
        return tpp.build_plan(
            tables, [64 * (shared + private)] * rows, 64, "cpu", num_q_heads=32, num_kv_heads=8, head_dim=128
        )

    assert plan(8, 8).lean_phase1 and not plan(8, 1).lean_phase1 and not plan(8, 0).lean_phase1
    assert not plan(0, 8).lean_phase1  # nothing shared
    full, lean = (tpp_plan._launch_config(128, 64, 2, 64, lean) for lean in (False, True))
    assert (full["num_stages"], lean["num_stages"]) == (3, 2)
    assert tpp_plan._launch_config(128, 32, 2, 32, True)["num_stages"] == 3  # MHA's tile leaves room already
    # phase 2 lean where, after a phase 1, its programs (rows x 8 KV heads) would not fit one
    # wave of 3 per multiprocessor: 64 rows do not, 32 do
    assert tpp_plan._programs_per_sm(128, 16, 2, 4) == 3
    assert plan(32, 4, rows=64).lean_phase2 and not plan(32, 4).lean_phase2
    assert not plan(0, 4, rows=64).lean_phase2  # without a phase 1: not measured, not lean
    full, lean = (tpp_plan._launch_config(128, 16, 2, 4, lean) for lean in (False, True))
    assert (full["num_stages"], lean["num_stages"]) == (3, 2)


def _cut_of_two_levels(shared: int, private: int, num_kv_heads: int):
    """The cut of 32 rows (32 query heads, c = 64) that share `shared` chunks and each read
    `private` of their own, on 132 multiprocessors: (phase-1 piece lengths in chunks, sorted;
    phase 2's longest piece; the phase-1 partials phase-2 pieces fold, as a set)."""
    tables = [list(range(shared)) + list(range(shared + private * r, shared + private * (r + 1))) for r in range(32)]
    plan = tpp.build_plan(
        tables, [64 * (shared + private)] * 32, 64, "cpu", num_q_heads=32, num_kv_heads=num_kv_heads, head_dim=128
    )
    items = plan.items.tolist()
    return (
        sorted(it[4] for it in items if it[0] == 1),
        max((it[4] for it in items if it[0] == 2), default=0),
        {it[8] for it in items if it[0] == 2},
    )


def test_phase1_beside_phase2_is_cut_coarser(monkeypatch):
    # 32 rows, G = 4, 8 KV heads, one shared segment (two 64-vector row tiles), on 132
    # multiprocessors. Alone, phase 1 is cut for 2 programs per multiprocessor (at least 4-chunk
    # pieces); beside a phase 2, into about _P1_BESIDE_PIECES per KV head, never longer than
    # phase 2's longest piece.
    monkeypatch.setattr(tpp_plan, "_num_sms", lambda device: 132)

    def pieces1(shared, private):
        return _cut_of_two_levels(shared, private, 8)[:2]

    assert pieces1(32, 0) == ([4] * 16, 0)  # alone: 16 pieces of 4 chunks
    assert pieces1(32, 32) == ([16] * 4, 32)  # beside 32-chunk rows: 4 pieces of 16
    assert pieces1(48, 16) == ([16] * 6, 16)  # 4 pieces would be 24 chunks, longer than phase 2's 16
    assert pieces1(32, 4) == ([4] * 16, 4)  # short rows (batch scaling, a decode tail): as alone
    monkeypatch.setattr(tpp_plan, "_P1_BESIDE_PIECES", 0)  # the rule off: cut as alone
    assert pieces1(32, 32) == ([4] * 16, 32)


def test_mha_phase1_beside_phase2_is_one_piece_per_row_tile(monkeypatch):
    # 32 rows, MHA (G = 1), 32 KV heads: one 32-vector row tile. Where phase 2's longest piece is at
    # least as long as the segment, the segment is one piece per KV head (_P1_BESIDE_WHOLE_MHA), and
    # each row folds that one partial; otherwise about _P1_BESIDE_PIECES per KV head, as for GQA.
    monkeypatch.setattr(tpp_plan, "_num_sms", lambda device: 132)

    def pieces1(shared, private):
        return _cut_of_two_levels(shared, private, 32)

    assert pieces1(8, 8) == ([8], 8, {1})  # 1024 shared / 512 private: 2 pieces of 4 before
    assert pieces1(32, 32) == ([32], 32, {1})  # 4096 / 2048: 4 of 8 before
    assert pieces1(32, 16) == ([8] * 4, 16, {4})  # segment longer than phase 2's pieces: 4 pieces
    monkeypatch.setattr(tpp_plan, "_P1_BESIDE_WHOLE_MHA", False)
    assert pieces1(32, 32) == ([8] * 4, 32, {4})


@pytest.mark.parametrize("rows", [16, 32])
def test_phase1_alone_tile_and_cut(monkeypatch, rows):
    # MHA rows whose chunks are all shared (no phase 2): a 32-vector phase-1 tile launches as
    # _P1_ALONE_M vectors, and a segment read by one row tile is cut for
    # _P1_ALONE_PROGRAMS_PER_SM programs per multiprocessor. A private chunk in any row restores
    # the 32-vector tile and _PROGRAMS_PER_SM; 16 rows keep their 16-vector tile.
    monkeypatch.setattr(tpp_plan, "_MIN_PIECE_TOKENS", 16)
    monkeypatch.setattr(tpp_plan, "_num_sms", lambda device: 4)
    c, d, hkv = 16, 64, 2
    gen = torch.Generator().manual_seed(31)
    k, v = (torch.randn(8 + rows, hkv, c, d, generator=gen).to(DEVICE) for _ in range(2))
    q = torch.randn(rows, hkv, d, generator=gen).to(DEVICE)
    shared = [list(range(8))] * rows
    plan = plan_for(q, k, shared, [8 * c] * rows)
    per_head = 4 * tpp_plan._P1_ALONE_PROGRAMS_PER_SM // hkv  # 4 multiprocessors
    assert plan.launches == ((0, per_head, 64 if rows == 32 else 16, 64 if rows == 32 else 16, 1),)
    assert plan.phase_items(1) == per_head == 2 and plan.merge_items.shape[0] == rows
    check(q, k, v, shared, [8 * c] * rows, plan)
    tails = [list(range(8)) + [8 + r] for r in range(rows)]
    plan = plan_for(q, k, tails, [8 * c + 1] * rows)
    assert plan.launches[0][2] == (32 if rows == 32 else 16) and plan.phase_items(1) > 2
    check(q, k, v, tails, [8 * c + 1] * rows, plan)


def test_gqa_phase1_alone_over_several_tiles_cut_for_one_program_per_sm(monkeypatch):
    # rows whose chunks are all shared, 128 query vectors: their segment is read by 2 row tiles
    # of 64. GQA cuts it for _P1_ALONE_PROGRAMS_PER_SM programs per multiprocessor (4 here, over
    # 2 KV heads: one piece per tile), MHA for _PROGRAMS_PER_SM (two per tile)
    monkeypatch.setattr(tpp_plan, "_MIN_PIECE_TOKENS", 16)
    monkeypatch.setattr(tpp_plan, "_num_sms", lambda device: 4)
    c, d, hkv = 16, 64, 2
    gen = torch.Generator().manual_seed(32)
    k, v = (torch.randn(8, hkv, c, d, generator=gen).to(DEVICE) for _ in range(2))
    for g, rows, pieces in ((4, 32, 2), (1, 128, 4)):
        q = torch.randn(rows, hkv * g, d, generator=gen).to(DEVICE)
        tables = [list(range(8))] * rows
        plan = plan_for(q, k, tables, [8 * c] * rows)
        assert plan.launches == ((0, pieces, 64, 64, 1),)
        check(q, k, v, tables, [8 * c] * rows, plan)


@pytest.mark.parametrize("tma,rows", [(True, False), (False, False), (False, True)])
def test_reserved_chunks_plan_stays_valid_as_rows_grow(monkeypatch, tma, rows):
    # a plan built with reserved=True covers every row's chunks past its length (the engine
    # reserves one ahead): bumping the lengths across chunk boundaries needs no new plan; also
    # (rows) with several rows per phase-2 program, each row's whole private part in one piece
    monkeypatch.setattr(tpp, "_TMA", tma)
    monkeypatch.setattr(tpp_plan, "_MIN_PIECE_TOKENS", 16)
    if rows:
        monkeypatch.setattr(tpp_plan, "_MIN_PIECE_TOKENS", 1 << 20)  # no piece cut
        monkeypatch.setattr(tpp_plan, "_FOLD_MAX", 16)
        monkeypatch.setattr(tpp_plan, "_ROWS_MAX_CHUNKS", 16)
        monkeypatch.setattr(tpp_plan, "_ROWS_MIN_PROGRAMS", 1)
        monkeypatch.setattr(tpp_plan, "_ROWS", 2)  # G = 4: 2 rows of 4 vectors in the tile
    q, k, v, tables, lens = make_case(19, torch.float16, 64, 4, 16, 7, depth=3)
    spare = k.shape[0]
    tables = [t[: -(-n // 16)] + [spare + r] for r, (t, n) in enumerate(zip(tables, lens))]  # one reserved each
    k, v = (torch.cat([x, torch.full_like(x[: len(tables)], float("nan"))]) for x in (k, v))  # never written yet
    plan = plan_for(q, k, tables, lens, target_programs=24, reserved=True)
    assert (plan.rows_per_program > 1) == rows
    for step in (0, 3, 7, 12, 19):
        grown = [min(n + step, len(t) * 16) for t, n in zip(tables, lens)]
        for t, n, n0 in zip(tables, grown, lens):  # the new tokens' K/V written
            for pos in range(n0, n):
                for cache in (k, v):
                    cache[t[pos // 16], :, pos % 16] = torch.randn(cache.shape[1], cache.shape[3]).to(cache)
        plan.seq_lens.copy_(torch.tensor(grown, dtype=torch.int32))
        check(q, k, v, tables, grown, plan)
    assert any(g > len(t) * 16 - 16 for t, g in zip(tables, grown))  # some row reached its reserved chunk


def test_seq_lens_bump_in_place():
    q, k, v, tables, lens = make_case(13, torch.float32, 64, 1, 16, 8)
    plan = plan_for(q, k, tables, lens)
    # rows whose tail chunk has room take one more token, as a plain decode step does
    c = 16
    grown = [n + 1 if n % c else n for n in lens]
    plan.seq_lens.copy_(torch.tensor(grown, dtype=torch.int32))
    check(q, k, v, tables, grown, plan)


def test_edge_rows_and_empty_batch():
    c, d, hkv, g = 16, 64, 2, 4
    gen = torch.Generator().manual_seed(14)
    k, v = (torch.randn(8, hkv, c, d, generator=gen).to(DEVICE) for _ in range(2))
    q = torch.randn(5, g * hkv, d, generator=gen).to(DEVICE)
    # rows 0-1 read only a shared segment, row 2 has nothing, row 3 nothing shared, row 4 1 token
    tables = [[1, 3], [1, 3], [], [4, 5, 6], [7]]
    lens = [32, 32, 0, 40, 1]
    plan = plan_for(q, k, tables, lens)
    got = check(q, k, v, tables, lens, plan)
    assert torch.all(got[2] == 0)
    empty = tpp.tpp_decode(q[:0], k, v, plan_for(q[:0], k, [], []))
    assert empty.shape == (0, g * hkv, d)


def test_launcher_rejects_bad_inputs():
    c, d, hkv, g = 16, 64, 2, 2
    k = torch.randn(4, hkv, c, d, device=DEVICE)
    v = torch.randn(4, hkv, c, d, device=DEVICE)
    q = torch.randn(2, g * hkv, d, device=DEVICE)
    tables, lens = [[0, 1], [0, 2]], [20, 30]
    plan = plan_for(q, k, tables, lens)
    bad = {
        "q must be": (q[0], k, v, plan),
        "same strides": (q, k, v.transpose(0, 1).contiguous().transpose(0, 1), plan),
        "share one dtype": (q, k.half(), v.half(), plan),
        "does not match the plan": (q[:1], k, v, plan),
        "contiguous": (
            q,
            k.transpose(2, 3).contiguous().transpose(2, 3),
            v.transpose(2, 3).contiguous().transpose(2, 3),
            plan,
        ),
        "head dim": (q[..., :32], k, v, plan),
    }
    for msg, args in bad.items():
        with pytest.raises(ValueError, match=msg):
            tpp.tpp_decode(*args)
    with pytest.raises(ValueError, match="multiple"):
        tpp.build_plan(tables, lens, c, DEVICE, num_q_heads=3, num_kv_heads=2, head_dim=d)
    with pytest.raises(ValueError, match="non-contiguous"):  # not in DFS order
        tpp.build_plan([[0, 1], [5, 6], [0, 2]], [32] * 3, c, DEVICE, num_q_heads=4, num_kv_heads=2, head_dim=d)


# ---------------------------------------------------------------------------------------------
# GPU: real kernels, large batches and bigger trees
# ---------------------------------------------------------------------------------------------


# (dtype, head_dim, groups, chunk_size): every value of each, not their full product (each
# combination is a separate compile)
GPU_CASES = [
    (torch.float16, 128, 1, 64),
    (torch.bfloat16, 128, 4, 64),
    (torch.float16, 128, 8, 16),
    (torch.bfloat16, 64, 1, 16),
    (torch.float16, 64, 4, 32),
    (torch.bfloat16, 64, 8, 128),
    (torch.float16, 256, 1, 128),
    (torch.bfloat16, 256, 4, 16),
    (torch.float16, 256, 8, 64),
    (torch.bfloat16, 128, 1, 32),
    (torch.float16, 64, 4, 128),
    (torch.bfloat16, 128, 8, 64),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "dtype,head_dim,groups,c", GPU_CASES, ids=[f"{str(a[0])[6:]}-d{a[1]}-g{a[2]}-c{a[3]}" for a in GPU_CASES]
)
def test_gpu_random_trees(dtype, head_dim, groups, c):
    for seed, rows, depth in [(1, 300, 4), (2, 37, 3), (3, 1, 3), (4, 120, 6)]:
        q, k, v, tables, lens = make_case(seed * 1000 + c, dtype, head_dim, groups, c, rows, depth, hkv=4)
        check(q, k, v, tables, lens, plan_for(q, k, tables, lens))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("c", [16, 32, 64, 128])
def test_gpu_fp32_ieee_and_split_k(c):
    torch.backends.cuda.matmul.allow_tf32 = False
    q, k, v, tables, lens = make_case(c, torch.float32, 128, 4, c, 64, depth=5, hkv=8)
    check(q, k, v, tables, lens, plan_for(q, k, tables, lens))
    check(q, k, v, tables, lens, plan_for(q, k, tables, lens, target_programs=1 << 16))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "shared,private,batch", [(4096, 0, 32), (2048, 2048, 32), (0, 4096, 32), (2048, 300, 256), (1024, 5000, 2)]
)
def test_gpu_paper_shapes(shared, private, batch):
    # one system prompt of `shared` tokens, then each row's own tokens (c = 64, Llama-3-8B heads)
    c, d, hq, hkv = 64, 128, 32, 8
    ns, npriv = shared // c, -(-private // c)
    tables = [list(range(ns)) + list(range(ns + r * npriv, ns + (r + 1) * npriv)) for r in range(batch)]
    lens = [shared + private] * batch
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v = (
        torch.randn(ns + batch * npriv, hkv, c, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2)
    )
    q = torch.randn(batch, hq, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    check(q, k, v, tables, lens, plan_for(q, k, tables, lens))


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay_with_length_bumps():
    q, k, v, tables, lens = make_case(21, torch.float16, 128, 4, 64, 48, depth=3, hkv=8)
    plan = plan_for(q, k, tables, lens)
    tpp.tpp_decode(q, k, v, plan)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tpp.tpp_decode(q, k, v, plan)
    for step in range(3):
        cur = [n + step if n % 64 and n % 64 + step < 64 else n for n in lens]
        plan.seq_lens.copy_(torch.tensor(cur, dtype=torch.int32))
        graph.replay()
        want = decode_attention_ref(q, k, v, tables, cur)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@gpu
def test_gpu_overlapped_phases_give_the_same_bits(monkeypatch):
    # phase 2 launched early (programmatic dependent launch) must not change a bit: a missing
    # wait would fold phase-1 partials before they are written
    q, k, v, tables, lens = make_case(31, torch.bfloat16, 128, 4, 64, 200, depth=4, hkv=8)
    plan = plan_for(q, k, tables, lens)
    assert len(plan.launches) == 2 and plan.merge_items.shape[0] > 0  # both phases, and merges
    runs = []
    for pdl in (True, False):
        monkeypatch.setattr(tpp, "_PDL", pdl)
        runs.append([tpp.tpp_decode(q, k, v, plan) for _ in range(20)])
    want = check(q, k, v, tables, lens, plan)
    for out in runs[0] + runs[1]:
        assert torch.equal(out, want)


def _decoder_churn(device, dtype, head_dim, groups, c, rows, seeds, layers=2):
    """A TppDecoder (one per engine) over plans of several trees, each plan called for several
    layers' caches into a given out: every call equal to the reference for its own caches."""
    decoder = tpp.TppDecoder()
    for seed in seeds:
        q, k, v, tables, lens = make_case(seed, dtype, head_dim, groups, c, rows, depth=3, hkv=2, device=device)
        plan = plan_for(q, k, tables, lens)
        caches = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(layers - 1)]
        for _ in range(2):  # the plan's second pass runs its kept launches
            for kl, vl in caches:
                out = torch.full_like(q, float("nan"))
                got = decoder(q, kl, vl, plan, None, out)
                assert got is out
                want = decode_attention_ref(q, kl, vl, tables, lens)
                torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
        assert len(plan.launch_cache) == 1  # one kind of call: its launches worked out once


def test_decoder_reuses_a_plans_launches_over_layers_and_plans():
    _decoder_churn(DEVICE, torch.float16, 64, 4, 16, 6, seeds=(41, 42))


def test_decoder_rejects_an_out_of_another_shape_or_dtype():
    q, k, v, tables, lens = make_case(43, torch.float16, 64, 2, 16, 3, device=DEVICE)
    plan = plan_for(q, k, tables, lens)
    for out in (torch.empty_like(q)[:-1], torch.empty_like(q, dtype=torch.float32)):
        with pytest.raises(ValueError, match="out must be"):
            tpp.tpp_decode(q, k, v, plan, out=out)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_direct_launches_run_the_kernels_the_dispatcher_picks(dtype):
    # chunkserve.kernels.launch keys compiled kernels by what the caller says specializes them; verifying()
    # asks Triton's dispatcher for every direct launch and fails on a kernel compiled for other
    # arguments. Many trees (both phases, folds, merges, row programs) and layers.
    from chunkserve.kernels import launch

    with launch.verifying():
        _decoder_churn("cuda", dtype, 128, 4, 64, 48, seeds=range(50, 58), layers=3)
        _decoder_churn("cuda", dtype, 128, 1, 64, 200, seeds=(60, 61), layers=2)


@pytest.mark.gpu
@gpu
def test_gpu_first_launches_count_each_key_once():
    # first_launches() counts the keys that went through the dispatcher (a compile each, at
    # worst): new trees add keys, the same trees again launch directly and add none
    # (chunkserve.replicas.tools.bench reports the count per run, so compiles on a request's path show)
    from chunkserve.kernels import launch

    before = launch.first_launches()
    _decoder_churn("cuda", torch.float16, 64, 2, 32, 40, seeds=(70, 71), layers=2)
    keys, seconds = launch.first_launches()
    assert keys > before[0] and seconds > before[1]
    assert len(launch.first_launched(before[0])) == keys - before[0]
    assert set(launch.first_launched(before[0])) <= {"_attend_kernel", "_attend_rows_kernel", "_merge_kernel"}
    _decoder_churn("cuda", torch.float16, 64, 2, 32, 40, seeds=(70, 71), layers=2)
    assert launch.first_launches() == (keys, seconds)


def test_the_planners_powers_of_two_are_tritons():
    # chunkserve/kernels/tpp_plan.py plans without importing Triton: its tile sizes must be the same
    assert all(tpp_plan._next_pow2(n) == triton.next_power_of_2(n) for n in range(0, 4097))


def fixed_for(q, k, sizes, **kw):
    heads = PagedHeads(num_q_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=q.shape[2], chunk_size=k.shape[2])
    return tpp_plan.FixedPlans(q.device, sizes, heads, num_chunks=k.shape[0], **kw)


FIXED_CASES = [  # (dtype, head_dim, groups, chunk_size, rows, seed, depth): both phases, folds, merges
    (torch.float16, 64, 4, 16, 7, 81, 2),
    (torch.bfloat16, 64, 1, 32, 12, 91, 3),
    (torch.float32, 64, 2, 16, 3, 85, 3),
    (torch.float16, 128, 4, 16, 6, 82, 3),
]


@pytest.mark.parametrize("dtype,head_dim,groups,c,rows,seed,depth", FIXED_CASES)
def test_fixed_plans_match_reference_and_leave_padded_rows(dtype, head_dim, groups, c, rows, seed, depth):
    # a fixed plan over a padded batch: the real rows' outputs equal the reference; the rows
    # past them (a graph's padding) are neither read nor written
    q, k, v, tables, lens = make_case(seed, dtype, head_dim, groups, c, rows, depth=depth)
    fixed = fixed_for(q, k, (4, 8, 16))
    size = fixed.size_for(rows)
    plan = tpp.build_fixed_plan(tables, lens, fixed)
    assert plan is not None and plan.max_rows == size and plan.batch_size == rows
    assert min(plan.counts[::4].tolist()) > 0  # phase-1 pieces, phase-2 pieces, merge rows
    padded = torch.cat([q, torch.randn(size - rows, *q.shape[1:]).to(q)])
    out = torch.full_like(padded, float("nan"))
    tpp.tpp_decode(padded, k, v, plan, out=out)
    want = decode_attention_ref(q, k, v, tables, lens)
    torch.testing.assert_close(out[:rows].float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.isnan(out[rows:]).all()
    assert plan.launches[0][1] == fixed.shapes[size].cap1 and plan.launches[1][1] == fixed.shapes[size].cap2
    got = check(q, k, v, tables, lens, plan)  # unpadded too (a mixed step's decode rows)
    torch.testing.assert_close(got[:rows], out[:rows])


def test_fixed_plans_of_one_size_share_their_launches():
    # plans of different trees, one padded batch size: one set of launches (a CUDA graph's),
    # each plan's upload replacing the last one's data; rows grow in place (reserved chunks)
    decoder = tpp.TppDecoder()
    gen = torch.Generator().manual_seed(90)
    k, v = (torch.randn(400, 2, 16, 64, generator=gen).half() for _ in range(2))
    q = torch.randn(16, 8, 64, generator=gen).half()
    fixed = fixed_for(q, k, (16,))
    for seed in (81, 83, 87):
        _, _, _, tables, lens = make_case(seed, torch.float16, 64, 4, 16, 7 + seed % 3, depth=2)
        tables = [t[: -(-n // 16)] + [300 + r] for r, (t, n) in enumerate(zip(tables, lens))]
        plan = tpp.build_fixed_plan(tables, lens, fixed, reserved=True)
        assert plan is not None and plan.launch_cache is fixed.launch_caches[16]
        for step in (0, 5, 17):
            grown = [min(n + step, len(t) * 16) for t, n in zip(tables, lens)]
            plan.seq_lens[: len(grown)].copy_(torch.tensor(grown, dtype=torch.int32))
            out = decoder(q, k, v, plan, None, torch.empty_like(q))
            want = decode_attention_ref(q[: len(tables)], k, v, tables, grown)
            torch.testing.assert_close(out[: len(tables)].float(), want.float(), atol=2e-3, rtol=2e-3)
    assert len(fixed.launch_caches[16]) == 1


def test_fixed_plans_leave_what_does_not_fit_to_the_plain_planner(monkeypatch):
    q, k, v, tables, lens = make_case(95, torch.float16, 64, 4, 16, 24, depth=5)
    assert tpp.build_fixed_plan(tables, lens, fixed_for(q, k, (8, 16))) is None  # 24 rows: no size holds them
    monkeypatch.setattr(tpp_plan, "_PROGRAMS_PER_SM", 1)  # one program a head (4 SMs, 2 heads: 2)
    fixed = fixed_for(q, k, (32,))
    plan = tpp.build_plan(tables, lens, 16, q.device, num_q_heads=8, num_kv_heads=2, head_dim=64, target_programs=4)
    assert plan.phase_items(1) > fixed.shapes[32].cap1  # the deep tree's row tiles outnumber the capacity
    assert tpp.build_fixed_plan(tables, lens, fixed) is None
    idle = fixed.idle(32)  # what a graph is captured over: every program returns
    out = torch.full((32, 8, 64), float("nan"), dtype=torch.float16)
    tpp.tpp_decode(torch.zeros_like(out), k, v, idle, out=out)
    assert torch.isnan(out).all()


def tenant_case(seed, dtype, head_dim, groups, c, rows, tenants, hkv, device=DEVICE):
    """A batch as live traffic of several tenants makes it: every row after one system prompt
    (8 chunks), each tenant's rows after 2 chunks of its own, then 1-3 private chunks with a
    partial tail and one reserved."""
    rng = random.Random(seed)
    ids = iter(rng.sample(range(16 * rows), 16 * rows))
    system = [next(ids) for _ in range(8)]
    own = [[next(ids) for _ in range(2)] for _ in range(tenants)]
    tables, lens = [], []
    for r in range(rows):
        private = rng.randint(1, 3)
        tables.append(system + own[r * tenants // rows] + [next(ids) for _ in range(private + 1)])
        lens.append((10 + private - 1) * c + rng.randint(1, c - 1))
    g = torch.Generator().manual_seed(seed)
    shape = (16 * rows + 1, hkv, c, head_dim)
    k, v = (torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(2))
    q = torch.randn(rows, groups * hkv, head_dim, generator=g).to(dtype).to(device)
    return q, k, v, tables, lens


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows,tenants", [(48, 3), (200, 8), (5, 1)])
def test_gpu_fixed_plans_over_tenants_match_reference(rows, tenants):
    # fixed launches on the H200 (TMA, programmatic dependent launch, programs that return
    # first) over a padded batch, for every padded size the engine graphs; the padding untouched
    q, k, v, tables, lens = tenant_case(rows, torch.bfloat16, 128, 4, 64, rows, tenants, hkv=8)
    fixed = fixed_for(q, k, (8, 16, 32, 64, 128, 256))
    plan = tpp.build_fixed_plan(tables, lens, fixed, reserved=True)
    assert plan is not None and plan.counts[0] > 0 and plan.counts[4] >= rows  # both phases
    padded = torch.cat([q, torch.zeros(plan.max_rows - rows, *q.shape[1:]).to(q)])
    outs = [tpp.tpp_decode(padded, k, v, plan, out=torch.full_like(padded, float("nan"))) for _ in range(3)]
    out = outs[0]
    assert all(torch.equal(o[:rows], out[:rows]) for o in outs)  # the same bits each time
    want = decode_attention_ref(q, k, v, tables, lens)
    torch.testing.assert_close(out[:rows].float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.isnan(out[rows:]).all()
