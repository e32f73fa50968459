"""bitsandbytes' 4-bit linears under layer offloading: the packed weight their backward keeps outside autograd's
saved tensors, taken out after the call and put back from the reloaded copy just before that backward runs."""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

from lightning_ac.offload.weights.saved import nodes_near, output_tensors
from lightning_ac.offload.weights.slots import ParamView, Slot, StreamedLayer, is_params4bit

__all__ = ["KeptWeightHooks"]


class KeptWeightHooks:
    """bitsandbytes' 4-bit matmul keeps the packed weight for its backward outside autograd's saved tensors
    (``ctx.tensors``), where the saved-tensor hook cannot replace it, and that reference would keep the layer's
    device copy alive until backward. After each 4-bit linear's call, the reference is taken out and put back,
    from the reloaded copy, just before that backward node runs.

    Args:
        loaded: Each loaded device copy's storage pointer, and the layer and slot it is a copy of.
        rebuild: Makes the weight again from the layer's reloaded copy.
    """

    def __init__(
        self, loaded: Dict[int, Tuple[StreamedLayer, Slot]], rebuild: Callable[[ParamView], torch.Tensor]
    ) -> None:
        self._loaded = loaded
        self._rebuild = rebuild

    def install(self, layer: StreamedLayer, module: nn.Module) -> List[Any]:
        """Hook each 4-bit linear of ``module`` whose weight ``layer`` streams; the hooks' handles."""
        streamed = {id(p) for p in layer.params}
        handles = []
        for sub in module.modules():
            weight = sub._parameters.get("weight")
            if weight is None or id(weight) not in streamed or not is_params4bit(weight):
                continue
            # On a CPU with AVX512-bf16, bitsandbytes repacks the weight for its CPU kernel at its first call in
            # eval mode without gradient, replacing the data the streamer swaps: the release adopts it.
            handles.append(sub.register_forward_hook(self._drop_kept_weights))
        return handles

    def _drop_kept_weights(self, module: nn.Module, args: Any, output: Any) -> None:
        for node in nodes_near(output_tensors(output), depth=3):
            kept = getattr(node, "tensors", None)
            if type(node).__name__ != "MatMul4BitBackward" or not isinstance(kept, tuple) or len(kept) != 2:
                continue
            weight = kept[1]
            if not isinstance(weight, torch.Tensor):
                continue
            found = self._loaded.get(weight.untyped_storage().data_ptr())
            if found is None:
                continue
            view = ParamView(found[0], found[1], weight.storage_offset(), tuple(weight.shape), tuple(weight.stride()))
            node.tensors = (kept[0], None)
            # weak: a hook holding its own node would keep the graph (and what it rebuilt) alive for ever
            ref = weakref.ref(node)
            node.register_prehook(functools.partial(self._restore_kept_weight, ref, view))
            node.register_hook(functools.partial(self._drop_kept_weight, ref))

    def _restore_kept_weight(self, ref: Any, view: ParamView, grad_outputs: Any) -> None:
        """Just before the node's backward: the packed weight, from the reloaded device copy."""
        node = ref()
        if node is not None:
            node.tensors = (node.tensors[0], self._rebuild(view))

    def _drop_kept_weight(self, ref: Any, grad_inputs: Any, grad_outputs: Any) -> None:
        """Right after it: let go of the device copy, which the layer's release frees (a retained graph's next
        backward rebuilds it again)."""
        node = ref()
        if node is not None:
            node.tensors = (node.tensors[0], None)
