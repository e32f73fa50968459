"""The memory budget's plan for a device, from a fake measuring step: the ``budget:`` to set, and what it keeps.

The budget's own first step recomputes every decoder layer and measures each layer's figures and the step's peak
(:mod:`lightning_ac.budget.controller`). Here that step runs on fake tensors, through the same controller and meter
(which tell storages apart by identity, so a fake step measures what a real one does), and
:func:`lightning_ac.budget.choice.choose` makes the plan from its figures for the activation memory a device leaves:
its size, less the assumed margin (:mod:`lightning_ac.estimate.fit`), less what is not activations (weights,
buffers, gradients, optimizer state, the batch). On the device the closed loop still checks the first real step and
corrects it.

What a fake step cannot give is time: the layers' recompute seconds are the fake ops' wall time on this CPU, which
ranks alike layers alike but says nothing of the device; they only decide between choices that both fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import lightning.pytorch as pl
import torch

from lightning_ac.estimate.fit import CONTEXT_BYTES, FRAGMENTATION, margin_bytes
from lightning_ac.estimate.models import Training
from lightning_ac.estimate.modes import Mode
from lightning_ac.estimate.optimizers import OptimizerArgument
from lightning_ac.estimate.precision import Precision
from lightning_ac.estimate.results import StepEstimate
from lightning_ac.estimate.step import fake_step

__all__ = ["BUDGET", "BUDGET_BLOCK", "BudgetFigures", "BudgetPlan", "budget_plans", "measure", "plan_for"]

BUDGET = "budget"
# the block the plan is made for: the save rules where they measure faster than a whole recompute, as the benchmark's
# budget rows (lightning_ac.bench.modes.BUDGET_BLOCK)
BUDGET_BLOCK = {"selective": {"save": ["attention"]}}
_UNLIMITED = 2**62  # the measuring step's budget: its plan is made afterwards, for each device


@dataclass
class BudgetPlan:
    """The budget's plan for one device at one shape.

    Attributes:
        mode: ``budget`` or ``budget+chunked_loss``.
        seq: Tokens per sequence.
        batch: Sequences per step.
        device_memory_bytes: The device's size.
        budget_bytes: The activation memory the device leaves (the ``budget:`` to set): its size less the margin and
            what is not activations; negative when the weights alone do not fit.
        choices: Per decoder layer: ``keep``, ``selective`` or ``recompute``.
        estimated_peak_bytes: The plan's activation peak by the figures.
        device_total_bytes: What is not activations, plus that peak.
        fits: Whether the plan's peak is under the budget (every layer is recomputed when nothing fits).
        recompute_share: The plan's recompute time as a share of recomputing every layer (by the fake step's times).
    """

    mode: str
    seq: int
    batch: int
    device_memory_bytes: int
    budget_bytes: int
    choices: List[str] = field(default_factory=list)
    estimated_peak_bytes: int = 0
    device_total_bytes: int = 0
    fits: bool = False
    recompute_share: float = 1.0

    @property
    def setting(self) -> str:
        """The block's ``budget:`` value, in MiB (rounded down); ``none`` when the weights alone do not fit."""
        return f"{self.budget_bytes // 2**20}MiB" if self.budget_bytes >= 2**20 else "none"

    @property
    def layers(self) -> str:
        """The choices as one letter per layer: k keep, s selective, r recompute."""
        return "".join(c[0] for c in self.choices)


class _KeepController(pl.Callback):
    """The budget's controller once the measuring step has ended (the run removes it afterwards)."""

    controller: Any = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        from lightning_ac import ActivationCheckpointing

        block = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
        self.controller = block.plan.budget if block.plan is not None else None


def budget_mode(name: str, block: Optional[Dict[str, Any]] = None) -> Mode:
    """The measuring step's mode for ``budget`` or ``budget+chunked_loss``, over ``block`` (:data:`BUDGET_BLOCK`)."""
    block = {**(BUDGET_BLOCK if block is None else block), "budget": _UNLIMITED}
    if name.endswith("+chunked_loss"):
        block["chunked_loss"] = True
    return Mode(name, block)


def usable_bytes(device_memory: int) -> int:
    """What a device of ``device_memory`` bytes leaves for allocated bytes, after the assumed margin: the most
    allocated bytes that :func:`lightning_ac.estimate.fit.fits` says fit it (its inverse, to the byte)."""
    # dividing by 1 + FRAGMENTATION lands within a byte or two: the margin's proportional part is rounded down, so a
    # byte or two more may fit; the margin itself settles it
    total = int((device_memory - CONTEXT_BYTES) / (1 + FRAGMENTATION))
    while total + 1 + margin_bytes(total + 1) <= device_memory:
        total += 1
    while total + margin_bytes(total) > device_memory:
        total -= 1
    return total


@dataclass
class BudgetFigures:
    """What the budget's controller took from its fake measuring step, and what the step holds beside activations.

    Attributes:
        layers: Each decoder layer's figures.
        outside_bytes: What is saved outside the layers, and what the figures do not see (the calibration).
        head_bytes: The output head's working set.
        fixed_bytes: Weights, buffers, gradients, optimizer state, the batch and the libraries' workspaces.
        all_recompute_seconds: The recompute time of every layer recomputed.
    """

    layers: List[Any]
    outside_bytes: int
    head_bytes: int
    fixed_bytes: int
    all_recompute_seconds: float


def measure(
    name: str,
    config: Any,
    dtype: Union[torch.dtype, Precision],
    training: Training,
    seq: int,
    batch: int,
    optimizer: OptimizerArgument = "adamw",
    target: str = "cuda",
    block: Optional[Dict[str, Any]] = None,
) -> Tuple[StepEstimate, BudgetFigures]:
    """The budget's measuring step (every layer recomputed, as its first step) on fake tensors, and its figures."""
    from lightning_ac.budget.choice import Choice, estimate

    keep = _KeepController()
    mode = budget_mode(name, block)
    step = fake_step(config, dtype, training, mode, seq, batch, optimizer, target, extra_callbacks=[keep])
    controller = keep.controller
    assert controller is not None and controller.figures is not None, "the budget measured its first step"
    outside = controller.outside_bytes + controller.calibration
    fixed = step.parameter_bytes + step.buffer_bytes + step.gradient_bytes + step.optimizer_bytes
    fixed += batch * seq * 8  # the batch's token ids (int64)
    fixed += step.workspace_bytes  # the libraries' workspaces: kept like the parameters
    everything = [Choice.recompute] * len(controller.figures)
    seconds = estimate(controller.figures, everything, outside, controller.head_bytes)[1]
    return step, BudgetFigures(list(controller.figures), outside, controller.head_bytes, fixed, seconds)


def plan_for(name: str, seq: int, batch: int, figures: BudgetFigures, budget_bytes: int, device: int) -> BudgetPlan:
    """The plan :func:`~lightning_ac.budget.choice.choose` makes from ``figures`` under ``budget_bytes``."""
    from lightning_ac.budget.choice import choose

    plan = choose(figures.layers, max(budget_bytes, 1), figures.outside_bytes, figures.head_bytes)
    everything = figures.all_recompute_seconds
    return BudgetPlan(
        mode=name,
        seq=seq,
        batch=batch,
        device_memory_bytes=device,
        budget_bytes=budget_bytes,
        choices=[c.value for c in plan.choices],
        estimated_peak_bytes=plan.peak_bytes,
        device_total_bytes=figures.fixed_bytes + plan.peak_bytes,
        fits=plan.fits and budget_bytes > 0,
        recompute_share=plan.recompute_seconds / everything if everything else 0.0,
    )


def budget_plans(
    name: str,
    config: Any,
    dtype: Union[torch.dtype, Precision],
    training: Training,
    seq: int,
    batch: int,
    optimizer: OptimizerArgument,
    target: str,
    devices: List[int],
) -> Tuple[StepEstimate, List[BudgetPlan]]:
    """The fake measuring step of ``name``, and the plan its figures make for each device: the activation memory
    the device leaves after the margin and what is not activations."""
    step, figures = measure(name, config, dtype, training, seq, batch, optimizer, target)
    plans = [plan_for(name, seq, batch, figures, usable_bytes(d) - figures.fixed_bytes, d) for d in devices]
    return step, plans
