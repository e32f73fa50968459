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

and the choice minimises the summed recompute time. With ``offload.hidden_states: auto`` a layer can also be
recomputed with its input in host memory (:attr:`Choice.offload`): it then holds nothing on the device until its
backward reloads the input, costs its recompute and the copies its compute does not hide
(:func:`~lightning_ac.budget.host.offload_seconds`), and holds its input's bytes in host memory, whose sum over the
offloaded layers must stay under the host's room. The prefix sums only grow, so a dynamic
programme over the layers in order, whose state is the bytes held so far (and the host bytes), finds the optimum
exactly (a knapsack with one constraint per backward position). Its states are exact byte counts, none rounded: of the
ways to reach a layer, only those that hold fewer bytes, or fewer host bytes, than every faster way are kept (a way
that holds more of both and is no faster can only do worse from there on), which for a transformer's alike layers
leaves a few states per layer. Should a model's layers be so unlike that the states pass :data:`MAX_STATES`, the
slower ways are thinned out: the choice then still fits by the figures it was given, but may recompute more than
the optimum.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Choice", "LayerFigures", "LayerPlan", "MAX_STATES", "choose", "estimate", "host_bytes_of", "least_memory"]

# The most ways to reach a layer the programme keeps (see the module docstring; alike layers keep a few).
MAX_STATES = 20_000


class Choice(str, enum.Enum):
    """What a decoder layer does in backward."""

    keep = "keep"  # not recomputed: holds everything it saves
    selective = "selective"  # recomputed under the block's save rules
    recompute = "recompute"  # recomputed whole: holds its input only
    offload = "offload"  # recomputed whole, its input in host memory until its backward: holds nothing on the device


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
        offload_seconds: The time a recompute with its input in host memory adds (the recompute and the copies its
            compute does not hide); ``None``: not offered (no ``offload.hidden_states: auto``, or nothing to gain).
    """

    saved_bytes: int
    input_bytes: int
    recompute_seconds: float
    selective_bytes: Optional[int] = None
    selective_seconds: Optional[float] = None
    input_saved_bytes: int = 0
    offload_seconds: Optional[float] = None

    def host_bytes(self, choice: Choice) -> int:
        """What ``choice`` holds in host memory: an offloaded layer's input."""
        return self.input_bytes if choice is Choice.offload else 0

    def cost(self, choice: Choice) -> Tuple[int, int, float]:
        """``(held bytes, working bytes, seconds)`` of ``choice``; selective needs its figures."""
        working = self.input_bytes + self.saved_bytes - min(self.input_saved_bytes, self.input_bytes)
        if choice is Choice.keep:
            return self.saved_bytes, self.saved_bytes, 0.0
        if choice is Choice.recompute:
            return self.input_bytes, working, self.recompute_seconds
        if choice is Choice.offload:
            if self.offload_seconds is None:
                raise ValueError("offloading this layer's input is not offered (offload_seconds is None)")
            return 0, working, self.offload_seconds
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
        if self.offload_seconds is not None:
            offered.append(Choice.offload)
        return {choice: self.cost(choice) for choice in offered}


@dataclass(frozen=True)
class LayerPlan:
    """The choice for every layer, and what the figures say it costs.

    Attributes:
        choices: Per layer, in forward order.
        peak_bytes: The estimated activation peak of the step.
        recompute_seconds: The estimated recompute time per step.
        fits: Whether the estimate is under the budget (``False``: even the least memory the options allow is over
            it, and every layer takes it: :func:`least_memory`).
        host_bytes: What the offloaded layers' inputs hold in host memory.
    """

    choices: Tuple[Choice, ...]
    peak_bytes: int
    recompute_seconds: float
    fits: bool
    host_bytes: int = 0


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


Way = Tuple[int, int, float, Tuple[Choice, ...]]  # (device bytes held, host bytes held, seconds, choices so far)


def _undominated(ways: List[Way]) -> List[Way]:
    """Of ``ways``, those no other way beats on held bytes, host bytes and seconds at once, by held bytes."""
    kept: List[Way] = []
    # the (host bytes, seconds) of the ways kept so far that none of them beats: host bytes up, seconds down. Every
    # kept way holds no more device bytes than the next one, which stays unless one of them is as light on the host
    # and as fast: the frontier's last point at or under its host bytes is the fastest of those
    hosts: List[int] = []
    times: List[float] = []
    for way in sorted(ways, key=lambda w: (w[0], w[1], w[2])):
        _, host, seconds, _ = way
        at = bisect.bisect_right(hosts, host)
        if at and times[at - 1] <= seconds:
            continue
        kept.append(way)
        end = at
        while end < len(hosts) and times[end] >= seconds:  # the points this one beats leave the frontier
            end += 1
        hosts[at:end], times[at:end] = [host], [seconds]
    if len(kept) > MAX_STATES:  # thinned evenly, the least-held and the fastest ways kept: every one still fits
        step = len(kept) / MAX_STATES
        kept = [kept[int(i * step)] for i in range(MAX_STATES - 1)] + [kept[-1]]
    return kept


def least_memory(layers: Sequence[LayerFigures], host_bytes: Optional[int] = None) -> Tuple[Choice, ...]:
    """The choices that hold the least on the device, whatever the time: every input offloaded where every layer
    offers it and the host has the room, else every layer recomputed."""
    offload = tuple(Choice.offload for _ in layers)
    if layers and all(f.offload_seconds is not None for f in layers):
        if host_bytes is None or sum(f.host_bytes(Choice.offload) for f in layers) <= host_bytes:
            return offload
    return tuple(Choice.recompute for _ in layers)


def choose(
    layers: Sequence[LayerFigures],
    budget_bytes: int,
    outside_bytes: int = 0,
    head_bytes: int = 0,
    host_bytes: Optional[int] = None,
) -> LayerPlan:
    """The per-layer choice with the least recompute time whose estimated peak is under ``budget_bytes``, exactly.

    Args:
        layers: Each decoder layer's figures, in forward order.
        budget_bytes: The activation memory a step may use.
        outside_bytes: What is saved outside the layers and held through their backward (the embeddings' output).
        head_bytes: The output head's working set at its backward (logits and loss).
        host_bytes: The host memory the offloaded inputs may hold; ``None``: no limit.

    Returns:
        The optimum (at equal time, the one holding the fewest host bytes, then the fewest device bytes), or
        :func:`least_memory` with ``fits=False`` when nothing fits.
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    everything = tuple(Choice.keep for _ in layers)
    peak, _ = estimate(layers, everything, outside_bytes, head_bytes)
    if peak <= budget_bytes:
        return LayerPlan(everything, peak, 0.0, fits=True)
    room = float("inf") if host_bytes is None else host_bytes
    ways: List[Way] = [(outside_bytes, 0, 0.0, ())]
    for figures in layers:
        options = [(choice, cost, figures.host_bytes(choice)) for choice, cost in figures.options().items()]
        ways = _undominated(
            [
                (held + layer_held, host + layer_host, seconds + layer_seconds, chosen + (choice,))
                for held, host, seconds, chosen in ways
                for choice, (layer_held, working, layer_seconds), layer_host in options
                if held + working <= budget_bytes and host + layer_host <= room
            ]
        )
    finishing = [
        (seconds, host, held, chosen) for held, host, seconds, chosen in ways if held + head_bytes <= budget_bytes
    ]
    if not finishing:
        choices = least_memory(layers, host_bytes)
        peak, seconds = estimate(layers, choices, outside_bytes, head_bytes)
        return LayerPlan(choices, peak, seconds, fits=False, host_bytes=host_bytes_of(layers, choices))
    # the least time; at equal time, the fewest host bytes, then the least held on the device
    _, _, _, choices = min(finishing, key=lambda entry: entry[:3])
    peak, seconds = estimate(layers, choices, outside_bytes, head_bytes)
    return LayerPlan(choices, peak, seconds, fits=True, host_bytes=host_bytes_of(layers, choices))


def host_bytes_of(layers: Sequence[LayerFigures], choices: Sequence[Choice]) -> int:
    """What ``choices`` hold in host memory."""
    return sum(f.host_bytes(c) for f, c in zip(layers, choices))
