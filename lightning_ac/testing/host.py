"""What the simulated asynchronous device counts on the host's side of its copies: pinned buffers allocated, copies
through pageable memory (synchronous on a device: the engines' pinned pool ran out), and the host's waits for the
device (a copy engine's host should wait only where the compute stream needs what it waits for)."""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from lightning_ac.testing.streams import storage_key

__all__ = ["HostCounters"]


class HostCounters:
    """The simulated device's host-side counts (:attr:`~lightning_ac.testing.simulated.SimulatedDevice.host`).

    Attributes:
        pinned_allocations: Pinned host buffers allocated (``pinned_empty``).
        pageable_copies: Copies between the device and host memory that was not pinned.
        host_waits: Times the host waited for the device (an event's or a side stream's ``synchronize``; the
            device's own ``synchronize``, a test's, not counted).
    """

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory allocated (``pinned_empty``) and not yet freed, in bytes."""
        return sum(nbytes for ref, nbytes in self._allocated.values() if not ref.expired())

    def __init__(self) -> None:
        self.pinned_allocations = 0
        self.pageable_copies = 0
        self.host_waits = 0
        self._pinned: Dict[int, StorageWeakRef] = {}  # pinned host memory, by storage
        self._allocated: Dict[int, Tuple[StorageWeakRef, int]] = {}  # ... of it, what pinned_empty allocated

    def pinned(self, buffer: torch.Tensor, allocated: bool = False) -> torch.Tensor:
        """Record ``buffer``'s memory as pinned (``allocated``: by a new pinned allocation)."""
        self.pinned_allocations += allocated
        if allocated:
            storage = buffer.untyped_storage()
            self._allocated = {k: v for k, v in self._allocated.items() if not v[0].expired()}
            self._allocated[storage_key(buffer)] = (StorageWeakRef(storage), storage.nbytes())
        self._pinned[storage_key(buffer)] = StorageWeakRef(buffer.untyped_storage())
        return buffer

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A new pinned host buffer, allocated where no dispatch mode sees it: host memory is not the device's, which
        a device's allocator never sees allocated (on the CPU, MemTracker stands for that allocator)."""
        with _disable_current_modes():
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self.pinned(buffer, allocated=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory is pinned host memory still alive."""
        pinned = self._pinned.get(storage_key(tensor))
        return pinned is not None and not pinned.expired()

    def copy(self, host: torch.Tensor) -> None:
        """A copy to or from ``host``: counted when its memory is not pinned."""
        pinned = self._pinned.get(storage_key(host))
        if pinned is None or pinned.expired():
            self.pageable_copies += 1
