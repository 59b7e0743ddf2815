"""Serve on a local multi-node Ray cluster, for the end-to-end tests."""

import time
from contextlib import contextmanager

from chunkserve.replicas.engine.distributed import free_port


@contextmanager
def serve_on_local_cluster(num_nodes: int, include_dashboard: bool = False):
    """Yields the HTTP base URL of a Serve proxy on a fresh `num_nodes`-node local cluster."""
    import ray
    from ray import serve

    from chunkserve.cluster.local import LocalCluster, NodeSpec

    # the dashboard on a free port: another cluster on this machine may hold the default one
    with LocalCluster(
        num_nodes=num_nodes,
        node=NodeSpec(cpus=2, object_store_bytes=100 * 2**20),
        include_dashboard=include_dashboard,
        dashboard_port=free_port() if include_dashboard else None,
    ) as c:
        ray.init(address=c.address)
        port = _start_serve()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()


def _start_serve(tries: int = 3) -> int:
    """serve.start with its proxy on a free port, picked once the cluster runs; the port it got.
    Ray's processes take ports of their own as they start, so one picked free can be gone when
    the proxy binds it: then Serve goes down and comes up again on another."""
    from ray import serve

    for attempt in range(tries):
        port = free_port()
        try:
            serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
            return port
        except Exception as e:  # (a RayTaskError from the proxy's ready())
            if "Failed to bind" not in str(e) or attempt == tries - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


def wait_until_serving(base: str, timeout_s: float, proc=None, log_path=None) -> None:
    """Until `base`/v1/models answers 200; fails the test after timeout_s, or at once if `proc`
    (a `serve run` subprocess) exits first, with the end of its log at `log_path`."""
    import httpx
    import pytest

    def log() -> str:
        return "" if log_path is None else ":\n" + log_path.read_text()[-4000:]

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"serve run exited with {proc.returncode}{log()}")
        try:
            if httpx.get(f"{base}/v1/models", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    pytest.fail(f"{base}/v1/models did not answer within {timeout_s:.0f} s{log()}")
