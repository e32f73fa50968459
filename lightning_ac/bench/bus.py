"""The copy engine's pace on this device, and what an offload row's bytes need of it.

An offload row moves its saved activations to host memory in forward and back in backward. Its copy floor is the time
those bytes take on the bus at the bandwidth measured here first (a pinned 1 GiB copy each way): the GPU check's
verdict on offloading without recompute is its step time against that floor.
"""

from __future__ import annotations

import time
from typing import Optional, Tuple

import torch

__all__ = ["copy_bandwidth", "copy_floor_s"]

_PROBE_BYTES = 2**30


def copy_bandwidth(device: torch.device, nbytes: int = _PROBE_BYTES) -> Optional[Tuple[float, float]]:
    """Bytes a second of a pinned copy to ``device`` and back (the best of three each way); ``None`` where copies do
    not cross a bus (the CPU)."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for dst, src in ((on_device, host), (host, on_device)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        rates.append(nbytes / best)
    del host, on_device
    return rates[0], rates[1]


def copy_floor_s(moved_bytes: Optional[int], bandwidth: Optional[Tuple[float, float]]) -> Optional[float]:
    """The seconds ``moved_bytes`` need to the host at ``bandwidth``'s device-to-host rate and back at its
    host-to-device rate (the two directions run in different phases of the step: forward, backward)."""
    if not moved_bytes or bandwidth is None:
        return None
    to_device, to_host = bandwidth
    return moved_bytes / to_host + moved_bytes / to_device
