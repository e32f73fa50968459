"""The memory budget's figure bookkeeping: what the measured steps leave in each layer's figures (the layers' bytes
and times, the output head's working set, the save rules' cost), agreed across the ranks, as the controller's loop
(:mod:`lightning_ac.budget.controller`) reads and corrects them."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from lightning_ac._logging import rank_zero_info
from lightning_ac.budget.choice import Choice, LayerFigures, estimate
from lightning_ac.budget.host import offload_seconds
from lightning_ac.budget.measure import LayerReading
from lightning_ac.budget.phase import MEASURE
from lightning_ac.budget.settings import BudgetSettings
from lightning_ac.units import format_bytes

__all__ = ["FigureBook", "HEAD_FACTOR", "LINEAR_TOLERANCE", "SELECTIVE_GUESS", "scaled_figures"]

# The output head's working set at its backward, as a multiple of what it saves: the saved tensors (the logits'
# log-softmax, the head's input) and, as its backward runs, gradients of the same sizes.
HEAD_FACTOR = 2
# Before the save rules have run in a layer, their time is guessed at this fraction of a whole recompute: low enough
# that they are tried wherever they fit, and measured in the step that runs them.
SELECTIVE_GUESS = 0.5
# Figures measured at more tokens that differ from the scaled ones by more than this do not scale linearly.
LINEAR_TOLERANCE = 0.10


class FigureBook:
    """The figures part of :class:`~lightning_ac.budget.controller.BudgetController` (a mixin: it reads and writes
    the controller's figures, tokens, outside and head bytes, and agrees values across the ranks through it)."""

    figures: Optional[List[LayerFigures]]
    choices: List[Choice]
    settings: BudgetSettings

    @property
    def full_seconds(self) -> float:
        """The estimated recompute time of every layer recomputed, from the figures the plan holds now."""
        return sum(f.recompute_seconds for f in self.figures or [])

    @property
    def estimated_peak(self) -> Optional[int]:
        if self.figures is None:
            return None
        return self._estimate(self.choices, self.calibration)[0]

    def before_backward(self) -> None:
        """At backward's start, in the measuring step: the peak since the last layer's forward is the output head's
        forward's, and the peak from here to the layers its backward's."""
        if self.phase == MEASURE and self._measurement is not None and self.in_step:
            if self._head_forward_peak is not None:
                self._head_forward_peak = self._measurement.peak_so_far()
            self._measurement.restart_peak()

    def after_backward(self) -> None:
        """At backward's end: the time since the last layer's forward (:class:`~lightning_ac.budget.tools.TailTime`),
        in a step the meter measures."""
        if self._tail_clock is not None and self.meter.active:
            self.tail_time.seconds = 0.0
            self.meter.timer.stop(self._tail_clock, self.tail_time, "seconds")
        self._tail_clock = None

    def _head_forward_starts(self) -> None:
        """After the last layer's forward in the measuring step: what follows until backward is the head's forward."""
        if self._measurement is not None:
            self._measurement.restart_peak()
            self._head_forward_peak = 0
        # from here to the end of backward: the output head and every layer's backward, for weighing the tools
        self._tail_clock = self.meter.timer.start() if self.meter.active else None

    def _read_head_peak(self) -> None:
        """When backward reaches the layers in the measuring step: the peak since backward started is the output
        head's (every layer's input held)."""
        if self._measurement is not None:
            self._head_peak = self._measurement.peak_so_far()

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
        figures = [r.figures(self.settings.input_held, self.settings.rules_held, selective) for r in agreed]
        self.figures = figures
        if selective:
            self.selective_measured = [False] * len(figures)
        if alike_times:
            self._time_alike_as_one([f.recompute_seconds for f in figures])
        self._guess_selective()
        tokens, outside, head = self._agree([self.meter.tokens, self.meter.outside_bytes, self.meter.head_bytes])
        self.tokens, self.outside_bytes = int(tokens), int(outside)
        self.head_bytes = int(HEAD_FACTOR * head)
        self._price_offload()

    def _price_offload(self) -> None:
        """With ``offload.hidden_states: auto``, each layer's time recomputed with its input in host memory, from its
        recompute time and the host link's measured rates (:func:`~lightning_ac.budget.host.offload_seconds`); run
        whenever the recompute times change."""
        rates = self.settings.copy_rates
        if rates is None or self.figures is None:
            return
        self.figures = [dataclasses.replace(f, offload_seconds=offload_seconds(f, rates)) for f in self.figures]

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
        self._price_offload()

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
            held = before.input_bytes + (int(kept) if self.settings.rules_held else 0)
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
        self._choose(at_step_end=True)


def scaled_figures(figures: LayerFigures, ratio: float) -> LayerFigures:
    """``figures`` for ``ratio`` times the tokens (bytes and seconds scale per token)."""

    def scale(value: Any) -> Any:
        return None if value is None else type(value)(value * ratio)

    return LayerFigures(
        saved_bytes=scale(figures.saved_bytes),
        input_bytes=scale(figures.input_bytes),
        recompute_seconds=scale(figures.recompute_seconds),
        input_saved_bytes=scale(figures.input_saved_bytes),
        selective_bytes=scale(figures.selective_bytes),
        selective_seconds=scale(figures.selective_seconds),
        offload_seconds=scale(figures.offload_seconds),
    )
