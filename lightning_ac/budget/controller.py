"""The memory budget's closed loop: measure in the first step, choose, check the choice against the next measured
peak, correct it until it holds, and settle.

1. The first training step recomputes every decoder layer (the least memory the block allows) and measures each
   layer's figures (:mod:`lightning_ac.budget.measure`) and the step's activation peak. What the per-layer figures
   do not see (the embeddings, the output head's logits and loss, backward's temporaries) is the difference between
   that peak and the figures' estimate of it: the calibration, added at every backward position.
2. :func:`~lightning_ac.budget.choice.choose` picks keep / recompute per layer for the least recompute time whose
   estimated peak is under the budget.
3. The next step's peak is measured. Over the budget: the calibration takes the difference (and a small slack),
   the choice is made again, and the step after is measured. Under it: the plan is settled and one line says so.
   On CUDA every step's peak is read (the allocator keeps it for free) and a settled plan that goes over is
   corrected too; on the CPU a step is measured with MemTracker, which slows it, so only until the plan settles.
4. A batch with more tokens than any measured is re-planned before its first layer runs, with the figures scaled
   per token; the layers are measured again in that step, and where their figures did not scale linearly, the
   planner says so and takes the measured ones.
5. A batch whose shape of work is new (an attention mask appears with padding or packed documents, another
   precision: :func:`~lightning_ac.budget.measure.shape_of_work`) recomputes every layer (before its first layer
   runs, so that it stays under the budget where anything does) and is measured, on the CPU as on CUDA: what the
   figures do not see is kept per shape of work, the plan is chosen again to fit the largest, and the next step
   checks it like any choice. A step over the budget is corrected and said.

Under DDP and FSDP every rank must recompute the same layers: measurements are reduced (the largest) across the
ranks before a choice is made, and the token count of each step is agreed the same way
(:mod:`lightning_ac.budget.ranks`).

This module holds the loop; what the measured steps leave in the figures is :mod:`lightning_ac.budget.figures`, the
re-plans for more tokens or a new shape of work :mod:`lightning_ac.budget.replan`, the checkpointed plan
:mod:`lightning_ac.budget.state`, and what the budget says (its line, the per-layer report, metrics, the advice when
nothing fits) :mod:`lightning_ac.budget.report`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from lightning_ac._logging import rank_zero_info
from lightning_ac.budget.choice import Choice, LayerFigures, least_memory
from lightning_ac.budget.figures import FigureBook
from lightning_ac.budget.measure import LayerMeter
from lightning_ac.budget.phase import CHECK, MEASURE, SETTLED
from lightning_ac.budget.planning import SLACK, Planning
from lightning_ac.budget.ranks import AUTO_MARGIN, agree, auto_budget
from lightning_ac.budget.replan import Replans
from lightning_ac.budget.report import BudgetReport
from lightning_ac.budget.settings import BudgetSettings
from lightning_ac.budget.state import SavedPlan
from lightning_ac.budget.switch import LayerSwitch
from lightning_ac.budget.tools import BudgetTools, TailTime
from lightning_ac.memory import measure_step  # the benchmark's and the main job's measurement: the same peak
from lightning_ac.selective.policy import SelectivePolicy
from lightning_ac.units import format_bytes

__all__ = ["BudgetController", "AUTO_MARGIN", "MAX_CORRECTIONS", "SLACK"]

# Corrections before the plan falls back to recomputing every layer.
MAX_CORRECTIONS = 4


class BudgetController(FigureBook, Planning, Replans, SavedPlan, BudgetReport, BudgetTools):
    """Decides, step by step until it settles, which decoder layers keep their activations under a memory budget.

    Args:
        settings: What the budget is asked for (:class:`~lightning_ac.budget.settings.BudgetSettings`).
        layers: The decoder layers, in order.
        checkpoint_fn: The checkpoint function the engines would use for every layer.
        device: The device the steps compute on.
        on_change: Called with the choices whenever they change (the plan updates its report and policy).
        noun: What the layers are called in messages.
        policy: The selective policy, when the block sets ``selective``: then a layer can also run under the save
            rules, where that measures faster than recomputing it whole.
        layer_types: Each layer's attention type (``sliding_attention``...), where the model says: the save rules'
            measured cost in one layer stands for the layers of its type until they are measured themselves.
        tools: The chunked loss and the tiled MLP, where installed, in the order the budget turns on those the block
            leaves to it (:class:`~lightning_ac.budget.tools.BudgetTools`). Where the chunked loss ran as one chunk
            and the head holds a large share of the peak, the nothing-fits advice names ``chunk_tokens``.
        offload_fn: The checkpoint function that also moves the layer's input to host memory
            (``offload.hidden_states: auto``; ``settings.copy_rates`` prices it).
    """

    def __init__(
        self,
        settings: BudgetSettings,
        layers: Sequence[nn.Module],
        checkpoint_fn: Callable[..., Any],
        device: torch.device,
        on_change: Optional[Callable[[List[Choice]], None]] = None,
        noun: str = "decoder layers",
        policy: Optional[SelectivePolicy] = None,
        layer_types: Optional[Sequence[Optional[str]]] = None,
        tools: Optional[Callable[[], Sequence[Any]]] = None,
        offload_fn: Optional[Callable[..., Any]] = None,
    ) -> None:
        self.settings = settings
        self.tools = tools or (lambda: ())  # type: ignore[method-assign]
        self.turned_on: List[str] = []  # the tools turned on, in order
        self.weighed: set = set()  # the tools weighed (on or off since)
        self._measured_with: Dict[frozenset, int] = {}  # measuring steps per set of tools on
        self.tail_time = TailTime()  # the last measuring step's time from its last layer's forward to backward's end
        self._tail_clock: Any = None
        self.budget_bytes: Optional[int] = settings.budget_bytes
        self.device = device
        self.noun = noun
        self.policy = policy
        self.layer_types = list(layer_types) if layer_types is not None else [None] * len(layers)
        self.meter = LayerMeter(
            layers,
            device,
            dry_run=policy.dry_run if policy is not None else None,
            rule_bytes=policy.saved_bytes_per_layer.get if policy is not None else None,
        )
        # per layer: whether its selective figures were measured (not the first guess), and in which step
        self.selective_measured = [False] * len(layers)
        self.switches = [
            LayerSwitch(i, checkpoint_fn, self.meter, self._before_layer, offload_fn) for i in range(len(layers))
        ]
        self.on_change = on_change
        self.figures: Optional[List[LayerFigures]] = None
        self.tokens = 0  # the tokens per step the figures hold for
        self.outside_bytes = 0  # saved outside the layers before the last one ran: held through their backward
        self.head_bytes = 0  # the output head's working set at its backward (what it saves, and its gradients)
        self.calibration = 0  # measured peak less the figures' estimate: what they do not see (the largest below)
        self._calibrations: Dict[tuple, int] = {}  # the calibration of each shape of work measured
        self._shape: Optional[tuple] = None  # this step's shape of work, from its first layer call
        self._measuring_shape = False  # this step recomputes every layer to measure a new shape of work
        self.measured_peak: Optional[int] = None
        self.corrections = 0
        self.phase = MEASURE
        self._resumed = False  # a checkpoint's plan, not checked by a step of this run yet
        self._fake = False  # this step runs on fake tensors (budget_first_plan: estimate)
        self._estimated = False  # the plan is the fake step's, not checked by a real step yet
        self._estimate_tried = False
        self.steps = 0
        self.in_step = False
        self._measurement: Any = None
        self._first_call = False
        self._rescaled_from: Optional[List[LayerFigures]] = None
        self._over: set = set()  # the choices measured over the budget
        self._head_peak: Optional[int] = None  # the measuring step's peak when backward reached the layers
        self._head_forward_peak: Optional[int] = None  # its peak from the last layer's forward to backward
        self._measured: Dict[tuple, int] = {}  # the peak each measured choice had
        self._measured_modules: List[nn.Module] = []  # what this step's measurement watches
        self._measured_optimizers: List[torch.optim.Optimizer] = []

    # -- what the plan asks -----------------------------------------------------------------------------------

    @property
    def choices(self) -> List[Choice]:
        return [switch.choice for switch in self.switches]

    @property
    def settled(self) -> bool:
        return self.phase == SETTLED

    @property
    def wants_fake_step(self) -> bool:
        """Whether the next step should be preceded by the measuring step on fake tensors (``first_plan:
        estimate``, nothing measured or resumed yet, and not tried before)."""
        return self.settings.first_plan == "estimate" and self.figures is None and not self._estimate_tried

    def begin_step(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], fake: bool = False) -> None:
        """At a training step's start (every micro-batch: each has its own forward and backward). ``fake``: the
        measuring step on fake tensors (:mod:`lightning_ac.budget.first_plan`), measured by what it allocates, as on
        the CPU: no device allocator sees fake tensors."""
        if self.in_step:  # the last one never ended: the LightningModule skipped it (on_train_batch_start gave -1)
            self.abort_step()
        if fake:
            assert self.phase == MEASURE, "the fake step is the measuring step"
            self._estimate_tried = True
        self._fake = fake
        self.in_step, self._first_call = True, True
        if self.budget_bytes is None:
            self.budget_bytes = auto_budget(self.device)
        if self.phase == MEASURE:
            self._set([Choice.recompute] * len(self.switches))
            self.meter.dry = self.policy is not None
            self.meter.start(host_clock=fake)
            self.meter.on_first_recompute = self._read_head_peak
            self.meter.on_last_forward = self._head_forward_starts
        elif self._trying_rules() or self._estimated:  # the first real step after an estimate times every layer
            self.meter.dry = False
            self.meter.start()
        self._measured_modules, self._measured_optimizers = [module], list(optimizers)
        if self.phase != SETTLED or self.device.type == "cuda":
            where = torch.device("cpu") if fake else self.device
            self._measurement = measure_step([module], list(optimizers), where, synchronize=False)
            self._measurement.__enter__()

    def end_step(self) -> None:
        """At a training step's end: take the measurements, and choose again where they say so."""
        if not self.in_step:
            return  # the step was skipped (on_train_batch_start returned -1) or had no training_step
        self.in_step = False
        measurement, self._measurement = self._measurement, None
        peak = None
        if measurement is not None:
            measurement.__exit__(None, None, None)
            peak = measurement.result.activation_bytes if measurement.result is not None else None
        readings = self.meter.stop() if self.meter.active else None
        fake, self._fake = self._fake, False
        self.steps += 0 if fake else 1
        peak = int(self._agree([peak])[0]) if peak is not None else None
        self.measured_peak = peak if peak is not None and not fake else self.measured_peak
        if self.phase == MEASURE:
            assert readings is not None and peak is not None
            self.meter.on_first_recompute = self.meter.on_last_forward = None
            self._take_figures(readings, alike_times=fake)
            self._split_head(peak)
            self.phase = CHECK  # the step's peak checks "every layer recomputed" like any other choice
            checked = self._weigh_tools(peak, readings, fake)
            if checked is None:
                return  # a tool is weighed: the next step measures with it on
            self._check(checked, first=True, measuring=True)
            if fake and self.phase != MEASURE:  # an estimate: the first real step checks the plan it made
                self.phase, self._estimated = CHECK, True
            return
        if readings is not None and self._rescaled_from is not None:
            self._check_scaling(readings)  # chooses again from the measured figures: the next step checks that
            return
        if readings is not None:
            if self._estimated:
                self._retime(readings)
            self._take_selective(readings)
        if peak is not None and self._estimated:
            self._estimated = False
            # what the fake step measured was no real step's peak: the real ones alone say which choices fit, and
            # what the figures do not see (a later fallback could report the fake peak, a stale calibration stay)
            self._measured.clear()
            self._calibrations.clear()
            # the first real step: checked like the first choice after a measured step (a first step allocates what
            # only a first step does, so it is not held against later choices)
            self._check(peak, first=True)
        elif peak is not None and self._resumed:
            self._resumed = False
            assert self.budget_bytes is not None
            if peak <= self.budget_bytes:
                # the checkpoint's plan holds here: it stays as it was chosen, and this step's shape of work is one
                # measured (else the next batch alike would be measured again as a new one)
                self._calibrations.setdefault(self._shape, self.calibration)
                self._settle()
                return
            # a run's first step allocates what only a first step does: it is not held against later choices
            self._check(peak, first=True)
        elif peak is not None:
            measuring, self._measuring_shape = self._measuring_shape, False
            self._check(peak, measuring=measuring)

    def abort_step(self) -> None:
        """After an exception: nothing measured stays active."""
        self.in_step = self._fake = self._measuring_shape = False
        measurement, self._measurement = self._measurement, None
        if measurement is not None:
            measurement.__exit__(RuntimeError, RuntimeError("step failed"), None)
        if self.meter.active:
            self.meter.stop()

    def estimate_failed(self) -> None:
        """The fake step could not run: the first real step measures, as with ``first_plan: measure``."""
        self.abort_step()
        self.phase, self.figures, self._calibrations, self.calibration = MEASURE, None, {}, 0
        self.meter.on_first_recompute = self.meter.on_last_forward = None
        self._head_peak = self._head_forward_peak = None

    def plan_line(self) -> str:
        """The plan in force, as the line the budget logs when it settles."""
        return self._summary()

    # -- the loop ---------------------------------------------------------------------------------------------

    def _check(self, peak: int, first: bool = False, measuring: bool = False) -> None:
        """A measured step under the current choices: calibrate on it, choose again, and settle once the choice
        stays the same and its peak is under the budget.

        A choice measured over the budget is never chosen again (else the loop could go back to it); the first step
        is not held against later ones, as it also allocates what only a first step does (gradients that did not
        exist yet; not the libraries' workspaces, allocated before any step is measured:
        :func:`lightning_ac.memory.warm_up_libraries`). After the ``measuring`` step (every layer recomputed to
        measure them, not a choice) the plan's first choice is made: it is not a correction."""
        assert self.budget_bytes is not None and self.figures is not None
        budget, choices = self.budget_bytes, self.choices
        if self.settled and peak <= budget:
            return  # CUDA reads every step: a settled plan under the budget stays
        over = peak > budget
        if over and not first:
            self._over.add(tuple(choices))
        self._measured[tuple(choices)] = peak
        # what the figures do not see, in this step; over the budget, a little more, so the next choice moves away.
        # Kept per shape of work: the plan must fit the largest (padded batches beside unpadded ones)
        self._calibrations[self._shape] = peak - self._estimate(choices, 0)[0] + (int(SLACK * budget) if over else 0)
        self.calibration = max(self._calibrations.values())
        everything = list(least_memory(self.figures, self.settings.host_bytes))
        if over and choices == everything and not first:
            if self._turn_on_a_tool(
                f"the step's activation peak {format_bytes(peak)} is over the budget with every "
                f"{self.noun[:-1]} recomputed"
            ):
                return
            self._settle()
            self._warn_over(peak, "with every layer recomputed")
            return
        plan = self._choose_new()
        if not plan.fits and self._turn_on_a_tool(f"by the figures, every {self.noun[:-1]} recomputed is over"):
            return
        if not over and list(plan.choices) == choices:
            self._settle()
            return
        if not measuring:
            self.corrections += 1
        if self.corrections > MAX_CORRECTIONS:  # it did not converge: the fastest choice measured under the budget
            under = [c for c, p in self._measured.items() if p <= budget]
            best = min(under, key=lambda c: self._estimate(c, 0)[1]) if under else tuple(everything)
            self._set(list(best))
            self.measured_peak = self._measured.get(best)  # the settled plan's own peak, not the last step's
            self._settle()
            return
        if over and list(plan.choices) != choices:
            rank_zero_info(
                f"budget: the step's activation peak {format_bytes(peak)} is over the budget "
                f"{format_bytes(budget)}: choosing again with more recompute"
            )
        self._set(list(plan.choices))
        self.phase = CHECK

    def _settle(self) -> None:
        if self.phase != SETTLED:
            self.phase = SETTLED
            rank_zero_info(self._summary())

    def _set(self, choices: List[Choice]) -> None:
        changed = choices != self.choices
        for switch, choice in zip(self.switches, choices):
            switch.choice = choice
        if changed and self.on_change is not None:
            self.on_change(choices)

    def _agree(self, values: List[float]) -> List[float]:
        """``values`` as every rank sees them (:func:`~lightning_ac.budget.ranks.agree`)."""
        return agree(values, self.device)
