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
ranks before a choice is made, and the token count of each step is agreed the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from lightning_ac._logging import rank_zero_info, rank_zero_warn
from lightning_ac.budget.choice import Choice, LayerFigures, LayerPlan, choose, estimate
from lightning_ac.budget.measure import LayerMeter, LayerReading, held_bytes, shape_of_work
from lightning_ac.budget.switch import LayerSwitch
from lightning_ac.config import AUTO
from lightning_ac.loss.install import MIN_AUTO_CHUNK_TOKENS
from lightning_ac.memory import measure_step  # the benchmark's and the main job's measurement: the same peak
from lightning_ac.selective.policy import SelectivePolicy
from lightning_ac.units import format_bytes

__all__ = ["BudgetController", "AUTO_MARGIN", "MAX_CORRECTIONS"]

# budget: auto leaves this fraction of the device's memory free (fragmentation, the allocator's rounding, other
# processes' growth)
AUTO_MARGIN = 0.10
# Corrections before the plan falls back to recomputing every layer.
MAX_CORRECTIONS = 4
# A correction aims this fraction of the budget below it, so that step-to-step noise does not cross it again.
SLACK = 0.01
# The output head's working set at its backward, as a multiple of what it saves: the saved tensors (the logits'
# log-softmax, the head's input) and, as its backward runs, gradients of the same sizes.
HEAD_FACTOR = 2
# Before the save rules have run in a layer, their time is guessed at this fraction of a whole recompute: low enough
# that they are tried wherever they fit, and measured in the step that runs them.
SELECTIVE_GUESS = 0.5
# The nothing-fits advice names chunked_loss where the output head holds more than this share of the peak.
HEAD_ADVICE_SHARE = 0.25
# Figures measured at more tokens that differ from the scaled ones by more than this do not scale linearly.
LINEAR_TOLERANCE = 0.10

_MEASURE, _CHECK, _SETTLED = "measure", "check", "settled"


class BudgetController:
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
            self.budget_bytes = self._auto_budget()
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
        self.figures = [_scaled(f, ratio) for f in self.figures]
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

    def _take_figures(self, readings: List[LayerReading], alike_times: bool = False) -> None:
        """The measured layers' figures, the bytes outside them and the head's. ``alike_times``: alike layers take
        their mean time (a step on fake tensors, whose times are the host's for ops that computed nothing)."""
        values = self._agree(
            [
                v
                for r in readings
                for v in (r.saved_bytes, r.input_bytes, r.input_saved_bytes, r.rule_bytes, r.forward_seconds)
            ]
        )
        agreed = [
            LayerReading(
                saved_bytes=int(values[5 * i]),
                input_bytes=int(values[5 * i + 1]),
                input_saved_bytes=int(values[5 * i + 2]),
                rule_bytes=int(values[5 * i + 3]),
                forward_seconds=values[5 * i + 4],
            )
            for i in range(len(readings))
        ]
        selective = self.policy is not None
        figures = [r.figures(self.input_held, self.rules_held, selective) for r in agreed]
        self.figures = figures
        if selective:
            self.selective_measured = [False] * len(figures)
        if alike_times:
            self._time_alike_as_one([f.recompute_seconds for f in figures])
        self._guess_selective()
        tokens, outside, head = self._agree([self.meter.tokens, self.meter.outside_bytes, self.meter.head_bytes])
        self.tokens, self.outside_bytes = int(tokens), int(outside)
        self.head_bytes = int(HEAD_FACTOR * head)

    def _split_head(self, peak: int) -> None:
        """From the measuring step (every layer recomputed): the output head's working set is the larger of its
        forward's peak (from the last layer's forward to backward) and its backward's (until backward reached the
        layers), less what was held then (every layer's input, and what was saved outside them); the layers'
        positions take what their figures do not see from the step's peak, where it is theirs. Without a chunked
        loss the head's backward holds more (the logits and their gradient); with it, its forward does (each chunk's
        logits and their gradient are computed there, and backward only scales what they left)."""
        assert self.figures is not None
        head_peak, forward_peak = self._head_peak, self._head_forward_peak
        self._head_peak = self._head_forward_peak = None
        if head_peak is None:
            return  # no recompute reached (a step without backward): the head's saved bytes stand
        head_peak, forward_peak = (int(v) for v in self._agree([head_peak, forward_peak or 0]))
        everything = [Choice.recompute] * len(self.figures)
        held = self.outside_bytes + sum(f.input_bytes for f in self.figures)
        layers_peak = estimate(self.figures, everything, self.outside_bytes, 0)[0]  # without the head
        layer_extra = max(0, peak - layers_peak) if peak > max(head_peak, forward_peak) else 0
        self.head_bytes = max(0, max(head_peak, forward_peak) - held - layer_extra)

    def _retime(self, readings: List[LayerReading]) -> None:
        """The first real step after a plan from fake tensors: each layer's recompute time is its forward's, on the
        device's clock (the fake step's are the host's time for ops that computed nothing). A layer that ran the save
        rules has no whole forward to time (its forward ran the policy too): it takes its alike layers' time, or,
        where every alike layer ran them, its own forward's (no figure stays on the host's clock)."""
        seconds = self._agree([r.forward_seconds for r in readings])
        whole = [None if c is Choice.selective else s for c, s in zip(self.choices, seconds)]
        self._time_alike_as_one(whole, fallback=seconds)
        self._guess_selective()  # the first guess, on this clock

    def _time_alike_as_one(self, seconds: List[Optional[float]], fallback: Optional[List[float]] = None) -> None:
        """Set each layer's recompute time to the mean of ``seconds`` over its alike layers (the same attention type
        and byte figures; ``None``: not timed), or of ``fallback`` where none of them was. Alike layers cost alike:
        their times differ by the clock's noise alone, which would otherwise pick which of them to keep, and, when
        the first real step after an estimate retimes them, move the plan to another alike layer in a correction
        that changes nothing but the step it costs. With one time, the choice between them is the same on every
        clock."""
        assert self.figures is not None
        keys = [
            (kind, f.saved_bytes, f.input_bytes, f.input_saved_bytes) for kind, f in zip(self.layer_types, self.figures)
        ]

        def means(values: Sequence[Optional[float]]) -> Dict[Any, float]:
            timed: Dict[Any, List[float]] = {}
            for key, value in zip(keys, values):
                if value is not None:
                    timed.setdefault(key, []).append(value)
            return {key: sum(times) / len(times) for key, times in timed.items()}

        mean = {**means(fallback or []), **means(seconds)}
        for index, key in enumerate(keys):
            if key in mean:
                self.figures[index] = dataclasses.replace(self.figures[index], recompute_seconds=mean[key])

    def _guess_selective(self) -> None:
        """With save rules, each layer whose selective figures were not measured yet gets a first guess from its
        recompute time, so that the rules are tried where they fit; the step that runs them measures."""
        assert self.figures is not None
        if self.policy is None:
            return
        for index, figures in enumerate(self.figures):
            if not self.selective_measured[index]:
                guess = SELECTIVE_GUESS * figures.recompute_seconds
                self.figures[index] = dataclasses.replace(figures, selective_seconds=guess)

    def _trying_rules(self) -> bool:
        """Whether this step runs the save rules in a layer whose selective figures are still a guess."""
        return any(c is Choice.selective and not m for c, m in zip(self.choices, self.selective_measured))

    def _take_selective(self, readings: List[LayerReading]) -> None:
        """After a step that ran the save rules in layers with guessed figures: their measured figures, and for the
        other layers of the same type, the measured layers' time relative to a whole recompute."""
        assert self.figures is not None
        trying = [i for i, c in enumerate(self.choices) if c is Choice.selective and not self.selective_measured[i]]
        measured = [readings[i] for i in trying]
        values = self._agree([v for r in measured for v in (r.forward_seconds, r.recompute_seconds, r.rule_bytes)])
        ratios: Dict[Any, List[float]] = {}
        for k, index in enumerate(trying):
            forward, recompute, kept = values[3 * k : 3 * k + 3]
            before = self.figures[index]
            # the save rules' cost: what their policy adds to the forward, and the partial recompute
            seconds = max(0.0, forward - before.recompute_seconds) + recompute
            held = before.input_bytes + (int(kept) if self.rules_held else 0)
            self.figures[index] = dataclasses.replace(before, selective_seconds=seconds, selective_bytes=held)
            self.selective_measured[index] = True
            if before.recompute_seconds > 0:
                ratios.setdefault(self.layer_types[index], []).append(seconds / before.recompute_seconds)
        for index, figures in enumerate(self.figures):
            found = ratios.get(self.layer_types[index])
            if not self.selective_measured[index] and found:
                ratio = sum(found) / len(found)
                self.figures[index] = dataclasses.replace(figures, selective_seconds=ratio * figures.recompute_seconds)
                self.selective_measured[index] = True

    def _check_scaling(self, readings: List[LayerReading]) -> None:
        """After a step re-planned for more tokens: the measured figures replace the scaled ones; if they differ
        by more than :data:`LINEAR_TOLERANCE`, say that this model's activations do not scale per token."""
        scaled = self.figures or []
        measured_rules, head = self.selective_measured, self.head_bytes
        self._rescaled_from = None
        choices = self.choices
        self._take_figures(readings)
        self.head_bytes = head  # measured in the first step and scaled: this step did not split the head's peak off
        assert self.figures is not None
        for index, (before, choice) in enumerate(zip(scaled, choices)):
            # the save rules' time is what was measured, scaled; a layer that ran them saved part of its
            # activations past the hooks, so its whole-layer figures stay the scaled ones
            kept = dict(selective_seconds=before.selective_seconds)
            if choice is Choice.selective:
                kept.update(saved_bytes=before.saved_bytes, input_saved_bytes=before.input_saved_bytes)
            self.figures[index] = dataclasses.replace(self.figures[index], **kept)
        self.selective_measured = measured_rules
        measured = sum(f.saved_bytes for f in self.figures or [])
        expected = sum(f.saved_bytes for f in scaled)
        if expected and abs(measured - expected) > LINEAR_TOLERANCE * expected:
            rank_zero_info(
                f"budget: the {self.noun}' saved activations did not scale linearly with the tokens "
                f"({format_bytes(measured)} measured, {format_bytes(expected)} scaled): the plan uses the measured "
                "figures from here on"
            )
        self._choose()

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

    def _warn_over(self, peak: int, when: str) -> None:
        assert self.budget_bytes is not None
        rank_zero_warn(
            f"budget {format_bytes(self.budget_bytes)}: the step's activation peak is {format_bytes(peak)} {when}, "
            f"over the budget; training goes on recomputing every layer. To lower the peak further: {self._advice()}."
        )

    def _advice(self) -> str:
        """What lowers the activation peak below every layer recomputed, in this configuration. (Layer offloading
        is not among it: it moves weights, and its streamed copies add to the activations' peak.)"""
        ways = []
        big_head = self.head_bytes > HEAD_ADVICE_SHARE * (self.measured_peak or 0)
        chunks = self.head_chunks() if self.head_chunks is not None else None
        if self.head_chunkable and big_head:
            ways.append(
                f"chunked_loss: true (the output head's logits and their gradient hold {format_bytes(self.head_bytes)}"
                " of it; the loss a chunk of tokens at a time holds a chunk's)"
            )
        elif chunks is not None and chunks[0] >= chunks[1] and big_head:
            ways.append(
                f"chunked_loss.chunk_tokens below the step's {chunks[1]} tokens (the loss ran as one chunk of "
                f"{chunks[0]} tokens, whose logits and gradient hold {format_bytes(self.head_bytes)} of the peak; "
                f"chunk_tokens: auto takes at least {MIN_AUTO_CHUNK_TOKENS}, so give a number)"
            )
        if self.device.type != "cpu" and self.input_held:  # on the CPU, host memory is the device's
            ways.append("offload.hidden_states: cpu (each recomputed layer's input in host memory)")
        ways.append("a smaller batch or shorter sequences (with gradient accumulation to keep the batch size)")
        return ", or ".join(ways)

    def _set(self, choices: List[Choice]) -> None:
        changed = choices != self.choices
        for switch, choice in zip(self.switches, choices):
            switch.choice = choice
        if changed and self.on_change is not None:
            self.on_change(choices)

    def _summary(self) -> str:
        choices = self.choices
        n = len(choices)
        kept = choices.count(Choice.keep)
        selective = choices.count(Choice.selective)
        recomputed = choices.count(Choice.recompute)
        assert self.budget_bytes is not None
        estimated = self.estimated_peak
        figures = self.figures or []
        seconds = sum(f.cost(c)[2] for f, c in zip(figures, choices))
        share = f"{100 * seconds / self.full_seconds:.0f}%" if self.full_seconds else "n/a"
        parts = [f"keeping {kept}/{n} {self.noun}"]
        if selective:
            parts.append(f"selective in {selective}")
        parts.append(f"recomputing {recomputed}")
        measured = f", measured {format_bytes(self.measured_peak)}" if self.measured_peak is not None else ""
        return (
            f"budget {format_bytes(self.budget_bytes)}: {', '.join(parts)} (estimated peak "
            f"{format_bytes(estimated or 0)}{measured}; recompute {share} of full's)"
        )

    def describe_layer(self, index: int) -> str:
        """The layer's choice and figures, for the per-layer report."""
        choice = self.switches[index].choice.value
        if self.figures is None:
            return f"{choice} (measuring)"
        f = self.figures[index]
        return f"{choice}: saves {format_bytes(f.saved_bytes)}, recompute {1000 * f.recompute_seconds:.1f} ms"

    def metrics(self) -> Dict[str, float]:
        """What the run logs each step."""
        found = {
            "lightning_ac/budget_bytes": float(self.budget_bytes or 0),
            "lightning_ac/budget_recomputed_layers": float(sum(c is not Choice.keep for c in self.choices)),
        }
        if self.estimated_peak is not None:
            found["lightning_ac/budget_estimated_peak_bytes"] = float(self.estimated_peak)
        if self.measured_peak is not None:
            found["lightning_ac/budget_measured_peak_bytes"] = float(self.measured_peak)
        return found

    def summary(self) -> Dict[str, Any]:
        """The plan as plain data (the main job's ``summary.json``)."""
        return {
            "budget_bytes": self.budget_bytes,
            "choices": [c.value for c in self.choices],
            "estimated_peak_bytes": self.estimated_peak,
            "measured_peak_bytes": self.measured_peak,
            "settled": self.settled,
            "corrections": self.corrections,
            "line": self._summary() if self.budget_bytes is not None else None,
        }

    # -- helpers ----------------------------------------------------------------------------------------------

    def _auto_budget(self) -> int:
        """The device memory free now, plus what the allocator holds unused, less :data:`AUTO_MARGIN` of the
        total."""
        free, total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        budget = int(free + cached - AUTO_MARGIN * total)
        rank_zero_info(
            f"budget auto: {format_bytes(budget)} (free {format_bytes(free + cached)} of {format_bytes(total)}, less "
            f"{AUTO_MARGIN:.0%} of it)"
        )
        return max(budget, 1)

    def _agree(self, values: List[float]) -> List[float]:
        """``values`` as every rank sees them: the largest of each across the ranks (as they are without any)."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return values
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        device = self.device if dist.get_backend() != "gloo" else torch.device("cpu")
        with unset_fake_temporarily():  # in the fake step too, the ranks agree on real numbers
            tensor = torch.tensor(values, dtype=torch.float64, device=device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            return tensor.tolist()


def _scaled(figures: LayerFigures, ratio: float) -> LayerFigures:
    def scale(value: Any) -> Any:
        return None if value is None else type(value)(value * ratio)

    return LayerFigures(
        saved_bytes=scale(figures.saved_bytes),
        input_bytes=scale(figures.input_bytes),
        recompute_seconds=scale(figures.recompute_seconds),
        input_saved_bytes=scale(figures.input_saved_bytes),
        selective_bytes=scale(figures.selective_bytes),
        selective_seconds=scale(figures.selective_seconds),
    )
