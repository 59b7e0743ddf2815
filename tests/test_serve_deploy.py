"""The deploy path: Serve configs as `serve deploy` and KubeRay take them.

Every Serve config we ship (configs/*.yaml and the KubeRay manifest's `serveConfigV2`) passes Serve's
own schema (ray.serve.schema.ServeDeploySchema) with no key it does not know, and each application's
`args` are a valid cluster.config.AppConfig that build_app binds; broken copies are refused.
"""

from __future__ import annotations

import copy
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from ray.serve.schema import ServeDeploySchema

from cluster.app import build_app
from cluster.config import AppConfig

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
    return {**{path: yaml.safe_load((REPO / path).read_text()) for path in CONFIG_FILES},
            "configs/kuberay/rayservice.yaml serveConfigV2": _kuberay_serve_config()}


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
        assert app.import_path == "cluster.app:build_app", app.import_path
        apps.append(AppConfig.model_validate(app.args))
        build_app(app.args)
    return apps


@pytest.mark.parametrize("name", list(_serve_configs()))
def test_shipped_serve_configs_pass_serves_schema_and_app_config(name):
    config = _serve_configs()[name]
    (app,) = _validate(config)
    assert app.model_name  # (every file serves one application)


def test_kuberay_serve_config_is_the_gpu_deployment():
    """The values the manifest's pods are sized for reach AppConfig as written."""
    (app,) = _validate(_kuberay_serve_config())
    assert app.device == "cuda" and app.num_replicas == 4 and app.api_key_env == "CHUNKSERVE_API_KEY"
    assert app.engine.max_model_len == 32768 and app.ingress.num_replicas == 2


def _broken(edit) -> dict:
    config = copy.deepcopy(_kuberay_serve_config())
    edit(config, config["applications"][0])
    return config


@pytest.mark.parametrize("edit, match", [
    (lambda c, a: a["args"]["engine"].update(kv_cache=4096), "kv_cache"),  # unknown arg key
    (lambda c, a: a["args"].update(num_replicas="four"), "num_replicas"),  # wrong type
    (lambda c, a: a["args"].update(device="tpu"), "device"),
    (lambda c, a: c["http_options"].update(port="eighty"), "port"),  # Serve's schema: wrong type
    (lambda c, a: a.update(route_prefx="/v1"), "route_prefx"),  # keys Serve's schema would ignore
    (lambda c, a: c.update(proxy_locaton="HeadOnly"), "proxy_locaton"),
    (lambda c, a: a.update(deployments=[{"name": "LLMReplica", "num_replica": 2}]), r"deployments\[0\].num_replica"),
])
def test_broken_kuberay_serve_configs_are_refused(edit, match):
    with pytest.raises(ValueError, match=match):  # (pydantic's ValidationError is one)
        _validate(_broken(edit))
