"""Layer offloading: frozen decoder-layer parameters live in host memory and visit the device one layer at a time.

Each decoder layer's frozen parameters are copied once into one host buffer per layer (pinned on an accelerator), in
``Callback.setup``, before the strategy places the module: the strategy's ``module.to(device)`` skips them (a dtype
conversion converts their host copies), DDP's broadcast of the module's state leaves them to us, and the device
never holds them whole. Between uses a parameter's ``.data`` *is* its slice of that buffer, so ``state_dict``,
checkpoints and user code between steps see real values. Before a layer runs, its parameters are copied to the
device on a side stream, and the next layer's copy starts while this one computes; after it runs, ``.data`` points
at the host copy again and the device copy is freed. Backward walks the layers in reverse: when the gradient reaches
a layer's outputs (or the layer is called again to recompute it), that layer comes back, the one before it is
prefetched, and every other layer (those after it, whose backward is done, and the end of another forward's chain
when a step ran the layers more than once) goes. A callback queued on the autograd engine releases whatever is still
on the device when backward ends.

Autograd keeps what it saves of a parameter as a view of the parameter's device memory (``linear`` saves
``weight.t()``), which would keep every layer's weights on the device until backward. During a layer's call a
saved-tensor hook therefore keeps a reference to the parameter instead of such a view and rebuilds the view
from the reloaded copy when backward asks for it; other tensors go to the saved-tensor hooks already in force
(activation offloading's, or a checkpoint's around the layer).

The CPU may run ahead of the device; the allocator cannot reuse a released copy until the device has finished
with it (the copy is ``record_stream``'d to the compute stream), so the host waits for the device before each
new copy (as FSDP's ``limit_all_gathers`` does), to keep two layers on the device at most: in forward the next
layer is loaded once this one's kernels are issued, after the device has passed the release of the layer
before; in backward the layer before is loaded once the device has passed the release of the layer after.

On a CPU device the same path runs synchronously with separate host tensors standing in for device copies
(``copy_on_host``); the accelerator branch runs on the CPU on the simulated asynchronous device
(:mod:`lightning_ac.testing.simulated`).
"""

from __future__ import annotations

import collections
import functools
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_ac.offload.device import DeviceStreams, async_device, check_host_budget, host_limit, stands_for_plain

__all__ = ["LayerWeightStreamer", "frozen_layer_parameters"]

_ALIGN = 64  # bytes: every parameter's slice of a layer's host buffer starts on a cache line


def frozen_layer_parameters(layers: Sequence[nn.Module]) -> List[List[nn.Parameter]]:
    """For each layer, the parameters layer offloading moves: frozen, plain ``nn.Parameter`` or bitsandbytes'
    4-bit ``Params4bit`` (with its quant state; other subclasses, such as DTensor shards, stay put), and used by
    that layer only (a parameter shared between layers stays put)."""
    owners: Dict[int, int] = {}
    for layer in layers:
        for p in layer.parameters():  # each parameter once per layer (parameters() drops duplicates)
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [
        [p for p in layer.parameters() if not p.requires_grad and _streamable(p) and owners[id(p)] == 1]
        for layer in layers
    ]


def _streamable(p: nn.Parameter) -> bool:
    if type(p) is nn.Parameter or (stands_for_plain(p) and isinstance(p, nn.Parameter)):
        return True
    return _is_params4bit(p) and getattr(p, "quant_state", None) is not None


def _is_params4bit(p: torch.Tensor) -> bool:
    """bitsandbytes' 4-bit parameter, recognised without importing bitsandbytes."""
    cls = type(p)
    return cls.__name__ == "Params4bit" and cls.__module__.startswith("bitsandbytes")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(eq=False)
class _Slot:
    """One tensor a layer streams: a parameter's ``.data``, or a tensor of a 4-bit parameter's quant state
    (``absmax``, ``code``; with double quantization also ``offset`` and the nested state's), which the
    dequantizing kernels read next to the packed weight."""

    param: nn.Parameter
    owner: Any  # the parameter, or the (nested) QuantState holding the tensor
    attr: str  # "data", or the QuantState attribute

    def get(self) -> torch.Tensor:
        return self.owner.data if self.attr == "data" else getattr(self.owner, self.attr)

    def set(self, tensor: torch.Tensor) -> None:
        if self.attr == "data":
            self.owner.data = tensor
        else:
            setattr(self.owner, self.attr, tensor)


def _slots(param: nn.Parameter) -> List[_Slot]:
    """What streaming ``param`` moves: its data, and for a 4-bit parameter the tensors of its quant state."""
    slots = [_Slot(param, param, "data")]
    state = getattr(param, "quant_state", None) if _is_params4bit(param) else None
    if state is not None:
        slots += [_Slot(param, state, "absmax"), _Slot(param, state, "code")]
        if getattr(state, "nested", False):
            slots += [_Slot(param, state, "offset"), _Slot(param, state.state2, "absmax")]
            slots += [_Slot(param, state.state2, "code")]
    return slots


@dataclass(eq=False)
class _Layer:
    index: int
    params: List[nn.Parameter]
    slots: List[_Slot] = field(default_factory=list)  # what moves for ``params``, in order
    host: List[torch.Tensor] = field(default_factory=list)  # each slot's tensor between uses
    buffer: Optional[torch.Tensor] = None  # the host buffer ``host`` slices
    device: Optional[List[torch.Tensor]] = None  # each slot's device copy while the layer is loaded
    event: Any = None  # accelerator event: the host -> device copy has finished
    nbytes: int = 0

    def copy_of(self, slot: _Slot) -> Optional[torch.Tensor]:
        """The device copy of ``slot`` while the layer is loaded (found by identity: a call that replaced some of
        the layer's tensors can change which slots the layer has), else ``None``."""
        if self.device is None:
            return None
        return next((t for s, t in zip(self.slots, self.device) if s is slot), None)


@dataclass(eq=False)
class _ParamView:
    """What the saved-tensor hook keeps instead of a view of a loaded parameter."""

    layer: _Layer
    slot: _Slot
    offset: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]


class LayerWeightStreamer:
    """Keeps the frozen parameters of ``layers`` in host memory and streams them to ``device`` per layer.

    Args:
        layers: The decoder layers, in forward order.
        params: For each layer, the parameters to stream (see :func:`frozen_layer_parameters`).
        device: The training device.
        copy_on_host: On a CPU device, run the same path with separate host tensors (tests, debugging).
        host_reserve_bytes: Host memory left free: needing more raises :class:`HostMemoryError` in
            :meth:`install` instead of letting the OOM killer end the run.
        groups: For each layer, the model it belongs to (a policy and a frozen reference model in one module):
            layers are prefetched only within their model, whose layers run in order. ``None``: one model.
        resident: For each layer, whether its frozen weights stay on the device (``params`` empty for it).

    Attributes:
        stats: This step's ``loads`` (layer copies to the device), ``bytes`` copied, and
            ``max_resident_layers`` (most layers on the device at once).
        host_bytes: Bytes of parameters held in host memory.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        params: Sequence[Sequence[nn.Parameter]],
        device: torch.device,
        copy_on_host: bool = False,
        host_reserve_bytes: int = 2 * 2**30,
        groups: Optional[Sequence[int]] = None,
        resident: Optional[Sequence[bool]] = None,
    ) -> None:
        self.device = torch.device(device)
        self.on_accelerator = self.device.type != "cpu"
        self.copy_on_host = copy_on_host
        self.host_reserve_bytes = host_reserve_bytes
        self.modules = list(layers)
        self.groups = list(groups) if groups is not None else [0] * len(self.modules)
        self.resident = list(resident) if resident is not None else [False] * len(self.modules)
        self.layers = [_Layer(i, list(ps)) for i, ps in enumerate(params)]
        self._async = async_device(self.device)  # None: copies are synchronous (CPU copy_on_host, MPS)
        self._streams = DeviceStreams(self._async) if self._async is not None else None
        self.stats: Dict[str, int] = {"loads": 0, "bytes": 0, "max_resident_layers": 0}
        self.host_bytes = 0
        self._offloaded = False
        self._handles: List[Any] = []
        self._hook_contexts: List[Any] = []
        self._by_storage: Dict[int, Tuple[_Layer, _Slot]] = {}  # device copy's storage -> (layer, slot)
        self._release_events: Deque[Any] = collections.deque()
        self._registered: List[torch.Tensor] = []  # host buffers pinned with cudaHostRegister
        self._guarded: List[nn.Module] = []  # submodules whose _apply skips streamed parameters
        self._backward_task: Optional[int] = None  # the graph task whose final callback is queued

    @property
    def streamed(self) -> List[nn.Parameter]:
        """Every parameter this streamer moves."""
        return [p for layer in self.layers for p in layer.params]

    def describe(self, noun: str = "decoder layers") -> str:
        """What moves, as the log line says it (``noun``: what the layers are)."""
        with_params = [layer for layer in self.layers if layer.params]
        # copy_on_host on a CPU trainer: the copies go to separate host buffers, standing in for the device
        where = "separate host buffers" if self.device.type == "cpu" else str(self.device)
        resident = sum(self.resident)
        kept = f"; {resident} resident on the device" if resident else ""
        return (
            f"layer offloading: frozen parameters of {len(with_params)}/{len(self.layers)} {noun} "
            f"({self.streamed_bytes / 2**20:.1f} MiB) live in host memory and are copied to {where} one layer at a "
            f"time{kept}"
        )

    def describe_layer(self, index: int) -> Optional[str]:
        """What moves for decoder layer ``index`` (for the per-layer report), ``None`` when nothing does."""
        if index < len(self.resident) and self.resident[index]:
            frozen = sum(_nbytes(p) for p in self.modules[index].parameters() if not p.requires_grad)
            return f"frozen params ({frozen / 2**20:.1f} MiB) resident on the device"
        if index >= len(self.layers) or not self.layers[index].params:
            return None
        frozen = self.layers[index].nbytes
        return f"frozen params ({frozen / 2**20:.1f} MiB) ↔ cpu"

    @property
    def streamed_bytes(self) -> int:
        """Bytes this streamer moves per layer visit, summed over the layers (4-bit weights with their quant
        state)."""
        return sum(layer.nbytes for layer in self.layers)

    def kept_frozen_bytes(self) -> int:
        """Bytes of frozen decoder-layer parameters this streamer does not move (parameter subclasses such as
        quantized weights, shared parameters)."""
        streamed = {id(p) for p in self.streamed}
        kept = {
            id(p): _nbytes(p)
            for m, resident in zip(self.modules, self.resident)
            if not resident  # kept on purpose
            for p in m.parameters()
            if not p.requires_grad
        }
        return sum(n for i, n in kept.items() if i not in streamed)

    # -- install / remove ---------------------------------------------------------------------------------

    def install(self) -> None:
        """Move the streamed parameters to host memory now, guard them against module conversions, and
        register the forward hooks on each layer.

        Called before the strategy places the module on its device (``Callback.setup``), so that the device never
        holds the streamed weights whole: the strategy's ``module.to(device)`` (and a precision plugin's dtype
        conversion) skip them, and a dtype conversion is applied to their host copies instead.
        """
        self._offload_all()
        for layer, module in zip(self.layers, self.modules):
            if not layer.params:
                continue
            self._guard_conversions(layer, module)
            self._handles.append(module.register_forward_pre_hook(self._make_pre_hook(layer)))
            self._handles.append(module.register_forward_hook(self._make_post_hook(layer), always_call=True))
            self._install_4bit_hooks(layer, module)

    def _install_4bit_hooks(self, layer: _Layer, module: nn.Module) -> None:
        """bitsandbytes' 4-bit matmul keeps the packed weight for its backward outside autograd's saved tensors
        (``ctx.tensors``), where the saved-tensor hook cannot replace it, and that reference would keep the
        layer's device copy alive until backward. After each 4-bit linear's call, the reference is taken out
        and put back, from the reloaded copy, just before that backward node runs."""
        streamed = {id(p) for p in layer.params}
        for sub in module.modules():
            weight = sub._parameters.get("weight")
            if weight is None or id(weight) not in streamed or not _is_params4bit(weight):
                continue
            # On a CPU with AVX512-bf16, bitsandbytes repacks the weight for its CPU kernel at its first call in
            # eval mode without gradient, replacing the data this streamer swaps: the release adopts it.
            self._handles.append(sub.register_forward_hook(self._drop_kept_weights))

    def _drop_kept_weights(self, module: nn.Module, args: Any, output: Any) -> None:
        for node in _nodes_near(_tensors(output), depth=3):
            kept = getattr(node, "tensors", None)
            if type(node).__name__ != "MatMul4BitBackward" or not isinstance(kept, tuple) or len(kept) != 2:
                continue
            weight = kept[1]
            if not isinstance(weight, torch.Tensor):
                continue
            found = self._by_storage.get(weight.untyped_storage().data_ptr())
            if found is None:
                continue
            view = _ParamView(found[0], found[1], weight.storage_offset(), tuple(weight.shape), tuple(weight.stride()))
            node.tensors = (kept[0], None)
            # weak: a hook holding its own node would keep the graph (and what it rebuilt) alive for ever
            ref = weakref.ref(node)
            node.register_prehook(functools.partial(self._restore_kept_weight, ref, view))
            node.register_hook(functools.partial(self._drop_kept_weight, ref))

    def _restore_kept_weight(self, ref: Any, view: _ParamView, grad_outputs: Any) -> None:
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

    def broadcast(self, src: int = 0) -> None:
        """Give every process the streamed weights of process ``src``: DDP's broadcast of the module's state at
        setup must not see them (it would need them on the device, whole), so this does it one parameter at a
        time, through the device when the backend needs device tensors."""
        import torch.distributed as dist

        for layer in self.layers:
            for host in layer.host:
                staged = host.to(self.device) if self.on_accelerator else host.contiguous()
                dist.broadcast(staged, src)
                if staged.data_ptr() != host.data_ptr():
                    host.copy_(staged)

    def _guard_conversions(self, layer: _Layer, module: nn.Module) -> None:
        """Make ``module.to(...)``, ``.half()``, ``.cuda()`` and the like leave this layer's streamed parameters
        in host memory: each submodule that holds one gets an ``_apply`` (:class:`_ApplyGuard`) that hides them
        from the conversion, then converts their dtype on the host if the conversion changes it."""
        streamed = {id(p) for p in layer.params}
        for sub in module.modules():
            holds = any(p is not None and id(p) in streamed for p in sub._parameters.values())
            if holds and "_apply" not in sub.__dict__:
                sub._apply = _ApplyGuard(self, layer, sub)
                self._guarded.append(sub)

    def _converted(self, layer: _Layer, params: Sequence[nn.Parameter], fn: Any) -> None:
        """After a module conversion that skipped ``params``: apply its dtype change to their host copies."""
        for param in params:
            # What the conversion makes of a tensor of this dtype, without allocating one on the device
            dtype = fn(torch.empty(0, dtype=param.dtype)).dtype
            if dtype != param.dtype:
                param.data = param.data.to(dtype)  # still host memory
        if layer.device is None:
            self._refresh(layer)  # the layer gets a new host buffer in the new dtype

    def _unguard_conversions(self) -> None:
        for sub in self._guarded:
            sub.__dict__.pop("_apply", None)
        self._guarded = []

    def close(self, to: Optional[torch.device] = None) -> None:
        """Remove the hooks and give every parameter its own memory on ``to`` again (default: the training
        device; pageable memory when ``to`` is the CPU). Safe to call more than once."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._unguard_conversions()
        while self._hook_contexts:  # a call that never returned (an exception before the post hook ran)
            context = self._hook_contexts.pop()
            if context is not None:
                context.__exit__(None, None, None)
        if self._streams is not None:
            self._streams.synchronize()
        target = torch.device(to) if to is not None else self.device
        if self._offloaded:
            for layer in self.layers:
                self._release(layer)
                for slot, host in zip(layer.slots, layer.host):
                    if _holds(slot.get(), host):  # untouched since: the parameter gets memory of its own back
                        slot.set(self._own_copy(host, target))
                layer.host = []
        self._offloaded = False
        self._release_events.clear()
        self._by_storage.clear()
        self._unregister_host_buffers()

    def start_step(self) -> None:
        """Reset the step's figures; release anything a failed backward left on the device."""
        self._release_all()
        self.stats = {"loads": 0, "bytes": 0, "max_resident_layers": 0}

    # -- host memory --------------------------------------------------------------------------------------

    def _offload_all(self) -> None:
        """Copy every streamed parameter to the host once, and make the host copy its ``.data``. Parameters
        elsewhere (on the meta device, on another accelerator) are not streamed."""
        for layer in self.layers:
            layer.params = [p for p in layer.params if all(self._movable(slot.get()) for slot in _slots(p))]
            layer.slots = [slot for p in layer.params for slot in _slots(p)]
        check_host_budget(
            "layer_offloading",
            sum(_nbytes(slot.get()) for layer in self.layers for slot in layer.slots),
            host_limit(self.host_reserve_bytes),
            self.host_reserve_bytes,
            "Free host memory, use fewer data-parallel processes per machine, or set layer_offloading: false.",
        )
        for layer in self.layers:
            self._rehost(layer)  # no old buffer yet
        self._count_host_bytes()
        self._offloaded = True

    def _rehost(self, layer: _Layer) -> None:
        """Copy the layer's tensors, as they are now, into a new host buffer, and let the old one, if any, go
        (unpinned: a dtype conversion must not leave the old dtype's buffer page-locked beside the new one)."""
        old = layer.buffer
        layer.host, layer.buffer = self._host_copies([slot.get() for slot in layer.slots])
        for slot, host in zip(layer.slots, layer.host):
            slot.set(host)
        if old is not None and any(b is old for b in self._registered):
            if self._streams is not None:
                self._streams.synchronize()  # no copy may still read it (a prefetch released unused)
            self._registered = [b for b in self._registered if b is not old]
            assert self._async is not None
            self._async.unpin(old)

    def _movable(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" or tensor.device == self.device

    def _count_host_bytes(self) -> None:
        for layer in self.layers:
            layer.nbytes = sum(_nbytes(h) for h in layer.host)
        self.host_bytes = sum(layer.nbytes for layer in self.layers)

    def _host_copies(self, tensors: Sequence[torch.Tensor]) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """Host copies of ``tensors``: slices of one buffer for the layer (a non-contiguous tensor gets memory of
        its own, so that its strides survive), and that buffer."""
        offsets: List[Optional[int]] = []
        total = 0
        for p in tensors:
            if p.is_contiguous():
                total = -(-total // _ALIGN) * _ALIGN
                offsets.append(total)
                total += _nbytes(p)
            else:
                offsets.append(None)
        buffer = self._host_buffer(total)
        copies = []
        for p, offset in zip(tensors, offsets):
            if offset is None:  # small: torch's pinned allocator (registering it in place could share a page)
                host = torch.empty_like(p, device="cpu")
                host = self._async.pin(host) if self._async is not None else host
            else:
                host = buffer[offset : offset + _nbytes(p)].view(p.dtype).view(p.shape)
            host.copy_(p)
            copies.append(host)
        return copies, buffer

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        """Host bytes for one layer: pinned (in place where the device can) when copies run on streams."""
        return self._pinned(torch.empty(nbytes, dtype=torch.uint8))

    def _pinned(self, buffer: torch.Tensor) -> torch.Tensor:
        if self._async is None or buffer.numel() == 0:
            return buffer
        pinned = self._async.pin_in_place(buffer)
        if pinned.data_ptr() == buffer.data_ptr():
            self._registered.append(pinned)  # page-locked in place: unpinned in close()
        return pinned

    def _unregister_host_buffers(self) -> None:
        if self._async is not None:
            for buffer in self._registered:
                self._async.unpin(buffer)
        self._registered = []

    def _own_copy(self, host: torch.Tensor, target: torch.device) -> torch.Tensor:
        if target.type == "cpu":
            return torch.empty_like(host, pin_memory=False).copy_(host)  # no pinned memory left to the user
        return host.to(target)

    def _refresh(self, layer: _Layer) -> None:
        """Between uses: a parameter that now trains (a fine-tuning schedule unfroze it) leaves the stream and
        gets device memory of its own; a tensor someone replaced (``model.to(...)``) gets a new host copy."""
        if all(not s.param.requires_grad and _holds(s.get(), h) for s, h in zip(layer.slots, layer.host)):
            return  # the usual case, checked at every load: nothing changed since the last use
        for slot, host in zip(layer.slots, layer.host):
            if slot.param.requires_grad:
                slot.set(self._own_copy(host if _holds(slot.get(), host) else slot.get(), self.device))
        kept = [(s, h) for s, h in zip(layer.slots, layer.host) if not s.param.requires_grad]
        layer.params = [p for p in layer.params if not p.requires_grad]
        layer.slots, layer.host = [s for s, _ in kept], [h for _, h in kept]
        if any(not _holds(slot.get(), host) for slot, host in zip(layer.slots, layer.host)):
            self._rehost(layer)
        self._count_host_bytes()

    # -- moving parameters --------------------------------------------------------------------------------

    def _load(self, layer: _Layer, pending_releases: int = 1) -> None:
        """Start copying a layer's parameters to the device (asynchronously on an accelerator).

        Args:
            layer: The layer to load.
            pending_releases: How many released layers the device may still be using when the copy starts: the
                memory of a released copy is reusable only once the device has passed its release.
        """
        if layer.device is not None:
            return
        self._refresh(layer)
        if not layer.params:
            return
        if self._streams is not None:
            while len(self._release_events) > pending_releases:
                self._release_events.popleft().synchronize()  # bound how far the CPU runs ahead
            with self._streams.stream(self._streams.h2d):
                layer.device = [self._async.to_device(h, f"layer weights: layer {layer.index}") for h in layer.host]
                layer.event = self._streams.h2d.record_event()
        elif self.on_accelerator:
            layer.device = [h.to(self.device) for h in layer.host]
        else:
            layer.device = [h.clone() for h in layer.host]
        for slot, t in zip(layer.slots, layer.device):
            self._by_storage[t.untyped_storage().data_ptr()] = (layer, slot)
        self.stats["loads"] += 1
        self.stats["bytes"] += layer.nbytes
        resident = sum(other.device is not None for other in self.layers)
        self.stats["max_resident_layers"] = max(self.stats["max_resident_layers"], resident)

    def _use(self, layer: _Layer) -> None:
        """Make the layer's device copies its parameters' data, once their copy has finished."""
        self._load(layer)
        if layer.device is None:
            return
        if layer.event is not None and self._streams is not None:
            current = self._streams.current()
            current.wait_event(layer.event)
            for t in layer.device:
                self._streams.device.record_stream(t, current)  # allocated on the copy stream, used on this one
            layer.event = None
        for slot, t in zip(layer.slots, layer.device):
            if not _holds(slot.get(), t):
                slot.set(t)

    def _release(self, layer: _Layer) -> None:
        """Point the parameters back at their host copies; the device copies are freed."""
        if layer.device is None:
            return
        for key in [t.untyped_storage().data_ptr() for t in layer.device]:  # no loop variable keeps one alive
            self._by_storage.pop(key, None)
        holding = [slot.get() for slot in layer.slots]
        # A prefetch released unused (the forward raised before the layer ran) never became the parameters' data:
        # they still hold their host copies. Anything else a slot holds was put there by the layer's call.
        if all(_holds(c, t) or _holds(c, h) for c, t, h in zip(holding, layer.device, layer.host)):
            for slot, host in zip(layer.slots, layer.host):
                slot.set(host)
        else:
            self._adopt_replaced(layer)
        del holding
        layer.device = None
        layer.event = None
        if self._streams is not None:
            self._release_events.append(self._streams.current().record_event())

    def _adopt_replaced(self, layer: _Layer) -> None:
        """The layer's call replaced some of its tensors: what it holds now is what it computes with from then on,
        as it would without offloading, so it becomes the layer's new host copy.

        bitsandbytes does this on a CPU with AVX512-bf16: at a 4-bit linear's first call in eval mode without
        gradient it repacks the weight (another layout, ``absmax`` transposed to bf16, a nested state folded into
        it and dropped) and flags the quant state, and from then on computes with its AVX512-bf16 kernel. Putting
        the old host copies back would hand that kernel the old layout; keeping the layout from before the repack
        (turning the repack off) computes with other kernels than the same model without offloading.
        """
        known = {(id(s.owner), s.attr): s for s in layer.slots}
        # The same slot objects where the tensor still exists: saved-tensor views name the slot they came from.
        slots = [known.get((id(s.owner), s.attr), s) for p in layer.params for s in _slots(p)]
        for slot, host in zip(layer.slots, layer.host):
            if all(slot is not s for s in slots):
                # No longer part of the state (a folded nested state's): its own small copy of its last value,
                # not a device copy, nor a slice keeping the old host buffer alive.
                slot.set(self._own_copy(host, torch.device("cpu")))
        layer.slots = slots
        self._rehost(layer)  # copies what the slots hold now: device copies, and what the call put in their place
        self._count_host_bytes()

    def _release_all(self) -> None:
        for layer in self.layers:
            self._release(layer)

    # -- hooks --------------------------------------------------------------------------------------------

    def _make_pre_hook(self, layer: _Layer) -> Any:
        def pre_hook(module: nn.Module, args: Any) -> None:
            if _in_backward():
                # Called again in backward: a recompute by a checkpoint around the layer's call (torch's
                # CheckpointWrapper, a model's own checkpoint): the layer's backward is next.
                self._backward_reached(layer)
            else:
                self._use(layer)
            context = None
            if torch.is_grad_enabled():
                # Pushed in forward and in a recompute alike, so a checkpoint around the call sees the same saves.
                context = torch.autograd.graph.saved_tensors_hooks(*self._saved_tensor_hooks())
                context.__enter__()
            self._hook_contexts.append(context)  # popped by the post hook, which always runs

        return pre_hook

    def _make_post_hook(self, layer: _Layer) -> Any:
        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            context = self._hook_contexts.pop() if self._hook_contexts else None
            if context is not None:
                context.__exit__(None, None, None)
            if _in_backward():
                return  # released once the backward has moved on to earlier layers
            needs_grad = [t for t in _tensors(output) if t.requires_grad]
            if needs_grad:
                torch.autograd.graph.register_multi_grad_hook(
                    needs_grad, lambda grads: self._backward_reached(layer), mode="any"
                )
            self._release(layer)
            # The next layer's copy runs while the device computes this one, which may still use this layer's
            # memory: one release may stay pending.
            nxt = self._neighbour(layer, +1)
            if nxt is not None:
                self._load(nxt, pending_releases=1)

        return post_hook

    def _backward_reached(self, layer: _Layer) -> None:
        """The gradient reached this layer: its backward is next, the later layers' is done."""
        task = torch._C._current_graph_task_id()
        if task != self._backward_task:  # once per backward pass, even after one that raised
            self._backward_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._release_all)
        # Done: the layers after this one, and any other layer still loaded (the end of another forward's chain
        # when a step ran the layers more than once before backward); the layer before stays if it is already
        # loaded (a recompute reaches this layer a second time).
        before = self._neighbour(layer, -1)
        for other in self.layers:
            if other is not layer and other is not before:
                self._release(other)
        self._use(layer)
        if before is not None:
            # Backward loads the layer before while it still holds this one: the device must be done with the
            # layers released above.
            self._load(before, pending_releases=0)

    def _neighbour(self, layer: _Layer, step: int) -> Optional[_Layer]:
        """The layer that runs after (``step=+1``) or before (``-1``) this one within its model, if any."""
        index = layer.index + step
        if 0 <= index < len(self.layers) and self.groups[index] == self.groups[layer.index]:
            return self.layers[index]
        return None

    def _saved_tensor_hooks(self) -> Tuple[Any, Any]:
        """Saved-tensor hooks for a layer's call: views of loaded parameters are kept as references,
        everything else goes to the hooks already in force."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(tensor: torch.Tensor) -> Any:
            plain = type(tensor) in (torch.Tensor, nn.Parameter) and tensor.layout is torch.strided
            if plain and tensor.device == self.device:
                found = self._by_storage.get(tensor.untyped_storage().data_ptr())
                if found is not None:
                    layer, slot = found
                    copy = layer.copy_of(slot)
                    if copy is not None and tensor.dtype == copy.dtype:
                        size, stride = tuple(tensor.shape), tuple(tensor.stride())
                        return _ParamView(layer, slot, tensor.storage_offset(), size, stride)
            return outer_pack(tensor) if outer_pack is not None else tensor

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, _ParamView):
                return self._rebuild(packed)
            return outer_unpack(packed) if outer_unpack is not None else packed

        return pack, unpack

    def _rebuild(self, view: _ParamView) -> torch.Tensor:
        """The view of a parameter that backward asks for, from the layer's device copy."""
        self._use(view.layer)  # loaded by the backward hook; if not (an unusual graph), now
        copy = view.layer.copy_of(view.slot)
        assert copy is not None
        return torch.as_strided(copy, view.size, view.stride, view.offset)


class _ApplyGuard:
    """A streamed submodule's ``_apply`` (what ``.to()``, ``.half()``, ``.cuda()`` call) while layer offloading is
    installed: the parameters still streamed sit out the conversion, which then reaches their host copies'
    dtype only. A deep copy of the module (Lightning's StochasticWeightAveraging, user code) gets the plain
    ``_apply`` of its own class instead: the copy is not streamed, and must not convert the original."""

    def __init__(self, streamer: LayerWeightStreamer, layer: _Layer, module: nn.Module) -> None:
        self.streamer, self.layer, self.module = streamer, layer, module

    def __call__(self, fn: Any, recurse: bool = True) -> nn.Module:
        module = self.module
        streamed = {id(p) for p in self.layer.params}  # now: a parameter unfrozen since is converted as usual
        held = {n: p for n, p in module._parameters.items() if p is not None and id(p) in streamed}
        for name in held:
            module._parameters[name] = None  # skipped by nn.Module._apply; the key keeps its place
        try:
            type(module)._apply(module, fn, recurse)
        finally:
            for name, param in held.items():
                module._parameters[name] = param
        self.streamer._converted(self.layer, list(held.values()), fn)
        return module

    def __deepcopy__(self, memo: Dict[int, Any]) -> Any:
        copy = memo.get(id(self.module))
        return types.MethodType(type(copy)._apply, copy) if copy is not None else None


def _holds(current: torch.Tensor, data: torch.Tensor) -> bool:
    """Whether ``current`` (a parameter's ``.data``, a new tensor object at each access) is ``data``: compare
    devices, storages and offsets."""
    return (
        current.device == data.device
        and current.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
        and current.storage_offset() == data.storage_offset()
    )


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _nodes_near(tensors: Sequence[torch.Tensor], depth: int) -> List[Any]:
    """The autograd nodes within ``depth`` steps of ``tensors``' ``grad_fn``."""
    found: List[Any] = []
    frontier = [t.grad_fn for t in tensors if t.grad_fn is not None]
    for _ in range(depth):
        found += frontier
        frontier = [nxt for node in frontier for nxt, _ in node.next_functions if nxt is not None]
    return found


def _tensors(output: Any) -> List[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
