"""The exact per-layer choice of the memory budget: measured figures in, keep / selective / recompute per decoder
layer out. A pure function, with no model, engine or torch in it.

The step's activation memory is estimated where its peak happens, not as a sum of averages. Layers run forward in
order, each holding until its backward what its choice leaves it (everything it saves when kept; its input and what
the save rules keep when selective; its input alone when recomputed). Backward runs in reverse, so when it reaches
layer ``i``, layers ``0..i-1`` still hold their bytes, and layer ``i`` has its whole working set materialised: what
it saves (a recomputed or selective layer recreates the rest next to its input). Before the layers, the output head
runs its backward with every layer's bytes held. So, with ``held`` a layer's bytes under its choice and ``working``
its bytes while its backward runs:

- head: ``outside + sum(held) + head <= budget``
- layer ``i``: ``outside + sum(held[:i]) + working[i] <= budget``

and the choice minimises the summed recompute time. The prefix sums only grow, so a dynamic programme over the layers
in order, whose state is the bytes held so far, finds the optimum exactly (a knapsack with one constraint per
backward position). Its states are exact byte counts, none rounded: of the ways to reach a layer, only those that
hold fewer bytes than every faster way are kept (a way that holds more and is no faster can only do worse from there
on), which for a transformer's alike layers leaves a few states per layer. Should a model's layers be so unlike that
the states pass :data:`MAX_STATES`, the slower ways are thinned out: the choice then still fits by the figures it was
given, but may recompute more than the optimum.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Choice", "LayerFigures", "LayerPlan", "choose", "estimate", "MAX_STATES"]

# The most ways to reach a layer the programme keeps (see the module docstring; alike layers keep a few).
MAX_STATES = 20_000


class Choice(str, enum.Enum):
    """What a decoder layer does in backward."""

    keep = "keep"  # not recomputed: holds everything it saves
    selective = "selective"  # recomputed under the block's save rules
    recompute = "recompute"  # recomputed whole: holds its input only


@dataclass(frozen=True)
class LayerFigures:
    """What one decoder layer measured (bytes, seconds).

    Attributes:
        saved_bytes: What its forward saves for backward (a recompute materialises exactly this).
        input_bytes: What it holds when recomputed (its input; less when offload.hidden_states moves it).
        recompute_seconds: The time its recompute adds to a step.
        selective_bytes: What it holds under the save rules (its input and what they keep), if measured.
        selective_seconds: The time a selective recompute adds, if measured.
        input_saved_bytes: What of its input the forward saves itself (counted in ``saved_bytes`` already, so a
            recompute's working set does not hold it twice).
    """

    saved_bytes: int
    input_bytes: int
    recompute_seconds: float
    selective_bytes: Optional[int] = None
    selective_seconds: Optional[float] = None
    input_saved_bytes: int = 0

    def cost(self, choice: Choice) -> Tuple[int, int, float]:
        """``(held bytes, working bytes, seconds)`` of ``choice``; selective needs its figures."""
        working = self.input_bytes + self.saved_bytes - min(self.input_saved_bytes, self.input_bytes)
        if choice is Choice.keep:
            return self.saved_bytes, self.saved_bytes, 0.0
        if choice is Choice.recompute:
            return self.input_bytes, working, self.recompute_seconds
        if self.selective_bytes is None or self.selective_seconds is None:
            raise ValueError("selective figures were not measured for this layer")
        return self.selective_bytes, working, self.selective_seconds

    def options(self) -> Dict[Choice, Tuple[int, int, float]]:
        """The choices on offer, each with :meth:`cost`. Selective is offered only where it was measured faster
        than recomputing the whole layer: its policy runs Python for every op, which can cost more than it saves."""
        offered = [Choice.keep, Choice.recompute]
        if (
            self.selective_bytes is not None
            and self.selective_seconds is not None
            and self.selective_seconds < self.recompute_seconds
        ):
            offered.append(Choice.selective)
        return {choice: self.cost(choice) for choice in offered}


@dataclass(frozen=True)
class LayerPlan:
    """The choice for every layer, and what the figures say it costs.

    Attributes:
        choices: Per layer, in forward order.
        peak_bytes: The estimated activation peak of the step.
        recompute_seconds: The estimated recompute time per step.
        fits: Whether the estimate is under the budget (``False``: even recomputing every layer is over it, and every
            layer is recomputed).
    """

    choices: Tuple[Choice, ...]
    peak_bytes: int
    recompute_seconds: float
    fits: bool


def estimate(
    layers: Sequence[LayerFigures], choices: Sequence[Choice], outside_bytes: int = 0, head_bytes: int = 0
) -> Tuple[int, float]:
    """The step's activation peak and recompute time under ``choices``, by the model in the module docstring."""
    held = outside_bytes
    peak = 0
    seconds = 0.0
    for figures, choice in zip(layers, choices):
        layer_held, working, layer_seconds = figures.cost(choice)
        peak = max(peak, held + working)
        held += layer_held
        seconds += layer_seconds
    return max(peak, held + head_bytes), seconds


def _fastest_per_held(ways: List[Tuple[int, float, Tuple[Choice, ...]]]) -> List[Tuple[int, float, Tuple[Choice, ...]]]:
    """Of ``(held, seconds, choices)`` ways, those that hold fewer bytes than every faster one, by held bytes."""
    kept: List[Tuple[int, float, Tuple[Choice, ...]]] = []
    for way in sorted(ways, key=lambda w: (w[0], w[1])):
        if not kept or way[1] < kept[-1][1]:
            kept.append(way)
    if len(kept) > MAX_STATES:  # thinned evenly, the least-held and the fastest ways kept: every one still fits
        step = len(kept) / MAX_STATES
        kept = [kept[int(i * step)] for i in range(MAX_STATES - 1)] + [kept[-1]]
    return kept


def choose(
    layers: Sequence[LayerFigures],
    budget_bytes: int,
    outside_bytes: int = 0,
    head_bytes: int = 0,
) -> LayerPlan:
    """The per-layer choice with the least recompute time whose estimated peak is under ``budget_bytes``, exactly.

    Args:
        layers: Each decoder layer's figures, in forward order.
        budget_bytes: The activation memory a step may use.
        outside_bytes: What is saved outside the layers and held through their backward (the embeddings' output).
        head_bytes: The output head's working set at its backward (logits and loss).

    Returns:
        The optimum (at equal time, the one holding the least), or every layer recomputed with ``fits=False`` when
        nothing fits.
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    everything = tuple(Choice.keep for _ in layers)
    peak, _ = estimate(layers, everything, outside_bytes, head_bytes)
    if peak <= budget_bytes:
        return LayerPlan(everything, peak, 0.0, fits=True)
    # the ways to reach the next layer: (bytes held, seconds, choices so far)
    ways: List[Tuple[int, float, Tuple[Choice, ...]]] = [(outside_bytes, 0.0, ())]
    for figures in layers:
        options = figures.options().items()
        ways = _fastest_per_held(
            [
                (held + layer_held, seconds + layer_seconds, chosen + (choice,))
                for held, seconds, chosen in ways
                for choice, (layer_held, working, layer_seconds) in options
                if held + working <= budget_bytes
            ]
        )
    # the least time; at equal time, the least memory held (the ways are ordered by held bytes)
    finishing = [(seconds, held, chosen) for held, seconds, chosen in ways if held + head_bytes <= budget_bytes]
    if not finishing:
        choices: Tuple[Choice, ...] = tuple(Choice.recompute for _ in layers)
        peak, seconds = estimate(layers, choices, outside_bytes, head_bytes)
        return LayerPlan(choices, peak, seconds, fits=False)
    _, _, choices = min(finishing, key=lambda entry: (entry[0], entry[1]))
    peak, seconds = estimate(layers, choices, outside_bytes, head_bytes)
    return LayerPlan(choices, peak, seconds, fits=True)
