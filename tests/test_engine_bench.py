"""chunkserve.replicas.tools.bench's Poisson mode: the engine under arrivals, every request served and counted."""

import json

from chunkserve.replicas.tools.bench import main, poisson_offsets


def test_poisson_offsets_are_the_load_tests():
    from chunkserve.cluster.loadtest.workloads import poisson_offsets as loadtest_offsets

    assert poisson_offsets(200, 7.5, seed=3) == loadtest_offsets(200, 7.5, seed=3)


def test_poisson_mode_serves_every_request_and_reports_its_latencies(capsys):
    main(
        [
            "--model",
            "tiny",
            "--prefix",
            "128",
            "--suffix",
            "8",
            "--max-tokens",
            "6",
            "--request-rate",
            "50,200",
            "--requests",
            "24",
            "--groups",
            "2",
            "--kv-cache-tokens",
            "8192",
        ]
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["request_rate"] for r in rows] == [50.0, 200.0]
    for r in rows:
        assert r["bench"] == "engine_poisson" and r["requests"] == 24
        assert r["total_output_tokens"] == 24 * 6
        assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"] and r["median_tpot_ms"] > 0
        assert r["prompt_tokens"] == 24 * 136  # every request finished (fresh prompts each run)
        assert 0 < r["cached_prompt_tokens"] <= 22 * 128  # the 2 prefixes' first requests miss
        assert r["steps"] >= r["decode_steps"] > 0 and r["graph_replays"] == 0  # (CPU: no graphs)
        assert 0 < r["p99_step_ms"] <= r["max_step_ms"] and r["graph_capture_s"] == 0
        assert r["kernel_first_launches"] == 0 and r["kernel_first_launch_s"] == 0  # (CPU: no Triton launches)
        assert r["kernel_first_launched"] == [] and r["decode_graph_fraction"] == 0
        # steps split by kind: every step is decode-only or mixed, each kind's host time within its time
        assert r["mixed_steps"] == r["steps"] - r["decode_steps"] > 0
        for kind in ("decode_only", "mixed"):
            assert 0 < r[f"{kind}_host_ms"] <= r[f"{kind}_step_ms"]
