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

This module holds the loop; what the measured steps leave in the figures is :mod:`lightning_ac.budget.figures`, and
what the budget says (its line, the per-layer report, metrics, the advice when nothing fits)
:mod:`lightning_ac.budget.report`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_ac._logging import rank_zero_info
from lightning_ac.budget.choice import Choice, LayerFigures, LayerPlan, choose, estimate
from lightning_ac.budget.figures import FigureBook, scaled_figures
from lightning_ac.budget.measure import LayerMeter, held_bytes, shape_of_work
from lightning_ac.budget.ranks import AUTO_MARGIN, agree, auto_budget
from lightning_ac.budget.report import BudgetReport
from lightning_ac.budget.switch import LayerSwitch
from lightning_ac.config import AUTO
from lightning_ac.memory import measure_step  # the benchmark's and the main job's measurement: the same peak
from lightning_ac.selective.policy import SelectivePolicy
from lightning_ac.units import format_bytes

__all__ = ["BudgetController", "AUTO_MARGIN", "MAX_CORRECTIONS"]

# Corrections before the plan falls back to recomputing every layer.
MAX_CORRECTIONS = 4
# A correction aims this fraction of the budget below it, so that step-to-step noise does not cross it again.
SLACK = 0.01

_MEASURE, _CHECK, _SETTLED = "measure", "check", "settled"


class BudgetController(FigureBook, BudgetReport):
    """Decides, step by step until it settles, which decoder layers keep their activations under a memory budget.

    Args:
        budget: The activation memory a step may use, in bytes, or ``"auto"``.
        layers: The decoder layers, in order.
        checkpoint_fn: The checkpoint function the engines would use for every layer.
        device: The device the steps compute on.
        input_held: Whether a recomputed layer's input stays on the device (not when ``offload.hidden_states``
            moves it to host memory on an accelerator).
        on_change: Called with the choices whenever they change (the plan updates its report and policy).
        noun: What the layers are called in messages.
        policy: The selective policy, when the block sets ``selective``: then a layer can also run under the save
            rules, where that measures faster than recomputing it whole.
        rules_held: Whether what the save rules keep stays on the device (not when ``offload.selective`` moves it
            to host memory on an accelerator).
        layer_types: Each layer's attention type (``sliding_attention``...), where the model says: the save rules'
            measured cost in one layer stands for the layers of its type until they are measured themselves.
        head_chunkable: Whether the block's ``chunked_loss`` is off for a model with an output head: then, where
            the head holds a large share of the peak, the nothing-fits advice names it.
        first_plan: ``measure`` (the first step recomputes every layer and measures them) or ``estimate`` (a step
            on fake tensors before it does: :mod:`lightning_ac.budget.first_plan`).
        head_chunks: When the chunked loss runs, what its last call did: ``(tokens a chunk, tokens)``, or ``None``
            before any. Where it ran as one chunk and the head holds a large share of the peak, the nothing-fits
            advice names ``chunk_tokens``.
    """

    def __init__(
        self,
        budget: Any,
        layers: Sequence[nn.Module],
        checkpoint_fn: Callable[..., Any],
        device: torch.device,
        input_held: bool = True,
        on_change: Optional[Callable[[List[Choice]], None]] = None,
        noun: str = "decoder layers",
        policy: Optional[SelectivePolicy] = None,
        rules_held: bool = True,
        layer_types: Optional[Sequence[Optional[str]]] = None,
        head_chunkable: bool = False,
        first_plan: str = "measure",
        head_chunks: Optional[Callable[[], Optional[Tuple[int, int]]]] = None,
    ) -> None:
        self.requested = budget
        self.first_plan = first_plan
        self.head_chunkable = head_chunkable
        self.head_chunks = head_chunks
        self.budget_bytes: Optional[int] = None if budget == AUTO else int(budget)
        self.device = device
        self.input_held = input_held
        self.rules_held = rules_held
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
        self.switches = [LayerSwitch(i, checkpoint_fn, self.meter, self._before_layer) for i in range(len(layers))]
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
        self.phase = _MEASURE
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
        return self.phase == _SETTLED

    @property
    def full_seconds(self) -> float:
        """The estimated recompute time of every layer recomputed, from the figures the plan holds now."""
        return sum(f.recompute_seconds for f in self.figures or [])

    @property
    def estimated_peak(self) -> Optional[int]:
        if self.figures is None:
            return None
        return self._estimate(self.choices, self.calibration)[0]

    @property
    def wants_fake_step(self) -> bool:
        """Whether the next step should be preceded by the measuring step on fake tensors (``first_plan:
        estimate``, nothing measured or resumed yet, and not tried before)."""
        return self.first_plan == "estimate" and self.figures is None and not self._estimate_tried

    def begin_step(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], fake: bool = False) -> None:
        """At a training step's start (every micro-batch: each has its own forward and backward). ``fake``: the
        measuring step on fake tensors (:mod:`lightning_ac.budget.first_plan`), measured by what it allocates, as on
        the CPU: no device allocator sees fake tensors."""
        if self.in_step:  # the last one never ended: the LightningModule skipped it (on_train_batch_start gave -1)
            self.abort_step()
        if fake:
            assert self.phase == _MEASURE, "the fake step is the measuring step"
            self._estimate_tried = True
        self._fake = fake
        self.in_step, self._first_call = True, True
        if self.budget_bytes is None:
            self.budget_bytes = auto_budget(self.device)
        if self.phase == _MEASURE:
            self._set([Choice.recompute] * len(self.switches))
            self.meter.dry = self.policy is not None
            self.meter.start(host_clock=fake)
            self.meter.on_first_recompute = self._read_head_peak
            self.meter.on_last_forward = self._head_forward_starts
        elif self._trying_rules() or self._estimated:  # the first real step after an estimate times every layer
            self.meter.dry = False
            self.meter.start()
        self._measured_modules, self._measured_optimizers = [module], list(optimizers)
        if self.phase != _SETTLED or self.device.type == "cuda":
            where = torch.device("cpu") if fake else self.device
            self._measurement = measure_step([module], list(optimizers), where, synchronize=False)
            self._measurement.__enter__()

    def before_backward(self) -> None:
        """At backward's start, in the measuring step: the peak since the last layer's forward is the output head's
        forward's, and the peak from here to the layers its backward's."""
        if self.phase == _MEASURE and self._measurement is not None and self.in_step:
            if self._head_forward_peak is not None:
                self._head_forward_peak = self._measurement.peak_so_far()
            self._measurement.restart_peak()

    def _head_forward_starts(self) -> None:
        """After the last layer's forward in the measuring step: what follows until backward is the head's forward."""
        if self._measurement is not None:
            self._measurement.restart_peak()
            self._head_forward_peak = 0

    def _read_head_peak(self) -> None:
        """When backward reaches the layers in the measuring step: the peak since backward started is the output
        head's (every layer's input held)."""
        if self._measurement is not None:
            self._head_peak = self._measurement.peak_so_far()

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
        if self.phase == _MEASURE:
            assert readings is not None and peak is not None
            self.meter.on_first_recompute = self.meter.on_last_forward = None
            self._take_figures(readings, alike_times=fake)
            self._split_head(peak)
            self.phase = _CHECK  # the step's peak checks "every layer recomputed" like any other choice
            self._check(peak, first=True, measuring=True)
            if fake:  # an estimate: the first real step checks the plan it made, whatever it chose
                self.phase, self._estimated = _CHECK, True
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
                self._settle()  # the checkpoint's plan holds here: it stays as it was chosen
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
        self.phase, self.figures, self._calibrations, self.calibration = _MEASURE, None, {}, 0
        self.meter.on_first_recompute = self.meter.on_last_forward = None
        self._head_peak = self._head_forward_peak = None

    def plan_line(self) -> str:
        """The plan in force, as the line the budget logs when it settles."""
        return self._summary()

    # -- state ------------------------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The settled plan and what it was chosen from, for a resumed run to start from."""
        return {
            "budget_bytes": self.budget_bytes,
            "layers": len(self.switches),
            "tokens": self.tokens,
            "calibration": self.calibration,
            "outside_bytes": self.outside_bytes,
            "head_bytes": self.head_bytes,
            "full_seconds": self.full_seconds,
            "figures": [dataclasses.asdict(f) for f in self.figures] if self.figures is not None else None,
            "choices": [c.value for c in self.choices],
            "settled": self.settled,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Start from a saved plan, unless it was made for another number of layers or another budget (then measure
        again). The resumed run's first step is measured and checks the plan like any choice: what the saved figures
        cannot see (another precision, other save rules, another model of as many layers) corrects it there."""
        requested = self.budget_bytes if self.requested != AUTO else state.get("budget_bytes")
        if state.get("layers") != len(self.switches) or state.get("budget_bytes") != requested:
            rank_zero_info(
                f"budget: the checkpoint's plan was made for {state.get('layers')} {self.noun} and a budget of "
                f"{state.get('budget_bytes')} bytes; this run has {len(self.switches)} and {requested}: measuring "
                "again"
            )
            return
        if not state.get("settled") or state.get("figures") is None:
            return  # saved before it settled: measuring again costs one step
        self.budget_bytes = state["budget_bytes"]
        self.figures = [LayerFigures(**f) for f in state["figures"]]
        self.tokens = int(state["tokens"])
        self.calibration = int(state["calibration"])
        self.outside_bytes, self.head_bytes = int(state["outside_bytes"]), int(state["head_bytes"])
        self._set([Choice(c) for c in state["choices"]])
        self.phase, self._resumed = _CHECK, True
        rank_zero_info(f"budget: resuming with the checkpoint's plan ({self._summary()}); its first step checks it")

    # -- the loop ---------------------------------------------------------------------------------------------

    def _before_layer(self, index: int, function: Callable[..., Any], args: tuple) -> None:
        """Before each layer call; the first of a step checks its tokens and its shape of work against the figures'."""
        if not self._first_call:
            return
        self._first_call = False
        self._shape = shape_of_work(function, args)
        new_shape = self.figures is not None and self.phase == _SETTLED and self._shape not in self._calibrations
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
        self.phase = _CHECK
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

    def _check(self, peak: int, first: bool = False, measuring: bool = False) -> None:
        """A measured step under the current choices: calibrate on it, choose again, and settle once the choice
        stays the same and its peak is under the budget.

        A choice measured over the budget is never chosen again (else the loop could go back to it); the first step
        is not held against later ones, as it also allocates what only a first step does (gradients that did not
        exist yet, an accelerator library's workspace). After the ``measuring`` step (every layer recomputed to
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
        everything = [Choice.recompute] * len(choices)
        if over and choices == everything and not first:
            self._settle()
            self._warn_over(peak, "with every layer recomputed")
            return
        plan = self._choose_new()
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
        self.phase = _CHECK

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

    def _choose(self) -> None:
        """Choose from the figures and the calibration; the next measured step checks the choice."""
        assert self.budget_bytes is not None and self.figures is not None
        self._set(list(self._plan(self.calibration).choices))
        self.phase = _CHECK

    def _estimate(self, choices: Sequence[Choice], calibration: int) -> tuple:
        """The estimated peak and recompute time of ``choices``: the layers' figures, what is saved outside them and
        in the head, and ``calibration``."""
        assert self.figures is not None
        return estimate(self.figures, choices, self.outside_bytes + calibration, self.head_bytes)

    def _plan(self, calibration: int) -> LayerPlan:
        assert self.figures is not None and self.budget_bytes is not None
        return choose(self.figures, self.budget_bytes, self.outside_bytes + calibration, self.head_bytes)

    def _settle(self) -> None:
        if self.phase != _SETTLED:
            self.phase = _SETTLED
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
