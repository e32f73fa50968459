"""The simulated device's streams and events, and the records of its pending work (see
:mod:`lightning_ac.testing.simulated`): work queued on a side stream in order and run only when waited for; a compute
stream is the CPU's eager computation."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = [
    "Allocation",
    "PendingCopy",
    "POISON",
    "SimEvent",
    "SimStream",
    "StreamWait",
    "Simulator",
    "poison",
    "storage_key",
    "use_count",
]

POISON = 0xFF


class Simulator(Protocol):
    """What a stream asks of the device it belongs to (:class:`~lightning_ac.testing.simulated.SimulatedDevice`)."""

    def poll(self) -> None:
        """Find memory given up under pending copies, and count device memory down."""

    def run_copy(self, copy: PendingCopy) -> None:
        """Run one queued copy."""

    def inject(self, fault: str) -> bool:
        """Whether to inject ``fault`` now."""

    def computing(self) -> SimStream:
        """The compute stream the CPU's ops run on now."""

    @property
    def host(self) -> Any:
        """The host-side counts (:class:`~lightning_ac.testing.host.HostCounters`): the host's waits among them."""

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is device memory the simulator allocated (what a copy to the device writes)."""


def storage_key(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s memory: tensors on the same memory share it."""
    return tensor.untyped_storage().data_ptr()


def byte_range(tensor: torch.Tensor) -> Tuple[int, int, int]:
    """``(storage_key, first byte, end)``: the bytes of its memory a contiguous tensor covers (slices of one host arena
    share a storage and touch different bytes)."""
    start = tensor.storage_offset() * tensor.element_size()
    return storage_key(tensor), start, start + tensor.numel() * tensor.element_size()


def overlap(a: Tuple[int, int, int], b: Tuple[int, int, int]) -> bool:
    """Whether two :func:`byte_range` results share a byte."""
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def unordered_conflicts(
    streams: List[SimStream], stream: SimStream, dst: torch.Tensor, src: torch.Tensor
) -> List[Tuple[SimStream, PendingCopy]]:
    """The pending copies on other streams that a copy ``src -> dst`` on ``stream`` is not ordered after, though they
    write what it touches or read what it writes (by byte ranges: slices of one host arena are apart)."""
    dst_range, src_range = byte_range(dst), byte_range(src)
    found = []
    for other in streams:
        if other is stream:
            continue
        for pending in other.pending_copies():
            if pending.seq <= stream.after.get(other, 0):
                continue
            writes = byte_range(pending.dst)
            if overlap(writes, dst_range) or overlap(writes, src_range) or overlap(byte_range(pending.src), dst_range):
                found.append((other, pending))
    return found


def use_count(tensor: torch.Tensor) -> int:
    """How many tensors hold ``tensor``'s memory (less the storage object this call holds)."""
    # Held in a name: a temporary's reference may or may not be dropped before the count (torch < 2.10 drops it)
    storage = tensor.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) - 1


def poison(tensor: torch.Tensor) -> None:
    """Fill with 0xFF bytes: NaN in every floating dtype, -1 in integer ones."""
    if tensor.numel() == 0:
        return
    if tensor.is_contiguous():
        tensor.view(-1).view(torch.uint8).fill_(POISON)
    else:
        tensor.fill_(float("nan") if tensor.is_floating_point() else -1)


@dataclass(eq=False)
class PendingCopy:
    """A copy issued on a side stream and not run yet."""

    dst: torch.Tensor
    src: torch.Tensor
    role: str
    seq: int
    reported: bool = False  # released under it: reported once
    corrupt: bool = False  # an injected fault: its source was reused before it ran, so it copies poison


@dataclass(eq=False)
class StreamWait:
    """A side stream's wait for ``stream`` to reach ``seq``."""

    stream: SimStream
    seq: int


@dataclass(eq=False)
class Allocation:
    """Device memory the simulator allocated, counted until it is reusable."""

    storage: StorageWeakRef
    data_ptr: int
    nbytes: int
    kind: str
    role: str
    stream: SimStream
    seq: int  # the stream's position when allocated: the copy that fills it comes after
    recorded_to: Optional[SimStream] = None  # the compute stream it was record_stream'd to
    freed_at: Optional[int] = None  # that compute stream's position when the transfer code freed it


class SimEvent:
    """A point on one stream's work."""

    def __init__(self, stream: SimStream, seq: int) -> None:
        self.stream, self.seq = stream, seq

    def query(self) -> bool:
        """Whether the stream has passed this point (nothing runs by being asked)."""
        self.stream.sim.poll()
        return self.stream.completed >= self.seq

    def synchronize(self) -> None:
        """The host waits until the stream has passed this point (counted: :attr:`SimulatedDevice.host_waits`)."""
        self.stream.sim.host.host_waits += 1
        self.stream.run_until(self.seq)


class SimStream:
    """A stream of the simulated device: work queued in order, run only when waited for; or, for a compute stream
    (``compute=True``), the CPU's eager computation, which waits at once when it is the stream computing."""

    def __init__(self, sim: Simulator, name: str, compute: bool = False) -> None:
        self.sim, self.name, self.compute = sim, name, compute
        self.issued = 0  # positions handed out: one per queued item or compute-stream event
        self.completed = 0
        self.queue: collections.deque = collections.deque()
        self.after: Dict[SimStream, int] = {}  # for each other stream, the position this stream is ordered after
        self.waited_on: set = set()  # compute streams waited on since the last copy of a compute-produced tensor
        self.held_waits: List[SimEvent] = []  # a compute stream's waits issued while another one computed

    def _next(self) -> int:
        self.issued += 1
        return self.issued

    def record_event(self) -> SimEvent:
        self.sim.poll()
        return SimEvent(self, self._next() if self.compute else self.issued)

    def wait_event(self, event: SimEvent) -> None:
        self.sim.poll()
        if self.compute:
            if self._reads_a_copy(event) and self.sim.inject("skip_wait"):
                return  # the fault: compute goes on without waiting for a copy it reads
            if self is not self.sim.computing():
                self.held_waits.append(event)  # this stream's next op comes after the event, not the running one's
                return
            event.stream.run_until(event.seq)  # compute is the CPU: its next op runs now, after the event
            return
        if event.stream.compute:
            self.waited_on.add(event.stream)
        self.after[event.stream] = max(self.after.get(event.stream, 0), event.seq)
        self.queue.append(StreamWait(event.stream, event.seq))
        self._next()

    def _reads_a_copy(self, event: SimEvent) -> bool:
        """Whether waiting for ``event`` orders compute after a pending copy into device memory (what compute then
        reads); a wait for a copy to the host only keeps its source from reuse."""
        pending = [p for p in event.stream.pending_copies() if p.seq <= event.seq]
        return event.stream is not self and any(self.sim.on_device(p.dst) for p in pending)

    def wait_stream(self, stream: SimStream) -> None:
        self.wait_event(stream.record_event())

    def synchronize(self) -> None:
        """The host waits until the stream has run everything queued (counted as :meth:`SimEvent.synchronize`)."""
        self.sim.host.host_waits += 1
        self.run_until(self.issued)

    def run_until(self, seq: int) -> None:
        """Run queued work in order until this stream has passed ``seq``."""
        self.sim.poll()  # memory given up since the last call, under copies about to run
        if self.compute:
            self.completed = max(self.completed, seq)
            self.sim.poll()
            return
        while self.completed < seq and self.queue:
            item = self.queue.popleft()
            if isinstance(item, StreamWait):
                item.stream.run_until(item.seq)
            else:
                self.sim.run_copy(item)
            self.completed += 1
        self.completed = max(self.completed, min(seq, self.issued))
        self.sim.poll()

    def pending_copies(self) -> List[PendingCopy]:
        return [item for item in self.queue if isinstance(item, PendingCopy)]
