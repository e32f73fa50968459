"""The activation peak of training steps, measured one way for the memory budget, the main job and the benchmark.

On CUDA the allocator's statistics give the device peak. CPU has no allocator statistics, so a step is run under
torch's ``MemTracker``, which attributes every allocation to a category (parameter, gradient, optimizer state,
activation, temporary); the activation peak is the most that activations and temporaries held together at any moment
of the step. (MemTracker's own "peak" snapshot is taken where the step's *total* memory peaks: when gradients and
optimizer state dominate, as in the first step after validation, whose gradients start as None, that moment can come
after most activations are freed, and it read half the activation peak.) MemTracker slows the step it watches, and,
a dispatch mode, it would make dynamo skip the frame of any compiled module the step runs (an output head compiled by
itself) for good, so that it never compiled: compiled code runs eagerly while MemTracker watches (``force_eager``), and
compiles once the measurement ends.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from lightning_ac.module_tracking import mod_tracker_class

__all__ = ["MemoryPeak", "StepMeasurement", "first_matmuls", "measure_step", "warm_up_libraries"]


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


_WARMED: set = set()  # (device index, stream) pairs whose libraries have allocated their workspaces


def warm_up_libraries(device: torch.device) -> None:
    """Have cuBLAS allocate on ``device``'s current stream what it allocates once, on its first matmuls there: its
    workspaces (32 MiB each on Hopper, through the caching allocator, kept for good). A step measured after this
    counts its own memory only; the first CUDA step otherwise held them as if they were its activations (on the
    H200, 68,039,168 bytes in a tiny model's first step against the 885,504 its budget allowed: two workspaces of
    32 MiB, the forward's and the backward's). What a budget bounds is a step's activations: the first step's too,
    without the libraries' one-time allocations, which stay like the parameters do (the estimator counts them in its
    device total: :mod:`lightning_ac.estimate.workspaces`)."""
    if device.type != "cuda":
        return
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    if key in _WARMED:
        return
    _WARMED.add(key)
    first_matmuls(device)


def first_matmuls(device: torch.device) -> None:
    """A matmul of each dtype a step computes in, forward and backward, on ``device``'s current stream.

    cuBLAS keeps a workspace per handle and stream, and torch keeps a handle per thread: the backward's matmuls run
    on autograd's own thread for the device, whose workspace is not the caller's, so the backward is run too. What
    this saves goes past any saved-tensor hooks in force (the budget's counting, an offload's packing: it is no
    step's activation), and it computes in each dtype as asked, whatever autocast is in force."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.enable_grad())
        stack.enter_context(torch.autocast(device.type, enabled=False))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_same, _same))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
            # cuBLASLt's path (a bias epilogue), then cuBLAS's; their backward: matmuls on autograd's thread
            torch.mm(torch.addmm(x, x, x), x).sum().backward()


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class StepMeasurement:
    """Context around one step: CUDA allocator stats when the module is on CUDA, else MemTracker."""

    def __init__(
        self,
        modules: List[torch.nn.Module],
        optimizers: List[torch.optim.Optimizer],
        device: torch.device,
        synchronize: bool = True,
        inside_forward: bool = False,
    ):
        self.device = device
        self.synchronize = synchronize
        self.inside_forward = inside_forward
        self.modules, self.optimizers = modules, optimizers
        self._tracker: Any = None
        self._eager: Any = None  # the compiler's stance while MemTracker watches
        self._baseline = 0
        self._earlier = 0  # the peak before restart_peak
        self._held = 0  # bytes that existed before the measurement started and stay through it
        self.result: Optional[MemoryPeak] = None

    def __enter__(self) -> StepMeasurement:
        if self.device.type == "cuda":
            warm_up_libraries(self.device)
            if self.synchronize:
                torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        else:
            self._tracker = _tracker_class()(self.inside_forward)
            self._tracker.track_external(*self.modules, *self.optimizers)
            self._eager = _EAGER
            _EAGER.enter()
            try:
                self._tracker.__enter__()
            except BaseException:
                self._eager, eager = None, self._eager
                eager.exit()
                raise
        return self

    def add_held(self, nbytes: int) -> None:
        """Count ``nbytes`` that existed before a measurement started late in a step (the memory budget's, at the
        first decoder layer of a batch of a new shape) and are held through it. On CUDA the allocator's baseline
        already holds them."""
        if self.device.type != "cuda":
            self._held += nbytes

    def peak_so_far(self) -> int:
        """The activation peak since the measurement started, or since :meth:`restart_peak`."""
        if self.device.type == "cuda":
            return max(0, torch.cuda.max_memory_allocated(self.device) - self._baseline)
        return _activation_peak(self._tracker) + self._held

    def restart_peak(self) -> None:
        """From now on :meth:`peak_so_far` reads the peak of what follows (the memory budget: the output head's
        backward alone); the result at exit is still the whole measurement's peak."""
        self._earlier = max(self._earlier, self.peak_so_far())
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._tracker.activation_peak = self._tracker.activation_now()

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            if self.synchronize:
                torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            activation = max(0, peak - self._baseline, self._earlier)
            self.result = MemoryPeak(max(peak, self._baseline + self._earlier), activation, "cuda_allocator")
            return
        tracker, self._tracker = self._tracker, None
        eager, self._eager = self._eager, None
        try:
            tracker.__exit__(*exc)
        finally:
            eager.exit()
        if exc[0] is not None:
            return
        activation = max(_activation_peak(tracker) + self._held, self._earlier)
        self.result = MemoryPeak(activation, activation, "mem_tracker")


class _EagerWhileMeasuring:
    """``force_eager`` while any CPU measurement is open. Measurements overlap and end in any order (the memory
    budget's and the benchmark's in the same step, each from its own callback): the stance in force before the first
    one is put back when the last one ends, not when the first ends (``set_stance``'s own exit restores the stance of
    its own entry, which would leave ``force_eager`` on for good)."""

    def __init__(self) -> None:
        self.open = 0
        self._stance: Any = None

    def enter(self) -> None:
        if self.open == 0:
            self._stance = torch.compiler.set_stance("force_eager")  # set at once; its __exit__ puts the last back
        self.open += 1

    def exit(self) -> None:
        self.open -= 1
        if self.open == 0:
            stance, self._stance = self._stance, None
            stance.__exit__(None, None, None)


_EAGER = _EagerWhileMeasuring()


def _activation_peak(tracker: Any) -> int:
    """The most that activations and temporaries held together at any moment the tracker watched."""
    return int(tracker.activation_peak)


class _NoModuleTracking:
    """Stands in for MemTracker's module tracker in a measurement started inside a forward (the memory budget's, at
    the first decoder layer of a batch of a new shape), where the module tracker, seeing calls end that it did not
    see start, raises. The activation peak needs none of it: activations and temporaries are summed either way, and
    gradients and optimizer state are told apart by hooks on the parameters and optimizers."""

    parents = frozenset({"Global"})

    @property
    def is_bw(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def get_known_fqn(self, module: torch.nn.Module) -> Optional[str]:
        return None

    def __enter__(self) -> _NoModuleTracking:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _tracker_class() -> type:
    """torch's MemTracker, adapted to a Lightning training step.

    - MemTracker registers a gradient hook on every parameter, which raises for parameters that do not
      require grad (a LoRA model's frozen base): hooks go on trainable parameters only.
    - It tags everything allocated inside ``optimizer.step`` as optimizer state, but Lightning runs the
      forward and backward inside ``optimizer.step(closure)``: only the optimizer's state tensors are tagged
      (after the step), so activations stay activations.
    - Its peak snapshot is the moment of the total peak, and keeping it walks every module's statistics after every
      op: the activation peak is kept here instead, as the most activations and temporaries held at once (O(1) per
      op).
    - A root module called twice in a step (chosen and rejected halves, R-Drop, two views) is taken for the next
      iteration and raises: its per-module statistics, which are not read here, are started again instead.
    - Its module tracker names apart the modules of one class met outside the model's tree, and lets go of the
      step's autograd graph at exit (:func:`lightning_ac.module_tracking.mod_tracker_class`).
    """
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from lightning_ac.offload.device import on_simulated_host  # once, not per tensor in _track (a hot path)

    held = (_MemRefType.ACT, _MemRefType.TEMP)

    class FrozenAwareMemTracker(MemTracker):
        activation_peak = 0

        def __init__(self, inside_forward: bool = False) -> None:
            super().__init__()
            if inside_forward:  # module tracking cannot start inside a module's call: it is left out (see below)
                self._mod_tracker = _NoModuleTracking()
            else:
                self._mod_tracker = mod_tracker_class()()

        def activation_now(self) -> int:
            return sum(snap.get(kind, 0) for snap in self._curr_mem_snap.values() for kind in held)

        def _update_peak_stats(self, peak_state: Any) -> None:  # type: ignore[override]
            now = self.activation_now()
            if now > self.activation_peak:
                self.activation_peak = now

        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:  # type: ignore[override]
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} <= {"Global"}:  # a root module's second call
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def _register_global_optimizer_hook(self) -> None:
            def track_states(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                self._track_optimizer_states(_MemRefType.OPT, optimizer)

            handle = register_optimizer_step_post_hook(track_states)
            self._optimizer_hook_handles = (handle, handle)

        def _track(self, reftype: Any, t: torch.Tensor) -> None:  # type: ignore[override]
            if not on_simulated_host(t):  # the simulated device's host memory is not the device's
                super()._track(reftype, t)

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
    inside_forward: bool = False,
) -> StepMeasurement:
    """A context manager measuring the memory peak of what runs inside it (``.result`` after exit).

    ``synchronize=False`` leaves CUDA's queue running: the allocator's figures are kept as the host allocates, so the
    memory budget, which reads them every step, does not stall the device (the benchmark waits, for its step times).
    ``inside_forward=True`` starts it inside a module's forward (what existed before is not counted: see
    :meth:`StepMeasurement.add_held`).
    """
    return StepMeasurement(modules, optimizers, device, synchronize, inside_forward)
