"""Where a streamed layer's tensors are: a host copy between uses, a device copy while the layer is loaded."""

from __future__ import annotations

import collections
from typing import Any, Deque, Dict, List, Sequence, Tuple

import torch
from torch import nn

from lightning_ac.offload.device import DeviceStreams, async_device, check_host_budget, host_limit
from lightning_ac.offload.weights.host import HostBuffers, own_copy
from lightning_ac.offload.weights.slots import Slot, StreamedLayer, holds, nbytes, slots_of
from lightning_ac.units import DEFAULT_HOST_RESERVE_BYTES

__all__ = ["LayerResidency"]


class LayerResidency:
    """Loads, uses and releases the streamed layers, and keeps their host copies in step with what the parameters
    hold. When to load and release is the :class:`~lightning_ac.offload.weights.streamer.LayerWeightStreamer`'s
    business; it takes the same arguments.

    Attributes:
        stats: This step's ``loads`` (layer copies to the device), ``bytes`` copied, and
            ``max_resident_layers`` (most layers on the device at once).
        host_bytes: Bytes of parameters held in host memory.
    """

    def __init__(
        self,
        params: Sequence[Sequence[nn.Parameter]],
        device: torch.device,
        copy_on_host: bool = False,
        host_reserve_bytes: int = DEFAULT_HOST_RESERVE_BYTES,
    ) -> None:
        self.device = torch.device(device)
        self.on_accelerator = self.device.type != "cpu"
        self.copy_on_host = copy_on_host
        self.host_reserve_bytes = host_reserve_bytes
        self.layers = [StreamedLayer(i, list(ps)) for i, ps in enumerate(params)]
        self._async = async_device(self.device)  # None: copies are synchronous (CPU copy_on_host, MPS)
        self._streams = DeviceStreams(self._async) if self._async is not None else None
        self._host = HostBuffers(self._async)
        self.stats: Dict[str, int] = {"loads": 0, "bytes": 0, "max_resident_layers": 0}
        self.host_bytes = 0
        self._offloaded = False
        self._by_storage: Dict[int, Tuple[StreamedLayer, Slot]] = {}  # device copy's storage -> (layer, slot)
        self._release_events: Deque[Any] = collections.deque()

    @property
    def streamed(self) -> List[nn.Parameter]:
        """Every parameter this streamer moves."""
        return [p for layer in self.layers for p in layer.params]

    @property
    def streamed_bytes(self) -> int:
        """Bytes this streamer moves per layer visit, summed over the layers (4-bit weights with their quant
        state)."""
        return sum(layer.nbytes for layer in self.layers)

    def _give_back(self, to: torch.device) -> None:
        """Release every layer and give each parameter untouched since memory of its own on ``to``."""
        if self._streams is not None:
            self._streams.synchronize()
        if self._offloaded:
            for layer in self.layers:
                self._release(layer)
                for slot, host in zip(layer.slots, layer.host):
                    if holds(slot.get(), host):  # untouched since: the parameter gets memory of its own back
                        slot.set(own_copy(host, to))
                layer.host = []
        self._offloaded = False
        self._release_events.clear()
        self._by_storage.clear()
        self._host.unpin_all()

    # -- host copies --------------------------------------------------------------------------------------

    def _offload_all(self) -> None:
        """Copy every streamed parameter to the host once, and make the host copy its ``.data``. Parameters
        elsewhere (on the meta device, on another accelerator) are not streamed."""
        for layer in self.layers:
            layer.params = [p for p in layer.params if all(self._movable(slot.get()) for slot in slots_of(p))]
            layer.slots = [slot for p in layer.params for slot in slots_of(p)]
        check_host_budget(
            "layer_offloading",
            sum(nbytes(slot.get()) for layer in self.layers for slot in layer.slots),
            host_limit(self.host_reserve_bytes),
            self.host_reserve_bytes,
            "Free host memory, use fewer data-parallel processes per machine, or set layer_offloading: false.",
        )
        for layer in self.layers:
            self._rehost(layer)  # no old buffer yet
        self._count_host_bytes()
        self._offloaded = True

    def _rehost(self, layer: StreamedLayer) -> None:
        """Copy the layer's tensors, as they are now, into a new host buffer, and let the old one, if any, go."""
        old = layer.buffer
        layer.host, layer.buffer = self._host.copies([slot.get() for slot in layer.slots])
        for slot, host in zip(layer.slots, layer.host):
            slot.set(host)
        self._host.let_go(old, self._streams)

    def _movable(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" or tensor.device == self.device

    def _count_host_bytes(self) -> None:
        for layer in self.layers:
            layer.nbytes = sum(nbytes(h) for h in layer.host)
        self.host_bytes = sum(layer.nbytes for layer in self.layers)

    def _refresh(self, layer: StreamedLayer) -> None:
        """Between uses: a parameter that now trains (a fine-tuning schedule unfroze it) leaves the stream and
        gets device memory of its own; a tensor someone replaced (``model.to(...)``) gets a new host copy."""
        if all(not s.param.requires_grad and holds(s.get(), h) for s, h in zip(layer.slots, layer.host)):
            return  # the usual case, checked at every load: nothing changed since the last use
        for slot, host in zip(layer.slots, layer.host):
            if slot.param.requires_grad:
                slot.set(own_copy(host if holds(slot.get(), host) else slot.get(), self.device))
        kept = [(s, h) for s, h in zip(layer.slots, layer.host) if not s.param.requires_grad]
        layer.params = [p for p in layer.params if not p.requires_grad]
        layer.slots, layer.host = [s for s, _ in kept], [h for _, h in kept]
        if any(not holds(slot.get(), host) for slot, host in zip(layer.slots, layer.host)):
            self._rehost(layer)
        self._count_host_bytes()

    # -- moving parameters --------------------------------------------------------------------------------

    def _load(self, layer: StreamedLayer, pending_releases: int = 1) -> None:
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

    def _use(self, layer: StreamedLayer) -> None:
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
            if not holds(slot.get(), t):
                slot.set(t)

    def _release(self, layer: StreamedLayer) -> None:
        """Point the parameters back at their host copies; the device copies are freed."""
        if layer.device is None:
            return
        for key in [t.untyped_storage().data_ptr() for t in layer.device]:  # no loop variable keeps one alive
            self._by_storage.pop(key, None)
        holding = [slot.get() for slot in layer.slots]
        # A prefetch released unused (the forward raised before the layer ran) never became the parameters' data:
        # they still hold their host copies. Anything else a slot holds was put there by the layer's call.
        if all(holds(c, t) or holds(c, h) for c, t, h in zip(holding, layer.device, layer.host)):
            for slot, host in zip(layer.slots, layer.host):
                slot.set(host)
        else:
            self._adopt_replaced(layer)
        del holding
        layer.device = None
        layer.event = None
        if self._streams is not None:
            self._release_events.append(self._streams.current().record_event())

    def _adopt_replaced(self, layer: StreamedLayer) -> None:
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
        slots = [known.get((id(s.owner), s.attr), s) for p in layer.params for s in slots_of(p)]
        for slot, host in zip(layer.slots, layer.host):
            if all(slot is not s for s in slots):
                # No longer part of the state (a folded nested state's): its own small copy of its last value,
                # not a device copy, nor a slice keeping the old host buffer alive.
                slot.set(own_copy(host, torch.device("cpu")))
        layer.slots = slots
        self._rehost(layer)  # copies what the slots hold now: device copies, and what the call put in their place
        self._count_host_bytes()

    def _release_all(self) -> None:
        for layer in self.layers:
            self._release(layer)
