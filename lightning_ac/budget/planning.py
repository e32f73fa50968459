"""The memory budget's choosing: the per-layer plan for the figures held now and a calibration, past the choices
measured over the budget, by :func:`~lightning_ac.budget.choice.choose` (a mixin of
:class:`~lightning_ac.budget.controller.BudgetController`, whose loop decides when to choose)."""

from __future__ import annotations

from typing import List, Optional, Sequence

from lightning_ac.budget.choice import Choice, LayerFigures, LayerPlan, choose, estimate
from lightning_ac.budget.phase import CHECK
from lightning_ac.budget.settings import BudgetSettings

__all__ = ["Planning", "SLACK"]

# A correction aims this fraction of the budget below it, so that step-to-step noise does not cross it again.
SLACK = 0.01


class Planning:
    """The choosing part of :class:`~lightning_ac.budget.controller.BudgetController` (a mixin over its state: the
    figures, the calibration, the choices measured over the budget)."""

    figures: Optional[List[LayerFigures]]
    settings: BudgetSettings
    budget_bytes: Optional[int]
    calibration: int
    _over: set

    def _choose_new(self) -> LayerPlan:
        """The choice for the current calibration, raised a slack at a time past the choices measured over."""
        assert self.budget_bytes is not None and self.figures is not None
        calibration = self.calibration
        for _ in range(len(self.switches) * 4 + 1):
            plan = self._plan(calibration)
            if tuple(plan.choices) not in self._over or not plan.fits:
                return plan
            calibration += max(1, int(SLACK * self.budget_bytes))
        return self._plan(10 * self.budget_bytes)  # nothing fits: every layer recomputed

    def _choose(self, at_step_end: bool = False) -> None:
        """Choose from the figures and the calibration; the next measured step checks the choice. ``at_step_end``:
        where nothing fits, a tool the budget decides may be turned on (its next step measures; not before a step's
        layers run, where the tool's own hooks have already run)."""
        assert self.budget_bytes is not None and self.figures is not None
        plan = self._plan(self.calibration)
        if (
            at_step_end
            and not plan.fits
            and self._turn_on_a_tool(
                f"by the figures measured at {self.tokens} tokens, every {self.noun[:-1]} recomputed is over"
            )
        ):
            return
        self._set(list(plan.choices))
        self.phase = CHECK

    def _estimate(self, choices: Sequence[Choice], calibration: int) -> tuple:
        """The estimated peak and recompute time of ``choices``: the layers' figures, what is saved outside them and
        in the head, and ``calibration``."""
        assert self.figures is not None
        return estimate(self.figures, choices, self.outside_bytes + calibration, self.head_bytes)

    def _plan(self, calibration: int) -> LayerPlan:
        assert self.figures is not None and self.budget_bytes is not None
        return choose(
            self.figures,
            self.budget_bytes,
            self.outside_bytes + calibration,
            self.head_bytes,
            host_bytes=self.settings.host_bytes,
        )
