"""The memory budget's closed loop, step by step, on figures given by hand: what it calibrates per shape of work,
what it holds against a choice measured over the budget (and what not: a first step), the slack of a correction,
and the fallback once the corrections are spent.

The controller is a real one over four (or five) modules; each step's measured peak is given, as the device's
allocator would read it (on CUDA every step is measured), and the step's first layer call is a real call's
arguments: the padded batches' carries an attention mask. The figures are alike layers that save their own input
(saved 100 bytes, input 10, all of it saved): by hand, with ``c`` the calibration, every layer recomputed peaks at
``30 + 100 + c`` (the last layer's backward), as does keeping only the last layer; two kept layers (the last among
them) peak at ``120 + 100 + c``, three at ``210 + 100 + c``. Their recompute times differ (4, 3, 2, 1 s), so which
layers are kept is unique: the slowest to recompute, where they fit.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Sequence

import pytest
import torch
from test_budget import letters, oracle_peak, oracle_seconds

from lightning_ac import LightningACWarning
from lightning_ac.budget import BudgetSettings, LayerFigures
from lightning_ac.budget.controller import MAX_CORRECTIONS, SLACK, BudgetController

TIMES = (4.0, 3.0, 2.0, 1.0)
ALIKE = [LayerFigures(saved_bytes=100, input_bytes=10, recompute_seconds=t, input_saved_bytes=10) for t in TIMES]
HIDDEN = torch.zeros(2, 8, 4)  # 16 tokens, as many as the figures were measured at


def _layer(hidden, attention_mask=None):
    return hidden


def call(padded: bool = False):
    """A layer call as the engines make it: the keyword inputs bound; padded batches bind an attention mask."""
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool) if padded else None
    return functools.partial(_layer, attention_mask=mask)


class Measured:
    """A step's measurement, read at its end (``measure_step``'s result)."""

    def __init__(self, peak: int) -> None:
        self.result = SimpleNamespace(activation_bytes=peak)

    def __exit__(self, *args) -> None:
        pass


def controller(figures: Sequence[LayerFigures], budget: int, first_peak: int) -> BudgetController:
    """A controller after its measuring step (every layer recomputed, unpadded) read ``first_peak``: its figures are
    ``figures`` (none outside the layers, no head) and its first choice is made, as ``end_step`` makes it."""
    modules = [torch.nn.Linear(1, 1) for _ in figures]
    budget_controller = BudgetController(BudgetSettings(budget), modules, lambda f, *a, **k: f(*a), torch.device("cpu"))
    budget_controller._first_call = True
    budget_controller._before_layer(0, call(), (HIDDEN,))  # the measuring step's first layer call: its shape
    budget_controller.figures, budget_controller.tokens = list(figures), 16
    budget_controller.phase = "check"
    budget_controller._check(first_peak, first=True, measuring=True)
    return budget_controller


def step(budget_controller: BudgetController, peak: int, padded: bool = False) -> str:
    """One training step under the controller's choices, measured at ``peak``; the choices it runs with."""
    budget_controller.in_step, budget_controller._first_call = True, True
    budget_controller._measurement = Measured(peak)
    budget_controller._before_layer(0, call(padded), (HIDDEN,))  # before its first layer runs
    ran = letters(budget_controller.choices)
    budget_controller.end_step()
    return ran


def plan(budget_controller: BudgetController) -> str:
    return letters(budget_controller.choices)


def test_the_hand_figures():
    """The peaks the tests below are planned with, by the test's own model of the step."""
    peaks = {p: oracle_peak(ALIKE, p) for p in ("rrrr", "rrrk", "krrk", "rkrk", "kkrk", "kkkk")}
    assert peaks == {"rrrr": 130, "rrrk": 130, "krrk": 220, "rkrk": 220, "kkrk": 310, "kkkk": 400}
    assert oracle_peak(ALIKE, "krrr") == 220, "keeping a layer before a recomputed one costs its working set on top"


def test_the_calibration_is_kept_per_shape_of_work_and_the_plan_fits_the_largest():
    """Padded batches carry more than the figures see (their mask, another attention path): measured as a shape of
    work of their own, their calibration stays beside the unpadded batches', and the plan fits the larger, whichever
    batch was measured last. (With one calibration for every shape, an unpadded step measured after the padded ones
    took the plan back to keeping two layers, and the next padded batch ran over the budget.)"""
    budget = controller(ALIKE, 250, first_peak=150)  # calibration 20: two kept fit, 240
    assert plan(budget) == "krrk"
    assert step(budget, 240) == "krrk" and budget.settled
    # the first padded batch: a new shape of work, every layer recomputed to measure it (20 more than unpadded)
    assert step(budget, 170, padded=True) == "rrrr"
    assert budget.calibration == 40 and plan(budget) == "rrrk" and not budget.settled
    assert budget.corrections == 0, "measuring a new shape is not a correction"
    # an unpadded batch under the new plan: lighter (calibration 20), but the plan must still fit the padded ones
    assert step(budget, 150) == "rrrk"
    assert budget.settled and plan(budget) == "rrrk" and budget.calibration == 40
    assert budget.estimated_peak == 130 + 40
    # both shapes measured: neither is new any more, and the plan stays
    assert step(budget, 170, padded=True) == "rrrk"
    assert step(budget, 150) == "rrrk"
    assert budget.settled and plan(budget) == "rrrk" and budget.corrections == 0


def test_a_peak_exactly_at_the_budget_fits():
    budget = controller(ALIKE, 250, first_peak=150)
    assert step(budget, 250) == "krrk"
    assert budget.settled and plan(budget) == "krrk" and budget.corrections == 0


def test_a_correction_aims_a_slack_below_the_budget():
    """Over the budget, the calibration takes the measured difference and 1% of the budget more, so that the next
    choice does not cross it again by the step-to-step noise."""
    budget = controller(ALIKE, 250, first_peak=150)
    assert step(budget, 251) == "krrk"
    slack = int(SLACK * 250)
    assert slack == 2 and budget.calibration == 251 - 220 + slack
    assert plan(budget) == "rrrk" and budget.estimated_peak == 130 + 33 and budget.corrections == 1


def test_a_first_real_step_over_the_budget_is_not_held_against_its_choice():
    """A run's first real step allocates what only a first step does (gradients that did not exist yet, a library's
    workspace). After a plan made on fake tensors (``budget_first_plan: estimate``) that step ran over the budget: a
    correction, but the choice stays allowed, and when the next step shows the figures' calibration, it is chosen
    again and holds. (Held against it, the loop settled on recomputing a layer more for the whole run.)"""
    budget = controller(ALIKE, 250, first_peak=150)  # the fake step's measurement: calibration 20
    budget._estimated = True  # as end_step leaves it after the fake step
    assert plan(budget) == "krrk"
    assert step(budget, 270) == "krrk"  # the first real step: over, by what a first step allocates
    assert plan(budget) == "rrrk" and budget.corrections == 1
    assert step(budget, 150) == "rrrk"  # calibration 20 again: two kept fit
    assert plan(budget) == "krrk" and not budget.settled
    assert step(budget, 240) == "krrk"
    assert budget.settled and plan(budget) == "krrk"


def test_a_measuring_step_over_the_budget_with_every_layer_recomputed_does_not_settle_there(recwarn):
    """The measuring step recomputes every layer and is a first step: over the budget it says nothing of later
    steps, so the loop goes on (every layer recomputed, as nothing else fits its figure) and the next step decides."""
    budget = controller(ALIKE, 250, first_peak=260)
    assert plan(budget) == "rrrr" and not budget.settled
    assert not [w for w in recwarn if "over the budget" in str(w.message)]
    assert step(budget, 150) == "rrrr"  # calibration 20: two kept fit
    assert plan(budget) == "krrk" and not budget.settled
    assert step(budget, 240) == "krrk" and budget.settled
    # a later step with every layer recomputed over the budget settles there, and says so
    over = controller(ALIKE, 250, first_peak=260)
    with pytest.warns(LightningACWarning, match="over the budget; training goes on recomputing every layer"):
        step(over, 262)
    assert over.settled and plan(over) == "rrrr"


# Five unlike layers (sizes and times) and a run whose measured peaks swing around the figures' estimates by more
# than the slack: the loop spends its corrections and falls back. The sequence: the plan each step ran, and its peak.
UNLIKE = [
    LayerFigures(saved_bytes=saved, input_bytes=10, recompute_seconds=t, input_saved_bytes=10)
    for saved, t in ((100, 4.0), (60, 3.0), (80, 2.5), (40, 2.0), (100, 1.0))
]
SWINGS = [("rkrkk", 295), ("rrrkk", 160), ("krrkk", 290), ("rkrrk", 285), ("rrrrk", 120)]


def test_spent_corrections_fall_back_to_the_fastest_choice_measured_under_the_budget():
    """Measured under the budget of 250: every layer recomputed (the measuring step, 140), rrrkk (160), rrrrk (120).
    The fastest of them by the figures (4 + 3 + 2.5 = 9.5 s against 12.5 s and 11.5 s) is neither the first nor the
    last measured, and the settled plan reports its own measured peak, not the last step's."""
    budget = controller(UNLIKE, 250, first_peak=140)
    ran = [step(budget, peak) for _, peak in SWINGS]
    assert ran == [choices for choices, _ in SWINGS], "the run the figures and peaks make"
    under = {"rrrrr": 140, "rrrkk": 160, "rrrrk": 120}
    fastest = min(under, key=lambda p: oracle_seconds(UNLIKE, p))
    assert fastest == "rrrkk" and oracle_seconds(UNLIKE, fastest) == 9.5
    assert budget.corrections == MAX_CORRECTIONS + 1 and budget.settled
    assert plan(budget) == "rrrkk" and budget.measured_peak == 160
    # the settled plan stays while it fits
    assert step(budget, 160) == "rrrkk" and budget.settled


def test_a_new_shape_of_work_gets_corrections_of_its_own():
    """After the fallback spent every correction, padded batches are a new shape of work: the loop starts again for
    them (measured with every layer recomputed, then a choice checked like the first one), rather than settling at
    once on the only choice measured with their inputs (every layer recomputed)."""
    budget = controller(UNLIKE, 250, first_peak=140)
    for _, peak in SWINGS:
        step(budget, peak)
    assert budget.settled and budget.corrections == MAX_CORRECTIONS + 1
    assert step(budget, 180, padded=True) == "rrrrr"  # 40 more than the figures' 140
    assert budget.corrections == 0 and not budget.settled and budget.calibration == 40
    chosen = plan(budget)
    assert chosen.count("k") == 2 and oracle_peak(UNLIKE, chosen) + 40 <= 250, chosen
