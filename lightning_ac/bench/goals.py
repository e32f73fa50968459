"""A preset's goals: one row's activation peak or step time at most a multiple of another row's, in the same run.

The benchmark checks them on the rows it measured and reports each verdict beside its tables (``results.md``) and
in ``goals.json``. A step-time verdict that the repetitions' spread could turn is marked as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

__all__ = ["Goal", "Verdict", "check_goals"]


@dataclass(frozen=True)
class Goal:
    """``mode``'s ``figure`` (``"peak"``: the activation peak; ``"step"``: the step time) at most ``at_most`` times
    ``against``'s."""

    mode: str
    figure: str
    against: str
    at_most: float

    def __post_init__(self) -> None:
        if self.figure not in ("peak", "step"):
            raise ValueError(f"Goal.figure: {self.figure!r}; expected 'peak' or 'step'")

    def describe(self) -> str:
        what = "activation peak" if self.figure == "peak" else "step time"
        return f"`{self.mode}`'s {what} at most {self.at_most:g}x `{self.against}`'s"


@dataclass
class Verdict:
    """A goal checked on measured rows."""

    goal: Goal
    value: Optional[float]  # the mode's figure (bytes or seconds); None when it was not measured
    base: Optional[float]  # the figure it is compared with
    ratio: Optional[float]
    met: Optional[bool]  # None when either figure is missing
    # "within noise" where the repetitions' median steps of either row spread by more than the ratio lies from the
    # goal (another run could turn the verdict), "one repetition" where either ran once (no spread to tell)
    noise: str = ""

    @property
    def text(self) -> str:
        if self.met is None:
            return "not measured"
        return ("met" if self.met else "missed") + (f" ({self.noise})" if self.noise else "")


def _figure(row: object, figure: str) -> Optional[float]:
    if row is None or getattr(row, "status", "ok") != "ok":
        return None
    return getattr(row, "peak_activation_bytes" if figure == "peak" else "step_time_s")


def check_goals(rows: Sequence, goals: Sequence[Goal]) -> List[Verdict]:
    """Each goal's verdict on ``rows`` (benchmark rows: ``mode``, ``status``, ``peak_activation_bytes``,
    ``step_time_s``, ``step_time_spread``)."""
    by = {r.mode: r for r in rows}
    verdicts = []
    for goal in goals:
        row, other = by.get(goal.mode), by.get(goal.against)
        value, base = _figure(row, goal.figure), _figure(other, goal.figure)
        if value is None or not base:
            verdicts.append(Verdict(goal, value, base, None, None))
            continue
        ratio = value / base
        noise = ""
        if goal.figure == "step":
            spreads = [row.step_time_spread, other.step_time_spread]  # type: ignore[union-attr]
            if any(s is None for s in spreads):
                noise = "one repetition"
            elif max(spreads) > abs(ratio - goal.at_most):  # type: ignore[type-var]
                noise = f"within noise: the repetitions spread by {max(spreads):.0%}"  # type: ignore[type-var]
        verdicts.append(Verdict(goal, value, base, ratio, ratio <= goal.at_most, noise))
    return verdicts
