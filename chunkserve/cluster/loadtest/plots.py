"""PNG plots of load-test reports (matplotlib, imported only here): latency CDFs, a sweep's
throughput and TTFT against the offered rate, each replica's share of the requests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from chunkserve.cluster.loadtest import metrics
from chunkserve.cluster.loadtest.client import Record


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(run: dict) -> str:
    rate = run.get("request_rate")
    return f"{run.get('label') or ''} {'inf' if rate in (None, 'inf') else f'{rate:g}'} req/s".strip()


def _finish(axes, xlabel: str | None, legend_size: int) -> None:
    for ax in axes:
        if xlabel is not None:
            ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)


def _save(plt, fig, path: Path, written: list[Path]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)


def write_plots(runs: list[dict], out: str | Path) -> list[Path]:
    """Plots of runs (reports with detail) into directory out; returns the files written."""
    plt = _plt()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        recs = [rec for rec in map(Record.from_dict, run.get("records", [])) if rec.ok]
        ttft = np.sort([r.ttft * 1e3 for r in recs])
        tpot = np.sort([metrics.tpot(r) * 1e3 for r in recs if (r.output_tokens or 0) > 1])
        for ax, xs in zip(axes, (ttft, tpot)):
            if xs.size:
                ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=_label(run))
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
    _finish(axes, None, 7)
    _save(plt, fig, out / "latency_cdf.png", written)

    rated = [r for r in runs if isinstance(r.get("request_rate"), (int, float))]
    series: dict[str, list[dict]] = {}  # a line per label (a sweep each)
    for r in sorted(rated, key=lambda r: r["request_rate"]):
        series.setdefault(r.get("label") or "", []).append(r)
    if any(len(s) > 1 for s in series.values()):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        top = max(r["request_rate"] for r in rated)
        axes[0].plot([0, top], [0, top], ":", color="gray", label="offered")
        for label, s in series.items():
            rates = [r["request_rate"] for r in s]
            axes[0].plot(rates, [r["request_throughput"] for r in s], "o-", label=f"{label} completed".strip())
            (line,) = axes[1].plot(rates, [r["median_ttft_ms"] for r in s], "o-", label=f"{label} TTFT p50".strip())
            p99 = next((k for k in s[0] if k.startswith("p99_ttft")), None)
            if p99:
                axes[1].plot(
                    rates, [r[p99] for r in s], "s--", color=line.get_color(), label=f"{label} TTFT p99".strip()
                )
        axes[0].set_ylabel("requests / s")
        axes[1].set_ylabel("ms")
        axes[1].set_yscale("log")
        _finish(axes, "offered request rate (req/s)", 8)
        _save(plt, fig, out / "sweep.png", written)

    replicas = sorted({rep for run in runs for rep in run.get("replicas", {})})
    if replicas:
        fig, ax = plt.subplots(figsize=(max(5, len(replicas) * 0.8 + 3), 4))
        width = 0.8 / len(runs)
        for k, run in enumerate(runs):
            total = sum(v["requests"] for v in run["replicas"].values()) or 1
            share = [run["replicas"].get(rep, {"requests": 0})["requests"] / total for rep in replicas]
            ax.bar(np.arange(len(replicas)) + k * width, share, width, label=_label(run))
        ax.set_xticks(np.arange(len(replicas)) + width * (len(runs) - 1) / 2)
        ax.set_xticklabels([rep[-8:] for rep in replicas], rotation=30, fontsize=7)
        ax.set_ylabel("share of requests")
        ax.legend(fontsize=7)
        _save(plt, fig, out / "replica_share.png", written)
    return written
