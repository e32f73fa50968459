"""Host memory for layer offloading: one buffer per layer, pinned where copies run on an accelerator's streams."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from lightning_ac.offload.device import AsyncDevice, DeviceStreams
from lightning_ac.offload.weights.slots import nbytes

__all__ = ["HostBuffers", "own_copy"]

_ALIGN = 64  # bytes: every parameter's slice of a layer's host buffer starts on a cache line


def own_copy(host: torch.Tensor, target: torch.device) -> torch.Tensor:
    """A copy of ``host`` on ``target`` in memory of its own (pageable on the CPU: no pinned memory is left to
    the user)."""
    if target.type == "cpu":
        return torch.empty_like(host, pin_memory=False).copy_(host)
    return host.to(target)


class HostBuffers:
    """Makes the host copies of a layer's tensors, and unpins the buffers it page-locked in place.

    Args:
        device: The asynchronous device the copies go to, ``None`` where copies are synchronous (nothing is
            pinned then).
    """

    def __init__(self, device: Optional[AsyncDevice]) -> None:
        self._async = device
        self._registered: List[torch.Tensor] = []  # host buffers pinned in place (cudaHostRegister)

    def copies(self, tensors: Sequence[torch.Tensor]) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """Host copies of ``tensors``: slices of one buffer for the layer (a non-contiguous tensor gets memory of
        its own, so that its strides survive), and that buffer."""
        offsets: List[Optional[int]] = []
        total = 0
        for p in tensors:
            if p.is_contiguous():
                total = -(-total // _ALIGN) * _ALIGN
                offsets.append(total)
                total += nbytes(p)
            else:
                offsets.append(None)
        buffer = self._pinned(torch.empty(total, dtype=torch.uint8))
        copies = []
        for p, offset in zip(tensors, offsets):
            if offset is None:  # small: torch's pinned allocator (registering it in place could share a page)
                host = torch.empty_like(p, device="cpu")
                host = self._async.pin(host) if self._async is not None else host
            else:
                host = buffer[offset : offset + nbytes(p)].view(p.dtype).view(p.shape)
            host.copy_(p)
            copies.append(host)
        return copies, buffer

    def let_go(self, buffer: Optional[torch.Tensor], streams: Optional[DeviceStreams]) -> None:
        """A layer's old buffer is no longer its copy: unpin it now (a dtype conversion must not leave the old
        dtype's buffer page-locked beside the new one)."""
        if buffer is None or all(b is not buffer for b in self._registered):
            return
        if streams is not None:
            streams.synchronize()  # no copy may still read it (a prefetch released unused)
        self._registered = [b for b in self._registered if b is not buffer]
        assert self._async is not None
        self._async.unpin(buffer)

    def unpin_all(self) -> None:
        """Unpin every buffer page-locked in place (the parameters have memory of their own by then)."""
        if self._async is not None:
            for buffer in self._registered:
                self._async.unpin(buffer)
        self._registered = []

    def _pinned(self, buffer: torch.Tensor) -> torch.Tensor:
        if self._async is None or buffer.numel() == 0:
            return buffer
        pinned = self._async.pin_in_place(buffer)
        if pinned.data_ptr() == buffer.data_ptr():
            self._registered.append(pinned)  # page-locked in place: unpinned in unpin_all() or let_go()
        return pinned
