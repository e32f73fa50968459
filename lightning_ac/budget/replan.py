"""The memory budget's re-plans within a run: a batch with more tokens than any measured, and a batch whose shape of
work is new (an attention mask for padding or packed documents, another precision), seen at a step's first layer
call, before any layer runs."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from lightning_ac._logging import rank_zero_info
from lightning_ac.budget.choice import Choice, LayerFigures
from lightning_ac.budget.figures import scaled_figures
from lightning_ac.budget.measure import held_bytes, shape_of_work
from lightning_ac.budget.phase import CHECK, SETTLED
from lightning_ac.memory import measure_step

__all__ = ["Replans"]


class Replans:
    """The re-planning part of :class:`~lightning_ac.budget.controller.BudgetController` (a mixin over its
    state: the figures, their calibrations, the measured choices and the step's measurement)."""

    figures: Optional[List[LayerFigures]]
    _calibrations: Dict[tuple, int]

    def _before_layer(self, index: int, function: Callable[..., Any], args: tuple) -> None:
        """Before each layer call; the first of a step checks its tokens and its shape of work against the figures'."""
        if not self._first_call:
            return
        self._first_call = False
        self._shape = shape_of_work(function, args)
        new_shape = self.figures is not None and self.phase == SETTLED and self._shape not in self._calibrations
        # every rank takes the same way: the largest token count, and a new shape of work if any rank sees one
        tokens, new = self._agree([self.meter.note_tokens(args), float(new_shape)])
        if self.figures is None:
            return
        if tokens > self.tokens:
            self._more_tokens(int(tokens), args)
        elif new:
            self._new_shape(function, args)

    def _new_shape(self, function: Callable[..., Any], args: tuple) -> None:
        """This step's layers get other inputs than any measured step's: before its first layer runs, every layer is
        set to recompute (the least memory the block allows, as in the measuring step: the settled plan's figures
        never saw these inputs, and ran over the budget by about 10% with a padded batch); the step is measured, and
        the plan is chosen again for what it shows, like the first choice after the measuring step."""
        rank_zero_info(
            "budget: this step's batch has another shape of work than the steps measured (e.g. an attention mask for "
            "padding or packed sequences): recomputing every layer in it to measure it, then choosing again"
        )
        self._measured.clear()  # the peaks measured with other inputs do not say that a choice fits these
        self.corrections = 0
        self.phase = CHECK
        self._set([Choice.recompute] * len(self.switches))
        self._measuring_shape = True
        if self._measurement is None:  # a settled plan on the CPU: nothing is measured until now
            self._measurement = measure_step(
                self._measured_modules, self._measured_optimizers, self.device, False, inside_forward=True
            )
            self._measurement.__enter__()
            # what exists before the first layer and stays through the step: its input, the mask, the rotary tables
            self._measurement.add_held(held_bytes(function, args, self.device))

    def _more_tokens(self, tokens: int, args: tuple) -> None:
        ratio = tokens / self.tokens
        rank_zero_info(
            f"budget: this step has {tokens} tokens, more than the {self.tokens} measured: choosing again with the "
            "figures scaled per token, and measuring the layers in this step"
        )
        self._rescaled_from = self.figures
        self.figures = [scaled_figures(f, ratio) for f in self.figures]
        self._calibrations = {shape: int(value * ratio) for shape, value in self._calibrations.items()}
        self.calibration = int(self.calibration * ratio)
        # the choices measured at fewer tokens say nothing about these: the loop starts again
        self._measured.clear()
        self._over.clear()
        self.corrections = 0
        self.outside_bytes, self.head_bytes = int(self.outside_bytes * ratio), int(self.head_bytes * ratio)
        self.tokens = tokens
        self._choose()
        if not self.meter.active:
            self.meter.dry = self.policy is not None
            self.meter.start()
            self.meter.note_tokens(args)
