"""LocalCluster: an N-node Ray cluster on one machine (a head and N-1 worker raylets).

Each node has its own node id, raylet, object store and resources, so Serve schedules replicas
across them as it would across machines. For tests, demos and load tests:

    with LocalCluster(num_nodes=3, node=NodeSpec(cpus=2)) as cluster:
        ray.init(address=cluster.address)
        ...

    python -m chunkserve.cluster.local --nodes 3      # prints the address, runs until Ctrl-C
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field

import ray
from ray.cluster_utils import Cluster


@dataclass(frozen=True)
class NodeSpec:
    """What each node of a LocalCluster has: logical CPUs, GPUs, object store, custom resources."""

    cpus: float = 2
    gpus: int = 0
    object_store_bytes: int = 200 * 2**20
    resources: Mapping[str, float] = field(default_factory=dict)


class LocalCluster:
    def __init__(
        self,
        num_nodes: int = 3,
        node: NodeSpec = NodeSpec(),
        include_dashboard: bool = False,
        dashboard_port: int | None = None,
    ):
        """include_dashboard: the heaviest head process; needed by `ray.util.state` and `serve deploy`
        (whose default address is the dashboard's default port, 8265: dashboard_port None)."""
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        self.num_nodes = num_nodes
        self.include_dashboard = include_dashboard
        self.dashboard_port = dashboard_port
        self._node_args = {
            "num_cpus": node.cpus,
            "num_gpus": node.gpus,
            "object_store_memory": node.object_store_bytes,
            "resources": dict(node.resources),
        }
        self._cluster: Cluster | None = None

    def start(self) -> LocalCluster:
        if self._cluster is not None:
            raise RuntimeError("the cluster is already running")
        self._cluster = Cluster(
            initialize_head=True,
            head_node_args={
                **self._node_args,
                "include_dashboard": self.include_dashboard,
                **({} if self.dashboard_port is None else {"dashboard_port": self.dashboard_port}),
            },
        )
        try:
            for _ in range(self.num_nodes - 1):
                self._cluster.add_node(**self._node_args)
            self._cluster.wait_for_nodes()
        except BaseException:
            self.shutdown()
            raise
        return self

    def shutdown(self) -> None:
        """Disconnect this process's driver (if any) and stop every node's processes."""
        if self._cluster is None:
            return
        if ray.is_initialized():
            ray.shutdown()
        self._cluster.shutdown()
        self._cluster = None

    @property
    def address(self) -> str:
        """The GCS address: `ray.init(address=...)`, `serve run --address ...`."""
        if self._cluster is None:
            raise RuntimeError("the cluster is not running")
        return self._cluster.address

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkserve.cluster.local", description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--cpus", type=float, default=2, help="logical CPUs per node")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs per node")
    ap.add_argument("--object-store-mb", type=int, default=200)
    ap.add_argument("--dashboard", action="store_true", help="start the dashboard (for `serve deploy`, `ray list`)")
    args = ap.parse_args(argv)
    node = NodeSpec(args.cpus, args.gpus, args.object_store_mb * 2**20)
    with LocalCluster(args.nodes, node, include_dashboard=args.dashboard) as cluster:
        print(
            f"{args.nodes}-node Ray cluster at {cluster.address}; "
            f"e.g. serve run --address {cluster.address} configs/local.yaml; Ctrl-C stops it",
            flush=True,
        )
        stop = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # taken by sigwait, so the `with` exits cleanly
        signal.sigwait(stop)


if __name__ == "__main__":
    main()
