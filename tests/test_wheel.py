"""What a wheel of chunkserve carries: `pip install chunkserve` (or a Docker image's `pip install
/app`, configs/kuberay/rayservice.yaml) gets the package alone, not this checkout, so whatever the
runtime reads (the model presets) must be package data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_wheel_serves_a_preset_without_the_checkout(tmp_path):
    # built from a copy: setuptools writes build/ and *.egg-info/ into the tree it builds
    src = tmp_path / "src"
    shutil.copytree(ROOT / "chunkserve", src / "chunkserve", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path, src],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("chunkserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    presets = sorted(n for n in names if n.startswith("chunkserve/replicas/model/presets/"))
    assert presets == [f"chunkserve/replicas/model/presets/{m}.json" for m in ("llama3-8b", "smollm2-135m", "tiny")]
    assert not [n for n in names if not n.startswith(("chunkserve/", "chunkserve-"))]  # one top-level name
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # the wheel's copy first on the path (the checkout's editable install after it), run from elsewhere
    code = (
        "import chunkserve, sys; from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams\n"
        f"assert chunkserve.__file__.startswith({str(site)!r}), chunkserve.__file__\n"
        "engine = LLMEngine.from_model('tiny', kv_cache_tokens=1024)\n"
        "print(len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    assert r.returncode == 0 and r.stdout.split() == ["4"], r.stderr
