"""Serve a config, load-test it, shut it down: one variant of the whole stack per invocation.

    python -m chunkserve.cluster.loadtest.stack configs/llama3-8b.yaml \\
        --set engine.enable_prefix_sharing=false --set router.policy=pow2 \\
        -- --workload gsp --sweep 8,24,64 --save-result out.jsonl

`--set PATH=VALUE` overrides a field of the (first) application's `args:` (YAML values: true,
16, pow2). The application is started with `serve run` in a process group of its own, the load
test (`python -m chunkserve.cluster.loadtest` with the arguments after `--`) runs once `/ready`
answers (a model replica is up; it needs no API key, so configs with keys or tenants start too),
and the application and its Ray instance are stopped after, whatever happened.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from chunkserve.cluster.loadtest.cli import main as loadtest


def apply_overrides(config: dict, sets: list[str]) -> dict:
    args = config["applications"][0].setdefault("args", {})
    for item in sets:
        path, sep, value = item.partition("=")
        if not sep or not path:
            raise ValueError(f"--set takes PATH=VALUE, got {item!r}")
        *parents, leaf = path.split(".")
        node = args
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    return config


def wait_ready(
    url: str, timeout: float, proc: subprocess.Popen, path: str = "/ready", replicas: int | None = None
) -> float:
    """Seconds until url + path answers 200 (ours: /ready, a model replica is up: the ingress's
    readiness, which needs no API key) and, given `replicas`, its `model_replicas` count that
    many RUNNING: a load test over several replicas must not start on the first one alone.
    Raises if the server's process exits first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            r = httpx.get(url + path, timeout=5)
            if r.status_code == 200 and (
                replicas is None or r.json().get("model_replicas", {}).get("RUNNING", 0) >= replicas
            ):
                return time.monotonic() - t0
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} was not ready within {timeout:.0f} s")


def fixed_replicas(config: dict) -> int | None:
    """The model replicas a config's first application runs when their number is fixed (None:
    autoscaling, or the field absent, where the app's default of 1 holds)."""
    args = (config.get("applications") or [{}])[0].get("args", {})
    if args.get("autoscaling_config") is not None:
        return None
    return int(args.get("num_replicas") or 1)


def api_url(config: dict) -> str:
    """Where a Serve config's API answers: the ingress replicas' own port (ingress.http_port,
    chunkserve/cluster/front.py) where the first application sets one, else Serve's proxy."""
    http = config.get("http_options", {})
    host, port = http.get("host", "127.0.0.1"), http.get("port", 8000)
    ingress = (config.get("applications") or [{}])[0].get("args", {}).get("ingress", {})
    if ingress.get("http_port") is not None:
        host, port = ingress.get("http_host", "127.0.0.1"), ingress["http_port"]
    return f"http://{host.replace('0.0.0.0', '127.0.0.1')}:{port}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="python -m chunkserve.cluster.loadtest.stack", description=__doc__.split("\n")[0])
    ap.add_argument("config", help="a Serve config file")
    ap.add_argument("--set", action="append", default=[], help="PATH=VALUE override of the app's args")
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the replicas")
    ap.add_argument("--log", help="serve run's output to this file (default: inherited)")
    args = ap.parse_args(ours)
    config = yaml.safe_load(Path(args.config).read_text())
    try:
        config = apply_overrides(config, args.set)
    except ValueError as e:
        ap.error(str(e))
    url = api_url(config)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    log = open(args.log, "w") if args.log else None  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run", f.name]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None, start_new_session=True)
    try:
        ready_s = wait_ready(url, args.ready_timeout, proc, replicas=fixed_replicas(config))
        print(f"# {args.config} {' '.join(args.set)}: ready after {ready_s:.0f} s", file=sys.stderr, flush=True)
        return loadtest(["--url", url, *rest])
    finally:
        try:
            os.killpg(proc.pid, signal.SIGINT)  # serve run shuts the application (and a Ray it started) down
            proc.wait(120)
        except ProcessLookupError:  # (it exited by itself: wait_ready says why)
            pass
        except subprocess.TimeoutExpired:  # (then the Ray it started may be left: stopped too)
            os.killpg(proc.pid, signal.SIGKILL)
            subprocess.run(
                [sys.executable, "-c", "from ray.scripts.scripts import main; main()", "stop", "--force"],
                capture_output=True,
                timeout=120,
            )
        os.unlink(f.name)
        if log is not None:
            log.close()


if __name__ == "__main__":
    sys.exit(main())
