"""How much host memory is available, and the error raised before offloading would exhaust it."""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["HostMemoryError", "available_host_bytes"]


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
