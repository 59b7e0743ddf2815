"""The deploy path: Serve configs as `serve deploy` and KubeRay take them.

Every Serve config we ship (configs/*.yaml and the KubeRay manifest's `serveConfigV2`) passes Serve's
own schema (ray.serve.schema.ServeDeploySchema) with no key it does not know, and each application's
`args` are a valid chunkserve.cluster.config.AppConfig that build_app binds; broken copies are refused.

The real `serve deploy` CLI, against the dashboard of a LocalCluster, deploys configs/local.yaml
with the `tiny` preset, then updates it in place while streaming completions arrive every 150 ms:
num_replicas 1 -> 2, then engine.kv_cache_tokens 4096 -> 8192. Both are rolling restarts (Serve
hashes an application's args into its code version, so a change to them replaces every replica).
Not one request of the stream fails, the served configuration changes (two replicas answer, their
engines hold the larger pool), and `serve shutdown` takes the application away. Requests do wait:
Serve stops the one ingress replica before its replacement runs (max_surge_percent 0, its
default), and the proxy holds what arrives meanwhile (the slowest took 5-17 s on 2 shared cores).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
import threading
import time
import typing
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from pydantic import BaseModel
from ray.serve.schema import ServeDeploySchema

from chunkserve.cluster.app import build_app
from chunkserve.cluster.config import AppConfig
from chunkserve.cluster.ingress import REPLICA_HEADER
from chunkserve.cluster.local import LocalCluster, NodeSpec
from chunkserve.replicas.engine.distributed import free_port
from tests.serve_cluster import wait_until_serving

pytestmark = pytest.mark.slow  # Serve on a Ray cluster of its own: README's quick run leaves it out

REPO = Path(__file__).resolve().parents[1]
CONFIG_FILES = ("configs/local.yaml", "configs/serve.yaml", "configs/llama3-8b.yaml")
KUBERAY = REPO / "configs" / "kuberay" / "rayservice.yaml"


def _kuberay_serve_config() -> dict:
    """The Serve config KubeRay deploys: the manifest's serveConfigV2, a YAML document in a string."""
    manifest = yaml.safe_load(KUBERAY.read_text())
    assert manifest["kind"] == "RayService"
    text = manifest["spec"]["serveConfigV2"]
    assert isinstance(text, str)  # KubeRay takes the config as a string, not as a YAML mapping
    return yaml.safe_load(text)


def _serve_configs() -> dict[str, dict]:
    return {
        **{path: yaml.safe_load((REPO / path).read_text()) for path in CONFIG_FILES},
        "configs/kuberay/rayservice.yaml serveConfigV2": _kuberay_serve_config(),
    }


def _schema_in(annotation) -> type[BaseModel] | None:
    """The pydantic model a field holds (itself, optional, in a list or a union), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (model := _schema_in(arg)) is not None:
            return model
    return None


def _unknown_keys(model: type[BaseModel], data: dict, where: str = "") -> list[str]:
    """Keys of `data` that are no field of `model`, at every depth of its nested schemas. Serve's
    schemas ignore unknown keys, so a typo (`route_prefx`, `num_replica` in a deployment's
    overrides) would deploy with the default, silently; free-form fields (args, runtime_env) are
    not walked: AppConfig checks args."""
    fields = {field.alias or name: field for name, field in model.model_fields.items()}
    unknown = []
    for key, value in data.items():
        field = fields.get(key)
        if field is None:
            unknown.append(where + key)
            continue
        sub = _schema_in(field.annotation)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if sub is not None and isinstance(item, dict):
                unknown += _unknown_keys(sub, item, f"{where}{key}{'' if i is None else f'[{i}]'}.")
    return unknown


def _validate(config: dict) -> list[AppConfig]:
    """Serve's schema, then each application's args as AppConfig and through build_app (which
    turns them into Serve deployment options). -> the applications' AppConfigs."""
    schema = ServeDeploySchema.model_validate(config)
    unknown = _unknown_keys(ServeDeploySchema, config)
    if unknown:
        raise ValueError(f"keys Serve's schema does not know (ignored by `serve deploy`): {unknown}")
    apps = []
    for app in schema.applications:
        assert app.import_path == "chunkserve.cluster.app:build_app", app.import_path
        apps.append(AppConfig.model_validate(app.args))
        build_app(app.args)
    return apps


@pytest.mark.parametrize("name", list(_serve_configs()))
def test_shipped_serve_configs_pass_serves_schema_and_app_config(name):
    config = _serve_configs()[name]
    (app,) = _validate(config)
    assert app.model_name  # (every file serves one application)


def test_one_machine_configs_serve_this_machine_only():
    # the embedded default and the one-GPU config bind the HTTP proxy to loopback (docs/usage.md: what
    # listens where); the cluster configs serve a network
    configs = _serve_configs()
    assert {path: configs[path]["http_options"]["host"] for path in CONFIG_FILES} == {
        "configs/local.yaml": "127.0.0.1",
        "configs/llama3-8b.yaml": "127.0.0.1",
        "configs/serve.yaml": "0.0.0.0",
    }


def test_kuberay_serve_config_is_the_gpu_deployment():
    """The values the manifest's pods are sized for reach AppConfig as written."""
    (app,) = _validate(_kuberay_serve_config())
    assert app.device == "cuda" and app.num_replicas == 4 and app.api_key_env == "CHUNKSERVE_API_KEY"
    assert app.engine.max_model_len == 32768 and app.ingress.num_replicas == 2


def _broken(edit) -> dict:
    config = copy.deepcopy(_kuberay_serve_config())
    edit(config, config["applications"][0])
    return config


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c, a: a["args"]["engine"].update(kv_cache=4096), "kv_cache"),  # unknown arg key
        (lambda c, a: a["args"].update(num_replicas="four"), "num_replicas"),  # wrong type
        (lambda c, a: a["args"].update(device="tpu"), "device"),
        (lambda c, a: c["http_options"].update(port="eighty"), "port"),  # Serve's schema: wrong type
        (lambda c, a: a.update(route_prefx="/v1"), "route_prefx"),  # keys Serve's schema would ignore
        (lambda c, a: c.update(proxy_locaton="HeadOnly"), "proxy_locaton"),
        (
            lambda c, a: a.update(deployments=[{"name": "LLMReplica", "num_replica": 2}]),
            r"deployments\[0\].num_replica",
        ),
    ],
)
def test_broken_kuberay_serve_configs_are_refused(edit, match):
    with pytest.raises(ValueError, match=match):  # (pydantic's ValidationError is one)
        _validate(_broken(edit))


# -- serve deploy, in-place updates and serve shutdown on a LocalCluster -----------------------------

SERVE = Path(sys.executable).parent / "serve"
APP = "chunkserve"
STARTUP_S = 300
UPDATE_S = 240
PERIOD_S = 0.15  # the steady stream: one streaming completion started this often


@dataclass
class _Result:
    i: int
    started: float  # time.monotonic()
    seconds: float
    status: int | None = None
    replica: str | None = None
    done: bool = False  # the stream ended with data: [DONE]
    finished: bool = False  # a choice came with its finish_reason
    error: str | None = None  # an error event in the stream, or the transport's exception

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.finished and self.error is None


class _SteadyStream:
    """Streaming /v1/completions started every PERIOD_S (whether or not earlier ones have ended),
    from an event loop on a thread of its own, each one's outcome recorded."""

    def __init__(self, base: str, model: str):
        self.base, self.model = base, model
        self.results: list[_Result] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),), daemon=True)

    def __enter__(self) -> _SteadyStream:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "the stream's requests did not end within 120 s"

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            tasks, i = [], 0
            while not self._stop.is_set():
                tasks.append(asyncio.create_task(self._one(client, i)))
                i += 1
                await asyncio.sleep(PERIOD_S)
            await asyncio.gather(*tasks)

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        # prompts differ and are shorter than a chunk, so the prefix router spreads them by load
        body = {
            "model": self.model,
            "prompt": f"request {i}: the quick brown fox",
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
        }
        started = time.monotonic()
        result = _Result(i, started, 0.0)
        try:
            async with client.stream("POST", f"{self.base}/v1/completions", json=body) as r:
                result.status, result.replica = r.status_code, r.headers.get(REPLICA_HEADER)
                lines = [line async for line in r.aiter_lines()]
            data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
            result.done = bool(data) and data[-1] == "[DONE]"
            if r.status_code != 200:
                result.error = "\n".join(lines)[:500]
            for event in (json.loads(d) for d in data if d != "[DONE]"):
                if "error" in event:
                    result.error = json.dumps(event["error"])
                elif any(c.get("finish_reason") for c in event.get("choices", ())):
                    result.finished = True
        except httpx.HTTPError as e:
            result.error = repr(e)
        result.seconds = time.monotonic() - started
        self.results.append(result)  # (list.append: safe across the threads)

    def since(self, t: float) -> list[_Result]:
        return [r for r in list(self.results) if r.started >= t]


def _serve(*args: str, dashboard: str) -> str:
    p = subprocess.run(
        [str(SERVE), *args, "--address", dashboard], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, f"serve {' '.join(args)} exited with {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p.stdout


def _deploy(config: dict, path: Path, dashboard: str) -> None:
    path.write_text(yaml.safe_dump(config))
    _serve("deploy", str(path), dashboard=dashboard)


def _status(dashboard: str) -> dict:
    """`serve status`'s report of the application (YAML): its status and each deployment's replica states."""
    return (yaml.safe_load(_serve("status", dashboard=dashboard)).get("applications") or {}).get(APP) or {}


def _wait_running(dashboard: str, llm_replicas: int) -> float:
    """Wait until the application is RUNNING with exactly `llm_replicas` LLMReplica replicas and one
    ingress, none starting or stopping (`serve deploy` has set the application DEPLOYING by the time it
    returns, so RUNNING is the new config's). -> seconds waited."""
    start = time.monotonic()
    want = {"LLMReplica": {"RUNNING": llm_replicas}, "OpenAIIngress": {"RUNNING": 1}}
    while True:
        app = _status(dashboard)
        states = {name: d.get("replica_states") for name, d in (app.get("deployments") or {}).items()}
        if app.get("status") == "RUNNING" and states == want:
            return time.monotonic() - start
        assert app.get("status") not in ("DEPLOY_FAILED", "UNHEALTHY"), app
        assert time.monotonic() - start < UPDATE_S, f"not {want} within {UPDATE_S} s: {app}"
        time.sleep(1)


def _engine_stats(calls: int = 8) -> list[dict]:
    """LLMReplica.stats() through a DeploymentHandle, `calls` times (Serve spreads them over the replicas)."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMReplica", app_name=APP)
    return [handle.stats.remote().result(timeout_s=60) for _ in range(calls)]


def test_serve_deploy_updates_in_place_while_requests_stream_then_shutdown(tmp_path, monkeypatch):
    import ray

    begun = time.monotonic()
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port  # (not local.yaml's 8000: another server may hold it)
    args = config["applications"][0]["args"]
    args.update(model="tiny", device="cpu", num_replicas=1)
    args["engine"]["kv_cache_tokens"] = 4096
    chunk = args["engine"]["chunk_size"]
    base = f"http://127.0.0.1:{port}"
    # the nodes (and Serve's build task and replicas, their children) import this checkout, as a real
    # cluster's nodes import the installed package
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))
    dashboard_port = free_port()
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    # 4 logical CPUs on one node: two replicas of 1 CPU each, and room for replacements while old
    # replicas drain
    node = NodeSpec(cpus=4, object_store_bytes=100 * 2**20)
    with LocalCluster(num_nodes=1, node=node, include_dashboard=True, dashboard_port=dashboard_port) as cluster:
        ray.init(address=cluster.address)
        _deploy(config, tmp_path / "v1.yaml", dashboard)
        wait_until_serving(base, STARTUP_S)
        _wait_running(dashboard, 1)
        assert {s["kv_chunks_total"] for s in _engine_stats(2)} == {4096 // chunk}
        up = time.monotonic() - begun

        with _SteadyStream(base, args["model"]) as stream:
            time.sleep(2)  # some requests on the first deployment before the update

            args["num_replicas"] = 2
            _deploy(config, tmp_path / "v2.yaml", dashboard)
            scaled_in = _wait_running(dashboard, 2)
            scaled = time.monotonic()
            time.sleep(4)  # ~25 requests on the two replicas
            replicas = {r.replica for r in stream.since(scaled) if r.ok}
            assert len(replicas) == 2, f"requests after num_replicas: 2 were served by {replicas}"

            args["engine"]["kv_cache_tokens"] = 8192
            _deploy(config, tmp_path / "v3.yaml", dashboard)
            reconfigured_in = _wait_running(dashboard, 2)
            assert [s["kv_chunks_total"] for s in _engine_stats()] == [8192 // chunk] * 8
            time.sleep(2)  # and some after it
            after = {r.replica for r in stream.since(time.monotonic() - 2) if r.ok}
            assert after and not after & replicas, f"the restarted replicas {after} reuse ids of {replicas}"

        results = stream.results
        failed = [r for r in results if not r.ok]
        slowest = max(r.seconds for r in results)
        print(
            f"\nup in {up:.0f} s; {len(results)} streamed requests, {len(failed)} failed; "
            f"num_replicas 1 -> 2 took {scaled_in:.0f} s, kv_cache_tokens {reconfigured_in:.0f} s; "
            f"slowest request {slowest:.1f} s"
        )
        assert not failed, f"{len(failed)} of {len(results)} failed during the updates, e.g. {failed[:3]}"
        assert len(results) >= 50

        _serve("shutdown", "-y", dashboard=dashboard)
        assert _status(dashboard) == {}
        with pytest.raises(httpx.TransportError):  # no proxy listens any more
            httpx.get(f"{base}/v1/models", timeout=10)
