"""What the transfer engine keeps per copy and per save (Note [What the engine holds, until when] in
:mod:`lightning_ac.offload.engine`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from lightning_ac.offload.saved_version import SavedVersion

__all__ = ["HeldCopy", "HostCopy", "InFlight", "Packed", "byte_extent"]


@dataclass(eq=False)
class HostCopy:
    """A host copy of the byte range ``[start, start + nbytes)`` of one device storage."""

    host: torch.Tensor  # nbytes of host memory (HostCopyMemory)
    storage: Any  # a weak reference to the device storage: a freed storage's address can be reused
    version: int  # the tensor's version counter when copied: an in-place edit since makes the copy stale
    start: int
    nbytes: int
    event: Any = None  # the device -> host copy finished (an accelerator event, or a HeldCopy)
    device_data: Optional[torch.Tensor] = None  # reloaded bytes, shared by every save of this copy
    reload_event: Any = None
    pending_unpacks: int = 0  # saves of this copy not yet unpacked
    asked: bool = False  # an unpack has asked for it (a copy loaded and never asked for was loaded ahead)
    edited_in_flight: bool = False  # an in-place edit ran while the asynchronous copy was reading it

    def covers(self, tensor: torch.Tensor, start: int, end: int) -> bool:
        if self.storage.expired() or tensor._version != self.version:
            return False  # the storage it copied is gone, or it was edited in place since
        in_range = self.start <= start and end <= self.start + self.nbytes
        return in_range and (start - self.start) % tensor.element_size() == 0


@dataclass(eq=False)
class Packed:
    """What a saved-tensor hook keeps in place of a device tensor."""

    copy: HostCopy
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int  # in elements, from the start of the copied byte range
    dtype: torch.dtype
    index: int  # position in this step's pack order, for prefetching
    saved: SavedVersion  # the tensor's version counter when packed: autograd's in-place check
    unpacked: bool = False


@dataclass(eq=False)
class InFlight:
    """A copy to the host not known to have finished: its device bytes stay referenced (the stash)."""

    done: Any  # the copy's event (``query()``: finished), or a HeldCopy
    source: torch.Tensor  # the device bytes the copy reads
    saved: torch.Tensor  # the saved tensor, to see an in-place edit racing the copy
    version: int  # its version counter when the copy was issued
    copy: HostCopy
    producer: Any  # the stream that produced the tensor: its memory returns to that stream's pool

    def retire(self) -> None:
        if self.saved._version != self.version:
            self.copy.edited_in_flight = True


class HeldCopy:
    """What stands for a copy's event on the synchronous path inside
    :func:`~lightning_ac.offload.device.hold_copies_in_flight`: the copy counts as finished once something waited for
    it, as on a device whose copies finish only when waited for (the simulated device): the compute stream at the
    stash's bound, or backward reloading it or a later copy (copies to the host run in order)."""

    done = False

    def query(self) -> bool:
        return self.done


def byte_extent(tensor: torch.Tensor) -> Tuple[int, int]:
    """The bytes of its storage a tensor can read: exact for views, offsets, permutations and stride 0."""
    size = tensor.element_size()
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    start = tensor.storage_offset() * size
    return start, start + (last + 1) * size
