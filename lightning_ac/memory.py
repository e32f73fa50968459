"""The activation peak of training steps, measured one way for the memory budget, the main job and the benchmark.

On CUDA the allocator's statistics give the device peak. CPU has no allocator statistics, so a step is run under
torch's ``MemTracker``, which attributes every allocation to a category (parameter, gradient, optimizer state,
activation, temporary); the activation peak is the sum of the activation and temporary peaks. MemTracker slows the
step it watches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

__all__ = ["MemoryPeak", "measure_step"]


@dataclass
class MemoryPeak:
    """The memory peak of one training step.

    Attributes:
        peak_bytes: The device allocator's peak (CUDA), or on CPU the activation peak (there is no device
            allocator to read; parameters and optimizer state are not part of what the modes change).
        activation_bytes: The peak of what the step itself allocates beyond parameters, gradients and
            optimizer state.
        source: ``"cuda_allocator"`` or ``"mem_tracker"``.
    """

    peak_bytes: int
    activation_bytes: int
    source: str


class _StepMeasurement:
    """Context around one step: CUDA allocator stats when the module is on CUDA, else MemTracker."""

    def __init__(
        self,
        modules: List[torch.nn.Module],
        optimizers: List[torch.optim.Optimizer],
        device: torch.device,
        synchronize: bool = True,
    ):
        self.device = device
        self.synchronize = synchronize
        self.modules, self.optimizers = modules, optimizers
        self._tracker: Any = None
        self._baseline = 0
        self._earlier = 0  # the peak before restart_peak
        self.result: Optional[MemoryPeak] = None

    def __enter__(self) -> _StepMeasurement:
        if self.device.type == "cuda":
            if self.synchronize:
                torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        else:
            self._tracker = _tracker_class()()
            self._tracker.track_external(*self.modules, *self.optimizers)
            self._tracker.__enter__()
        return self

    def peak_so_far(self) -> int:
        """The activation peak since the measurement started, or since :meth:`restart_peak`."""
        if self.device.type == "cuda":
            return max(0, torch.cuda.max_memory_allocated(self.device) - self._baseline)
        return _activation_peak(self._tracker)

    def restart_peak(self) -> None:
        """From now on :meth:`peak_so_far` reads the peak of what follows (the memory budget: the output head's
        backward alone); the result at exit is still the whole measurement's peak."""
        self._earlier = max(self._earlier, self.peak_so_far())
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        tracker = self._tracker
        if hasattr(tracker, "_peak_mem") and hasattr(tracker, "_peak_mem_snap"):  # MemTracker's private records
            tracker._peak_mem = {}
            tracker._peak_mem_snap = tracker.get_tracker_snapshot("current")

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            if self.synchronize:
                torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            activation = max(0, peak - self._baseline, self._earlier)
            self.result = MemoryPeak(max(peak, self._baseline + self._earlier), activation, "cuda_allocator")
            return
        tracker, self._tracker = self._tracker, None
        tracker.__exit__(*exc)
        if exc[0] is not None:
            return
        activation = max(_activation_peak(tracker), self._earlier)
        self.result = MemoryPeak(activation, activation, "mem_tracker")


def _activation_peak(tracker: Any) -> int:
    """MemTracker's activation peak: the activation and temporary peaks, over the devices."""
    peaks: Dict[Any, int] = {}
    for stats in tracker.get_tracker_snapshot("peak").values():
        for category, value in stats.items():
            name = getattr(category, "value", category)
            peaks[name] = peaks.get(name, 0) + int(value)
    return peaks.get("Activation", 0) + peaks.get("Temp", 0)


def _tracker_class() -> type:
    """torch's MemTracker, adapted to a Lightning training step.

    - MemTracker registers a gradient hook on every parameter, which raises for parameters that do not
      require grad (a LoRA model's frozen base): hooks go on trainable parameters only.
    - It tags everything allocated inside ``optimizer.step`` as optimizer state, but Lightning runs the
      forward and backward inside ``optimizer.step(closure)``: only the optimizer's state tensors are tagged
      (after the step), so activations stay activations.
    """
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.optim.optimizer import register_optimizer_step_post_hook

    class FrozenAwareMemTracker(MemTracker):
        def _register_global_optimizer_hook(self) -> None:
            def track_states(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                self._track_optimizer_states(_MemRefType.OPT, optimizer)

            handle = register_optimizer_step_post_hook(track_states)
            self._optimizer_hook_handles = (handle, handle)

        def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True):  # type: ignore[override]
            memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if not install_grad_hooks:
                return memory
            for param in module.parameters():
                if not param.requires_grad or self._param_to_grad_hook_handles.get(param) is not None:
                    continue

                def track_grad(grad: torch.Tensor) -> None:
                    self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(track_grad),
                    param.register_post_accumulate_grad_hook(lambda p: track_grad(p.grad)),
                )
            return memory

    return FrozenAwareMemTracker


def measure_step(
    modules: List[torch.nn.Module],
    optimizers: List[torch.optim.Optimizer],
    device: torch.device,
    synchronize: bool = True,
) -> _StepMeasurement:
    """A context manager measuring the memory peak of what runs inside it (``.result`` after exit).

    ``synchronize=False`` leaves CUDA's queue running: the allocator's figures are kept as the host allocates, so the
    memory budget, which reads them every step, does not stall the device (the benchmark waits, for its step times).
    """
    return _StepMeasurement(modules, optimizers, device, synchronize)
