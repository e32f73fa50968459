"""The layer weight streamer: when each decoder layer's frozen weights come to the device and when they go."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import nn

from lightning_ac.offload.weights.conversions import ConversionGuard
from lightning_ac.offload.weights.four_bit import KeptWeightHooks
from lightning_ac.offload.weights.residency import LayerResidency
from lightning_ac.offload.weights.saved import in_backward, output_tensors, param_view_hooks
from lightning_ac.offload.weights.slots import ParamView, StreamedLayer, nbytes
from lightning_ac.units import DEFAULT_HOST_RESERVE_BYTES

__all__ = ["LayerWeightStreamer"]


class LayerWeightStreamer(LayerResidency):
    """Keeps the frozen parameters of ``layers`` in host memory and streams them to ``device`` per layer.

    Args:
        layers: The decoder layers, in forward order.
        params: For each layer, the parameters to stream (see
            :func:`~lightning_ac.offload.weights.frozen_layer_parameters`).
        device: The training device.
        copy_on_host: On a CPU device, run the same path with separate host tensors (tests, debugging).
        host_reserve_bytes: Host memory left free: needing more raises :class:`HostMemoryError` in
            :meth:`install` instead of letting the OOM killer end the run.
        groups: For each layer, the model it belongs to (a policy and a frozen reference model in one module):
            layers are prefetched only within their model, whose layers run in order. ``None``: one model.
        resident: For each layer, whether its frozen weights stay on the device (``params`` empty for it).

    Its figures (``stats``, ``host_bytes``) are :class:`~lightning_ac.offload.weights.residency.LayerResidency`'s.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        params: Sequence[Sequence[nn.Parameter]],
        device: torch.device,
        copy_on_host: bool = False,
        host_reserve_bytes: int = DEFAULT_HOST_RESERVE_BYTES,
        groups: Optional[Sequence[int]] = None,
        resident: Optional[Sequence[bool]] = None,
    ) -> None:
        super().__init__(params, device, copy_on_host, host_reserve_bytes)
        self.modules = list(layers)
        self.groups = list(groups) if groups is not None else [0] * len(self.modules)
        self.resident = list(resident) if resident is not None else [False] * len(self.modules)
        self._handles: List[Any] = []
        self._hook_contexts: List[Any] = []
        self._conversions = ConversionGuard(self._refresh)
        self._backward_task: Optional[int] = None  # the graph task whose final callback is queued

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
            frozen = sum(nbytes(p) for p in self.modules[index].parameters() if not p.requires_grad)
            return f"frozen params ({frozen / 2**20:.1f} MiB) resident on the device"
        if index >= len(self.layers) or not self.layers[index].params:
            return None
        return f"frozen params ({self.layers[index].nbytes / 2**20:.1f} MiB) ↔ cpu"

    def kept_frozen_bytes(self) -> int:
        """Bytes of frozen decoder-layer parameters this streamer does not move (parameter subclasses such as
        quantized weights, shared parameters)."""
        streamed = {id(p) for p in self.streamed}
        kept = {
            id(p): nbytes(p)
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
        four_bit = KeptWeightHooks(self._by_storage, self._rebuild)
        for layer, module in zip(self.layers, self.modules):
            if not layer.params:
                continue
            self._conversions.guard(layer, module)
            self._handles.append(module.register_forward_pre_hook(self._make_pre_hook(layer)))
            self._handles.append(module.register_forward_hook(self._make_post_hook(layer), always_call=True))
            self._handles += four_bit.install(layer, module)

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

    def close(self, to: Optional[torch.device] = None) -> None:
        """Remove the hooks and give every parameter its own memory on ``to`` again (default: the training
        device; pageable memory when ``to`` is the CPU). Safe to call more than once."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._conversions.remove()
        while self._hook_contexts:  # a call that never returned (an exception before the post hook ran)
            context = self._hook_contexts.pop()
            if context is not None:
                context.__exit__(None, None, None)
        self._give_back(torch.device(to) if to is not None else self.device)

    def start_step(self) -> None:
        """Reset the step's figures; release anything a failed backward left on the device."""
        self._release_all()
        self.stats = {"loads": 0, "bytes": 0, "max_resident_layers": 0}

    # -- hooks --------------------------------------------------------------------------------------------

    def _make_pre_hook(self, layer: StreamedLayer) -> Any:
        def pre_hook(module: nn.Module, args: Any) -> None:
            if in_backward():
                # Called again in backward: a recompute by a checkpoint around the layer's call (torch's
                # CheckpointWrapper, a model's own checkpoint): the layer's backward is next.
                self._backward_reached(layer)
            else:
                self._use(layer)
            context = None
            if torch.is_grad_enabled():
                # Pushed in forward and in a recompute alike, so a checkpoint around the call sees the same saves.
                hooks = param_view_hooks(self.device, self._by_storage, self._rebuild)
                context = torch.autograd.graph.saved_tensors_hooks(*hooks)
                context.__enter__()
            self._hook_contexts.append(context)  # popped by the post hook, which always runs

        return pre_hook

    def _make_post_hook(self, layer: StreamedLayer) -> Any:
        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            context = self._hook_contexts.pop() if self._hook_contexts else None
            if context is not None:
                context.__exit__(None, None, None)
            if in_backward():
                return  # released once the backward has moved on to earlier layers
            needs_grad = [t for t in output_tensors(output) if t.requires_grad]
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

    def _backward_reached(self, layer: StreamedLayer) -> None:
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

    def _neighbour(self, layer: StreamedLayer, step: int) -> Optional[StreamedLayer]:
        """The layer that runs after (``step=+1``) or before (``-1``) this one within its model, if any."""
        index = layer.index + step
        if 0 <= index < len(self.layers) and self.groups[index] == self.groups[layer.index]:
            return self.layers[index]
        return None

    def _rebuild(self, view: ParamView) -> torch.Tensor:
        """The view of a parameter that backward asks for, from the layer's device copy."""
        self._use(view.layer)  # loaded by the backward hook; if not (an unusual graph), now
        copy = view.layer.copy_of(view.slot)
        assert copy is not None
        return torch.as_strided(copy, view.size, view.stride, view.offset)
