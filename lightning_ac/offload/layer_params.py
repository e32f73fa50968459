"""Layer offloading: frozen decoder-layer parameters live in host memory and visit the device one layer at a time.

Each decoder layer's frozen parameters are copied to host memory once (pinned on an accelerator). Between
uses a parameter's ``.data`` *is* that host copy, so ``state_dict``, checkpoints and user code between steps
see real values. Before a layer runs, its parameters are copied to the device on a side stream, and the next
layer's copy starts while this one computes; after it runs, ``.data`` points at the host copy again and the
device copy is freed. Backward walks the layers in reverse: when the gradient reaches a layer's outputs, that
layer comes back (and the one before it is prefetched), and the layer after it, whose backward is done, goes.
A callback queued on the autograd engine releases whatever is still on the device when backward ends.

Autograd keeps what it saves of a parameter as a view of the parameter's device memory (``linear`` saves
``weight.t()``), which would keep every layer's weights on the device until backward. During a layer's
forward, a saved-tensor hook therefore keeps a reference to the parameter instead of such a view and rebuilds
the view from the reloaded copy when backward asks for it (other tensors go to the saved-tensor hooks already
in force, e.g. activation offloading's). Checkpointed layers recompute in backward, when the layer is on the
device anyway.

On a CPU device the same path runs with separate host tensors standing in for device copies
(``copy_on_host``): that is how the logic is tested without an accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_ac.offload.engine import _Streams

__all__ = ["LayerParamStreamer", "frozen_layer_parameters"]


def frozen_layer_parameters(layers: Sequence[nn.Module]) -> List[List[nn.Parameter]]:
    """For each layer, the parameters layer offloading moves: frozen, plain ``nn.Parameter`` (not quantized or
    sharded subclasses), and used by that layer only (a parameter shared between layers stays put)."""
    owners: Dict[int, int] = {}
    for layer in layers:
        for p in {id(p): p for p in layer.parameters()}.values():
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [
        [p for p in layer.parameters() if not p.requires_grad and type(p) is nn.Parameter and owners[id(p)] == 1]
        for layer in layers
    ]


@dataclass(eq=False)
class _Layer:
    index: int
    params: List[nn.Parameter]
    host: List[torch.Tensor] = field(default_factory=list)  # the parameters' .data between uses
    device: Optional[List[torch.Tensor]] = None  # device copies while the layer is loaded
    event: Any = None  # accelerator event: the host -> device copy has finished
    nbytes: int = 0


@dataclass(eq=False)
class _ParamView:
    """What the saved-tensor hook keeps instead of a view of a loaded parameter."""

    layer: _Layer
    slot: int
    offset: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]


class LayerParamStreamer:
    """Keeps the frozen parameters of ``layers`` in host memory and streams them to ``device`` per layer.

    Args:
        layers: The decoder layers, in forward order.
        params: For each layer, the parameters to stream (see :func:`frozen_layer_parameters`).
        device: The training device.
        copy_on_host: On a CPU device, run the same path with separate host tensors (tests, debugging).

    Attributes:
        stats: This step's ``loads`` (layer copies to the device), ``bytes`` copied, and
            ``max_resident_layers`` (most layers on the device at once).
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        params: Sequence[Sequence[nn.Parameter]],
        device: torch.device,
        copy_on_host: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.on_accelerator = self.device.type != "cpu"
        self.copy_on_host = copy_on_host
        self.modules = list(layers)
        self.layers = [_Layer(i, list(ps)) for i, ps in enumerate(params)]
        # Devices whose module has no streams (MPS) copy synchronously.
        asynchronous = self.on_accelerator and hasattr(torch.get_device_module(self.device.type), "Stream")
        self._streams = _Streams(self.device) if asynchronous else None
        self.stats: Dict[str, int] = {"loads": 0, "bytes": 0, "max_resident_layers": 0}
        self.host_bytes = 0
        self._offloaded = False
        self._handles: List[Any] = []
        self._hook_contexts: List[Any] = []
        self._by_storage: Dict[int, Tuple[_Layer, int]] = {}  # device copy's storage -> (layer, slot)
        self._final_callback_queued = False

    # -- install / remove ---------------------------------------------------------------------------------

    def install(self) -> None:
        """Register the forward hooks on each layer. Parameters move to the host at the first forward, after
        the strategy has placed the model on its device."""
        for layer, module in zip(self.layers, self.modules):
            if not layer.params:
                continue
            self._handles.append(module.register_forward_pre_hook(self._make_pre_hook(layer)))
            self._handles.append(module.register_forward_hook(self._make_post_hook(layer), always_call=True))

    def close(self) -> None:
        """Put every parameter back on the device and remove the hooks. Safe to call more than once."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        while self._hook_contexts:  # a forward that never returned (an exception before the post hook ran)
            context = self._hook_contexts.pop()
            if context is not None:
                context.__exit__(None, None, None)
        if self._streams is not None:
            self._streams.synchronize()
        if self._offloaded:
            for layer in self.layers:
                self._release(layer)
                for p, host in zip(layer.params, layer.host):
                    if _holds(p, host):  # untouched since: the model goes back to the device, as we found it
                        p.data = host.to(self.device) if self.on_accelerator else host.clone()
                layer.host = []
        self._offloaded = False
        self._by_storage.clear()

    def start_step(self) -> None:
        self.stats = {"loads": 0, "bytes": 0, "max_resident_layers": 0}

    # -- moving parameters --------------------------------------------------------------------------------

    def _offload_all(self) -> None:
        """Copy every streamed parameter to the host once, and make the host copy its ``.data``."""
        pin = self._streams is not None
        for layer in self.layers:
            layer.params = [p for p in layer.params if p.device == self.device]
            layer.host = []
            for p in layer.params:
                host = torch.empty_like(p.data, device="cpu", pin_memory=pin)
                host.copy_(p.data)
                layer.host.append(host)
                p.data = host
            layer.nbytes = sum(h.numel() * h.element_size() for h in layer.host)
        self.host_bytes = sum(layer.nbytes for layer in self.layers)
        self._offloaded = True

    def _check_host_copies(self, layer: _Layer) -> None:
        """Someone replaced a parameter's data between steps (``model.to(...)``, a weight update): take the
        new values as the host copy."""
        for slot, (p, host) in enumerate(zip(layer.params, layer.host)):
            if not _holds(p, host):
                fresh = torch.empty_like(p.data, device="cpu", pin_memory=self._streams is not None)
                fresh.copy_(p.data)
                layer.host[slot] = fresh
                p.data = fresh

    def _load(self, layer: _Layer) -> None:
        """Start copying a layer's parameters to the device (asynchronously on an accelerator)."""
        if layer.device is not None:
            return
        if not all(_holds(p, h) for p, h in zip(layer.params, layer.host)):
            self._check_host_copies(layer)
        if self._streams is not None:
            with self._streams.stream(self._streams.h2d):
                layer.device = [h.to(self.device, non_blocking=True) for h in layer.host]
                layer.event = self._streams.h2d.record_event()
        elif self.on_accelerator:
            layer.device = [h.to(self.device) for h in layer.host]
        else:
            layer.device = [h.clone() for h in layer.host]
        for slot, t in enumerate(layer.device):
            self._by_storage[t.untyped_storage().data_ptr()] = (layer, slot)
        self.stats["loads"] += 1
        self.stats["bytes"] += layer.nbytes
        resident = sum(other.device is not None for other in self.layers)
        self.stats["max_resident_layers"] = max(self.stats["max_resident_layers"], resident)

    def _use(self, layer: _Layer) -> None:
        """Make the layer's device copies its parameters' data, once their copy has finished."""
        self._load(layer)
        assert layer.device is not None
        if layer.event is not None and self._streams is not None:
            current = self._streams.current()
            current.wait_event(layer.event)
            for t in layer.device:
                t.record_stream(current)  # allocated on the copy stream, used on this one
            layer.event = None
        for p, t in zip(layer.params, layer.device):
            if not _holds(p, t):
                p.data = t

    def _release(self, layer: _Layer) -> None:
        """Point the parameters back at their host copies; the device copies are freed."""
        if layer.device is None:
            return
        for t in layer.device:
            self._by_storage.pop(t.untyped_storage().data_ptr(), None)
        for p, host in zip(layer.params, layer.host):
            p.data = host
        layer.device = None
        layer.event = None

    def _release_all(self) -> None:
        for layer in self.layers:
            self._release(layer)
        self._final_callback_queued = False

    # -- hooks --------------------------------------------------------------------------------------------

    def _make_pre_hook(self, layer: _Layer) -> Any:
        def pre_hook(module: nn.Module, args: Any) -> None:
            if not self._offloaded:
                self._offload_all()
            self._use(layer)
            if _in_backward():
                return  # a recompute (torch's CheckpointWrapper calls the module again): backward loads
            nxt = layer.index + 1
            if nxt < len(self.layers) and self.layers[nxt].params:
                self._load(self.layers[nxt])
            context = None
            if torch.is_grad_enabled():
                context = torch.autograd.graph.saved_tensors_hooks(*self._saved_tensor_hooks())
                context.__enter__()
            self._hook_contexts.append(context)  # popped by the post hook, which always runs

        return pre_hook

    def _make_post_hook(self, layer: _Layer) -> Any:
        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            if _in_backward():
                return
            context = self._hook_contexts.pop() if self._hook_contexts else None
            if context is not None:
                context.__exit__(None, None, None)
            needs_grad = [t for t in _tensors(output) if t.requires_grad]
            if needs_grad:
                torch.autograd.graph.register_multi_grad_hook(
                    needs_grad, lambda grads: self._backward_reached(layer), mode="any"
                )
            self._release(layer)

        return post_hook

    def _backward_reached(self, layer: _Layer) -> None:
        """The gradient reached this layer's outputs: its backward is next, the later layers' is done."""
        if not self._final_callback_queued:
            self._final_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._release_all)
        self._use(layer)
        for later in self.layers[layer.index + 1 :]:
            self._release(later)
        previous = layer.index - 1
        if previous >= 0 and self.layers[previous].params:
            self._load(self.layers[previous])

    def _saved_tensor_hooks(self) -> Tuple[Any, Any]:
        """Saved-tensor hooks for a layer's forward: views of loaded parameters are kept as references,
        everything else goes to the hooks already in force."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(tensor: torch.Tensor) -> Any:
            found = self._by_storage.get(tensor.untyped_storage().data_ptr()) if tensor.device == self.device else None
            if found is not None:
                layer, slot = found
                copy = layer.device[slot] if layer.device is not None else None
                if copy is not None and tensor.dtype == copy.dtype:
                    size, stride = tuple(tensor.shape), tuple(tensor.stride())
                    return _ParamView(layer, slot, tensor.storage_offset(), size, stride)
            return outer_pack(tensor) if outer_pack is not None else tensor

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, _ParamView):
                self._use(packed.layer)  # loaded by the backward hook; if not (an unusual graph), now
                assert packed.layer.device is not None
                return torch.as_strided(packed.layer.device[packed.slot], packed.size, packed.stride, packed.offset)
            return outer_unpack(packed) if outer_unpack is not None else packed

        return pack, unpack


def _holds(param: nn.Parameter, data: torch.Tensor) -> bool:
    """Whether ``param.data`` is ``data`` (``param.data`` is a new tensor object at each access: compare
    storages)."""
    return param.untyped_storage().data_ptr() == data.untyped_storage().data_ptr() and param.device == data.device


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(output: Any) -> List[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
