"""The transfer engine shared by the three offload targets: device -> host in forward, back in backward.

On an accelerator, copies to the host run on a side stream ordered by events, so the compute stream never waits for
a copy it does not need; backward brings copies back on a second side stream. On a CPU device there is nothing to
gain, so offloading is off unless ``copy_on_host`` forces the full pack/unpack path (copies into separate host
buffers), which runs the same bookkeeping synchronously: that is how the logic is tested without an accelerator.
Inside :func:`~lightning_ac.offload.device.hold_copies_in_flight` (the estimate's fake steps) the synchronous path
holds each copy's device tensor in the stash as an accelerator does while the copy is in flight, as if no copy ever
finished early: what the slowest bus leaves on the device.

Note [What the engine holds, until when]
    Device memory:
    - **The stash** (forward): each saved tensor's device bytes, referenced until its copy to the host has finished,
      so that the allocator cannot hand them out early. Bounded in bytes (``stash_bytes``; by default two of the
      largest tensors the step has offloaded: two layer inputs under hidden-state offload): past the bound the stream
      that produced the oldest tensor, never the host, waits for its copy. Released in ``_release_finished`` (the
      copy's event has completed: at every pack and unpack), ``_make_room`` (the bound) and ``finish_step``.
    - **Reloaded copies** (backward): a copy's bytes come back to the device when a save that needs them is
      unpacked (on demand) or ahead of it (the prefetch, below), and the engine holds them while some save of the
      copy is still to be unpacked (several saves can share one copy); at a copy's last unpack the engine lets go
      (``unpack``), and only the tensors handed to autograd keep the bytes, for as long as autograd keeps those.
    - **The prefetch**: at most ``prefetch`` copies loaded ahead of any unpack asking for them. At each unpack, when
      fewer are loaded ahead, the engine loads the copy of the nearest save packed before this one that no unpack
      has asked for yet (backward runs roughly in reverse of forward; a node unpacks its saves in forward order, and
      a recompute replays a layer forwards, so the nearest earlier save still to come is the guess, and a copy whose
      saves have all been unpacked is never brought back). A copy loaded ahead for a save autograd drops unused (a
      graph freed without backward) stops counting as ahead; one never asked for is let go at ``finish_step``.
    Host memory: each copy's bytes (:class:`~lightning_ac.offload.host_pool.HostCopyMemory`: a slice of a pinned arena
    or a pageable buffer), until the copy is garbage-collected: the engine refers to a step's saves and copies weakly,
    so a copy lives exactly as long as autograd keeps a save that uses it (a pass outside the training step, a graph
    kept across steps), plus while it is loaded ahead. The stash may drop a copy's device bytes before the copy to
    the host has finished (the producer waits for it on the device), and the copy may then be collected and its host
    slice taken by a later copy: that later copy runs on the same device-to-host stream, after it.
    Version counters: each save carries its tensor's version when packed (:class:`SavedVersion`): ``unpack`` raises
    torch's own error for a tensor edited in place since, as autograd does for saves without hooks.

A tensor is moved exactly: the bytes of its storage that it can read (its extent) are copied, and the same
size, stride and offset are rebuilt on the way back, so views, offsets, permutations and broadcast (stride-0)
tensors come back as they were, without materialising a broadcast. Saves that share bytes move once a step.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_ac.offload.copies import HeldCopy, HostCopy, InFlight, Packed, byte_extent
from lightning_ac.offload.device import DeviceStreams, async_device, copies_held_in_flight, stands_for_plain
from lightning_ac.offload.host_pool import HostCopyMemory
from lightning_ac.offload.lookahead import Lookahead
from lightning_ac.offload.saved_version import SavedVersion

__all__ = ["OffloadStats", "Packed", "TransferEngine"]


@dataclass
class OffloadStats:
    """What one target moved to the host during a step."""

    tensors: int = 0
    bytes: int = 0

    def as_dict(self) -> Dict[str, int]:
        return {"tensors": self.tensors, "bytes": self.bytes}


@dataclass
class _Step:
    """One step's bookkeeping, replaced whole at :meth:`TransferEngine.start_step`."""

    stats: Dict[str, OffloadStats] = field(default_factory=lambda: collections.defaultdict(OffloadStats))
    copies: Dict[int, List[Any]] = field(default_factory=dict)  # storage data_ptr -> weak refs to its host copies
    order: Lookahead = field(default_factory=Lookahead)  # the saves in pack order, and the copies loaded ahead
    largest: int = 0  # the largest copy, in bytes: the automatic stash bound is two of them
    peak_held_bytes: int = 0  # the most device bytes the stash held at once


class TransferEngine:
    """Moves saved activations between a device and host memory (Note [What the engine holds, until when]).

    Args:
        device: The training device.
        copy_on_host: On a CPU device, still copy into separate host buffers (tests, debugging).
        max_pinned_bytes: Upper bound of the pinned host memory the engine keeps, past which copies use pageable
            memory (synchronous, slower); ``None`` (default): as much as a step moves, within the host memory check.
        stash_bytes: How many device bytes may wait for their copy to the host; past it the compute stream
            waits for the oldest copy. ``None`` (default): two of the largest tensors offloaded this step.
        prefetch: How many copies backward may bring back ahead of the unpacks that ask for them.
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
        self.stash_bytes = stash_bytes
        self.prefetch = prefetch
        self.host = HostCopyMemory(self._async, max_pinned_bytes, host_reserve_bytes, host_memory_fix)
        self.last_step: Dict[str, Dict[str, int]] = {}
        # storage address -> weak reference: a storage freed since (a parameter moved) no longer matches
        self.skip_storages: Dict[int, StorageWeakRef] = {}
        self._streams: Optional[DeviceStreams] = None
        self._stash: Deque[InFlight] = collections.deque()
        self._stash_held = 0  # device bytes in the stash
        self._step = _Step()
        self._in_step = False

    @property
    def stats(self) -> Dict[str, OffloadStats]:
        """What each target has moved this step."""
        return self._step.stats

    @property
    def peak_held_bytes(self) -> int:
        """The most device bytes the stash held at once this step (awaiting their copy)."""
        return self._step.peak_held_bytes

    @property
    def host_memory_fix(self) -> str:
        return self.host.host_memory_fix

    @host_memory_fix.setter
    def host_memory_fix(self, fix: str) -> None:
        self.host.host_memory_fix = fix

    # -- step lifecycle -----------------------------------------------------------------------------------

    def start_step(self) -> None:
        """A new training step: fresh bookkeeping (what a pass outside the step packed is dropped from the counts;
        its copies live as long as its graph)."""
        assert not self._in_step, "start_step() twice without finish_step()"
        self._in_step = True
        self._step = _Step()
        self.host.start_step()

    def finish_step(self) -> None:
        """Wait for every copy in flight and record ``last_step``.

        Host buffers go back to the pool only when their copy is garbage-collected (autograd dropped every save that
        uses it), so a graph kept across steps never reads a buffer that was reused.
        """
        if self._streams is not None:
            self._streams.synchronize()
        while self._stash:
            self._stash_pop().retire()
        self.last_step = {name: s.as_dict() for name, s in self._step.stats.items()}
        self.host.finish_step()
        # Let go of the step's saves: copies loaded ahead and never asked for (their reloads have finished, synchronized
        # above); the figures (stats, the stash's bound and peak) stay readable until the next step starts.
        step = self._step
        for copy in step.order.ahead:
            copy.device_data = None  # loaded ahead and never asked for: its graph was dropped, or is kept for later
        step.order, step.copies = Lookahead(), {}
        self._in_step = False

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
        start, end = byte_extent(tensor)
        step = self._step
        refs = step.copies.setdefault(storage.data_ptr(), [])
        copy = next((c for c in (r() for r in refs) if c is not None and c.covers(tensor, start, end)), None)
        if copy is None:
            copy = self._copy_to_host(tensor, StorageWeakRef(storage), start, end - start, target)
            refs[:] = [r for r in refs if r() is not None] + [weakref.ref(copy)]
        copy.pending_unpacks += 1
        offset = (start - copy.start) // tensor.element_size()
        shape, stride, dtype = tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype
        packed = step.order.add(lambda index: Packed(copy, shape, stride, offset, dtype, index, SavedVersion(tensor)))
        return packed

    def unpack(self, packed: Packed, check_version: bool = True) -> torch.Tensor:
        """Bring a packed tensor back to the device, and the copy backward needs next ahead of it.

        Args:
            packed: What :meth:`pack` returned.
            check_version: Raise torch's error if the tensor was edited in place since it was packed; ``False``: the
                caller checks (selective checkpointing's storage, whose own check reads the version).
        """
        self._release_finished()  # backward adds no copies: free what the bus has finished with (and check edits)
        if check_version:
            packed.saved.check()
        copy = packed.copy
        if copy.edited_in_flight:
            raise RuntimeError(
                "A tensor saved for backward was edited in place while it was being copied to host memory, so "
                "its host copy may be torn. Avoid the in-place edit, or register the op that produced it with "
                "lightning_ac.register_mandatory_save (the forward then edits a clone)."
            )
        data = self._reload(copy)
        self._step.order.asked(copy)
        packed.unpacked = True
        if self._step.order.owns(packed):
            self._load_ahead(packed.index)
        if self._streams is not None and copy.reload_event is not None:
            current = self._streams.current()
            current.wait_event(copy.reload_event)
            self._streams.device.record_stream(data, current)  # the stream that uses it, known only now
        out = torch.empty(0, dtype=packed.dtype, device=data.device)
        out.set_(data.untyped_storage(), packed.offset, packed.size, packed.stride)
        copy.pending_unpacks -= 1
        if copy.pending_unpacks <= 0:
            copy.device_data = None  # its last save: the engine lets go; autograd holds what it was handed
        return out

    # -- internals ----------------------------------------------------------------------------------------

    def _load_ahead(self, index: int) -> None:
        """Load the copies of the nearest saves packed before ``index`` that are still to be unpacked, until
        ``prefetch`` copies are loaded ahead of any unpack asking for them."""
        order = self._step.order
        while len(order.ahead) < self.prefetch:
            earlier = order.still_to_come(index)
            if earlier is None or earlier.copy.device_data is not None:
                return  # nothing earlier is to come, or it is on the device already (another save asked for it)
            self._reload(earlier.copy)
            order.loaded_ahead(earlier.copy, earlier)
            index = earlier.index

    def _copy_to_host(self, tensor: torch.Tensor, storage: Any, start: int, nbytes: int, target: str) -> HostCopy:
        source = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        source.set_(tensor.untyped_storage(), start, (nbytes,), (1,))
        step = self._step
        stats = step.stats[target]
        stats.tensors += 1
        stats.bytes += nbytes
        step.largest = max(step.largest, nbytes)
        copy = HostCopy(host=torch.empty(0), storage=storage, version=tensor._version, start=start, nbytes=nbytes)
        copy.host = self._host_buffer(nbytes, copy)
        if self._async is None:
            copy.host.copy_(source)
            if copies_held_in_flight():  # as if the bus had not finished: the stash holds the device bytes
                self._make_room(nbytes)
                copy.event = HeldCopy()
                self._stash_push(InFlight(copy.event, source, tensor.detach(), tensor._version, copy, None))
            return copy
        self._make_room(nbytes)
        streams = self._ensure_streams()
        producer = streams.current()
        streams.d2h.wait_stream(producer)  # after the kernels that produced the tensor
        # No wait on the reload stream: a host buffer is reused only once its copy is collected, and a copy whose
        # reload may still be in flight is referenced until an unpack waited for it or finish_step synchronized.
        with streams.stream(streams.d2h):
            self._async.copy_to_host(copy.host, source, "host copy of a saved activation")
            copy.event = streams.d2h.record_event()
        # Keep the device bytes referenced until the copy has finished, so the allocator cannot reuse them, and
        # watch the version counter: an in-place edit on the compute stream could race with the copy.
        self._stash_push(InFlight(copy.event, source, tensor.detach(), tensor._version, copy, producer))
        return copy

    def _host_buffer(self, nbytes: int, copy: HostCopy) -> torch.Tensor:
        """``nbytes`` of host memory for ``copy``, given back when the copy is collected (the estimate counts what
        this allocates as host memory)."""
        return self.host.take(nbytes, copy)[0]

    def _stash_push(self, entry: InFlight) -> None:
        self._stash.append(entry)
        self._stash_held += entry.copy.nbytes
        self._step.peak_held_bytes = max(self._step.peak_held_bytes, self._stash_held)

    def _stash_pop(self) -> InFlight:
        entry = self._stash.popleft()
        self._stash_held -= entry.copy.nbytes
        assert self._stash_held >= 0, "the stash's byte count went below zero"
        return entry

    def stash_bound(self) -> int:
        """The device bytes that may wait for their copy to the host now (``stash_bytes``, or two of the largest
        tensors this step has offloaded)."""
        return self.stash_bytes if self.stash_bytes is not None else 2 * self._step.largest

    def _release_finished(self) -> None:
        """Drop the device bytes of the oldest copies that have finished (asking the events; nothing waits)."""
        while self._stash and self._stash[0].done.query():
            self._stash_pop().retire()

    def _make_room(self, nbytes: int) -> None:
        """Before a copy of ``nbytes`` is issued: the stash with room for it within the bound (a tensor larger than
        the bound waits alone)."""
        self._release_finished()
        while self._stash and self._stash_held + nbytes > self.stash_bound():
            entry = self._stash_pop()
            if isinstance(entry.done, HeldCopy):
                entry.done.done = True
            else:
                # The stream that produced the tensor waits for the oldest copy, never the host: the host keeps
                # queueing kernels, and the memory dropped here returns to that stream's pool, reused only by its
                # kernels queued after the wait (the stream computing now may be another: FSDP2, a user's stream).
                entry.producer.wait_event(entry.done)
            entry.retire()

    def _ensure_streams(self) -> DeviceStreams:
        assert self._async is not None
        if self._streams is None:
            self._streams = DeviceStreams(self._async)
        return self._streams

    def _reload(self, copy: HostCopy) -> torch.Tensor:
        if copy.device_data is not None:
            return copy.device_data
        if self._async is None:
            data = torch.empty(copy.nbytes, dtype=torch.uint8, device=self.device)
            data.copy_(copy.host)
            copy.device_data = data
            if isinstance(copy.event, HeldCopy):  # reloading waits for this copy, and so for every earlier one
                for entry in self._stash:
                    entry.done.done = True
                    if entry.copy is copy:
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
