"""The memory budget: the suite decides, layer by layer, what to keep and what to recompute so that a training step
fits a given activation memory at the least recompute time.

- :mod:`~lightning_ac.budget.choice`: the exact per-layer choice, a pure function of measured figures;
- :mod:`~lightning_ac.budget.measure`: each layer's figures, measured in a step;
- :mod:`~lightning_ac.budget.switch`: each layer's checkpoint function, doing what its current choice says;
- :mod:`~lightning_ac.budget.settings`: what the budget is asked for, typed;
- :mod:`~lightning_ac.budget.controller`: the closed loop (measure, choose, check, correct, settle).
"""

from lightning_ac.budget.choice import Choice, LayerFigures, LayerPlan, choose, estimate
from lightning_ac.budget.controller import BudgetController
from lightning_ac.budget.settings import BudgetSettings

__all__ = ["BudgetController", "BudgetSettings", "Choice", "LayerFigures", "LayerPlan", "choose", "estimate"]
