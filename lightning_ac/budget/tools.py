"""The tools a memory budget turns on where its step needs them, or where they make it faster: ``chunked_loss: auto``
and ``tiled_mlp: auto``.

Recomputing a decoder layer is the budget's first means: per layer, keep, save selectively or recompute, for the least
recompute under the budget (:mod:`lightning_ac.budget.choice`). What recompute cannot reach is the output head's logits
(the chunked loss) and a recomputed layer's own working set, its MLP's intermediates and its norms' float32 copies (the
tiled MLP). A tool the block leaves to the budget is installed off, each model computing as it does, and weighed:

- After the measuring step, where the plan it allows recomputes anything (or nothing fits), the first tool not weighed
  yet is turned on and the next step measures again, every layer recomputed, as the first did: the figures change with
  the tool (the head's bytes, each layer's working set and time). The first step measured with the tools on then is
  cold (a run's first, or the one that kept the last tool: what only a first step or a tool's first call allocates and
  initialises is in its times): where it would be the step a tool is weighed against for speed, the next step measures
  again first. A weighing step of another length is measured once more; two steps of different lengths are compared at
  the longer one's tokens.
- The two measured steps then give two plans, each the fastest under the budget by its own figures. The tool's own
  time is what it changes outside the layers' recomputes, in every step whatever the plan: the layers' forwards, and
  the time from the last layer's forward to the end of backward (the output head's forward and backward, every
  layer's backward) less the recomputes in it, measured in both steps; what it changes in a recompute is in the plan's
  recompute time already. (A tiled MLP recomputes its tiles in the backward of a kept layer too: that is its own
  time.) It stays on where its plan fits and steps faster (predicted: the plan's recompute and the
  tool's own time) by more than :data:`MIN_GAIN` of the recompute without it (less is the clock's noise, and off the
  step is the plain one), or where only its plan fits; else it is turned off again and the step measured without it is
  taken back. Either way one line says which and why, and the next tool is weighed the same way.
- Later, when a step measured with every layer recomputed is over the budget (a longer batch, another shape of work),
  the first tool still off is turned on without weighing: nothing else is left.

A budget that keeps every layer weighs nothing and turns nothing on: the step is the plain one. After a plan made
from fake tensors (``budget_first_plan: estimate``, whose times are the host's) nothing is weighed either: a tool is
turned on only where nothing fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from lightning_ac._logging import rank_zero_info
from lightning_ac.budget.choice import Choice, LayerFigures, LayerPlan, choose, estimate
from lightning_ac.budget.figures import scaled_figures
from lightning_ac.budget.measure import LayerReading
from lightning_ac.budget.phase import MEASURE

__all__ = ["BudgetTools", "MIN_GAIN", "TailTime"]

# A tool stays on for speed only where its plan is predicted faster by more than this share of the recompute time
# without it: two measured steps differ by the clock's noise, and a tool that gains nothing is better off.
MIN_GAIN = 0.10


@dataclass
class TailTime:
    """A measuring step's time from its last layer's forward to the end of its backward."""

    seconds: float = 0.0


@dataclass(frozen=True)
class _Weighed:
    """A measuring step without the tool being weighed: what to go back to, and its times."""

    tool: Any
    figures: List[LayerFigures]
    outside_bytes: int
    head_bytes: int
    peak: int
    own_seconds: float  # the time the tool's own time is the difference of (see _own_seconds)
    tokens: int  # the step's tokens: a weighing step of another length is measured again, then compared per token
    retried: bool = False


class BudgetTools:
    """The controller's part that weighs and turns on the tools the block leaves to the budget (mixed into
    :class:`~lightning_ac.budget.controller.BudgetController`).

    Attributes:
        tools: Returns the tools installed, in the order the budget weighs them; each has ``name``,
            ``budget_decides``, ``active`` and ``describe()`` (:class:`~lightning_ac.loss.install.ChunkedLoss`,
            :class:`~lightning_ac.tiled_mlp.install.TiledMLP`).
        turned_on: The tools on, in the order they were turned on.
        weighed: The tools weighed (on or off since).
    """

    tools: Callable[[], Sequence[Any]] = staticmethod(lambda: ())  # type: ignore[assignment]
    turned_on: List[str]
    weighed: Set[str]
    tail_time: TailTime
    _weighing: Optional[_Weighed] = None
    _measured_with: Dict[frozenset, int]

    def _weigh_tools(self, peak: int, readings: List[LayerReading], fake: bool) -> Optional[int]:
        """After a measuring step (its figures taken): end the weighing of a tool, and start the next one's where the
        plan recomputes anything. Returns the measured peak the plan is chosen from (the step without the tool's,
        where that one was taken back), or ``None`` where the next step measures with another tool on."""
        own_seconds = self._own_seconds(readings)
        measured = frozenset(t.name for t in self.tools() if t.active)  # the tools this step ran with
        self._measured_with[measured] = self._measured_with.get(measured, 0) + (0 if fake else 1)
        if self._weighing is not None:
            before = self._weighing
            if abs(self.tokens - before.tokens) > 0.1 * before.tokens and not before.retried:
                # another length than the step weighed against: measured once more, the tool still on
                self._weighing = dataclasses.replace(before, retried=True)
                self._measure_again()
                return None
            peak, own_seconds = self._end_weighing(peak, own_seconds)
        tool = None if fake else next((t for t in self._undecided() if t.name not in self.weighed), None)
        if tool is None:
            return peak
        plan = self._plan_measured(peak)
        if plan.fits and not any(c is not Choice.keep for c in plan.choices):
            return peak  # every layer kept: no tool can make the step faster
        if plan.fits and self._measured_with.get(frozenset(t.name for t in self.tools() if t.active), 0) < 2:
            # the first step measured with these tools is a cold one (what only a first step, or a tool's first call,
            # allocates and initialises): the step a tool is weighed against for speed is measured again, warm (where
            # nothing fits without the tool, its time decides nothing)
            rank_zero_info("budget: measuring the next step too before weighing a tool (the last one was cold)")
            self._measure_again()
            return None
        assert self.figures is not None
        self._weighing = _Weighed(
            tool, list(self.figures), self.outside_bytes, self.head_bytes, peak, own_seconds, self.tokens
        )
        self.weighed.add(tool.name)
        tool.active, tool.turned_on_because = True, "weighing"
        self.turned_on.append(tool.name)
        rank_zero_info(f"budget: weighing {tool.name}: measuring the next step with it on ({tool.describe()})")
        self._measure_again()
        return None

    def _end_weighing(self, peak: int, own_seconds: float) -> Tuple[int, float]:
        """Keep the tool weighed on where its plan fits and is faster, or where only its plan fits; else turn it off
        and take back the step measured without it. Returns the measured peak and the time outside the recomputes
        (:meth:`_own_seconds`) of the step whose figures are kept: the next tool is weighed against that step."""
        assert self._weighing is not None and self.budget_bytes is not None
        before, self._weighing = self._weighing, None
        tool = before.tool
        # both steps at the longer one's tokens (a step of another length: its figures and times per token)
        tokens = max(self.tokens, before.tokens)
        assert self.figures is not None
        with_tool = self._plan_at(self.figures, self.outside_bytes, self.head_bytes, peak, tokens / self.tokens)
        ratio = tokens / before.tokens
        without = self._plan_at(before.figures, before.outside_bytes, before.head_bytes, before.peak, ratio)
        tool_seconds = own_seconds * tokens / self.tokens - before.own_seconds * ratio
        seconds_with = with_tool.recompute_seconds + tool_seconds
        faster = seconds_with < (1 - MIN_GAIN) * without.recompute_seconds
        if with_tool.fits and (not without.fits or faster):
            why = (
                "only with it does a plan fit the budget"
                if not without.fits
                else f"its plan steps {1000 * (without.recompute_seconds - seconds_with):.1f} ms faster (recompute "
                f"{1000 * with_tool.recompute_seconds:.1f} ms and its own {1000 * tool_seconds:.1f} ms, against "
                f"{1000 * without.recompute_seconds:.1f} ms of recompute without it)"
            )
            tool.turned_on_because = "needed" if not without.fits else "faster"
            rank_zero_info(f"budget: keeping {tool.name} on: {why}")
            return peak, own_seconds
        tool.active = False
        self.turned_on.remove(tool.name)
        self.figures = list(before.figures)
        self.outside_bytes, self.head_bytes, self.tokens = before.outside_bytes, before.head_bytes, before.tokens
        self._price_offload()
        self.measured_peak = before.peak
        why = (
            "no plan fits the budget with it either"
            if not with_tool.fits
            else f"the plan with it is not predicted faster (recompute {1000 * without.recompute_seconds:.1f} ms, "
            f"against {1000 * with_tool.recompute_seconds:.1f} ms and its own {1000 * tool_seconds:.1f} ms with it)"
        )
        rank_zero_info(f"budget: turning {tool.name} off again: {why}")
        return before.peak, before.own_seconds

    def _own_seconds(self, readings: List[LayerReading]) -> float:
        """What a measuring step spent outside its layers' recomputes, where a tool's own time lies: the layers'
        forwards, and from the last layer's forward to backward's end less the recomputes."""
        recomputes = sum(r.recompute_seconds for r in readings)
        return sum(r.forward_seconds for r in readings) + self.tail_time.seconds - recomputes

    def _plan_at(self, figures: List[LayerFigures], outside: int, head: int, peak: int, ratio: float) -> LayerPlan:
        """The plan a measuring step's figures allow, calibrated on its measured ``peak``, all scaled by ``ratio`` (its
        figures at ``ratio`` times its tokens)."""
        assert self.budget_bytes is not None
        if ratio != 1.0:
            figures = [scaled_figures(f, ratio) for f in figures]
            outside, head, peak = int(outside * ratio), int(head * ratio), int(peak * ratio)
        calibration = peak - estimate(figures, self.choices, outside, head)[0]
        return choose(figures, self.budget_bytes, outside + calibration, head, host_bytes=self.settings.host_bytes)

    def _plan_measured(self, peak: int) -> LayerPlan:
        """The plan the figures of the measuring step just taken allow, calibrated on its measured ``peak``."""
        assert self.figures is not None
        return self._plan_at(self.figures, self.outside_bytes, self.head_bytes, peak, 1.0)

    def _turn_on_a_tool(self, why: str) -> bool:
        """Turn on the first tool the budget decides that is still off, and measure again; ``False`` if none is
        left (``why``: the line's reason)."""
        tool = next(iter(self._undecided()), None)
        if tool is None:
            return False
        tool.active, tool.turned_on_because = True, "needed"
        self.turned_on.append(tool.name)
        self.weighed.add(tool.name)
        rank_zero_info(f"budget: {why}: turning {tool.name} on, and measuring the step again ({tool.describe()})")
        self._measure_again()
        return True

    def _undecided(self) -> List[Any]:
        """The tools the budget decides that are off, in the order it weighs them."""
        return [t for t in self.tools() if t.budget_decides and not t.active]

    def _measure_again(self) -> None:
        """The next step measures every layer recomputed, as the first did; what was measured before holds for a
        step without the tool, and is forgotten."""
        self.phase = MEASURE
        self.figures = None
        self._calibrations, self.calibration = {}, 0
        self._over, self._measured = set(), {}
        self.corrections = 0
