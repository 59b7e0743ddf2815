"""Serve a peer (vLLM, SGLang: any OpenAI-compatible server), load-test it, shut it down: the
other side of a side-by-side run, with the same client, workload and seed as `loadtest.stack`.

    python -m chunkserve.cluster.loadtest.peer --url http://127.0.0.1:8010 \\
        --serve "vllm serve /models/llama3-8b --port 8010 --enable-prefix-caching \\
                 --enable-prompt-tokens-details --gpu-memory-utilization 0.66" \\
        -- --workload gsp --sweep 8,24,64 --save-result peer.jsonl

The server command runs in a process group of its own; the load test (`python -m
chunkserve.cluster.loadtest` with the arguments after `--`) starts once `/v1/models` answers, and
its report's `label` names the peer: the server's `/version` (vLLM's) and its command, unless
`--label` is among the load test's arguments. The server is stopped after, whatever happened.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys

import httpx

from chunkserve.cluster.loadtest.cli import main as loadtest
from chunkserve.cluster.loadtest.stack import start_server, wait_ready


def peer_label(url: str, command: list[str]) -> str:
    """`<name> <version>: <command>`, the version from the server's /version where it answers."""
    version = ""
    try:
        r = httpx.get(url + "/version", timeout=5)
        if r.status_code == 200:
            version = str(r.json().get("version", ""))
    except (httpx.HTTPError, ValueError):
        pass
    name = os.path.basename(command[0]) if command else "peer"
    return f"{name} {version}".strip() + ": " + shlex.join(command)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="python -m chunkserve.cluster.loadtest.peer", description=__doc__.split("\n")[0])
    ap.add_argument("--serve", required=True, help="the server's command line (one string, shell words)")
    ap.add_argument("--url", required=True, help="where it answers, e.g. http://127.0.0.1:8010")
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for --ready-path")
    ap.add_argument(
        "--ready-path", default="/v1/models", help="answers 200 once it serves (/health for a server with a key)"
    )
    ap.add_argument("--log", help="the server's output to this file (default: inherited)")
    args = ap.parse_args(ours)
    command = shlex.split(args.serve)
    if not command:
        ap.error("--serve is empty")
    log = open(args.log, "w") if args.log else None  # noqa: SIM115 - closed below
    try:
        proc = start_server(command, log)
    except OSError as e:
        ap.error(f"--serve: cannot start {command[0]!r}: {e}")
    try:
        ready_s = wait_ready(args.url, args.ready_timeout, proc, args.ready_path)  # (vLLM has no /ready)
        print(f"# {args.serve}: ready after {ready_s:.0f} s", file=sys.stderr, flush=True)
        label = [] if "--label" in rest else ["--label", peer_label(args.url, command)]
        return loadtest(["--url", args.url, *label, *rest])
    finally:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(60)
        except ProcessLookupError:  # (it exited by itself, its group with it: wait_ready says why)
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if log is not None:
            log.close()


if __name__ == "__main__":
    sys.exit(main())
