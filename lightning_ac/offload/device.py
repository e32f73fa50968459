"""The one seam between the copy engines and the device: streams, events, copies, pinned memory, host budget.

Both copy engines (activation offloading's :class:`~lightning_ac.offload.engine.TransferEngine` and layer
offloading's :class:`~lightning_ac.offload.weights.LayerWeightStreamer`) reach an asynchronous device only
through an :class:`AsyncDevice`: its streams and events, non-blocking copies, device allocations,
``record_stream`` and pinned host memory. :func:`async_device` picks the implementation: the real accelerator
(:class:`AcceleratorDevice`, through ``torch.get_device_module``), the simulated asynchronous device while one
is active (:class:`~lightning_ac.testing.simulated.SimulatedDevice`, tests), or none, where the engines copy
synchronously (a CPU device with ``copy_on_host``, MPS). Nothing in the engines knows which one it runs on.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, List, Optional

import torch

from lightning_ac.units import format_bytes

__all__ = [
    "AcceleratorDevice",
    "AsyncDevice",
    "DeviceStreams",
    "HostMemoryError",
    "async_device",
    "available_host_bytes",
    "check_host_budget",
    "copies_held_in_flight",
    "hold_copies_in_flight",
    "is_asynchronous",
    "on_simulated_host",
    "host_copies",
    "stands_for_plain",
    "standing_for_plain",
    "synchronous_transfers",
    "stand_in_for_cpu",
    "unlimited_host",
    "transfers_are_synchronous",
]

_synchronous = 0  # depth of synchronous_transfers() contexts


@contextlib.contextmanager
def synchronous_transfers() -> Iterator[None]:
    """Inside: every copy an :class:`AsyncDevice` issues has completed when the call that issued it returns, and
    the device is idle before it starts. The engines run their usual code path; only the asynchrony is taken out
    (verify mode's reference pass)."""
    global _synchronous
    _synchronous += 1
    try:
        yield
    finally:
        _synchronous -= 1


def transfers_are_synchronous() -> bool:
    """Whether a :func:`synchronous_transfers` context is active."""
    return _synchronous > 0


class HostMemoryError(RuntimeError):
    """Offloading would exhaust host memory: raised before the kernel's OOM killer would end the run."""


def available_host_bytes() -> Optional[int]:
    """Host memory available to new allocations (``MemAvailable``), ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


_host_unlimited = False  # inside unlimited_host()


@contextlib.contextmanager
def unlimited_host() -> Iterator[None]:
    """Inside: :func:`host_limit` sets no limit. The estimate's fake steps run here: what they place in host memory
    is counted, not held, and must not be judged against this machine's free memory."""
    global _host_unlimited
    previous, _host_unlimited = _host_unlimited, True
    try:
        yield
    finally:
        _host_unlimited = previous


def host_limit(reserve_bytes: int) -> Optional[int]:
    """Bytes that may still be placed in host memory, keeping ``reserve_bytes`` free; ``None`` when unknown (and
    inside :func:`unlimited_host`)."""
    if _host_unlimited:
        return None
    available = available_host_bytes()
    return None if available is None else max(0, available - reserve_bytes)


def check_host_budget(what: str, needed_bytes: int, limit_bytes: Optional[int], reserve_bytes: int, fix: str) -> None:
    """Raise :class:`HostMemoryError` if ``needed_bytes`` exceed ``limit_bytes`` (from :func:`host_limit`).

    Args:
        what: Who needs the memory, as the message names it (``activation offloading``).
        needed_bytes: What it needs.
        limit_bytes: What :func:`host_limit` allowed; ``None`` (unknown) never raises.
        reserve_bytes: The reserve that limit keeps free, named in the message.
        fix: What the user can do, one sentence.
    """
    if limit_bytes is None or needed_bytes <= limit_bytes:
        return
    raise HostMemoryError(
        f"{what} needs {format_bytes(needed_bytes)} of host memory, but only {format_bytes(limit_bytes)} is "
        f"available (MemAvailable minus a {format_bytes(reserve_bytes)} reserve). {fix}"
    )


_held_in_flight = False  # inside hold_copies_in_flight()


@contextlib.contextmanager
def hold_copies_in_flight() -> Iterator[None]:
    """Inside: a synchronous copy to the host keeps its device tensor in the engine's stash as an asynchronous
    device keeps it while the copy is in flight, until the stash's bound makes the compute stream wait for it: as
    if the bus never finished a copy early. The estimate's fake steps run here, so that the device bytes awaiting
    their copy are counted as the slowest bus would leave them."""
    global _held_in_flight
    previous, _held_in_flight = _held_in_flight, True
    try:
        yield
    finally:
        _held_in_flight = previous


def copies_held_in_flight() -> bool:
    """Whether a :func:`hold_copies_in_flight` context is active."""
    return _held_in_flight


def is_asynchronous(device: torch.device) -> bool:
    """Whether copies to and from ``device`` can run on side streams: an accelerator whose device module has
    streams (CUDA, XPU...). MPS has none and the CPU needs none: there copies are synchronous."""
    return device.type != "cpu" and hasattr(torch.get_device_module(device.type), "Stream")


class AsyncDevice:
    """What the copy engines ask of a device whose copies run asynchronously.

    Streams and events are the device's own objects (``wait_stream``, ``wait_event``, ``record_event``,
    ``synchronize``; events ``query`` and ``synchronize``). Every allocation and copy names its ``role`` (what
    the tensor is to the engine), which a simulated device uses in its reports.
    """

    device: torch.device

    def new_stream(self) -> Any:
        """A new side stream."""
        raise NotImplementedError

    def current_stream(self) -> Any:
        """The stream the training computation runs on now (looked up at each use: FSDP2 and recompute switch
        streams)."""
        raise NotImplementedError

    def use_stream(self, stream: Any) -> Any:
        """A context in which ``stream`` is current."""
        raise NotImplementedError

    def copy_to_host(self, host: torch.Tensor, source: torch.Tensor, role: str) -> None:
        """Copy device memory ``source`` into ``host`` without blocking the host, on the current stream."""
        raise NotImplementedError

    def to_device(self, host: torch.Tensor, role: str) -> torch.Tensor:
        """A device copy of ``host``, allocated and copied without blocking the host, on the current stream."""
        raise NotImplementedError

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the allocator that ``stream`` uses ``tensor`` (allocated on another stream)."""
        tensor.record_stream(stream)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of page-locked host memory."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def pinned_nbytes(self, nbytes: int) -> int:
        """The host memory :meth:`pinned_empty` of ``nbytes`` really holds."""
        return nbytes

    def release_pinned(self) -> None:
        """Give freed pinned memory back to the system (where an allocator keeps it cached)."""

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of ``tensor`` (torch's pinned allocator)."""
        return tensor.pin_memory()

    def pin_in_place(self, buffer: torch.Tensor) -> torch.Tensor:
        """A large, page-aligned host buffer's memory page-locked: in place where the device supports it, else
        a pinned copy."""
        return buffer.pin_memory()

    def unpin(self, buffer: torch.Tensor) -> None:
        """Undo :meth:`pin_in_place` for a buffer it pinned in place."""


class AcceleratorDevice(AsyncDevice):
    """A real accelerator with streams (CUDA, XPU...), device-agnostic through ``torch.get_device_module``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.module = torch.get_device_module(device.type)

    def new_stream(self) -> Any:
        return self.module.Stream(device=self.device)

    def current_stream(self) -> Any:
        return self.module.current_stream(self.device)

    def use_stream(self, stream: Any) -> Any:
        return self.module.stream(stream)

    def copy_to_host(self, host: torch.Tensor, source: torch.Tensor, role: str) -> None:
        synchronous = transfers_are_synchronous()
        if synchronous:
            self.module.synchronize(self.device)  # what the copy reads is written
        host.copy_(source, non_blocking=not synchronous)
        if synchronous:
            self.module.synchronize(self.device)

    def to_device(self, host: torch.Tensor, role: str) -> torch.Tensor:
        synchronous = transfers_are_synchronous()
        if synchronous:
            self.module.synchronize(self.device)
        out = host.to(self.device, non_blocking=not synchronous)
        if synchronous:
            self.module.synchronize(self.device)
        return out

    def pinned_nbytes(self, nbytes: int) -> int:
        # torch's pinned allocator (CachingHostAllocator) rounds each block up to a power of two
        return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0

    def release_pinned(self) -> None:
        # freed pinned blocks stay in torch's pinned allocator's cache until emptied
        empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_cache is not None:
            empty_cache()

    def pin_in_place(self, buffer: torch.Tensor) -> torch.Tensor:
        # CUDA page-locks the memory where it is (cudaHostRegister): torch's pinned allocator rounds each block up
        # to a power of two, which would cost up to twice the weights' size in host memory.
        if self.device.type == "cuda" and buffer.numel():
            try:
                nbytes = buffer.numel() * buffer.element_size()
                error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
                if int(error) == 0 and buffer.is_pinned():
                    return buffer
            except Exception:  # noqa: BLE001 - an unavailable binding falls back to torch's pinned allocator
                pass
        return buffer.pin_memory()

    def unpin(self, buffer: torch.Tensor) -> None:
        if self.device.type == "cuda":
            try:
                torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
            except Exception:  # noqa: BLE001 - the memory is freed with the tensor either way
                pass


# Tensor types the copy engines treat as the plain tensors they stand for, while standing_for_plain() is active: the
# estimate's fake tensors (lightning_ac.estimate), which have the plain tensors' sizes and layout and no memory. Other
# subclasses (DTensor, functional and fake tensors under torch.compile) are left where they are.
_plain_standins: List[type] = []


@contextlib.contextmanager
def standing_for_plain(cls: type) -> Iterator[None]:
    """Inside: tensors of type ``cls`` are moved as plain tensors (and parameters of it as plain parameters)."""
    _plain_standins.append(cls)
    try:
        yield
    finally:
        _plain_standins.remove(cls)


def stands_for_plain(tensor: Any) -> bool:
    """Whether ``tensor`` is of a type :func:`standing_for_plain` made stand for a plain tensor."""
    return bool(_plain_standins) and type(tensor) in _plain_standins


_simulated: Optional[AsyncDevice] = None  # set while a SimulatedDevice is active (tests)


@contextlib.contextmanager
def host_copies() -> Iterator[None]:
    """Inside: a CPU device copies synchronously on the host, even while a
    :class:`~lightning_ac.testing.simulated.SimulatedDevice` is active. The self-checks' toy model runs here: its copies
    are not the run's, and must not show in the simulated device's figures."""
    global _simulated
    active, _simulated = _simulated, None
    try:
        yield
    finally:
        _simulated = active


def on_simulated_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is host memory of the active simulated device (what its engines pinned): on the CPU the
    rest of memory stands for the device's, and a step's measured device memory leaves this out. ``False`` when no
    simulated device is active (an accelerator's allocator never sees host memory; a CPU's host memory is its
    device's)."""
    return _simulated is not None and tensor.device.type == "cpu" and _simulated.on_host(tensor)


def stand_in_for_cpu(device: Optional[AsyncDevice]) -> Optional[AsyncDevice]:
    """Make ``device`` the asynchronous device the engines copy through for the CPU (a simulated device, while it is
    active; ``None``: copies on the CPU are synchronous again). Returns the one it replaces."""
    global _simulated
    previous, _simulated = _simulated, device
    return previous


def async_device(device: torch.device) -> Optional[AsyncDevice]:
    """The asynchronous device the engines copy through on ``device``, ``None`` where copies are synchronous.

    A CPU device is asynchronous only while a :class:`~lightning_ac.testing.simulated.SimulatedDevice` is
    active; an accelerator is when its device module has streams (MPS has none).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return _simulated
    return AcceleratorDevice(device) if is_asynchronous(device) else None


class DeviceStreams:
    """A device-to-host and a host-to-device side stream on an :class:`AsyncDevice`."""

    def __init__(self, device: AsyncDevice) -> None:
        self.device = device
        self.d2h = device.new_stream()
        self.h2d = device.new_stream()

    def current(self) -> Any:
        """The stream the training computation runs on now."""
        return self.device.current_stream()

    def stream(self, stream: Any) -> Any:
        """A context that makes ``stream`` current."""
        return self.device.use_stream(stream)

    def synchronize(self) -> None:
        """Wait on the host until both side streams are idle."""
        self.d2h.synchronize()
        self.h2d.synchronize()
