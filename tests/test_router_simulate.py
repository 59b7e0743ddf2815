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
    "decision_wall_us",
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
    if policy == "ray-prefix" and workload == "tenants":  # (its text tree needs tokens; tenants keeps hashes)
        with pytest.raises(ValueError, match="tokens"):
            sim.simulate(workloads[workload], policy)
        return  # (with keep_tokens it runs: test_tenants_shape_of_a_load_test_run)
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


def test_engine_pool_pins_chunks_in_flight_and_admits_while_they_fit():
    pool = sim._Pool(capacity_chunks=6)
    assert pool.fits((1, 2, 3), (-1,)) and pool.admit((1, 2, 3), (-1,)) == 0
    assert pool.fits((1, 2, 4), (-2,))  # 4 and -2 new: 6 pinned
    assert pool.admit((1, 2, 4), (-2,)) == 2 and pool.pins[1] == pool.pins[2] == 2
    assert not pool.fits((9, 8, 7), (-3,))  # four more: it waits, nothing evicted for it
    pool.release((1, 2, 3), (-1,))  # 3 and -1 now evictable, (1, 2) still pinned by the other
    assert set(pool.lru) == {3, -1} and set(pool.pins) == {1, 2, 4, -2}
    assert not pool.fits((9, 8, 7), (-3,))
    pool.release((1, 2, 4), (-2,))
    assert not pool.pins and pool.fits((9, 8, 7), (-3,))
    assert pool.admit((9, 8, 7), (-3,)) == 0  # evicts the least recently used: leaves, then roots
    assert set(pool.lru) == {1, 2} and len(pool.pins) == 4
    assert pool.routable == {1, 2, 9, 8, 7}
    assert pool.admit((1, 2, 5), (-4,)) == 2  # a held unpinned prefix matches and becomes pinned
    assert not pool.lru and len(pool.pins) == 8  # (over capacity only by what nothing could free)


def test_engine_pool_keeps_a_waiting_requests_prefix_as_if_just_used():
    pool = sim._Pool(capacity_chunks=6)
    for chain, out in (((1, 2), (-1,)), ((5, 6), (-2,))):
        pool.admit(chain, out)
        pool.release(chain, out)
    assert list(pool.lru) == [-1, 2, 1, -2, 6, 5]  # (1, 2) the older
    pool.touch((1, 2, 3))  # a queued request matching (1, 2): its run moves up, the root last
    assert list(pool.lru) == [-1, -2, 6, 5, 2, 1]
    pool.admit((7, 8, 9), (-3,))  # evictions take what nobody waits for first
    assert list(pool.lru) == [2, 1] and set(pool.pins) == {7, 8, 9, -3}


def test_engine_mode_on_a_shared_gpu_runs_and_orders_the_policies():
    # the H100 router run's shape, small: tenants whose prompts exceed a pool, 3 replicas on one
    # GPU, requests pinning their chunks, decode steps batched
    wl = sim.build_workload(
        "tenants", 3, 240, seed=3, tenants=16, tenant_prompt_len=1024, cache_tokens=4096, rate=6.0, keep_tokens=True
    )
    rows = {p: sim.simulate(wl, p, 3, engine_tpot=0.025, shared_gpu=True) for p in ("prefix", "ray-prefix", "pow2")}
    for row in rows.values():
        assert row["engine_tpot_s"] == 0.025 and row["shared_gpu"] and row["max_mean_backlog"] is None
        assert 0 < row["throughput_rps"] <= 6.5 and row["ttft_p50_s"] <= row["ttft_p90_s"]
    assert rows["prefix"]["hit_rate"] > rows["pow2"]["hit_rate"] + 0.15
    assert rows["ray-prefix"]["hit_rate"] > rows["pow2"]["hit_rate"] + 0.15
    # one GPU without the engine's pool: the replicas' work on one server
    row = sim.simulate(wl, "prefix", 3, shared_gpu=True)
    assert row["max_mean_backlog"] is None and row["engine_tpot_s"] is None and row["throughput_rps"] > 0


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


def test_tenants_shape_of_a_load_test_run(capsys):
    # a GPU run's shape (--tenants 16 --tenant-prompt-len 3584, 16384-token pools) from the command
    # line, ray-prefix included: its prompts' tokens are kept, each the chain's tokens
    wl = sim.build_workload(
        "tenants", 3, 96, seed=1, tenants=16, tenant_prompt_len=384, cache_tokens=2048, keep_tokens=True
    )
    assert wl.groups == 16 and wl.cache_tokens == 2048 and len(wl.texts) == 96
    for r in wl.requests[:8]:
        tokens = wl.tokens(r)
        assert len(tokens) == r.prompt_tokens and len(r.chain) == r.prompt_tokens // sim.CHUNK
        assert list(r.chain) == sim.chunk_hashes(tokens.tolist(), sim.CHUNK, 1 << 30, sim.MODEL)
    sim.main(
        ["--workload", "tenants", "--replicas", "3", "--requests", "96", "--tenants", "16"]
        + ["--tenant-prompt-len", "384", "--cache-tokens", "2048", "--policy", "ray-prefix"]
    )
    row = json.loads(capsys.readouterr().out)
    assert row["policy"] == "ray-prefix" and row["groups"] == 16 and row["cache_tokens"] == 2048
    assert 0.0 < row["hit_rate"] <= row["oracle_hit_rate"] + 1e-9


def test_command_line_prints_one_json_object_per_run(capsys):
    sim.main(["--policy", "ray-prefix", "--workload", "zipf", "--replicas", "4", "--requests", "128"])
    row = json.loads(capsys.readouterr().out)
    assert row["policy"] == "ray-prefix" and row["workload"] == "zipf" and row["replicas"] == 4


def test_k_routers_and_a_scale_up_run_and_report_per_phase():
    wl = sim.build_workload("gsp", replicas=4, requests=384, scale_up=True)
    assert wl.final_replicas == 8 and wl.scale_at == 192
    gaps_before = wl.requests[191].arrival - wl.requests[0].arrival
    gaps_after = wl.requests[-1].arrival - wl.requests[192].arrival
    assert gaps_after < gaps_before  # the rate doubles with the fleet
    for policy in ("prefix", "approx", "pow2"):
        row = sim.simulate(wl, policy, routers=4, digest_period=0.2, digest_delay=0.1)
        assert row["routers"] == 4 and row["replicas"] == 4 and row["replicas_after"] == 8
        assert row["max_mean_load"] >= 1.0 and 0.0 < row["throughput_rps"]
    assert sim.simulate(wl, "prefix", routers=4)["hit_rate"] > sim.simulate(wl, "pow2", routers=4)["hit_rate"]


def test_shared_routers_that_mirror_each_other_route_as_one():
    # `shared`: each of k routers books every other's decisions and completions a share delay
    # later. With the delay under the gap between arrivals, each router decides on the state one
    # router would hold: on gsp (no home wide enough to sample at random) the same placements to
    # the request as k = 1, scale-up included; `prefix` with k routers (reports only) does not.
    wl = sim.build_workload("gsp", replicas=4, requests=384, scale_up=True)
    one = sim.simulate(wl, "prefix", routers=1)
    shared = sim.simulate(wl, "shared", routers=4, share_delay=1e-9)
    apart = sim.simulate(wl, "prefix", routers=4)
    key = ("hit_rate", "max_mean_load", "max_mean_backlog", "p99_queue")
    assert [shared[k] for k in key] == [one[k] for k in key]
    assert shared["routers"] == 4 and shared["share_delay_s"] == 1e-9 and one["share_delay_s"] is None
    assert apart["hit_rate"] < one["hit_rate"]
    # one router: nobody to share with, so shared is prefix
    assert sim.simulate(wl, "shared", routers=1)["hit_rate"] == one["hit_rate"]


def test_tenants_sessions_resend_their_conversation():
    wl = sim.build_workload("tenants", replicas=2, requests=200)
    by_session: dict = {}
    for r in wl.requests:
        by_session.setdefault(r.session, []).append(r)
    turns = max(by_session.values(), key=len)
    assert len(turns) == sim.TURNS
    for a, b in zip(turns, turns[1:]):  # a turn's prompt extends the previous prompt and its reply
        assert b.chain[: len(a.chain) + len(a.out_chain)] == a.chain + a.out_chain
        assert b.prompt_tokens == a.prompt_tokens + sim.REPLY_LEN + sim.TURN_LEN


def test_tenant_zipf_sets_how_the_sessions_pick_their_tenants(capsys):
    def top_share(zipf: float) -> float:
        wl = sim.build_workload(
            "tenants", 4, 1600, seed=2, tenants=16, tenant_prompt_len=128, active_sessions=64, tenant_zipf=zipf
        )
        firsts = [r.chain[0] for r in wl.requests]  # a request's tenant: its system prompt's first chunk
        return max(firsts.count(h) for h in set(firsts)) / len(firsts)

    # 16 tenants: the first takes about 1 / 16 of the sessions alike, about a third at 1.1 (the default)
    assert top_share(0.0) < 0.15 < 0.25 < top_share(1.1)
    # the flag reaches the workload: the oracle's hit rate is the workload's alone, and moves with it
    oracle = {}
    for z in ("0", "1.1"):
        sim.main(["--workload", "tenants", "--replicas", "2", "--requests", "64", "--tenant-zipf", z])
        oracle[z] = json.loads(capsys.readouterr().out)["oracle_hit_rate"]
    assert oracle["0"] != oracle["1.1"]


def test_closed_loop_sends_a_turn_once_its_previous_turn_is_done(capsys):
    # the load test's client: a session's turn waits for its previous turn. One session of 4 turns,
    # offered at once (50 req/s): open loop, they queue at the replica; closed, none is sent while
    # another is in flight, so its turns span at least 3 requests' decode (128 steps of 25 ms)
    wl = sim.build_workload("tenants", 2, 4, seed=1, tenants=1, tenant_prompt_len=512, rate=50.0, active_sessions=1)
    assert [r.after for r in wl.requests] == [-1, 0, 1, 2] and wl.requests[-1].arrival < 0.5
    opened = sim.simulate(wl, "prefix", 1, engine_tpot=0.025)
    closed = sim.simulate(wl, "prefix", 1, engine_tpot=0.025, closed_loop=True)
    assert opened["p99_queue"] > 2 and closed["p99_queue"] == 0
    assert closed["closed_loop"] and not opened["closed_loop"] and closed["active_sessions"] == 1
    # throughput: the requests done by the last one's sending, over the span of the sendings.
    # Open: none is done by then; closed: three, over at least three turns' decode
    assert opened["throughput_rps"] == 0 < closed["throughput_rps"] <= 1 / (sim.REPLY_LEN * 0.025)
    assert closed["hit_rate"] == opened["hit_rate"]  # (the pool holds the session: the same hits)
    sim.main(
        ["--workload", "tenants", "--replicas", "2", "--requests", "4", "--tenants", "1", "--rate", "50"]
        + ["--tenant-prompt-len", "512", "--engine", "--active-sessions", "1", "--closed-loop", "--seed", "1"]
    )
    assert json.loads(capsys.readouterr().out)["p99_queue"] == 0


def test_window_max_mean_is_the_worst_window():
    t = [0.5, 1.0, 11.0, 11.5, 12.0, 12.5]
    r = [0, 1, 0, 0, 0, 1]
    w = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    got = sim.window_max_mean(*map(__import__("numpy").asarray, (t, r, w)), 2, 0.0, 13.0)
    # windows [0, 10) .. [3, 13): in [0, 10) both did 1 (1.0); in [2, 12) replica 0 did 2, replica 1
    # none: max 2 / mean 1; in [3, 13) 3 and 1: 1.5. The worst: 2
    assert got == pytest.approx(2.0)


def test_llmd_setup_measures_its_stage_only():
    wl = sim.build_llmd(rate=3.0, seconds=10.0)
    assert wl.replicas == 16 and wl.measure_from == 750 and len(wl.requests) == 750 + 30
    row = sim.simulate(wl, "prefix")
    assert row["requests"] == 30 and row["ttft_p90_s"] >= 0.0
