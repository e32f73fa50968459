"""The benchmark's wait for a budget row's plan to settle: the budget measures, checks and weighs in its first steps
(each one slower, and the measuring step holds less), so a budget row takes warm-up steps until its plan has settled
and only then its measured and timed steps, whose plan must stay as it is; a row whose budget was still choosing
would report a step it does not train with."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import lightning.pytorch as pl

from lightning_ac.bench.memory import StepMetrics

__all__ = ["MOST_EXTRA_STEPS", "NotSettled", "SettledCheck"]

# The warm-up steps a budget row may take beyond its own (BUDGET_SETTLE_STEPS, AUTO_SETTLE_STEPS: what it usually
# takes) while its budget corrects a plan measured over it
MOST_EXTRA_STEPS = 8


class NotSettled(RuntimeError):
    """A budget row's plan had not settled by the end of its warm-up steps, or changed in its timed steps."""


class SettledCheck(pl.Callback):
    """Hold a budget row's measured and timed steps back, a step at a time and at most :data:`MOST_EXTRA_STEPS`, until
    its budget has settled, then watch the plan (its layers' choices and the tools it turned on) stay as it is, and
    stop the run after its timed steps. Must come before ``metrics`` in the trainer's callbacks, whose steps it moves.

    Args:
        checkpointing: The row's :class:`~lightning_ac.ActivationCheckpointing` (its ``budget_plan``).
        metrics: The row's :class:`~lightning_ac.bench.memory.StepMetrics`; its first step after the warm-up is the
            first one it measures or times.
        steps: The timed steps after it.
    """

    def __init__(self, checkpointing: Any, metrics: StepMetrics, steps: int) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.metrics = metrics
        self.steps = steps
        self.extra_steps = 0  # the warm-up steps taken beyond the row's own
        self._plan: Optional[Tuple[List[str], List[str]]] = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        first = self.metrics.warmup_steps - 1  # the first step measured or timed (0-based)
        if trainer.global_step < first:
            return
        summary = self.checkpointing.budget_plan or {}
        if not summary.get("settled") and trainer.global_step == first:
            if self.extra_steps == MOST_EXTRA_STEPS:
                raise NotSettled(
                    f"the budget had not settled after {first} warm-up step{'s' if first != 1 else ''} "
                    f"({MOST_EXTRA_STEPS} more than the row's own), so its measured and timed steps would include "
                    "its measuring ones"
                )
            self.extra_steps += 1
            self.metrics.warmup_steps += 1
            if self.metrics.measure_step >= 0:
                self.metrics.measure_step += 1
            return
        plan = (list(summary.get("choices", [])), list(summary.get("turned_on", [])))
        if self._plan is None:
            self._plan = plan
        elif plan != self._plan or not summary.get("settled"):
            raise NotSettled(
                f"the budget's settled plan changed in the timed steps (from layers {_letters(self._plan[0])}, tools "
                f"{self._plan[1]} to layers {_letters(plan[0])}, tools {plan[1]}), so they timed more than one plan"
            )

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.metrics.warmup_steps + self.steps:
            trainer.should_stop = True  # the timed steps are done, however many warm-up steps it took


def _letters(choices: List[str]) -> str:
    return "".join(choice[0] for choice in choices)
