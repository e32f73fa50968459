"""Autograd's side of layer offloading: saved-tensor hooks that keep a reference instead of a view of a loaded
parameter, and what the forward hooks read off the graph."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torch import nn

from lightning_ac.offload.weights.slots import ParamView, Slot, StreamedLayer

__all__ = ["in_backward", "nodes_near", "output_tensors", "param_view_hooks"]


def param_view_hooks(
    device: torch.device,
    loaded: Dict[int, Tuple[StreamedLayer, Slot]],
    rebuild: Callable[[ParamView], torch.Tensor],
) -> Tuple[Any, Any]:
    """Saved-tensor hooks for a layer's call: views of loaded parameters are kept as references, everything else
    goes to the hooks already in force (activation offloading's, or a checkpoint's around the layer).

    Args:
        device: The training device.
        loaded: Each loaded device copy's storage pointer, and the layer and slot it is a copy of.
        rebuild: Makes the view again, from the layer's reloaded copy, when backward asks for it.
    """
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(tensor: torch.Tensor) -> Any:
        plain = type(tensor) in (torch.Tensor, nn.Parameter) and tensor.layout is torch.strided
        if plain and tensor.device == device:
            found = loaded.get(tensor.untyped_storage().data_ptr())
            if found is not None:
                layer, slot = found
                copy = layer.copy_of(slot)
                if copy is not None and tensor.dtype == copy.dtype:
                    size, stride = tuple(tensor.shape), tuple(tensor.stride())
                    return ParamView(layer, slot, tensor.storage_offset(), size, stride)
        return outer_pack(tensor) if outer_pack is not None else tensor

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, ParamView):
            return rebuild(packed)
        return outer_unpack(packed) if outer_unpack is not None else packed

    return pack, unpack


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread (a recompute, a backward hook)."""
    return torch._C._current_graph_task_id() != -1


def nodes_near(tensors: Sequence[torch.Tensor], depth: int) -> List[Any]:
    """The autograd nodes within ``depth`` steps of ``tensors``' ``grad_fn``."""
    found: List[Any] = []
    frontier = [t.grad_fn for t in tensors if t.grad_fn is not None]
    for _ in range(depth):
        found += frontier
        frontier = [nxt for node in frontier for nxt, _ in node.next_functions if nxt is not None]
    return found


def output_tensors(output: Any) -> List[torch.Tensor]:
    """The tensors in a module's output, however nested."""
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
