"""One validated plan for all suite callbacks on a module: built once from their requests, applied once,
removed once.

The plan knows the requests (:mod:`lightning_ac.config`) and the engines, never the callbacks. Each engine
owns what it knows: the recompute engines take the checkpoint function to use, the activation-offload runtime
installs itself (its output-head pause included), the selective policy, the offload runtime and the weight
streamer describe what they do to each layer for the report.

- :mod:`~lightning_ac.plan.core`: :class:`Plan`, apply (or defer), the training step's wrapper, remove;
- :mod:`~lightning_ac.plan.strategy`: the rules about the Trainer's strategy and precision;
- :mod:`~lightning_ac.plan.recompute`: the recompute engines installed, with their record and applied-line part;
- :mod:`~lightning_ac.plan.weights`: layer offloading installed;
- :mod:`~lightning_ac.plan.layer_table`: the per-layer table;
- :mod:`~lightning_ac.plan.layers_found`: the error when no decoder layer is found.
"""

from lightning_ac.plan.core import Plan

__all__ = ["Plan"]
