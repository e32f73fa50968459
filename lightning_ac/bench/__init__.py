"""Benchmark tooling, kept out of the core: the mode benchmark, the budget planner and step measurement.

    python -m lightning_ac.bench --out bench_out            # cpu-small on CPU
    python -m lightning_ac.bench --preset gpu-8k --out bench_out

Modules, one job each:
    :mod:`lightning_ac.bench.presets`: the presets (a model's shape, batch, repetitions) and the model each builds.
    :mod:`lightning_ac.bench.modes`: the modes and anchors, and which of them run here.
    :mod:`lightning_ac.bench.run`: running them side by side (:func:`run_benchmark`, one :class:`Row` per mode).
    :mod:`lightning_ac.bench.tables`: the markdown tables of the rows.
    :mod:`lightning_ac.bench.plot`: activation memory against step time, labels placed apart.
    :mod:`lightning_ac.bench.cli`: ``python -m lightning_ac.bench`` (:func:`main`).
    :mod:`lightning_ac.bench.planner`: the fastest mode under an activation-memory budget, from measured rows.
    :mod:`lightning_ac.bench.memory`: peak memory and step time of training steps (:class:`StepMetrics`), shared
        with the example training job.

The core package never imports from here; this package imports the core.
"""

# Re-exported objects are the modules' own (not copies): tests register presets with
# ``monkeypatch.setitem(bench.PRESETS, ...)`` and the runner must see them.
from lightning_ac.bench.cli import main
from lightning_ac.bench.modes import (
    ACCELERATOR_SUITE_MODES,
    ALL_BUDGET_MODES,
    BUDGET_MODES,
    LAYER_OFFLOAD_MODES,
    MODES,
    availability,
)
from lightning_ac.bench.plot import label_offsets, plot
from lightning_ac.bench.presets import PRESETS
from lightning_ac.bench.run import Row, run_benchmark
from lightning_ac.bench.tables import fastest_fixed_mode, results_markdown

__all__ = [
    "ACCELERATOR_SUITE_MODES",
    "ALL_BUDGET_MODES",
    "BUDGET_MODES",
    "LAYER_OFFLOAD_MODES",
    "MODES",
    "PRESETS",
    "Row",
    "availability",
    "fastest_fixed_mode",
    "label_offsets",
    "main",
    "plot",
    "results_markdown",
    "run_benchmark",
]
