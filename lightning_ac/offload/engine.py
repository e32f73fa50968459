"""The transfer engine shared by the three offload targets: device -> host in forward, back in backward.

On an accelerator, copies to the host run on a side stream ordered by events, so the compute stream never
waits for a copy it does not need; device tensors stay referenced in a stash until their copy has finished (so
the allocator cannot reuse their memory early). The stash is bounded in bytes (by default two of the largest
tensors the step has offloaded: two layer inputs under hidden-state offload): past the bound the compute stream,
never the host, waits for the oldest copy, so the host keeps queueing kernels and the device holds at most the
bound awaiting the bus. Host buffers come from a reusable pinned pool that grows to what a step moves (within the
host memory check), so a steady-state step allocates no pinned memory and copies nothing through pageable
memory; backward prefetches the next tensors on a second stream; and :meth:`TransferEngine.finish_step` leaves
nothing in flight. The current stream is looked up at each use, since FSDP2 and recompute switch streams.

On a CPU device there is nothing to gain, so offloading is off unless ``copy_on_host`` forces the full
pack/unpack path (copies into separate host buffers), which runs the same bookkeeping synchronously: that
is how the logic is tested without an accelerator. Inside :func:`~lightning_ac.offload.device.hold_copies_in_flight`
(the estimate's fake steps) the synchronous path holds each copy's device tensor in the stash as an accelerator
does while the copy is in flight, as if no copy ever finished early: what the slowest bus leaves on the device.

A tensor is moved exactly: the bytes of its storage that it can read (its extent) are copied, and the same
size, stride and offset are rebuilt on the way back, so views, offsets, permutations and broadcast (stride-0)
tensors come back as they were, without materialising a broadcast. Saves that share bytes move once a step.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_ac.offload.device import (
    DeviceStreams,
    async_device,
    check_host_budget,
    copies_held_in_flight,
    host_limit,
    stands_for_plain,
)

__all__ = ["OffloadStats", "Packed", "TransferEngine"]

# Host buffers are allocated in size classes so that a pool survives varying sequence lengths.
_SIZE_CLASS = 2**20


@dataclass
class OffloadStats:
    """What one target moved to the host during a step."""

    tensors: int = 0
    bytes: int = 0

    def as_dict(self) -> Dict[str, int]:
        return {"tensors": self.tensors, "bytes": self.bytes}


@dataclass(eq=False)
class _HostCopy:
    """A host copy of the byte range ``[start, start + nbytes)`` of one device storage."""

    host: torch.Tensor  # nbytes of ``buffer``
    storage: Any  # a weak reference to the device storage: a freed storage's address can be reused
    version: int  # the tensor's version counter when copied: an in-place edit since makes the copy stale
    start: int
    nbytes: int
    event: Any = None  # accelerator event: the device -> host copy finished
    device_data: Optional[torch.Tensor] = None  # reloaded bytes, shared by every save of this copy
    reload_event: Any = None
    pending_unpacks: int = 0
    edited_in_flight: bool = False  # an in-place edit ran while the asynchronous copy was reading it

    def covers(self, tensor: torch.Tensor, start: int, end: int) -> bool:
        if self.storage.expired() or tensor._version != self.version:
            return False  # the storage it copied is gone, or it was edited in place since
        in_range = self.start <= start and end <= self.start + self.nbytes
        return in_range and (start - self.start) % tensor.element_size() == 0


@dataclass(eq=False)
class Packed:
    """What a saved-tensor hook keeps in place of a device tensor."""

    copy: _HostCopy
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int  # in elements, from the start of the copied byte range
    dtype: torch.dtype
    index: int  # position in this step's pack order, for prefetching


class _HeldCopy:
    """What stands for a copy's event on the synchronous path inside
    :func:`~lightning_ac.offload.device.hold_copies_in_flight`: the copy counts as finished once something waited for
    it, as on a device whose copies finish only when waited for (the simulated device): the compute stream at the
    stash's bound, or backward reloading it or a later copy (copies to the host run in order)."""

    done = False

    def query(self) -> bool:
        return self.done


def _byte_extent(tensor: torch.Tensor) -> Tuple[int, int]:
    """The bytes of its storage a tensor can read: exact for views, offsets, permutations and stride 0."""
    size = tensor.element_size()
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    start = tensor.storage_offset() * size
    return start, start + (last + 1) * size


class TransferEngine:
    """Moves saved activations between a device and host memory.

    Args:
        device: The training device.
        copy_on_host: On a CPU device, still copy into separate host buffers (tests, debugging).
        max_pinned_bytes: Upper bound of the reusable pinned-buffer pool, past which copies use pageable memory
            (synchronous, slower); ``None`` (default): as much as a step moves, within the host memory check.
        stash_bytes: How many device bytes may wait for their copy to the host; past it the compute stream
            waits for the oldest copy. ``None`` (default): two of the largest tensors offloaded this step.
        prefetch: How many saves ahead backward brings back.
        host_reserve_bytes: Host memory left free: offloading past ``MemAvailable - reserve`` raises
            :class:`HostMemoryError` instead of letting the OOM killer end the run.
        host_memory_fix: What that error tells the user to do, one sentence (the engine does not know which
            targets use it; :class:`~lightning_ac.offload.activations.ActivationOffloadRuntime` names them).
    """

    def __init__(
        self,
        device: torch.device,
        copy_on_host: bool = False,
        max_pinned_bytes: Optional[int] = None,
        stash_bytes: Optional[int] = None,
        prefetch: int = 1,
        host_reserve_bytes: int = 2 * 2**30,
        host_memory_fix: str = "Offload less, lower the batch size or sequence length, or add host memory.",
    ) -> None:
        self.device = torch.device(device)
        self.on_accelerator = self.device.type != "cpu"
        self._async = async_device(self.device)  # None: copies are synchronous (CPU copy_on_host, MPS)
        self.asynchronous = self._async is not None
        self.enabled = self.on_accelerator or copy_on_host
        self.max_pinned_bytes = max_pinned_bytes
        self.stash_bytes = stash_bytes
        self.prefetch = prefetch
        self.host_reserve_bytes = host_reserve_bytes
        self.host_memory_fix = host_memory_fix
        self.stats: Dict[str, OffloadStats] = collections.defaultdict(OffloadStats)
        self.last_step: Dict[str, Dict[str, int]] = {}
        # storage address -> weak reference: a storage freed since (a parameter moved) no longer matches
        self.skip_storages: Dict[int, StorageWeakRef] = {}
        self._streams: Optional[DeviceStreams] = None
        self._copies: Dict[int, List[_HostCopy]] = {}  # storage data_ptr -> host copies, this step
        self._packed: List[Packed] = []  # this step, in pack order (backward runs roughly in reverse)
        # (copy finished event, device bytes, the saved tensor, its version then, the copy, the stream that produced
        # the tensor: the one its memory returns to, which must wait for the copy before reusing it)
        self._stash: Deque[Tuple[Any, torch.Tensor, torch.Tensor, int, _HostCopy, Any]] = collections.deque()
        self._stash_held = 0  # device bytes in the stash
        self._largest = 0  # the largest copy of this step, in bytes: the automatic stash bound is two of them
        self.peak_held_bytes = 0  # the most device bytes the stash held at once this step (awaiting their copy)
        self._pool: Dict[int, List[torch.Tensor]] = collections.defaultdict(list)
        self._pinned_bytes = 0
        self._host_limit: Optional[int] = None
        self._bytes_this_step = 0

    # -- step lifecycle -----------------------------------------------------------------------------------

    def start_step(self) -> None:
        """Reset per-step bookkeeping; read host memory once."""
        self.stats = collections.defaultdict(OffloadStats)
        self._bytes_this_step = 0
        self._largest = 0
        self.peak_held_bytes = 0
        if self._host_limit is None:
            self._host_limit = host_limit(self.host_reserve_bytes)

    def finish_step(self) -> None:
        """Wait for every copy in flight and record ``last_step``.

        Host buffers go back to the pool only when their copy is garbage-collected (autograd dropped every
        save that uses it), so a graph kept across steps never reads a buffer that was reused.
        """
        if self._streams is not None:
            self._streams.synchronize()
        while self._stash:
            self._retire(self._stash_pop())
        self._copies.clear()
        self._packed.clear()
        self.last_step = {name: s.as_dict() for name, s in self.stats.items()}

    # -- pack / unpack ------------------------------------------------------------------------------------

    def should_skip(self, tensor: Any, min_bytes: int = 0) -> bool:
        """What stays on the device: parameters and buffers (and views of them), host tensors, empty and small
        tensors, and tensors whose layout a byte copy would not carry (subclasses such as DTensor, conj/neg
        views)."""
        if not (type(tensor) is torch.Tensor or stands_for_plain(tensor)) or tensor.layout is not torch.strided:
            return True  # Parameters, DTensors, fake/functional tensors under compile...
        if tensor.device != self.device or tensor.numel() == 0 or tensor.is_conj() or tensor.is_neg():
            return True
        if tensor.numel() * tensor.element_size() < min_bytes:
            return True
        if isinstance(tensor._base, torch.nn.Parameter):
            return True
        skip = self.skip_storages.get(tensor.untyped_storage().data_ptr())
        return skip is not None and not skip.expired()

    def pack(self, tensor: torch.Tensor, target: str) -> Packed:
        """Start moving ``tensor`` to the host; returns what backward will unpack.

        A save whose bytes an earlier copy of this step already holds (a second view of one storage, the
        same tensor saved twice), unchanged since, reuses that copy: it moves once.
        """
        storage = tensor.untyped_storage()
        start, end = _byte_extent(tensor)
        copies = self._copies.setdefault(storage.data_ptr(), [])
        copy = next((c for c in copies if c.covers(tensor, start, end)), None)
        if copy is None:
            copy = self._copy_to_host(tensor, StorageWeakRef(storage), start, end - start, target)
            copies.append(copy)
        copy.pending_unpacks += 1
        offset = (start - copy.start) // tensor.element_size()
        packed = Packed(copy, tuple(tensor.shape), tuple(tensor.stride()), offset, tensor.dtype, len(self._packed))
        self._packed.append(packed)
        return packed

    def unpack(self, packed: Packed) -> torch.Tensor:
        """Bring a packed tensor back to the device, prefetching the saves backward needs next."""
        self._release_finished()  # backward adds no copies: free what the bus has finished with (and check edits)
        if packed.copy.edited_in_flight:
            raise RuntimeError(
                "A tensor saved for backward was edited in place while it was being copied to host memory, so "
                "its host copy may be torn. Avoid the in-place edit, or register the op that produced it with "
                "lightning_ac.register_mandatory_save (the forward then edits a clone)."
            )
        data = self._reload(packed.copy)
        index = packed.index
        if self.prefetch and index < len(self._packed) and self._packed[index] is packed:
            for ahead in self._packed[max(0, index - self.prefetch) : index]:
                self._reload(ahead.copy)
        if self._streams is not None and packed.copy.reload_event is not None:
            current = self._streams.current()
            current.wait_event(packed.copy.reload_event)
            self._streams.device.record_stream(data, current)  # the stream that uses it, known only now
        out = torch.empty(0, dtype=packed.dtype, device=data.device)
        out.set_(data.untyped_storage(), packed.offset, packed.size, packed.stride)
        packed.copy.pending_unpacks -= 1
        if packed.copy.pending_unpacks <= 0:
            packed.copy.device_data = None  # the last save that needs it holds it now
        return out

    def start_reload(self, packed: Packed) -> None:
        """Start bringing a packed tensor's bytes back to the device ahead of its :meth:`unpack`."""
        self._reload(packed.copy)

    # -- internals ----------------------------------------------------------------------------------------

    def _host_buffer(self, nbytes: int) -> Tuple[torch.Tensor, bool]:
        """A host buffer of at least ``nbytes``, and whether it is pinned (pinned buffers go back to the pool)."""
        size = -(-nbytes // _SIZE_CLASS) * _SIZE_CLASS if self.asynchronous else nbytes
        pool = self._pool.get(size)
        if pool:
            return pool.pop(), True
        pinned = self._pinned_bytes + size
        capped = self.max_pinned_bytes is not None and pinned > self.max_pinned_bytes
        # the pool stays within what the host memory check allows a step (it holds its buffers between steps)
        capped = capped or (self._host_limit is not None and pinned > self._host_limit)
        if self._async is not None and not capped:
            self._pinned_bytes += size
            return self._async.pinned_empty(size), True
        return torch.empty(size, dtype=torch.uint8, device="cpu"), False

    def _return_to_pool(self, buffer: torch.Tensor) -> None:
        self._pool[buffer.numel()].append(buffer)

    def _check_host_memory(self, nbytes: int) -> None:
        self._bytes_this_step += nbytes
        check_host_budget(
            "activation offloading (this step)",
            self._bytes_this_step,
            self._host_limit,
            self.host_reserve_bytes,
            self.host_memory_fix,
        )

    def _copy_to_host(self, tensor: torch.Tensor, storage: Any, start: int, nbytes: int, target: str) -> _HostCopy:
        self._check_host_memory(nbytes)
        source = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        source.set_(tensor.untyped_storage(), start, (nbytes,), (1,))
        buffer, pinned = self._host_buffer(nbytes)
        host = buffer[:nbytes]
        stats = self.stats[target]
        stats.tensors += 1
        stats.bytes += nbytes
        copy = _HostCopy(host=host, storage=storage, version=tensor._version, start=start, nbytes=nbytes)
        if pinned:
            weakref.finalize(copy, self._return_to_pool, buffer)
        self._largest = max(self._largest, nbytes)
        if self._async is None:
            host.copy_(source)
            if copies_held_in_flight():  # as if the bus had not finished: the stash holds the device bytes
                self._make_room(nbytes)
                copy.event = _HeldCopy()
                self._stash_push((copy.event, source, tensor.detach(), tensor._version, copy, None))
            return copy
        self._make_room(nbytes)
        streams = self._ensure_streams()
        producer = streams.current()
        streams.d2h.wait_stream(producer)  # after the kernels that produced the tensor
        # No wait on the reload stream: a pinned buffer returns to the pool only when its copy is collected, which
        # the engine's own references prevent until finish_step, after both streams are synchronized. A reload
        # still reading a pooled buffer could only be a prefetch of a copy dropped unread, whose bytes nobody uses.
        with streams.stream(streams.d2h):
            self._async.copy_to_host(host, source, "host copy of a saved activation")
            copy.event = streams.d2h.record_event()
        # Keep the device bytes referenced until the copy has finished, so the allocator cannot reuse them, and
        # watch the version counter: an in-place edit on the compute stream could race with the copy.
        self._stash_push((copy.event, source, tensor.detach(), tensor._version, copy, producer))
        return copy

    @staticmethod
    def _retire(entry: Tuple[Any, torch.Tensor, torch.Tensor, int, _HostCopy, Any]) -> None:
        _, _, tensor, version, copy, _ = entry
        if tensor._version != version:
            copy.edited_in_flight = True

    def _stash_push(self, entry: Tuple[Any, torch.Tensor, torch.Tensor, int, _HostCopy, Any]) -> None:
        self._stash.append(entry)
        self._stash_held += entry[4].nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self._stash_held)

    def _stash_pop(self) -> Tuple[Any, torch.Tensor, torch.Tensor, int, _HostCopy, Any]:
        entry = self._stash.popleft()
        self._stash_held -= entry[4].nbytes
        return entry

    def stash_bound(self) -> int:
        """The device bytes that may wait for their copy to the host now (``stash_bytes``, or two of the largest
        tensors this step has offloaded)."""
        return self.stash_bytes if self.stash_bytes is not None else 2 * self._largest

    def _release_finished(self) -> None:
        """Drop the device bytes of the oldest copies that have finished (asking the events; nothing waits)."""
        while self._stash and self._stash[0][0].query():
            self._retire(self._stash_pop())

    def _make_room(self, nbytes: int) -> None:
        """Before a copy of ``nbytes`` is issued: the stash with room for it within the bound (a tensor larger than
        the bound waits alone)."""
        self._release_finished()
        while self._stash and self._stash_held + nbytes > self.stash_bound():
            entry = self._stash_pop()
            if isinstance(entry[0], _HeldCopy):
                entry[0].done = True
            else:
                # The stream that produced the tensor waits for the oldest copy, never the host: the host keeps
                # queueing kernels, and the memory dropped here returns to that stream's pool, reused only by its
                # kernels queued after the wait (the stream computing now may be another: FSDP2, a user's stream).
                entry[5].wait_event(entry[0])
            self._retire(entry)

    def _ensure_streams(self) -> DeviceStreams:
        assert self._async is not None
        if self._streams is None:
            self._streams = DeviceStreams(self._async)
        return self._streams

    def _reload(self, copy: _HostCopy) -> torch.Tensor:
        if copy.device_data is not None:
            return copy.device_data
        if self._async is None:
            data = torch.empty(copy.nbytes, dtype=torch.uint8, device=self.device)
            data.copy_(copy.host)
            copy.device_data = data
            if isinstance(copy.event, _HeldCopy):  # reloading waits for this copy, and so for every earlier one
                for entry in self._stash:
                    entry[0].done = True
                    if entry[4] is copy:
                        break
            return data
        streams = self._ensure_streams()
        with streams.stream(streams.h2d):
            if copy.event is not None:
                streams.h2d.wait_event(copy.event)
            data = self._async.to_device(copy.host, "reloaded activation bytes")
            copy.reload_event = streams.h2d.record_event()
        copy.device_data = data
        return data
