"""build_app: AppConfig -> the Serve application (OpenAIIngress -> LLMReplica).

import_path: chunkserve.cluster.app:build_app      # in a Serve config file; `args:` is the AppConfig
serve.run(build_app({"model": "tiny", "num_replicas": 2}))
"""

from __future__ import annotations

import importlib.util
from typing import Any

import ray
import torch
from ray.serve import Application

from chunkserve.cluster.config import AppConfig
from chunkserve.cluster.ingress import OpenAIIngress
from chunkserve.replicas.deployment import LLMReplica, ReplicaOptions
from chunkserve.replicas.engine.llm_engine import EngineConfig

PREFIX_ROUTER = "chunkserve.router.serve_router:PrefixAffinityRouter"  # router.policy: prefix (DESIGN §3)
# router.policy ray_prefix: Ray Serve LLM's own prefix router (its public path imports vLLM or SGLang)
RAY_PREFIX_ROUTER = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
)


def build_app(args: dict[str, Any]) -> Application:
    config = AppConfig.model_validate(args)
    use_gpu = _use_gpu(config.device)
    engine_config = EngineConfig(
        model=config.model,
        device="cuda" if use_gpu else "cpu",
        dtype=config.dtype,
        tp_size=config.tensor_parallel_size,
        **config.engine.model_dump(),
    )
    # the replica seeds its cache digest as the ingress seeds prompt hashes: by the served model name
    options = ReplicaOptions(
        served_model_name=config.model_name,
        route_chunks=config.router.route_chunks,
        cpus_per_rank=config.num_cpus_per_replica,
        warm_up=use_gpu if config.warmup is None else config.warmup,
        stream_interval_ms=config.stream_interval_ms,
        direct_streams=config.max_ongoing_requests if config.router.direct_stream else None,
    )
    llm = LLMReplica.options(name="LLMReplica", **_replica_options(config, use_gpu)).bind(engine_config, options)
    ingress = OpenAIIngress.options(
        name="OpenAIIngress",
        num_replicas=config.ingress.num_replicas,
        max_ongoing_requests=config.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.ingress.num_cpus},
    )
    return ingress.bind(llm, config)


def _replica_options(config: AppConfig, use_gpu: bool) -> dict[str, Any]:
    # A replica holds tensor_parallel_size devices (GPUs, or CPU ranks over gloo): the replica actor
    # takes the first bundle, its tensor-parallel workers the others, all on one node (STRICT_PACK).
    tp = config.tensor_parallel_size
    gpus = (config.num_gpus_per_replica or 1) if tp == 1 else 1  # the replica actor's; TP: per rank
    bundle = {"CPU": config.num_cpus_per_replica, **({"GPU": gpus} if use_gpu else {})}
    options: dict[str, Any] = {
        "max_ongoing_requests": config.max_ongoing_requests,
        "max_queued_requests": config.max_queued_requests,
        "backpressure_config": {"retry_after_s": config.retry_after_s},
        "ray_actor_options": {"num_cpus": config.num_cpus_per_replica, "num_gpus": gpus if use_gpu else 0},
    }
    if config.autoscaling_config is not None:
        options["autoscaling_config"] = config.autoscaling_config
    else:
        options["num_replicas"] = config.num_replicas or 1
    if config.router.policy == "prefix":
        share = config.router.share_decisions
        if share is None:  # (DESIGN §3 "Routers that agree")
            share = config.ingress.num_replicas > 1
        options["request_router_config"] = {
            "request_router_class": PREFIX_ROUTER,
            "request_router_kwargs": {
                "chunk_size": config.engine.chunk_size,
                "host_hit_credit": config.router.host_hit_credit,
                "share_decisions": share,
            },
            "request_routing_stats_period_s": config.router.routing_stats_period_s,
        }
    elif config.router.policy == "ray_prefix":
        if importlib.util.find_spec("ray.llm") is None:  # (a Ray built without it: every replica would fail)
            raise ValueError(
                "router.policy ray_prefix is Ray Serve LLM's PrefixCacheAffinityRouter, in the ray.llm package of "
                f"Ray's own wheel; this Ray ({ray.__version__}) has no ray.llm: install ray[serve] from PyPI or "
                "choose router.policy prefix or pow2"
            )
        options["request_router_config"] = {
            "request_router_class": RAY_PREFIX_ROUTER,
            "request_routing_stats_period_s": config.router.routing_stats_period_s,
        }
    if tp > 1:
        options["placement_group_bundles"] = [bundle] * tp
        options["placement_group_strategy"] = "STRICT_PACK"
    return options


def _use_gpu(device: str) -> bool:
    """device auto: GPUs when the Ray cluster has any (this machine's, before Ray is started)."""
    if device != "auto":
        return device == "cuda"
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    return torch.cuda.is_available()
