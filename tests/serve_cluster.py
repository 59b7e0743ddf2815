"""Serve on a local multi-node Ray cluster, for the end-to-end tests."""

import time
from contextlib import contextmanager

from replicas.distributed import free_port


@contextmanager
def serve_on_local_cluster(num_nodes: int, include_dashboard: bool = False):
    """Yields the HTTP base URL of a Serve proxy on a fresh `num_nodes`-node local cluster."""
    import ray
    from ray import serve

    from cluster.local import LocalCluster

    port = free_port()
    # the dashboard on a free port: another cluster on this machine may hold the default one
    with LocalCluster(
        num_nodes=num_nodes,
        num_cpus_per_node=2,
        object_store_bytes=100 * 2**20,
        include_dashboard=include_dashboard,
        dashboard_port=free_port() if include_dashboard else None,
    ) as c:
        ray.init(address=c.address)
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()


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
