"""The one seam between the copy engines and the device: streams, events, and the host-memory budget.

Both copy engines (activation offloading's :class:`~lightning_ac.offload.engine.TransferEngine` and layer
offloading's :class:`~lightning_ac.offload.weights.LayerWeightStreamer`) reach the device only through this
module: whether copies can run asynchronously on it (:func:`is_asynchronous`), the side streams and events they
run on (:class:`DeviceStreams`), and whether host memory can take what they are about to copy
(:func:`check_host_budget`).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

__all__ = ["DeviceStreams", "HostMemoryError", "available_host_bytes", "check_host_budget", "is_asynchronous"]


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


def host_limit(reserve_bytes: int) -> Optional[int]:
    """Bytes that may still be placed in host memory, keeping ``reserve_bytes`` free; ``None`` when unknown."""
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
        f"{what} needs {needed_bytes / 2**30:.2f} GiB of host memory, but only {limit_bytes / 2**30:.2f} GiB is "
        f"available (MemAvailable minus a {reserve_bytes / 2**30:.2f} GiB reserve). {fix}"
    )


def is_asynchronous(device: torch.device) -> bool:
    """Whether copies to and from ``device`` can run on side streams: an accelerator whose device module has
    streams (CUDA, XPU...). MPS has none and the CPU needs none: there copies are synchronous."""
    return device.type != "cpu" and hasattr(torch.get_device_module(device.type), "Stream")


class DeviceStreams:
    """A device-to-host and a host-to-device side stream, and the current stream, on an accelerator
    (device-agnostic through ``torch.get_device_module``). The current stream is looked up at each use, since
    FSDP2 and recompute switch streams."""

    def __init__(self, device: torch.device) -> None:
        self.module = torch.get_device_module(device.type)
        self.device = device
        self.d2h = self.module.Stream(device=device)
        self.h2d = self.module.Stream(device=device)

    def current(self) -> Any:
        """The stream the training computation runs on now."""
        return self.module.current_stream(self.device)

    def stream(self, stream: Any) -> Any:
        """A context that makes ``stream`` current."""
        return self.module.stream(stream)

    def synchronize(self) -> None:
        """Wait on the host until both side streams are idle."""
        self.d2h.synchronize()
        self.h2d.synchronize()
