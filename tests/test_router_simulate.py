"""chunkserve/router/tools/simulate.py on small configurations: every policy and workload runs and reports, the
prefix policy beats Serve's power of two on a shared-prefix workload, Ray's text tree behaves as
published. No timing targets here: those are printed by `python -m chunkserve.router.tools.simulate --all`."""

import json

import pytest

from chunkserve.router.tools import simulate as sim

FIELDS = {
    "policy",
    "workload",
    "replicas",
    "hit_rate",
    "oracle_hit_rate",
    "max_mean_load",
    "p99_queue",
    "decision_us",
    "groups",
    "groups_scaled",
    "requests",
    "utilisation",
}


@pytest.fixture(scope="module")
def workloads():
    return {w: sim.build_workload(w, replicas=4, requests=256) for w in sim.WORKLOADS}


@pytest.mark.parametrize("policy", sim.POLICIES)
@pytest.mark.parametrize("workload", sim.WORKLOADS)
def test_every_policy_runs_every_workload(workloads, policy, workload):
    row = sim.simulate(workloads[workload], policy, digest_period=0.2, digest_delay=0.1)
    assert FIELDS <= set(row) and row["policy"] == policy and row["workload"] == workload
    assert 0.0 <= row["hit_rate"] <= 1.0 and 0.0 <= row["oracle_hit_rate"] <= 1.0
    assert row["max_mean_load"] >= 1.0 and row["decision_us"] > 0 and row["requests"] == 256
    if workload == "unique":
        assert row["hit_rate"] == 0.0 and row["oracle_hit_rate"] == 0.0


def test_prefix_policy_beats_power_of_two_on_shared_prefixes():
    wl = sim.build_workload("gsp", replicas=8, requests=1024)
    ours, pow2 = (sim.simulate(wl, p) for p in ("prefix", "pow2"))
    assert ours["hit_rate"] > pow2["hit_rate"] + 0.3
    assert ours["hit_rate"] >= 0.9 * ours["oracle_hit_rate"]


def test_workload_follows_sglang_gsp_shape():
    wl = sim.build_workload("gsp", replicas=4)
    assert wl.groups == 64 and len(wl.requests) == 64 * 16 and not wl.groups_scaled
    r = wl.requests[0]
    assert r.prompt_tokens == 2048 + 128 and r.output_tokens == 256
    assert len(r.chain) == (2048 + 128) // sim.CHUNK
    same_group = [q for q in wl.requests if q.source[0] == r.source[0]]
    assert len(same_group) == 16 and all(q.chain[:32] == r.chain[:32] for q in same_group)
    assert len({q.chain[32] for q in same_group}) == 16  # questions differ
    assert all(a.arrival < b.arrival for a, b in zip(wl.requests, wl.requests[1:]))
    assert sim.build_workload("gsp", replicas=16).groups == 256  # scaled with the replicas


def test_replica_cache_is_lru_with_leaf_first_eviction():
    cache = sim._LRU(capacity_chunks=6)
    assert cache.serve((1, 2, 3), (-1,)) == 0
    assert cache.serve((1, 2, 4), (-2,)) == 2  # shares (1, 2)
    assert cache.serve((9, 8, 7), (-3,)) == 0
    # the least recently used go first, leaves before their roots: (1, 2) survive, 3 and 4 do not
    assert set(cache.chunks) == {1, 2, 9, 8, 7, -3}
    assert cache.routable == {1, 2, 9, 8, 7}  # what its digest publishes


def test_ray_text_tree_matches_the_published_example():
    # prefix_tree.py's docstring: "helloworld" by tenant_1, "hellothere" and "hellothomas" by tenant_2
    tree = sim._TextTree(range(3))
    tree.insert("helloworld", 1)
    tree.insert("hellothere", 2)
    tree.insert("hellothomas", 2)
    assert tree.chars == {0: 0, 1: 10, 2: 14}
    assert tree.prefix_match("hellothomas", range(3)) == (11, [2])
    assert tree.prefix_match("hellowo", range(3)) == (7, [1])
    assert tree.prefix_match("hellx", range(3)) == (4, [1, 2])  # stops inside the shared "hello"
    assert tree.prefix_match("xyz", range(3)) == (0, [0, 1, 2])  # the root: every tenant
    assert tree.smallest_tenants() == [0]


def test_command_line_prints_one_json_object_per_run(capsys):
    sim.main(["--policy", "ray-prefix", "--workload", "zipf", "--replicas", "4", "--requests", "128"])
    row = json.loads(capsys.readouterr().out)
    assert row["policy"] == "ray-prefix" and row["workload"] == "zipf" and row["replicas"] == 4
