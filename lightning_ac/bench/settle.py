"""The benchmark's check that a budget row measured and timed its settled plan: the budget measures, checks and
weighs in its first steps (each one slower, and the measuring step holds less), so a row whose budget was still
choosing when its measured and timed steps began would report a step it does not train with."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import lightning.pytorch as pl

__all__ = ["NotSettled", "SettledCheck"]


class NotSettled(RuntimeError):
    """A budget row's measured or timed steps began before its plan settled, or its plan changed during them."""


class SettledCheck(pl.Callback):
    """Watch a budget row's plan from its first measured or timed step on: it must be settled then and stay as it is
    (its layers' choices and the tools it turned on); :class:`NotSettled` ends the row otherwise.

    Args:
        checkpointing: The row's :class:`~lightning_ac.ActivationCheckpointing` (its ``budget_plan``).
        first_step: The first step (0-based) whose memory or time the row reports.
    """

    def __init__(self, checkpointing: Any, first_step: int) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.first_step = first_step
        self._plan: Optional[Tuple[List[str], List[str]]] = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step < self.first_step:
            return
        summary = self.checkpointing.budget_plan or {}
        if not summary.get("settled"):
            raise NotSettled(
                f"the budget had not settled in the row's first {self.first_step} step"
                f"{'s' if self.first_step != 1 else ''} (before those it measures and times), so they would "
                "include its measuring steps; raise BUDGET_SETTLE_STEPS or AUTO_SETTLE_STEPS in "
                "lightning_ac/bench/modes.py"
            )
        plan = (list(summary["choices"]), list(summary["turned_on"]))
        if self._plan is None:
            self._plan = plan
        elif plan != self._plan:
            raise NotSettled(
                f"the budget's settled plan changed in the timed steps (from layers {_letters(self._plan[0])}, tools "
                f"{self._plan[1]} to layers {_letters(plan[0])}, tools {plan[1]}), so they timed more than one plan"
            )


def _letters(choices: List[str]) -> str:
    return "".join(choice[0] for choice in choices)
