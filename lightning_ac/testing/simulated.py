"""A simulated asynchronous device: the engines' accelerator branch, run on the CPU with a device's hazards.

While a :class:`SimulatedDevice` is active, :func:`~lightning_ac.offload.device.async_device` hands it to the
copy engines for the CPU device, so they run the code a CUDA device runs (side streams, events,
``record_stream``, the pinned pool, the bounded stash, prefetch, release events), not their synchronous
``copy_on_host`` branch. The simulated device is as slow as it may be: nothing it is asked to do happens until
something waits for it.

- **Deferred copies.** A copy issued on a side stream runs only when a stream that consumes it waits on an
  event recorded after it (the compute stream's ``wait_event`` runs it at once: compute is the CPU itself),
  when that event or stream is synchronized, or at :meth:`SimulatedDevice.synchronize`. Until then its
  destination holds poison (every byte ``0xFF``: NaN for floating tensors, ``-1`` for integers), so a missing
  wait shows up as wrong losses and gradients.
- **Premature release.** Memory the transfer code gives up (its last reference dropped) while a pending copy
  still reads or writes it is a :class:`SimulatedDeviceError` naming the tensor's role. A copy that touches
  memory a pending copy on another stream writes (or reads, when it writes) must be ordered after that copy
  (``wait_event``/``wait_stream``). A copy that reads a tensor the compute stream produced must be issued after
  the side stream waited on the compute stream.
- **Compute streams.** The training computation runs on the CPU, eagerly, on whichever compute stream is
  current: the device's own (:attr:`SimulatedDevice.compute`) or one made with ``new_stream(compute=True)`` and
  entered with ``use_stream`` (as a user or FSDP2 switches streams). A wait issued on a compute stream that is
  not computing now holds until that stream computes again, so transfer code that waits on a stream it looked up
  earlier, not on the one computing, reads poison.
- **Device memory.** Every device allocation is counted by role (the part of its role before any ``:``) until
  it is freed, and, when it was ``record_stream``'d to a compute stream, until the device has reached the
  point where it was freed (an event recorded on that stream after it, synchronized). Peaks are in
  :attr:`SimulatedDevice.peak_bytes`; the most copies in flight on each stream in
  :attr:`SimulatedDevice.peak_in_flight`, and the most bytes they read in :attr:`SimulatedDevice.peak_in_flight_bytes`
  (the device memory a copy to the host keeps from reuse). The host's side (pinned buffers allocated, copies through
  pageable memory, the host's waits) is counted in :attr:`SimulatedDevice.host`
  (:class:`~lightning_ac.testing.host.HostCounters`).

- **Synchronous transfers.** Inside :func:`~lightning_ac.offload.device.synchronous_transfers` (verify mode's
  reference pass) every copy runs as soon as it is issued.
- **Injected faults** (``SimulatedDevice(faults=["skip_wait", "early_release"])``, each once, into the first
  asynchronous transfer it can affect): the compute stream goes on without waiting for a copy, or a copy's
  source is released and reused before the copy runs (it delivers poison). Verify mode's tests use them.

What it cannot model: the compute stream runs eagerly on the CPU, so its kernels are finished before any side
stream could read their outputs (the rule on compute-produced tensors above stands in for that race), and it
has finished with a tensor before the allocator could hand that tensor's memory to a side stream, so a missing
``record_stream`` changes nothing here: :meth:`SimulatedDevice.recorded_to_compute` lets a test check it.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_ac.offload.device import AsyncDevice, stand_in_for_cpu, transfers_are_synchronous
from lightning_ac.testing.host import HostCounters
from lightning_ac.testing.streams import (
    Allocation,
    PendingCopy,
    SimStream,
    poison,
    storage_key,
    unordered_conflicts,
    use_count,
)

__all__ = ["SimulatedDevice", "SimulatedDeviceError"]

# Faults SimulatedDevice(faults=...) can inject, once each, for verify mode's tests: the compute stream goes on
# without waiting for a copy ("skip_wait"), or a copy's source is released and reused before it runs
# ("early_release").
FAULTS = ("skip_wait", "early_release")


class SimulatedDeviceError(RuntimeError):
    """The transfer code did something a real device would turn into a race or a use-after-free."""


@dataclass
class _Stats:
    peak_bytes: Dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    peak_in_flight: Dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    peak_in_flight_bytes: Dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    copies: int = 0


class SimulatedDevice(AsyncDevice):
    """An asynchronous device simulated on the CPU; active inside ``with SimulatedDevice() as sim:``.

    Attributes:
        peak_bytes: Per allocation kind (the role up to ``:``), the most device bytes held at once.
        peak_in_flight: Per stream name, the most copies issued and not yet run.
        peak_in_flight_bytes: Per stream name, the most bytes that copies issued and not yet run read at once.
        copies: Copies run.
        host: The host's side of the copies: pinned allocations, pageable copies, the host's waits.
        pinned_in_place: Host buffers page-locked in place and not yet unpinned: data pointer -> bytes.
    """

    def __init__(self, faults: Sequence[str] = ()) -> None:
        if set(faults) - set(FAULTS):
            raise ValueError(f"unknown fault(s) {sorted(set(faults) - set(FAULTS))}; known: {', '.join(FAULTS)}")
        self.faults = list(faults)  # each injected once, into the first asynchronous transfer it can affect
        self.device = torch.device("cpu")
        self.compute = SimStream(self, "compute", compute=True)
        self.streams: List[SimStream] = []
        self._current: List[SimStream] = [self.compute]
        self._user_compute: List[SimStream] = []  # compute streams made with new_stream(compute=True) and entered
        self._allocations: List[Allocation] = []  # device memory not yet reusable
        self._stats = _Stats()
        self._errors: List[str] = []
        self._previous: Optional[AsyncDevice] = None
        self.pinned_in_place: Dict[int, int] = {}
        self.host = HostCounters()

    # -- activation ---------------------------------------------------------------------------------------

    def __enter__(self) -> SimulatedDevice:
        self._previous = stand_in_for_cpu(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        stand_in_for_cpu(self._previous)
        if exc[0] is None:
            self.synchronize()

    @property
    def peak_bytes(self) -> Dict[str, int]:
        return dict(self._stats.peak_bytes)

    @property
    def peak_in_flight(self) -> Dict[str, int]:
        return dict(self._stats.peak_in_flight)

    @property
    def peak_in_flight_bytes(self) -> Dict[str, int]:
        return dict(self._stats.peak_in_flight_bytes)

    @property
    def copies(self) -> int:
        return self._stats.copies

    def on_device(self, tensor: torch.Tensor) -> bool:
        return self._allocation(tensor) is not None

    def synchronize(self) -> None:
        """The whole device idle: every stream run to its end, the compute stream too."""
        for stream in [*self.streams, *self.compute_streams]:
            stream.run_until(stream.issued)
        self.poll()

    # -- AsyncDevice ----------------------------------------------------------------------------------------

    def new_stream(self, compute: bool = False) -> SimStream:
        """A side stream; with ``compute``, a stream the training computation can run on (``use_stream``)."""
        if compute:
            return SimStream(self, f"compute stream {len(self.compute_streams)}", compute=True)
        stream = SimStream(self, f"side stream {len(self.streams)}")
        self.streams.append(stream)
        return stream

    @property
    def compute_streams(self) -> List[SimStream]:
        return [self.compute, *self._user_compute]

    def current_stream(self) -> SimStream:
        return self._current[-1]

    def computing(self) -> SimStream:
        """The compute stream the CPU's ops run on now (below any side stream made current for a copy)."""
        return next(stream for stream in reversed(self._current) if stream.compute)

    @contextlib.contextmanager
    def use_stream(self, stream: SimStream) -> Iterator[None]:
        if stream.compute and stream is not self.compute and stream not in self._user_compute:
            self._user_compute.append(stream)
        self._current.append(stream)
        self._resume(stream)
        try:
            yield
        finally:
            self._current.pop()
            self._resume(self.computing())

    @staticmethod
    def _resume(stream: SimStream) -> None:
        """A compute stream computes again: its first op comes after what it waited for while another computed."""
        if stream.compute:
            held, stream.held_waits = stream.held_waits, []
            for event in held:
                event.stream.run_until(event.seq)

    def _empty(self, shape: Any, dtype: torch.dtype, role: str) -> torch.Tensor:
        """Device memory, allocated on the current stream (poisoned, counted)."""
        self.poll()
        tensor = torch.empty(shape, dtype=dtype)
        poison(tensor)
        stream = self.current_stream()
        self._allocations.append(
            Allocation(
                StorageWeakRef(tensor.untyped_storage()),
                storage_key(tensor),
                tensor.numel() * tensor.element_size(),
                role.split(":")[0],
                role,
                stream,
                stream.issued,
            )
        )
        self._count_bytes()
        return tensor

    def copy_to_host(self, host: torch.Tensor, source: torch.Tensor, role: str) -> None:
        self.host.copy(host)
        stream = self.current_stream()
        if not stream.compute and self._allocation(source) is None:
            computing = self.computing()
            if computing not in stream.waited_on:
                self._fail(
                    f"{role}: copying a tensor the compute stream produced on {stream.name}, which has not waited on "
                    f"the compute stream ({computing.name}, the one computing now) since its last such copy; on a "
                    "device the copy could read the tensor before its kernel has written it (wait_stream(current) "
                    "before the copy)"
                )
            stream.waited_on = set()
        self._enqueue(host, source, role)

    def to_device(self, host: torch.Tensor, role: str) -> torch.Tensor:
        self.host.copy(host)
        out = self._empty(host.shape, host.dtype, role)
        self._enqueue(out, host, role)
        return out

    def _enqueue(self, dst: torch.Tensor, src: torch.Tensor, role: str) -> None:
        self.poll()
        stream = self.current_stream()
        if stream.compute:
            dst.copy_(src)
            return
        self._check_order(stream, dst, src, role)
        self._raise_errors()
        poison(dst)  # until the copy runs
        # The copy holds tensors of its own on the same memory, so that the transfer code's references can be told
        # apart from the simulator's (the storage's use count).
        copy = PendingCopy(dst.detach(), src.detach(), role, stream._next())
        stream.queue.append(copy)
        pending = stream.pending_copies()
        self._stats.peak_in_flight[stream.name] = max(self._stats.peak_in_flight[stream.name], len(pending))
        reading = self._stats.peak_in_flight_bytes  # the bytes the pending copies read: memory kept from reuse
        reading[stream.name] = max(reading[stream.name], sum(p.src.numel() * p.src.element_size() for p in pending))
        if transfers_are_synchronous():
            stream.synchronize()  # the copy has run before the call that issued it returns
        elif self.inject("early_release"):
            copy.corrupt = True

    def inject(self, fault: str) -> bool:
        """Whether to inject ``fault`` now (once; never into synchronous transfers, whose copies have run)."""
        if fault in self.faults and not transfers_are_synchronous():
            self.faults.remove(fault)
            return True
        return False

    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        allocation = self._allocation(tensor)
        if allocation is not None and stream.compute:
            allocation.recorded_to = stream

    def recorded_to_compute(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory, allocated on a side stream, was ``record_stream``'d to a compute stream.

        The simulator cannot see a missing ``record_stream`` by itself (its compute stream has finished with a
        tensor before any of its memory could be reused); tests ask this of what the engines hand to compute.
        """
        return self.recorded_to(tensor) is not None

    def recorded_to(self, tensor: torch.Tensor) -> Optional[SimStream]:
        """The compute stream ``tensor``'s memory was ``record_stream``'d to, if any."""
        allocation = self._allocation(tensor)
        return allocation.recorded_to if allocation is not None else None

    def on_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is host memory (pinned); the rest of the CPU's memory stands for the device's."""
        return self.host.is_pinned(tensor)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return self.host.pinned_empty(nbytes)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.host.pinned(tensor)

    def pin_in_place(self, buffer: torch.Tensor) -> torch.Tensor:
        self.pinned_in_place[buffer.data_ptr()] = buffer.numel() * buffer.element_size()
        return self.host.pinned(buffer)

    def unpin(self, buffer: torch.Tensor) -> None:
        if self.pinned_in_place.pop(buffer.data_ptr(), None) is None:
            self._fail("unpin of a buffer that is not pinned in place")
        key = storage_key(buffer)
        if any(storage_key(p.src) == key for s in self.streams for p in s.pending_copies()):
            self._fail(
                "a host buffer was unpinned while a pending copy reads it: on a device the DMA would read memory "
                "that is no longer page-locked"
            )
        self._raise_errors()

    # -- the device's side of things ----------------------------------------------------------------------

    def run_copy(self, copy: PendingCopy) -> None:
        if copy.corrupt:  # the memory it read was released early and reused: garbage arrives
            poison(copy.dst)
            self._stats.copies += 1
            return
        copy.dst.copy_(copy.src)
        self._stats.copies += 1

    def _check_order(self, stream: SimStream, dst: torch.Tensor, src: torch.Tensor, role: str) -> None:
        """A copy on ``stream`` must come after every pending copy on another stream that writes what it touches
        or reads what it writes."""
        for other, pending in unordered_conflicts(self.streams, stream, dst, src):
            self._fail(
                f"{role}: issued on {stream.name} while a copy on {other.name} ({pending.role}) still uses the same "
                "memory, without waiting for it (wait_event/wait_stream)"
            )

    def live_bytes(self, kind: str) -> int:
        """Device bytes of ``kind`` (a role up to ``:``) the transfer code still refers to now."""
        return sum(a.nbytes for a in self._allocations if a.kind == kind and not a.storage.expired())

    def poll(self) -> None:
        """Find memory the transfer code gave up: under a pending copy (an error), or device memory to count
        down."""
        for stream in self.streams:
            for pending in stream.pending_copies():
                if pending.reported:
                    continue
                for tensor, what in ((pending.src, "source"), (pending.dst, "destination")):
                    # the simulator's own references: the tensors its pending copies hold on that memory
                    held = sum(
                        storage_key(t) == storage_key(tensor)
                        for s in self.streams
                        for p in s.pending_copies()
                        for t in (p.src, p.dst)
                    )
                    if use_count(tensor) <= held and not self._allocated_on(tensor, stream):
                        pending.reported = True
                        self._fail(
                            f"the {what} of a pending copy ({pending.role}) on {stream.name} was released before the "
                            "copy ran (its last reference dropped): on a device the copy would touch freed memory"
                        )
        for allocation in list(self._allocations):
            recorded = allocation.recorded_to
            if allocation.freed_at is None and allocation.storage.expired():
                # Memory record_stream'd to a compute stream is reusable once that stream has passed the free; other
                # memory at once (the allocator reuses it in its own stream's order).
                allocation.freed_at = recorded._next() if recorded is not None else 0
            done = recorded.completed if recorded is not None else 0
            if allocation.freed_at is not None and done >= allocation.freed_at:
                self._allocations.remove(allocation)
        self._count_bytes()
        self._raise_errors()

    def _raise_errors(self) -> None:
        if self._errors:
            errors, self._errors = self._errors, []
            raise SimulatedDeviceError("; ".join(errors))

    def _allocated_on(self, tensor: torch.Tensor, stream: SimStream) -> bool:
        """Device memory allocated on ``stream`` may be freed with work pending on it: the allocator reuses it
        in stream order."""
        allocation = self._allocation(tensor)
        return allocation is not None and allocation.stream is stream

    def _allocation(self, tensor: torch.Tensor) -> Optional[Allocation]:
        """The live device allocation that holds ``tensor``'s memory, if the simulator allocated it."""
        key = storage_key(tensor)
        return next((a for a in self._allocations if a.freed_at is None and a.data_ptr == key), None)

    def _count_bytes(self) -> None:
        held: Dict[str, int] = collections.defaultdict(int)
        for allocation in self._allocations:
            held[allocation.kind] += allocation.nbytes
        for kind, nbytes in held.items():
            self._stats.peak_bytes[kind] = max(self._stats.peak_bytes[kind], nbytes)

    def _fail(self, message: str) -> None:
        self._errors.append(message)
