"""Serve on a local multi-node Ray cluster, for the end-to-end tests."""

from contextlib import contextmanager

from replicas.parallel import free_port


@contextmanager
def serve_on_local_cluster(num_nodes: int, include_dashboard: bool = False):
    """Yields the HTTP base URL of a Serve proxy on a fresh `num_nodes`-node local cluster."""
    import ray
    from ray import serve

    from cluster.local import LocalCluster

    port = free_port()
    # the dashboard on a free port: another cluster on this machine may hold the default one
    with LocalCluster(num_nodes=num_nodes, num_cpus_per_node=2, object_store_bytes=100 * 2**20,
                      include_dashboard=include_dashboard, dashboard_port=free_port() if include_dashboard else None) as c:
        ray.init(address=c.address)
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
