"""The memory budget (issue 21, in progress): the suite decides, layer by layer, what to keep, run selectively or
recompute so that a step fits a given activation memory at the least recompute time.

Here so far: the exact per-layer choice (:mod:`lightning_ac.budget.choice`), a pure function of measured figures.
Still to come: measuring the figures in the first step, the ``budget`` field of the block, the closed-loop check.
"""

from lightning_ac.budget.choice import Choice, LayerFigures, LayerPlan, choose, estimate

__all__ = ["Choice", "LayerFigures", "LayerPlan", "choose", "estimate"]
