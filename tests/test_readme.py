"""The README's quick start and load-test commands, as printed, against `serve run
configs/local.yaml` (real Serve, real HTTP, the smollm2-135m preset): one server for the module."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from chunkserve.cluster.loadtest.stack import start_server

pytestmark = pytest.mark.slow  # Serve on a Ray cluster of its own: README's quick run leaves it out

ROOT = Path(__file__).resolve().parents[1]
BASE = "http://127.0.0.1:8000"


def _block(after: str, lang: str) -> str:
    """The first `lang` block after the line containing `after`."""
    text = (ROOT / "README.md").read_text()
    return re.search(rf"```{lang}\n(.*?)```", text[text.index(after) :], re.S).group(1)


def _bash(after: str) -> str:
    return _block(after, "bash").replace("\\\n", " ").strip()


@pytest.fixture(scope="module")
def serve_run():
    """`serve run configs/local.yaml` as the quick start runs it, on a Ray of its own (its temp
    directory apart, so it neither joins nor is joined by another Ray on the machine)."""
    with httpx.Client() as c:
        try:
            c.get(f"{BASE}/v1/models", timeout=2)
            pytest.fail(f"{BASE} already serves; configs/local.yaml serves there")
        except httpx.TransportError:
            pass
    ray_tmp = tempfile.mkdtemp(prefix="ray")
    serve = start_server(  # (a session of its own, SIGINT at its default: our Ctrl-C below stops it)
        [sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run", str(ROOT / "configs/local.yaml")],
        subprocess.DEVNULL,
        cwd=ROOT,
        env=dict(os.environ, RAY_TMPDIR=ray_tmp, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"),  # (the quick start's)
    )
    try:
        start, deadline = time.monotonic(), time.monotonic() + 300
        while True:
            assert serve.poll() is None, "serve run exited"
            try:
                if httpx.get(f"{BASE}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve run was not ready in time"
            time.sleep(1)
        print(f"serve run configs/local.yaml answered after {time.monotonic() - start:.0f} s")
        yield serve
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def test_the_quick_starts_ray_listens_on_loopback_only(serve_run):
    # Ray's single-node mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, docs/usage.md: What the ports expose):
    # every port of serve run's processes (Ray's GCS, raylet, agents, metrics exports, workers, the
    # API's two) listens on loopback, but Serve's inter-deployment gRPC server, one per replica,
    # which Serve binds to [::] itself
    import psutil

    root = psutil.Process(serve_run.pid)
    listening: dict[str, list[tuple[str, int]]] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            name = " ".join(proc.cmdline())
            conns = proc.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        listening[f"{proc.pid} {name[:80]}"] = [c.laddr[:2] for c in conns if c.status == psutil.CONN_LISTEN]
    ports = {port for addrs in listening.values() for _, port in addrs}
    assert {8000, 8001} <= ports and len(ports) > 10, listening  # (the API's, and Ray's many)
    wide = {proc: [a for a in addrs if not _loopback(a[0])] for proc, addrs in listening.items()}
    wide = {proc: addrs for proc, addrs in wide.items() if addrs}
    assert wide, "Serve's replicas' gRPC servers bind [::]: this test's exception is stale"
    for proc, addrs in wide.items():
        assert "ray::ServeReplica" in proc and len(addrs) == 1 and addrs[0][0] in ("::", "0.0.0.0"), wide


def test_capital_of_france_through_the_openai_client(serve_run):
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", timeout=120)
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    r = client.chat.completions.create(
        model="smollm2-135m",
        max_tokens=32,
        temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model="smollm2-135m",
        max_tokens=32,
        temperature=0,
        stream=True,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == r.choices[0].message.content


def test_the_quick_start_examples_print_what_the_readme_shows(serve_run, tmp_path):
    shown = _block("prints (greedy", "text")
    curl = subprocess.run(_bash("Then, from another shell"), shell=True, capture_output=True, text=True, timeout=120)
    assert curl.returncode == 0, curl.stderr
    content = json.loads(curl.stdout)["choices"][0]["message"]["content"]
    assert content == "The capital of France is Paris."
    assert f'"content": "{content}"' in (ROOT / "README.md").read_text()
    script = tmp_path / "quick_start.py"
    script.write_text(_block("Then, from another shell", "python"))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == shown.rstrip("\n")  # the stream's text has no newline at its end
    assert run.stdout.startswith(content + " 0\n")


def test_the_readme_load_test_runs_as_printed(serve_run, tmp_path):
    command = _bash("## Load testing")
    assert command.startswith("python -m chunkserve.cluster.loadtest ")
    run = subprocess.run(
        command.replace("python ", f"{sys.executable} ", 1),
        shell=True,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (report,) = [json.loads(line) for line in (tmp_path / "gsp.jsonl").read_text().splitlines()]
    assert report["completed"] == report["num_prompts"] == 64 and report["failed"] == 0
    assert report["model_id"] == "smollm2-135m" and report["prompt_format"] == "text"
    assert report["cached_fraction"] > 0.5  # 4 groups of 16 prompts sharing 512 tokens
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {"latency_cdf.png", "replica_share.png"}


def test_the_readme_metrics_command_prints_every_replicas_metrics(serve_run):
    # after the tests above served requests: the README's curl | grep shows the replicas' series
    command = _bash("## Metrics")
    assert command == "curl -s 127.0.0.1:8000/metrics | grep chunkserve_", command
    run = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    generated = [line for line in run.stdout.splitlines() if line.startswith("chunkserve_generated_tokens_total{")]
    assert len(generated) == 2  # configs/local.yaml's two replicas, a series each
    assert sum(float(line.rsplit(" ", 1)[1]) for line in generated) > 0
