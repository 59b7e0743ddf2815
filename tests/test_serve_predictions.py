"""The router's predictions of cached prompt tokens against the replicas' counts, over real Serve
on a local Ray cluster (2 ingress replicas, each with its own router; 4 `tiny` model replicas),
driven by the load test (chunkserve/cluster/loadtest) with SGLang's gsp workload: in a steady run
(its groups' system prompts cached by a run before) at least 95 % of requests are predicted
exactly, and the load test's two views (each response's header; the server's /metrics counters)
agree with each other and with usage."""

from __future__ import annotations

import json

import httpx
import pytest
from ray import serve

from chunkserve.cluster.app import build_app
from chunkserve.cluster.loadtest.cli import main
from chunkserve.cluster.loadtest.metrics import router_counters
from tests.serve_cluster import serve_on_local_cluster

pytestmark = pytest.mark.slow  # Serve on a Ray cluster of its own, ~45 s of traffic: about 2 minutes

APP = {
    "model": "tiny",
    "device": "cpu",
    "num_replicas": 4,
    "num_cpus_per_replica": 0.25,
    "ingress": {"num_replicas": 2},
    "engine": {"kv_cache_tokens": 8192, "max_model_len": 1024},
}
# 8 groups of a 512-token system prompt (8 chunks) and 64-token questions: the prompts end on a
# chunk boundary, whose last chunk the engine always computes; the same seed in both runs, so the
# steady run repeats the warm-up's prompts too (held to their last chunk) besides new questions
GSP = ["--workload", "gsp", "--gsp-num-groups", "8", "--gsp-prompts-per-group", "64"]
GSP += ["--gsp-system-prompt-len", "512", "--gsp-question-len", "64", "--gsp-output-len", "8"]
GSP += ["--prompt-format", "tokens", "--seed", "0", "--request-rate", "8", "--no-progress"]


@pytest.fixture(scope="module")
def url():
    with serve_on_local_cluster(num_nodes=1) as base:
        serve.run(build_app(APP), name="pred", route_prefix="/pred")
        yield f"{base}/pred"


def _run(url: str, tmp_path, name: str, n: int) -> dict:
    out = tmp_path / f"{name}.jsonl"
    assert main(["--url", url, "--save-result", str(out), "--num-prompts", str(n), *GSP]) == 0
    (report,) = [json.loads(line) for line in out.read_text().splitlines()]
    return report


def test_predicted_and_reported_cached_tokens_agree_in_a_steady_gsp_run(url, tmp_path):
    warm = _run(url, tmp_path, "warm", 64)  # every group placed (and its system prompt cached)
    assert warm["completed"] == 64 and warm["server_router"]["requests"] == 64
    steady = _run(url, tmp_path, "steady", 256)
    assert steady["completed"] == 256 and steady["server_metrics_error"] is None
    records = steady["records"]
    assert all(r["predicted_cached_tokens"] is not None for r in records)  # (each one's header)
    client, server = steady["predictions"], steady["server_router"]
    print(json.dumps({"warm": warm["server_router"], "steady": server, "cached_fraction": steady["cached_fraction"]}))
    # the two views: each response's header against its usage, and the server's counters
    assert client["requests"] == server["requests"] == 256
    assert client["exact"] == server["exact"]
    assert server["predicted_cached_tokens"] == sum(r["predicted_cached_tokens"] for r in records)
    assert server["reported_cached_tokens"] == sum(r["cached_tokens"] for r in records)
    assert steady["total_cached_tokens"] > 0.5 * steady["total_input_tokens"]  # (the groups were found)
    assert server["agreement"] >= 0.95, server
    # both ingress replicas' routers took part (Serve's proxy spreads the requests over them)
    counters = router_counters(httpx.get(f"{url}/metrics", timeout=60).text)
    assert counters is not None
    routers = {rid for (sample, _, rid), n in counters.items() if sample.endswith("predictions_total") and n > 0}
    assert len(routers) == 2, counters
