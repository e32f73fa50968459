"""Activation offloading: a device-agnostic transfer engine and the three offload targets."""

from lightning_ac.offload.engine import OffloadStats, Packed, TransferEngine
from lightning_ac.offload.host_memory import HostMemoryError, available_host_bytes
from lightning_ac.offload.runtime import TARGETS, OffloadRuntime

__all__ = [
    "HostMemoryError",
    "OffloadRuntime",
    "OffloadStats",
    "Packed",
    "TARGETS",
    "TransferEngine",
    "available_host_bytes",
]
