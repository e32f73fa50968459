"""``offload.hidden_states`` for decoder layers compiled one by one (torchtitan's ``layers[i] = torch.compile(...)``,
``layer.compile()``, or ``layer.forward = torch.compile(layer.forward)``).

Inside a compiled region dynamo cannot trace saved-tensor hooks: entered around the checkpoint call, as for an eager
layer, they would make it run the layer eagerly, uncompiled, without a word. So for a compiled layer the hooks go
around the compiled call itself, where the code is eager: torch runs them on what the compiled graph saves, right
after that layer's forward. Of those saves only the layer's positional inputs move (the hidden states), as in
eager, where non-reentrant checkpoint saves exactly those under the hooks; keyword inputs (rotary embeddings, the
mask) and the graph's other saves stay on the device (``offload.all`` moves those too).

The compiled call is an instance attribute that the plan's journal records: the wrapper's ``forward`` (an
``OptimizedModule``), the layer's ``_compiled_call_impl`` (``layer.compile()``) or its compiled ``forward``. Removal
puts it back, and the compiled graphs are untouched: they never see the hooks.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lightning_ac.layers import compiled_function
from lightning_ac.offload.activations import SavedTensorOffloader

__all__ = [
    "COMPILED_CALL_ATTRIBUTES",
    "checkpointed_inside_too",
    "compiled_call",
    "offload_inputs_of_compiled_layer",
]

# Where eager code calls a layer's compiled graph (``forward`` of an OptimizedModule is journaled already).
COMPILED_CALL_ATTRIBUTES = ("_compiled_call_impl",)


def compiled_call(root: nn.Module, name: str, layer: nn.Module, engine: str) -> Optional[Tuple[nn.Module, str]]:
    """The module and attribute through which eager code calls the compiled graph that holds ``layer``'s checkpoint.

    Args:
        root: The module the layer's ``name`` is relative to.
        name: The layer's qualified name (``...layers.0._orig_mod`` inside a ``torch.compile`` wrapper).
        layer: The decoder layer.
        engine: The recompute engine: ``hf`` checkpoints inside the class's ``forward`` (transformers' wrapper), so a
            compiled ``forward`` on the instance holds it; ``torch`` and ``fsdp`` wrap the instance's ``forward``.

    Returns:
        ``None`` where no graph of the layer's own holds its checkpoint: the layer is a ``torch.compile`` wrapper
        itself (selected by name), or the checkpoint wraps its compiled ``forward`` (a compiled ``forward`` on the
        instance under the torch engines, or in the class), so its checkpoint wraps the compiled call from outside,
        in eager, and eager hooks work; or the layer is not compiled by itself.
    """
    if type(layer).__name__ == "OptimizedModule":
        return None
    if getattr(layer, "_compiled_call_impl", None) is not None:  # layer.compile()
        return layer, "_compiled_call_impl"
    if engine == "hf" and compiled_function(layer.__dict__.get("forward")):  # layer.forward = torch.compile(...)
        return layer, "forward"
    parts = name.split(".")
    if parts[-1] == "_orig_mod":
        wrapper = root.get_submodule(".".join(parts[:-1]))
        if "forward" in wrapper.__dict__:  # OptimizedModule: forward is the dynamo-wrapped call of the layer
            return wrapper, "forward"
    return None


def checkpointed_inside_too(layer: nn.Module, engine: str) -> bool:
    """Whether transformers' checkpoint wrapper, around a ``forward`` compiled in the layer's class (``@torch.compile``
    on the method of a subclass), checkpoints inside that compiled forward as well. Measured: the layer's backward
    graph then holds the recompute (20 matmuls on the tests' Llama, as when the checkpoint is inside), and
    ``offload.hidden_states``' hooks made dynamo run the layer eagerly, uncompiled, without a word."""
    return engine == "hf" and "forward" not in layer.__dict__ and compiled_function(type(layer).forward)


def offload_inputs_of_compiled_layer(
    layer: nn.Module, call: Tuple[nn.Module, str], offloader: SavedTensorOffloader
) -> None:
    """Move the positional inputs that ``layer``'s compiled graph saves to the host, through ``offloader``, in
    training calls.

    Args:
        layer: A decoder layer compiled by itself, checkpointed inside its graph.
        call: Where eager code calls its compiled graph (:func:`compiled_call`).
        offloader: ``offload.hidden_states``'s hooks.
    """
    owner, attribute = call
    compiled: Callable[..., Any] = getattr(owner, attribute)

    def compiled_call_offloading_inputs(*args: Any, **kwargs: Any) -> Any:
        if not (layer.training and torch.is_grad_enabled()):
            return compiled(*args, **kwargs)
        # Storages, not tensors: the graph may save a view or an alias of an input rather than the input itself.
        # Plain tensors only: a wrapper subclass (DTensor) has no storage of its own to compare.
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves(args) if type(t) is torch.Tensor}
        with offloader.hooks(only_storages=inputs):
            return compiled(*args, **kwargs)

    setattr(owner, attribute, compiled_call_offloading_inputs)
