"""README's load-test command, as printed, against `serve run configs/local.yaml` (real Serve, real HTTP)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _readme_command(after: str) -> str:
    """The first bash block after the line containing `after`, continuation lines joined."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(after):], re.S).group(1)
    return block.replace("\\\n", " ").strip()


def test_the_readme_load_test_runs_as_printed_against_serve_run(tmp_path):
    command = _readme_command("Against `serve run")
    assert command.startswith("python -m cluster.loadtest ")
    serve = subprocess.Popen([sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run",
                              str(ROOT / "configs/local.yaml")], cwd=ROOT, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert serve.poll() is None, "serve run exited"
            try:
                if httpx.get("http://127.0.0.1:8000/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve run was not ready in time"
            time.sleep(1)
        run = subprocess.run(command.replace("python ", f"{sys.executable} ", 1), shell=True, cwd=tmp_path,
                             capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
    assert run.returncode == 0, run.stderr[-3000:]
    (report,) = [json.loads(line) for line in (tmp_path / "gsp.jsonl").read_text().splitlines()]
    assert report["completed"] == report["num_prompts"] == 64 and report["failed"] == 0
    assert report["model_id"] == "tiny" and report["prompt_format"] == "text"
    assert report["cached_fraction"] > 0.5  # 4 groups of 16 prompts sharing 512 tokens
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {"latency_cdf.png", "replica_share.png"}
