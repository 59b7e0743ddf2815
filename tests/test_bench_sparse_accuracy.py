"""chunkserve.replicas.tools.bench_sparse_accuracy's figures on synthetic tensors and the tiny preset: the dense
attention it substitutes is the reference's, the oracle keeps at least the selector's mass for
as many blocks, a selection keeping every block keeps all of it, every share lies in [0, 1]."""

from __future__ import annotations

import pytest
import torch

from chunkserve.kernels import reference
from chunkserve.kernels.block_union import BlockUnion
from chunkserve.replicas.tools import bench_sparse_accuracy as bsa

C = 16  # chunk size


def _piece(seed: int, context: int = 512, t: int = 96, hq: int = 8, hkv: int = 2, d: int = 32):
    g = torch.Generator().manual_seed(seed)
    total = context + t
    chunks = -(-total // C)
    k = torch.randn(chunks, hkv, C, d, generator=g)
    k[3] += 2.0  # a chunk some queries weigh much more than the rest
    v = torch.randn(chunks, hkv, C, d, generator=g)
    q = torch.randn(t, hq, d, generator=g) * 2
    ids = torch.randperm(chunks, generator=g).tolist()  # a scattered chunk table
    return q, k, v, ids, context


def test_chunk_mass_is_the_reference_attention_and_sums_to_the_rows():
    q, k, v, ids, context = _piece(0)
    total = context + q.shape[0]
    kk, vv = reference.gather_kv(k, ids, total), reference.gather_kv(v, ids, total)
    out, mass = bsa.chunk_mass(q, kk, vv, context, C, 0.2)
    want = reference.prefill_attention_ref(q, k, v, ids, context, 0.2)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert mass.shape == (1, q.shape[1], -(-total // C))
    mass = mass[0]
    torch.testing.assert_close(mass.sum(1), torch.full((q.shape[1],), float(q.shape[0])))
    # causal: the piece's last chunk is seen only by its own rows' later positions
    assert (mass >= 0).all() and mass[:, -1].max() < q.shape[0]
    # in groups of rows: the same attention, the same mass split by rows, a group's only up to its last row
    out2, groups = bsa.chunk_mass(q, kk, vv, context, C, 0.2, group=32)
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5)
    assert groups.shape == (3, q.shape[1], -(-total // C))
    torch.testing.assert_close(groups.sum(0), mass, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(groups.sum(2), torch.full((3, q.shape[1]), 32.0))
    assert (groups[0, :, -(-(context + 32) // C) :] == 0).all()


@pytest.mark.parametrize(
    "cfg",
    [
        BlockUnion(min_context=0, block=32, budget=0.25, window=2, span=None),
        BlockUnion(min_context=0, block=32, alpha=0.9, window=1, subgroup=2, span=None),
        BlockUnion(min_context=0, block=16, budget=0.1, sink=2, window=1, span=None),
    ],
)
def test_oracle_keeps_at_least_the_selectors_mass(cfg):
    for seed in range(3):
        q, k, v, ids, context = _piece(seed)
        total, hq, hkv = context + q.shape[0], q.shape[1], k.shape[1]
        kk, vv = reference.gather_kv(k, ids, total), reference.gather_kv(v, ids, total)
        _, mass = bsa.chunk_mass(q, kk, vv, context, C, 0.2)
        mass = mass[0]
        sub = bsa.block_union.subgroup_size(hq, hkv, cfg.subgroup)
        k0 = context // C
        keep = bsa.select(q, kk, context, cfg, C, sub, 0.2)
        bm, own = bsa.list_mass(mass, sub, k0, cfg.block // C)
        assert keep.shape == bm.shape == (hq // sub, -(-k0 // (cfg.block // C)))
        torch.testing.assert_close(bm.sum(1) + own, torch.full((hq // sub,), float(sub * q.shape[0])))
        oracle = bsa.oracle_keep(bm, keep.sum(1))
        assert (oracle.sum(1) == keep.sum(1)).all()
        assert 0 < keep.sum() < keep.numel()  # a real selection: neither nothing nor everything
        per_list = (bm * keep).sum(1), (bm * oracle).sum(1)
        assert (per_list[1] >= per_list[0] - 1e-4).all()
        sel, orc = bsa.kept_mass(bm, own, keep), bsa.kept_mass(bm, own, oracle)
        for figures in (sel, orc):
            assert 0 <= figures["ctx_kept"] <= figures["ctx"] + 1e-4 and figures["kept"] <= figures["all"] + 1e-4
        assert orc["ctx_kept"] >= sel["ctx_kept"] - 1e-4


def test_oracle_takes_the_heaviest_blocks():
    bm = torch.tensor([[0.1, 5.0, 0.3, 2.0], [4.0, 0.0, 1.0, 3.0]])
    keep = bsa.oracle_keep(bm, torch.tensor([2, 1]))
    assert keep.tolist() == [[False, True, False, True], [True, False, False, False]]


def test_keeping_every_block_keeps_all_the_mass():
    q, k, v, ids, context = _piece(1)
    total = context + q.shape[0]
    kk, vv = reference.gather_kv(k, ids, total), reference.gather_kv(v, ids, total)
    _, mass = bsa.chunk_mass(q, kk, vv, context, C, 0.2)
    bm, own = bsa.list_mass(mass[0], 2, context // C, 2)
    figures = bsa.kept_mass(bm, own, torch.ones_like(bm, dtype=torch.bool))
    summary = bsa.summarise({0: figures, 1: figures})
    assert summary == {"mass": 1.0, "mass_worst": 1.0, "ctx_mass": 1.0, "ctx_mass_worst": 1.0}
    none = bsa.summarise({0: bsa.kept_mass(bm, own, torch.zeros_like(bm, dtype=torch.bool))})
    assert none["ctx_mass"] == 0.0 and 0 < none["mass"] < 1


def test_probe_on_the_tiny_preset_attends_as_the_engine_and_scores_every_layer():
    from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams

    torch.set_num_threads(1)
    opts = {
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_tokens": 2048,
        "max_num_batched_tokens": 256,
        "enable_prefix_sharing": False,
    }
    cfgs = {
        "b": BlockUnion(min_context=256, block=64, window=1, budget=0.25),
        "spans": BlockUnion(min_context=256, block=64, window=1, budget=0.25, span=1, dense_tail=0),
        "all": BlockUnion(min_context=256, block=64, window=1, budget=1.0),
    }
    plain, probed = LLMEngine.from_model("tiny", **opts), LLMEngine.from_model("tiny", **opts)
    probe = bsa.MassProbe(probed, cfgs, 256)
    prompt = [(i * 37) % 250 + 1 for i in range(900)]
    probe.needle, probe.prompt_len = (300, 310), 900
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert probed.generate([prompt], params) == plain.generate([prompt], params)
    layers = probed.model_config.num_layers
    for name in cfgs:
        assert sorted(probe.sums[name]["sel"]) == list(range(layers))
    for name in ("b", "spans"):
        sel, orc = bsa.summarise(probe.sums[name]["sel"]), bsa.summarise(probe.sums[name]["oracle"])
        assert all(0 <= x <= 1 for x in (*sel.values(), *orc.values()))
        assert orc["ctx_mass"] >= sel["ctx_mass"] - 1e-4 and orc["mass"] >= sel["mass"] - 1e-4
        assert sel["ctx_mass"] < 1
    # spans choose among their piece's earlier blocks too: less of the whole kept than one list
    assert bsa.summarise(probe.sums["spans"]["sel"])["mass"] < bsa.summarise(probe.sums["b"]["sel"])["mass"]
    assert bsa.summarise(probe.sums["all"]["sel"])["ctx_mass_worst"] == 1.0
    hit, of = probe.needle_hits["all"]["sel"]
    assert of > 0 and hit == of  # every list keeps every block, the needle's too
