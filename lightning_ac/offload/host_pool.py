"""Host memory for activation offloading's copies: what the :class:`~lightning_ac.offload.engine.TransferEngine`
copies into, and the count of what that memory really holds.

Note [What the host holds, until when]
    - **Pinned arenas** (an asynchronous device): page-locked buffers sliced, in order, one slice a copy (a slice
      starts at a multiple of :data:`ALIGN`). A slice is the copy's until the copy is garbage-collected (autograd
      dropped every save that uses it); an arena whose slices are all back starts again from its beginning. A request
      takes the first arena with room, so a step of the same shapes as the last one lands in the same slices and
      allocates nothing; a longer step adds an arena of at least a quarter of the pool, and at the next step's start,
      while nothing is sliced, the arenas it outgrew are freed and the next arena is as large as its copies were at
      once (so the pool ends within about 1.25x what the largest step moves, at least 1 MiB, not at the sum of every
      length seen; on CUDA each arena is rounded up to a power of two, which it uses: up to 2x); an arena no step
      has sliced for :data:`RELEASE_AFTER_STEPS` steps is freed.
    - **Pageable buffers**, sized exactly: past ``max_pinned_bytes``, past the arenas there once a pinned allocation
      failed (one warning), and on the synchronous path (a CPU device with ``copy_on_host``, where
      nothing is pinned). Each is freed with its copy.
    - **The count** is what is allocated, not the tensors' bytes: each arena's real size (the allocator's rounding:
      :meth:`~lightning_ac.offload.device.AsyncDevice.pinned_nbytes`), each pageable buffer's size. Memory is checked
      only when it grows, against ``MemAvailable``, read again whenever the pool grows or the room last read has run
      out.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass
from typing import Any, Deque, List, Optional, Tuple

import torch

from lightning_ac.offload.device import AsyncDevice, HostMemoryError, host_limit
from lightning_ac.units import format_bytes

__all__ = ["ALIGN", "RELEASE_AFTER_STEPS", "HostCopyMemory"]

ALIGN = 512  # where a slice starts: a multiple of every dtype's size, and of what DMA engines prefer
MIN_ARENA = 2**20
GROWTH = 4  # a new arena is at least 1/GROWTH of the pool
RELEASE_AFTER_STEPS = 3  # an arena no step sliced for this many steps is freed


@dataclass(eq=False)
class _Arena:
    buffer: torch.Tensor  # pinned bytes
    held: int  # the host memory it really pins (the allocator's rounding)
    last_step: int  # the last step that sliced it
    used: int = 0  # the next slice's start
    live: int = 0  # slices not yet given back

    @property
    def capacity(self) -> int:
        return self.buffer.numel()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class HostCopyMemory:
    """Host buffers for a transfer engine's copies (Note [What the host holds, until when] above).

    Args:
        device: The asynchronous device whose pinned memory the arenas are; ``None``: copies are synchronous, and
            each copy gets a pageable buffer of its own.
        max_pinned_bytes: At most this much pinned memory; past it, pageable buffers. ``None``: no cap but the host
            memory check.
        host_reserve_bytes: Host memory left free: needing more raises :class:`HostMemoryError`.
        host_memory_fix: What that error tells the user to do, one sentence.
    """

    def __init__(
        self,
        device: Optional[AsyncDevice],
        max_pinned_bytes: Optional[int],
        host_reserve_bytes: int,
        host_memory_fix: str,
    ) -> None:
        self.device = device
        self.max_pinned_bytes = max_pinned_bytes
        self.host_reserve_bytes = host_reserve_bytes
        self.host_memory_fix = host_memory_fix
        self.arenas: List[_Arena] = []
        self.pinning_failed = False
        self.step = 0
        self.step_bytes = self.step_tensors = 0  # what this step's copies asked for
        self.last_step_bytes: Optional[int] = None  # ... and the last finished step's
        self._room: Optional[int] = None  # host memory free at the last reading, less what was allocated since
        self._in_use_aligned = 0  # the slices not yet given back, in bytes (with their alignment)
        self._step_peak = 0  # the most of that at once this step
        self._outgrown = False  # this step added an arena to arenas it could not fit into
        self._had_arenas = False  # the step started with arenas
        self._next_arena = 0  # the least size of the next arena (what the last step had in slices at once)
        # Copies are collected on whichever thread drops them (autograd's), and by the cycle collector at any
        # allocation, inside this class's own code too: their finalizers only queue what they give back, and the
        # owner's thread applies it (no lock a finalizer could wait on).
        self._returned: Deque[Tuple[Optional[_Arena], int]] = collections.deque()
        self._pageable_bytes = 0
        self._in_use_bytes = 0

    @property
    def pinned_bytes(self) -> int:
        """Host memory the arenas pin (whether sliced now or not)."""
        return sum(arena.held for arena in self.arenas)

    @property
    def pageable_bytes(self) -> int:
        """Pageable buffers alive."""
        self._apply_returns()
        return self._pageable_bytes

    @property
    def in_use_bytes(self) -> int:
        """The copies alive: their slices and pageable buffers."""
        self._apply_returns()
        return self._in_use_bytes

    @property
    def held_bytes(self) -> int:
        """Host memory held now: the arenas and the pageable buffers alive."""
        return self.pinned_bytes + self.pageable_bytes

    def start_step(self) -> None:
        """A new step: free the arenas no step has sliced for :data:`RELEASE_AFTER_STEPS` steps; after a step that had
        to add arenas to ones it could not fill (a longer length: the old arenas' ends are too short for its copies),
        free them all while they are unused, and let the next arena be as large as that step's copies at once, so the
        pool does not keep the sum of every length seen."""
        self._apply_returns()
        unused = all(a.live == 0 for a in self.arenas)
        idle = [a for a in self.arenas if a.live == 0 and self.step + 1 - a.last_step > RELEASE_AFTER_STEPS]
        if self._outgrown and unused:
            idle, self._next_arena = list(self.arenas), self._step_peak
        if idle:
            self.arenas = [a for a in self.arenas if all(a is not i for i in idle)]
        self.step += 1
        self.step_bytes = self.step_tensors = 0
        # a step outgrown while a kept graph held a slice is consolidated once nothing is sliced
        self._outgrown = self._outgrown and not unused
        self._step_peak = self._in_use_aligned
        self._had_arenas = bool(self.arenas)
        if idle and self.device is not None:
            del idle
            self.device.release_pinned()

    def finish_step(self) -> None:
        self.last_step_bytes = self.step_bytes

    def take(self, nbytes: int, owner: Any) -> Tuple[torch.Tensor, bool]:
        """``nbytes`` of host memory for a copy, given back when ``owner`` is garbage-collected; and whether they are
        pinned."""
        self._apply_returns()
        self.step_bytes += nbytes
        self.step_tensors += 1
        if self.device is not None:
            found = self._slice(nbytes)
            if found is None and not self.pinning_failed:  # after a failure the arenas there still serve
                found = self._grow(nbytes)
            if found is not None:
                arena, start = found
                self._in_use_bytes += nbytes
                weakref.finalize(owner, self._returned.append, (arena, nbytes))
                return arena.buffer[start : start + nbytes], True
        self._ensure_room(nbytes)
        self._pageable_bytes += nbytes
        self._in_use_bytes += nbytes
        weakref.finalize(owner, self._returned.append, (None, nbytes))
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu"), False

    # -- internals ----------------------------------------------------------------------------------------

    def _apply_returns(self) -> None:
        """Apply what collected copies gave back (their finalizers only queue it)."""
        while self._returned:
            arena, nbytes = self._returned.popleft()
            self._in_use_bytes -= nbytes
            if arena is None:
                self._pageable_bytes -= nbytes
                if self._room is not None:
                    self._room += nbytes
                continue
            self._in_use_aligned -= _aligned(nbytes)
            arena.live -= 1
            if arena.live == 0:
                arena.used = 0

    def _slice(self, nbytes: int) -> Optional[Tuple[_Arena, int]]:
        size = _aligned(nbytes)
        for arena in self.arenas:
            if arena.used + size <= arena.capacity:
                start, arena.used = arena.used, arena.used + size
                arena.live += 1
                arena.last_step = self.step
                self._in_use_aligned += size
                self._step_peak = max(self._step_peak, self._in_use_aligned)
                return arena, start
        return None

    def _grow(self, nbytes: int) -> Optional[Tuple[_Arena, int]]:
        """A new arena with room for ``nbytes``; ``None`` past ``max_pinned_bytes`` or when pinning failed."""
        assert self.device is not None
        pinned, size = self.pinned_bytes, _aligned(nbytes)
        # the allocator's rounding (a power of two on CUDA) is room the arena may as well use
        capacity = self.device.pinned_nbytes(max(size, pinned // GROWTH, MIN_ARENA, self._next_arena))
        if self.max_pinned_bytes is not None and pinned + capacity > self.max_pinned_bytes:
            capacity = self.max_pinned_bytes - pinned
            if self.device.pinned_nbytes(capacity) + pinned > self.max_pinned_bytes:
                capacity = size  # the largest arena under the cap, rounded, might not fit it
            if capacity < size or pinned + self.device.pinned_nbytes(capacity) > self.max_pinned_bytes:
                return None
        if not self._room_for(self.device.pinned_nbytes(capacity), fresh=True):
            capacity = size  # a tight host: an arena of just this copy, or the error
        held = self.device.pinned_nbytes(capacity)
        self._ensure_room(held)
        try:
            buffer = self.device.pinned_empty(capacity)
        except RuntimeError as error:  # cudaHostAlloc refused (locked-memory limits, a container's cap)
            self.pinning_failed = True
            if self._room is not None:
                self._room += held
            from lightning_ac._logging import rank_zero_warn

            rank_zero_warn(
                f"activation offloading could not allocate {format_bytes(capacity)} of pinned host memory ({error}); "
                "past the pinned memory it holds, it copies through pageable memory from now on, which the device "
                "cannot overlap with compute. Raise the locked-memory limit (ulimit -l) or cap the pinned pool with "
                "ActivationOffload(max_pinned_bytes=...)."
            )
            return None
        self._outgrown = self._outgrown or self._had_arenas
        self._next_arena = 0
        self.arenas.append(_Arena(buffer, held, self.step))
        return self._slice(nbytes)

    def _room_for(self, nbytes: int, fresh: bool = False) -> bool:
        """Whether ``nbytes`` more host memory stay within ``MemAvailable`` less the reserve (read again when the pool
        grows, ``fresh``, or the room last read has run out; unknown, and in the estimate's fake steps: yes)."""
        if fresh or self._room is None or nbytes > self._room:
            self._room = host_limit(self.host_reserve_bytes)
        return self._room is None or nbytes <= self._room

    def _ensure_room(self, nbytes: int) -> None:
        """Before allocating ``nbytes`` of host memory: :meth:`_room_for` them, or :class:`HostMemoryError`."""
        if self._room_for(nbytes):
            if self._room is not None:
                self._room -= nbytes
            return
        last = self.last_step_bytes
        raise HostMemoryError(
            f"activation offloading needs {format_bytes(nbytes)} more host memory, but only "
            f"{format_bytes(self._room or 0)} is available (MemAvailable minus a "
            f"{format_bytes(self.host_reserve_bytes)} reserve). This step has moved "
            f"{format_bytes(self.step_bytes)} in {self.step_tensors} tensors so far, and offloading holds "
            f"{format_bytes(self.held_bytes)} of host memory ({format_bytes(self.pinned_bytes)} pinned)"
            f"{'' if last is None else f'; the last whole step moved {format_bytes(last)}'}. {self.host_memory_fix}"
        )
