"""The memory budget's self-check: its measuring step on the toy, as the plan runs it.

The budget relies on torch behaviour that is not public: its meter's saved-tensor hooks hand each save on to the
hooks in force (``torch._C._autograd._top_saved_tensors_default_hooks``, the checkpoint's own), and on the CPU
MemTracker measures the step's activation peak, restarted at backward's start through its private records. On a
release that changed them the measuring step would keep every layer's activations (nothing recomputed), or measure
no peak, silently: the budget would choose from figures that are not the run's.
"""

from __future__ import annotations

import copy
from typing import FrozenSet

import torch

from lightning_ac.selfcheck.toy import LAYERS, checkpointed, decoder_layers, same_as, toy, train_step
from lightning_ac.selfcheck.verdict import SelfCheckFailed

__all__ = ["check_budget"]

# far above the toy's activations: the measuring step is the same whatever the budget, and nothing is chosen to keep
_TOY_BUDGET_BYTES = 2**30


def check_budget(others: FrozenSet[str]) -> None:
    """The budget's measuring step recomputes every layer, with exact gradients, while its meter counts what each
    layer saves, through the checkpoint function the budget gives each layer (a forward and a recompute call); and
    MemTracker measures an activation peak that a restart at backward's start reads again from there."""
    from torch.utils.checkpoint import checkpoint

    from lightning_ac.budget import BudgetController, BudgetSettings

    model, ids = toy()
    reference = train_step(copy.deepcopy(model), ids)
    measured = copy.deepcopy(model)
    budget = BudgetController(
        BudgetSettings(_TOY_BUDGET_BYTES), decoder_layers(measured).modules, checkpoint, torch.device("cpu")
    )
    checkpointed(measured, layer_checkpoint_fns=budget.switches)
    budget.begin_step(measured, [])
    try:
        step = train_step(measured, ids, lambda: budget.meter.outside(measured), budget.before_backward)
    except BaseException:
        budget.abort_step()
        raise
    readings = list(budget.meter.readings)
    budget.end_step()
    what = "the memory budget's measuring step"
    same_as(reference, step, what)
    if step.attention != 2 * reference.attention:
        raise SelfCheckFailed(
            f"{what} ran attention {step.attention} times, where recomputing {LAYERS} layers runs it "
            f"{2 * reference.attention} times: its meter's saved-tensor hooks no longer hand the layers' saves on to "
            "the checkpoint's (torch._C._autograd._top_saved_tensors_default_hooks), so nothing was recomputed"
        )
    for index, reading in enumerate(readings):
        if reading.calls != 2 or reading.saved_bytes <= 0:
            raise SelfCheckFailed(
                f"in {what}, decoder layer {index} called the checkpoint function the budget gives it "
                f"{reading.calls} times (once in the forward, once in the recompute) and was measured saving "
                f"{reading.saved_bytes} bytes: the layers no longer run through the budget's checkpoint functions, "
                "so it measures nothing and its choices are ignored"
            )
    if not budget.measured_peak:
        raise SelfCheckFailed(f"MemTracker measured no activation peak in {what} ({budget.measured_peak!r})")
    _restarted_peak_reads_from_there()


def _restarted_peak_reads_from_there() -> None:
    """A measurement's restart (at backward's start, in the measuring step) forgets the peak before it: MemTracker's
    private records are where it is kept."""
    from lightning_ac.memory import measure_step

    size = 2**16  # floats: 256 KiB, far above anything else allocated meanwhile
    with measure_step([torch.nn.Linear(1, 1)], [], torch.device("cpu")) as measurement:
        torch.empty(size)  # allocated and dropped at once: a peak of its size
        before = measurement.peak_so_far()
        measurement.restart_peak()
        after = measurement.peak_so_far()
    if before < 4 * size or after >= before:
        raise SelfCheckFailed(
            f"MemTracker measured a peak of {before} bytes around a {4 * size}-byte tensor, and {after} bytes after "
            "the measurement restarted (its private _peak_mem and _peak_mem_snap): the budget would take the whole "
            "step's peak for its output head's"
        )
