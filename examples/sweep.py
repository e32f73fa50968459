"""The multirun summary: one row per job, from each job's summary.json, as CSV and a plot."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

COLUMNS = (
    "job", "mode", "model", "overrides", "steps", "final_loss", "peak_activation_bytes", "peak_memory_bytes",
    "step_time_s", "error",
)  # fmt: skip


def collect(sweep_dir: Path) -> List[Dict[str, Any]]:
    rows = []
    for path in sorted(sweep_dir.glob("*/summary.json"), key=lambda p: (len(p.parent.name), p.parent.name)):
        summary = json.loads(path.read_text())
        rows.append({"job": path.parent.name, **{k: summary.get(k) for k in COLUMNS[1:]}})
    return rows


def write_sweep_summary(sweep_dir: Path) -> List[Dict[str, Any]]:
    """Rewrite ``sweep_summary.csv`` and ``sweep_summary.png`` from the jobs finished so far."""
    rows = collect(sweep_dir)
    with open(sweep_dir / "sweep_summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows, sweep_dir / "sweep_summary.png")
    return rows


def _plot(rows: List[Dict[str, Any]], path: Path) -> List[str]:
    """Bars of activation peak and step time per job, each with its value; returns the value labels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['job']}: {r['mode']}" + (" (failed)" if r["error"] else "") for r in rows]
    memory = [_number(r["peak_activation_bytes"], 2**20) for r in rows]
    times = [_number(r["step_time_s"], 1e-3) for r in rows]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(10, 0.6 * len(rows) + 2))
    drawn: List[str] = []
    for ax, values, unit, color in ((ax_mem, memory, "MiB", "tab:blue"), (ax_time, times, "ms", "tab:orange")):
        bars = ax.barh(labels, [v or 0 for v in values], color=color)
        texts = [f"{v:.1f} {unit}" if v is not None else "not measured" for v in values]
        ax.bar_label(bars, labels=texts, padding=3, fontsize=8)
        drawn += texts
        ax.set_xlim(0, max([v or 0 for v in values] + [1e-9]) * 1.35)  # room for the labels
        ax.invert_yaxis()
    ax_mem.set_xlabel("activation peak (MiB)")
    ax_time.set_xlabel("median step time (ms)")
    ax_time.set_yticklabels([])
    fig.suptitle("lightning_ac sweep: memory and step time per mode")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def _number(value: Any, unit: float) -> Any:
    """A CSV/JSON figure in ``unit``, ``None`` when the job measured none."""
    if value in (None, ""):
        return None
    return float(value) / unit


class FailedJobs(Callback):
    """Hydra callback: a sweep starts from a clean summary, and ends by listing the jobs that stopped on a bad value
    (exit status 2)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # A sweep into a directory that holds an earlier sweep's results must not report them as its own.
        sweep_dir = Path(config.hydra.sweep.dir)
        for stale in [*sweep_dir.glob("*/summary.json"), *sweep_dir.glob("sweep_summary.*")]:
            stale.unlink()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        failed = [r for r in collect(Path(config.hydra.sweep.dir)) if r["error"]]
        if failed:
            lines = "\n".join(f"  job {r['job']} ({r['overrides'] or r['mode']}): {r['error']}" for r in failed)
            print(f"error: {len(failed)} sweep job(s) stopped on a bad value:\n{lines}", file=sys.stderr)
            sys.exit(2)
