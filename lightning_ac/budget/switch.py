"""Each decoder layer's checkpoint function under a memory budget: the engines call it where they would call torch's
checkpoint, and it does what the layer's current choice says.

- keep: the layer's forward runs as it is, saving everything for backward (nothing recomputed);
- selective: torch's checkpoint with the block's save rules (the engines' ``context_fn``);
- recompute: torch's checkpoint without them: the whole layer is recomputed;
- offload: as recompute, through the checkpoint function that also moves the layer's input to host memory
  (``offload.hidden_states: auto``).

The engines stay as they are (they checkpoint every layer, through these functions), and a choice can change from
one step to the next without reinstalling anything.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning_ac.budget.choice import Choice
from lightning_ac.budget.measure import LayerMeter

__all__ = ["LayerSwitch"]


class LayerSwitch:
    """The checkpoint function of decoder layer ``index``.

    Args:
        index: The layer's position among the decoder layers.
        checkpoint_fn: The checkpoint function the plan would give the engines (torch's, or the hidden-state
            offload's wrapper of it).
        meter: Measures the layer's calls while started.
        on_call: Called with the layer's index, the layer call (its keyword inputs bound) and its inputs before the
            layer runs (the budget re-plans a step with more tokens than any measured, or another shape of work,
            before its first layer runs).
        offload_fn: The checkpoint function that moves the layer's input to host memory, for ``offload``.
    """

    def __init__(
        self,
        index: int,
        checkpoint_fn: Callable[..., Any],
        meter: LayerMeter,
        on_call: Optional[Callable[[int, Callable[..., Any], tuple], None]] = None,
        offload_fn: Optional[Callable[..., Any]] = None,
    ) -> None:
        self.index = index
        self.checkpoint_fn = checkpoint_fn
        self.meter = meter
        self.on_call = on_call
        self.offload_fn = offload_fn
        self.choice = Choice.recompute

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.on_call is not None:
            self.on_call(self.index, function, args)
        with self.meter.in_layer():
            if self.choice is Choice.keep:
                return self.meter.wrap(self.index, function)(*args)
            if self.choice is not Choice.selective:
                kwargs.pop("context_fn", None)  # the save rules apply to selective layers only
            measured = self.meter.wrap(self.index, function, under_rules="context_fn" in kwargs)
            if self.choice is Choice.offload:
                assert self.offload_fn is not None, "offload is chosen only where offload.hidden_states is auto"
                return self.offload_fn(measured, *args, **kwargs)
            return self.checkpoint_fn(measured, *args, **kwargs)
