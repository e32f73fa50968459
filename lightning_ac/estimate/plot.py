"""The estimate's plot: each mode's activation peak, and its device total with the margin, against the sequence
length, beside the lines of the devices asked about."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Dict, List, Tuple

from lightning_ac.estimate.fit import margin_bytes
from lightning_ac.estimate.results import Estimate

__all__ = ["plot", "series"]

GIB = 2**30


def series(result: Estimate) -> Dict[str, List[Tuple[int, int, int]]]:
    """Per mode, in the order estimated: ``(seq, activation peak, device total with the margin)`` for every length
    a fake step ran at (those asked for, and the longest-length search's), by length."""
    found: Dict[str, Dict[int, Tuple[int, int, int]]] = {}
    for step in [*result.steps, *result.search_steps]:
        needed = step.device_total_bytes + margin_bytes(step.device_total_bytes)
        found.setdefault(step.mode, {})[step.seq] = (step.seq, step.activation_peak_bytes, needed)
    return {mode: [points[seq] for seq in sorted(points)] for mode, points in found.items()}


def plot(result: Estimate, path: Path) -> Path:
    """Write the plot to ``path`` (PNG): left, each mode's activation peak against the sequence length; right, what
    each mode needs on the device (its device total and the assumed margin) against the devices' sizes.

    Raises:
        ImportError: Without matplotlib (``pip install 'lightning_ac[examples]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (activations, device) = plt.subplots(1, 2, figsize=(14, 5.5), sharex=True)
    for index, (mode, points) in enumerate(series(result).items()):
        seqs = [p[0] for p in points]
        # matplotlib's colours repeat after ten: the line style tells the modes beyond apart
        style = {
            "marker": "o",
            "markersize": 3,
            "linewidth": 1.2,
            "label": mode,
            "linestyle": ("-", "--", ":")[index // 10 % 3],
        }
        activations.plot(seqs, [p[1] / GIB for p in points], **style)
        device.plot(seqs, [p[2] / GIB for p in points], **style)
    for size in result.device_memory_bytes:
        device.axhline(size / GIB, color="black", linestyle="--", linewidth=1)
        device.annotate(f"{size / GIB:g} GiB device", (0.01, size / GIB), xycoords=("axes fraction", "data"),
                        va="bottom", fontsize=8)  # fmt: skip
    activations.set_ylabel("activation peak (GiB)")
    device.set_ylabel("device total + margin (GiB)")
    for axis in (activations, device):
        axis.set_xscale("log", base=2)
        axis.set_xlabel(f"tokens per sequence (batch {result.steps[0].batch if result.steps else 1})")
        axis.grid(True, which="both", alpha=0.3)
    device.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    title = f"{result.model}: {result.description}; {result.training}, {result.dtype}"
    fig.suptitle(textwrap.fill(title, 170), fontsize=9)  # one line would run past the figure's edge
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
