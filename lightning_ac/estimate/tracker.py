"""What a training step holds in memory, op by op, counted on fake tensors: the estimate's meter.

A dispatch mode above the fake mode sees every op's outputs. Each storage it has not seen is counted once, under the
kind it is given (an activation, unless it is known as a parameter, a gradient, optimizer state, or one of the
engines' host buffers or streamed weights), and uncounted when it is freed (a weak reference to the storage object,
which torch keeps alive exactly as long as the storage). Storages are told apart by identity: every fake storage's
``data_ptr()`` is 0. The peaks are kept as the step runs, O(1) per op.

The activation peak is the one :func:`lightning_ac.memory.measure_step` reports on the CPU (torch's ``MemTracker``,
adapted): the most that activations and temporaries held together after any op, where gradients count as such once
autograd hands them to their parameter (before that, as the op that made them left them: a temporary), and
optimizer state once the optimizer's step has returned. What existed before the step and was not given to
:meth:`MemoryTracker.track_external` (the batch) is not counted unless an op returns it.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ac.estimate.flops import count_work

__all__ = ["Kind", "MemoryTracker", "Phase"]


class Kind(enum.IntEnum):
    """What a storage is to the step."""

    PARAMETER = 0
    BUFFER = 1
    GRADIENT = 2
    OPTIMIZER = 3
    ACTIVATION = 4  # activations and temporaries: what measure_step's activation peak sums
    WEIGHTS = 5  # layer offloading's device copies of streamed weights; FSDP's gathered parameters
    HOST = 6  # host memory: offloaded activations, streamed weights between uses


DEVICE_KINDS = (Kind.PARAMETER, Kind.BUFFER, Kind.GRADIENT, Kind.OPTIMIZER, Kind.ACTIVATION, Kind.WEIGHTS)


class Phase(str, enum.Enum):
    """Where in the step an op ran."""

    FORWARD = "forward"
    HEAD = "head"  # from the last decoder layer's output to the gradient reaching it
    BACKWARD = "backward"
    RECOMPUTE = "recompute"  # forward ops run again in backward (checkpointing)
    OPTIMIZER = "optimizer"


@dataclass
class _Entry:
    nbytes: int
    kind: Kind
    region: Any
    ref: Any = None  # the weak reference whose callback uncounts the storage


def local(tensor: Any) -> Any:
    """The tensor whose storage holds ``tensor``'s bytes on this rank: a ``DTensor``'s local shard (FSDP2's sharded
    parameters and gradients), else the tensor itself."""
    inner = getattr(tensor, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else tensor


def _storages(output: Any) -> Iterator[torch.UntypedStorage]:
    """The storages of the tensors in an op's output (a tensor, or a tuple or list of them); a ``DTensor``'s is its
    local shard's (the dispatch mode sees DTensor ops before DTensor unwraps them)."""
    if isinstance(output, torch.Tensor):
        yield local(output).untyped_storage()
    elif isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor):
                yield local(item).untyped_storage()
            elif isinstance(item, (tuple, list)):
                yield from _storages(item)


class MemoryTracker(TorchDispatchMode):
    """Counts the bytes a step holds, by kind, and their peaks; and the step's FLOPs by phase.

    Args:
        round_to: Round each storage up to this many bytes, as the device's allocator does (CUDA: 512); 1 counts
            exact bytes, as the CPU does.
        flop_registry: Per op (an ``OpOverloadPacket``), a function of the op's arguments and ``out_val`` giving its
            FLOPs (``torch.utils.flop_counter``'s formulas); ``None`` counts none.
        host_state: Whether an optimizer's state tensor (the optimizer, its state key, the tensor) lives in host
            memory on the target (:func:`~lightning_ac.estimate.optimizers.state_on_host`); ``None``: none does.

    Attributes:
        live: The bytes held now, per :class:`Kind`.
        activation_peak: The most activations held after any op (see the module's docstring).
        activation_peak_at: Where that peak was reached: ``head`` (inside the output head's window, forward or
            backward), else the phase of the op (``forward``, ``backward``, ``recompute``, ``optimizer``).
        device_peak: The most device bytes (every kind but host memory) held after any op.
        host_peak: The most host bytes held after any op.
        one_memory_peak: The most activations, streamed weights and host bytes the step added held together after
            any op: the activation peak of a CPU run, where the host is the device (what measure_step reports there
            with offloading on: the offloaded copies and the streamed layers' copies are activations to it).
        weights_peak: The most bytes of streamed weights on the device after any op.
        flops: FLOPs per :class:`Phase`.
        ops: Ops dispatched per :class:`Phase`; ``moved``: bytes the ops without FLOPs wrote (elementwise work).
        failed_op: The innermost op that raised last (an op fake tensors cannot run); :meth:`op_that_raised`
            tells whether it is what an exception came from.
        region: What the step's code is running now (the estimate sets it: a decoder layer's index, ``"outside"``,
            ``"head"``); each activation remembers the region it was made in.
    """

    def __init__(
        self,
        round_to: int = 1,
        flop_registry: Optional[Dict[Any, Callable[..., int]]] = None,
        host_state: Optional[Callable[[Any, str, torch.Tensor], bool]] = None,
    ) -> None:
        super().__init__()
        self.host_state = host_state
        self.round_to = max(1, int(round_to))
        self.flop_registry = flop_registry or {}
        self.live: List[int] = [0] * len(Kind)
        self.activation_peak = 0
        self.activation_peak_at = Phase.FORWARD.value
        self.device_peak = 0
        self.host_peak = 0
        self.weights_peak = 0
        self.one_memory_peak = 0
        self.host_at_start = 0
        self.flops: Dict[Phase, int] = {phase: 0 for phase in Phase}
        self.ops, self.moved = {phase: 0 for phase in Phase}, {phase: 0 for phase in Phase}
        self.region: Any = "outside"
        self.region_live: Dict[Any, int] = {}
        self.head = False  # inside the output head's window (set by the estimate)
        self._depth = 0  # how many times it is entered now
        self.in_optimizer = False  # the backward has ended (Lightning steps the optimizer then; its forward and
        # backward run inside optimizer.step(closure), so the optimizer's own hooks cannot tell)
        self._entries: Dict[int, _Entry] = {}  # id(storage) -> its entry, while the storage lives
        self._tag: Optional[Kind] = None  # the kind new storages get instead of ACTIVATION (tagging())
        self._window: Optional[List[int]] = None  # [activations at its start, the most since]
        self._handles: List[Any] = []
        self.failed_op: Any = None
        # what failed_op raised, as its type and message: the error itself would keep its frames' tensors alive
        # (after a library caught it, they would never be counted as freed)
        self._failed_error: Optional[Tuple[type, str]] = None

    def __enter__(self) -> MemoryTracker:
        entered = super().__enter__()
        self._depth += 1
        return entered

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        super().__exit__(*exc)

    @property
    def active(self) -> bool:
        """Whether the tracker is counting now (entered, at any depth)."""
        return self._depth > 0

    def op_that_raised(self, err: BaseException) -> Any:
        """The op ``err`` came from (the innermost op that raised it, or an error it was raised from), or ``None``:
        an error of the step's own code, or one an op raised that was caught, is not an op's."""
        return self.failed_op if self._raised_by_failed_op(err) else None

    def _raised_by_failed_op(self, err: BaseException) -> bool:
        return self._failed_error is not None and any(_signature(e) == self._failed_error for e in _causes(err))

    # -- counting ---------------------------------------------------------------------------------------------

    def _bytes(self, storage: torch.UntypedStorage) -> int:
        n = storage.nbytes()
        r = self.round_to
        return -(-n // r) * r if r > 1 else n

    def _add(self, storage: torch.UntypedStorage, kind: Kind) -> _Entry:
        key = id(storage)
        entry = _Entry(self._bytes(storage), kind, self.region)
        entries, live, region_live = self._entries, self.live, self.region_live

        def freed(_: Any, key: int = key, entry: _Entry = entry) -> None:
            if entries.get(key) is entry:
                del entries[key]
                live[entry.kind] -= entry.nbytes
                if entry.kind == Kind.ACTIVATION:
                    region_live[entry.region] -= entry.nbytes

        entry.ref = weakref.ref(storage, freed)
        entries[key] = entry
        live[kind] += entry.nbytes
        if kind == Kind.ACTIVATION:
            region_live[entry.region] = region_live.get(entry.region, 0) + entry.nbytes
        return entry

    def _known(self, storage: torch.UntypedStorage) -> Optional[_Entry]:
        entry = self._entries.get(id(storage))
        if entry is not None and entry.ref() is storage:
            return entry
        return None

    def label(self, tensor: Optional[torch.Tensor], kind: Kind) -> None:
        """Count ``tensor``'s storage as ``kind`` from now on (counting it now if it was not seen)."""
        if tensor is None or not isinstance(tensor, torch.Tensor):
            return
        try:
            storage = local(tensor).untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        entry = self._known(storage)
        if entry is None:
            self._add(storage, kind)
            return
        if entry.kind == kind:
            return
        self.live[entry.kind] -= entry.nbytes
        if entry.kind == Kind.ACTIVATION:
            self.region_live[entry.region] -= entry.nbytes
        entry.kind = kind
        self.live[kind] += entry.nbytes
        if kind == Kind.ACTIVATION:
            self.region_live[entry.region] = self.region_live.get(entry.region, 0) + entry.nbytes

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was resized in place (``UntypedStorage.resize_``: FSDP2 frees and refills its gathered
        parameters so): its bytes are what it holds now; one not seen yet is counted as an op's output would be."""
        entry = self._known(storage)
        if entry is None:
            if storage.nbytes():
                self._add(storage, self._tag if self._tag is not None else Kind.ACTIVATION)
                self._update_peaks(self.phase())
            return
        self._set_bytes(entry)
        self._update_peaks(self.phase())

    def _set_bytes(self, entry: _Entry) -> None:
        storage = entry.ref()
        nbytes = self._bytes(storage)
        self.live[entry.kind] += nbytes - entry.nbytes
        if entry.kind == Kind.ACTIVATION:
            self.region_live[entry.region] += nbytes - entry.nbytes
        entry.nbytes = nbytes

    def kept(self, storage: torch.UntypedStorage) -> Optional[Tuple[int, Any]]:
        """``(bytes, region)`` of ``storage`` if it is a counted activation, else ``None``."""
        entry = self._known(storage)
        return (entry.nbytes, entry.region) if entry is not None and entry.kind == Kind.ACTIVATION else None

    @contextlib.contextmanager
    def tagging(self, kind: Kind) -> Iterator[None]:
        """Inside: storages made by ops count as ``kind`` (an engine's host buffers, streamed weights)."""
        outer, self._tag = self._tag, kind
        try:
            yield
        finally:
            self._tag = outer

    def track_external(self, modules: List[nn.Module], optimizers: List[Any], host: Tuple[Any, ...] = ()) -> None:
        """Count what exists before the step: the modules' parameters, buffers and gradients, the optimizers' state,
        and ``host`` tensors (host memory), each storage once."""
        for tensor in host:
            self.label(tensor, Kind.HOST)
        for module in modules:
            for p in module.parameters():
                if self._known(local(p).untyped_storage()) is None:
                    self.label(p, Kind.PARAMETER)
                self.label(p.grad, Kind.GRADIENT)
            for b in module.buffers():
                if self._known(local(b).untyped_storage()) is None:
                    self.label(b, Kind.BUFFER)
        for optimizer in optimizers:
            self._label_state(optimizer)
        self.host_at_start = self.live[Kind.HOST]
        self._update_peaks()

    def _label_state(self, optimizer: Any) -> None:
        for state in getattr(optimizer, "state", {}).values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    on_host = self.host_state is not None and self.host_state(optimizer, key, value)
                    self.label(value, Kind.HOST if on_host else Kind.OPTIMIZER)

    def watch_gradients(self, modules: List[nn.Module]) -> None:
        """Count each trainable parameter's gradient as a gradient once autograd hands it over."""
        seen = set()
        for module in modules:
            for p in module.parameters():
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                self._handles.append(p.register_hook(self._gradient_arrived))
                self._handles.append(p.register_post_accumulate_grad_hook(lambda q: self.label(q.grad, Kind.GRADIENT)))

    def _gradient_arrived(self, grad: torch.Tensor) -> None:
        self.label(grad, Kind.GRADIENT)

    def watch_optimizers(self) -> None:
        """Count optimizer state as such once a step of the optimizer returns (what it allocates inside its step
        counts as activations until then, as measure_step counts it)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def after(optimizer: Any, args: Any, kwargs: Any) -> None:
            self._label_state(optimizer)

        self._handles.append(register_optimizer_step_post_hook(after))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- windows ----------------------------------------------------------------------------------------------

    def start_window(self) -> None:
        """Start keeping the most activations held from now on (the output head's working set)."""
        now = self.live[Kind.ACTIVATION]
        self._window = [now, now]

    def end_window(self) -> int:
        """The most activations held since :meth:`start_window`, beyond those held at its start."""
        if self._window is None:
            return 0
        start, most = self._window
        self._window = None
        return most - start

    # -- the dispatch mode ------------------------------------------------------------------------------------

    def phase(self) -> Phase:
        if self.in_optimizer:
            return Phase.OPTIMIZER
        if torch._C._current_graph_task_id() != -1:
            # forward ops run again inside backward (a checkpoint's recompute) run with gradients on; backward's
            # own ops without
            return Phase.RECOMPUTE if torch.is_grad_enabled() else Phase.BACKWARD
        return Phase.HEAD if self.head else Phase.FORWARD

    def _update_peaks(self, phase: Optional[Phase] = None) -> None:
        live = self.live
        activations = live[Kind.ACTIVATION]
        if activations > self.activation_peak:
            self.activation_peak = activations
            self.activation_peak_at = Phase.HEAD.value if self.head or phase is None else phase.value
        device = activations + live[Kind.PARAMETER] + live[Kind.BUFFER] + live[Kind.GRADIENT]
        device += live[Kind.OPTIMIZER] + live[Kind.WEIGHTS]
        if device > self.device_peak:
            self.device_peak = device
        host = live[Kind.HOST]
        if host > self.host_peak:
            self.host_peak = host
        one_memory = activations + host - self.host_at_start + live[Kind.WEIGHTS]
        if one_memory > self.one_memory_peak:
            self.one_memory_peak = one_memory
        if live[Kind.WEIGHTS] > self.weights_peak:
            self.weights_peak = live[Kind.WEIGHTS]
        window = self._window
        if window is not None and activations > window[1]:
            window[1] = activations

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except Exception as err:
            # the innermost op that raised: an outer op raises with it (the same error, or one caused by it); an
            # error raised and caught earlier (a library trying an op and falling back) is not this one's cause
            if not self._raised_by_failed_op(err):
                self.failed_op, self._failed_error = func, _signature(err)
            raise
        kind = self._tag if self._tag is not None else Kind.ACTIVATION
        written = 0  # what the op wrote to new memory (a view writes nothing)
        for storage in _storages(out):
            entry = self._entries.get(id(storage))
            if entry is None or entry.ref() is not storage:
                written += self._add(storage, kind).nbytes
            elif entry.nbytes != self._bytes(storage):  # resized in place
                self._set_bytes(entry)
        phase = self.phase()
        count_work(self, phase, func, args, kwargs, out, written)
        self._update_peaks(phase)
        return out


def _signature(err: BaseException) -> Tuple[type, str]:
    return type(err), str(err)


def _causes(err: Optional[BaseException]) -> List[BaseException]:
    """``err`` and what it was raised from or while handling, innermost last."""
    chain: List[BaseException] = []
    while err is not None and not any(e is err for e in chain):
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain
