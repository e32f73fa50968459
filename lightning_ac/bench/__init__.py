"""Benchmark tooling, kept out of the core: the mode benchmark, the budget planner and step measurement.

    python -m lightning_ac.bench --out bench_out            # cpu-small on CPU
    python -m lightning_ac.bench --preset gpu-8k --out bench_out

Modules:
    :mod:`lightning_ac.bench.harness`: the benchmark itself (presets, modes, anchors, the CLI's ``main``).
    :mod:`lightning_ac.bench.planner`: the fastest mode under an activation-memory budget, from measured rows.
    :mod:`lightning_ac.bench.memory`: peak memory and step time of training steps (:class:`StepMetrics`), shared
        with the example training job.

The core package never imports from here; this package imports the core.
"""

# Re-exported objects are the harness's own (not copies): tests register presets with
# ``monkeypatch.setitem(bench.PRESETS, ...)`` and the harness must see them.
from lightning_ac.bench.harness import (
    BUDGET_MODES,
    LAYER_OFFLOAD_MODES,
    MODES,
    PRESETS,
    Row,
    fastest_fixed_mode,
    label_offsets,
    main,
    plot,
    results_markdown,
    run_benchmark,
)

# Private, but reachable as ``bench._availability`` as before the move (tests call it); the alias marks the
# re-export as intended.
from lightning_ac.bench.harness import _availability as _availability  # noqa: E402

__all__ = [
    "BUDGET_MODES",
    "LAYER_OFFLOAD_MODES",
    "MODES",
    "PRESETS",
    "Row",
    "fastest_fixed_mode",
    "label_offsets",
    "main",
    "plot",
    "results_markdown",
    "run_benchmark",
]
