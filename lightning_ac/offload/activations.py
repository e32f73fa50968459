"""Activation offloading: the three targets, built on one :class:`~lightning_ac.offload.engine.TransferEngine`,
and :class:`ActivationOffloadRuntime`, which installs them on a model and drives them step by step.

- ``hidden_states``: an outer saved-tensor hook around each checkpointed layer's checkpoint call. Both
  non-reentrant and reentrant checkpoint save exactly the layer's inputs under it (their inner saves go to
  checkpoint's own storage), so only layer inputs move. No torch function is patched.
- ``all``: a saved-tensor hook over the whole training step; parameters, buffers, small tensors, and what is saved
  from the output head's call on (the logits and the loss over them) stay on the device.
- ``selective``: a storage for torch's selective-checkpoint modes whose entries live on the host; SAC-saved
  tensors bypass saved-tensor hooks, so this is the only way to move them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_ac._compat import SAC_STORAGE_INDEXED, cached_dispatch_mode
from lightning_ac._reenterable import Reenterable
from lightning_ac.config import OFFLOAD_TARGETS, ActivationOffloadRequest
from lightning_ac.offload.device import stands_for_plain
from lightning_ac.offload.engine import Packed, TransferEngine
from lightning_ac.offload.saved_version import Kept

__all__ = [
    "ActivationOffloadRuntime",
    "SavedTensorOffloader",
    "offload_less",
    "offloading_checkpoint",
    "offloading_sac_storage",
]


class SavedTensorOffloader:
    """Saved-tensor hooks that move what autograd saves to the host through ``engine``.

    Args:
        engine: The transfer engine.
        target: The stats bucket (``hidden_states`` or ``all``).
        min_bytes: Tensors smaller than this stay on the device.
    """

    def __init__(self, engine: TransferEngine, target: str, min_bytes: int = 0) -> None:
        self.engine, self.target, self.min_bytes = engine, target, min_bytes
        self.paused = 0
        self._active: Optional[Any] = None

    def _pack(self, tensor: torch.Tensor, only_storages: Optional[Set[int]] = None) -> Any:
        if self.paused or self.engine.should_skip(tensor, self.min_bytes):
            return _keep(tensor)
        if only_storages is not None and tensor.untyped_storage().data_ptr() not in only_storages:
            return _keep(tensor)
        if torch._C._current_graph_task_id() != -1:
            return _keep(tensor)  # saved during backward (a reentrant recompute): used at once, not worth moving
        return self.engine.pack(tensor, self.target)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, Packed):
            return self.engine.unpack(packed)
        return packed.unpack() if isinstance(packed, Kept) else packed

    def hooks(self, only_storages: Optional[Set[int]] = None) -> torch.autograd.graph.saved_tensors_hooks:
        """A fresh saved-tensor hook context.

        Args:
            only_storages: Move only saved tensors on these storages (by ``data_ptr``); all when ``None``.
        """
        # The bound method itself when nothing filters: with a functools.partial as the hook in every case, seven
        # tests/test_compile.py cases (offload.all, offload.hidden_states) recorded no compiled graph (measured).
        pack = self._pack if only_storages is None else functools.partial(self._pack, only_storages=only_storages)
        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    def push(self) -> None:
        """Enter the hooks until :meth:`pop` (a training step spans several Lightning hooks)."""
        self.paused = 0  # a head called outside the step (validation) paused nothing of this one
        if self._active is None:
            self._active = self.hooks()
            self._active.__enter__()

    def pop(self) -> None:
        if self._active is not None:
            active, self._active = self._active, None
            active.__exit__(None, None, None)

    def pause_from(self, head: nn.Module) -> Any:
        """Keep what is saved from the call of ``head`` (the output head) on, on the device: its logits and the loss
        over them (a log-softmax of the vocabulary's size, in float32), which backward reads first thing, so moving
        them would spend transfers and host memory for no lower peak; wherever the loss is computed, in the model's
        forward or in the training step after it. Offloading resumes at :meth:`resume_at` or the step's end.

        Returns:
            The hook's handle.
        """

        def pause(*_: Any) -> None:
            self.paused = 1

        return head.register_forward_pre_hook(pause)

    def resume_at(self, module: nn.Module) -> Any:
        """Offload again from the next forward of ``module`` on (a model called again in the same step after its
        head: a second forward, a reference model). Returns the hook's handle."""

        def resume(*_: Any) -> None:
            self.paused = 0

        return module.register_forward_pre_hook(resume)


def _keep(tensor: Any) -> Any:
    """A save that stays on the device, with its version for autograd's in-place check (which a hook turns off).
    torch.compile's tensors (fake, functional) are its own to check, and pass as they are."""
    plain = type(tensor) is torch.Tensor or isinstance(tensor, nn.Parameter) or stands_for_plain(tensor)
    return Kept(tensor) if plain else tensor


def offloading_checkpoint(checkpoint_fn: Callable[..., Any], offloader: SavedTensorOffloader) -> Callable[..., Any]:
    """Wrap a checkpoint function so that what it saves outside its region (the layer's inputs) moves."""

    @functools.wraps(checkpoint_fn)
    def checkpoint_offloading_inputs(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with offloader.hooks():
            return checkpoint_fn(function, *args, **kwargs)

    return checkpoint_offloading_inputs


class _HostEntries:
    """One op's saved outputs in one region, kept on the host until the recompute: the offload on the way in, the
    reload on the way out, around whichever container torch's SAC modes use (see :data:`SAC_STORAGE_INDEXED`)."""

    engine: TransferEngine

    def _offload(self, entry: Any) -> Any:
        from torch.utils._pytree import tree_map

        def offload(wrapper: Any) -> Any:
            value = getattr(wrapper, "val", None)
            if isinstance(value, torch.Tensor) and not self.engine.should_skip(value):
                # The host copy is taken at save time, so a later in-place edit of the forward's tensor cannot reach
                # it (the recompute replays that edit on the reloaded copy, as the forward did). An edit racing an
                # asynchronous copy is caught by the engine.
                wrapper.val = self.engine.pack(value, "selective")
            return wrapper

        return tree_map(offload, entry, is_leaf=_is_wrapper) if _is_entry(entry) else entry

    def _reload(self, entry: Any) -> Any:
        from torch.utils._pytree import tree_map

        if not _is_entry(entry):
            return entry

        def reload(wrapper: Any) -> Any:
            value = getattr(wrapper, "val", None)
            if isinstance(value, Packed):
                wrapper.val = self.engine.unpack(value, check_version=False)
                # SAC's own check on the forward's tensor, which it compares with the version saved: an edit since
                # the save shows as it would without offloading
                wrapper.version = wrapper.val._version - value.saved.edits()
            return wrapper

        return tree_map(reload, entry, is_leaf=_is_wrapper)

    def entries(self) -> Iterator[Any]:
        raise NotImplementedError

    def packed(self) -> List[Packed]:
        from torch.utils._pytree import tree_leaves

        found = []
        for entry in self.entries():
            if _is_entry(entry):
                found.extend(
                    w.val
                    for w in tree_leaves(entry, is_leaf=_is_wrapper)
                    if isinstance(getattr(w, "val", None), Packed)
                )
        return found


class _HostSlots(_HostEntries, dict):
    """torch >= 2.13: invocation index -> entry (or a recompute/consumed marker, which stays as it is)."""

    def __init__(self, engine: TransferEngine) -> None:
        super().__init__()
        self.engine = engine

    def __setitem__(self, index: int, entry: Any) -> None:
        super().__setitem__(index, self._offload(entry))

    def get(self, index: int, default: Any = None) -> Any:  # type: ignore[override]
        return self._reload(super().get(index, default))

    def entries(self) -> Iterator[Any]:
        return iter(self.values())


class _HostQueue(_HostEntries, list):
    """torch < 2.13: the saved entries in call order, appended in the forward and popped from the front in the
    recompute."""

    def __init__(self, engine: TransferEngine) -> None:
        super().__init__()
        self.engine = engine

    def append(self, entry: Any) -> None:
        super().append(self._offload(entry))

    def pop(self, index: int = -1) -> Any:  # type: ignore[override]
        return self._reload(super().pop(index))

    def entries(self) -> Iterator[Any]:
        return iter(self)


def _is_wrapper(x: Any) -> bool:
    return type(x).__name__ == "_VersionWrapper"


def _is_entry(entry: Any) -> bool:
    from torch.utils._pytree import tree_leaves

    return any(_is_wrapper(x) for x in tree_leaves(entry, is_leaf=_is_wrapper))


class _HostStorage(dict):
    """torch SAC's storage (op key -> slots) with host-resident slots."""

    def __init__(self, engine: TransferEngine) -> None:
        super().__init__()
        self.engine = engine

    def __missing__(self, key: Any) -> _HostEntries:
        slots = self[key] = (_HostSlots if SAC_STORAGE_INDEXED else _HostQueue)(self.engine)
        return slots


def offloading_sac_storage(engine: TransferEngine) -> Callable[[Callable[..., Any]], Tuple[Any, Any]]:
    """A ``storage_factory`` for :class:`~lightning_ac.selective.policy.SelectivePolicy` whose saved tensors
    live on the host: each comes back as the recompute reaches it (the engine's prefetch guesses the nearest save
    packed before the one unpacked, so within a region it brings the previous region's last save ahead)."""
    from torch.utils.checkpoint import _CachingTorchDispatchMode

    def factory(policy_fn: Callable[..., Any]) -> Tuple[Any, Any]:
        # The storage lives as long as the checkpoint that uses it (its graph): nothing else refers to it, so the host
        # copies of a region are given back with its graph, in a pass outside the training step too.
        storage = _HostStorage(engine)
        cached = cached_dispatch_mode(policy_fn, storage)
        return _CachingTorchDispatchMode(policy_fn, storage), Reenterable(lambda: cached)

    return factory


# What offloading less means for each target, as a HostMemoryError suggests it.
_OFFLOAD_LESS = {
    "all": "offload.hidden_states instead of offload.all",
    "selective": "offload.selective off, or fewer activation_checkpointing.selective.save rules",
    "hidden_states": "offload.hidden_states off",
}


def offload_less(targets: Sequence[str], recompute: bool = True) -> str:
    """The fix a :class:`~lightning_ac.offload.HostMemoryError` suggests, for the targets in force (``recompute``:
    whether the run checkpoints its layers; offload.hidden_states needs it)."""
    ways = [_OFFLOAD_LESS[target] for target in ("all", "selective", "hidden_states") if target in targets]
    if not recompute and "all" in targets:
        ways[0] = (
            "activation checkpointing on, with offload.hidden_states instead of offload.all (only layer inputs move)"
        )
    return f"Offload less ({'; or '.join(ways)}), lower the batch size or sequence length, or add host memory."


class ActivationOffloadRuntime:
    """The engine and the targets of one run: what the plan installs for activation offloading.

    Args:
        request: Which targets move to the host, and the engine's limits.
        device: The training device.
    """

    def __init__(self, request: ActivationOffloadRequest, device: torch.device) -> None:
        offload = request.offload
        self.engine = TransferEngine(
            device,
            copy_on_host=request.copy_on_host,
            max_pinned_bytes=request.max_pinned_bytes,
            host_reserve_bytes=request.host_reserve_bytes,
            host_memory_fix=offload_less(offload.targets),
        )
        self.targets = offload.targets
        self.hidden_states = (
            SavedTensorOffloader(self.engine, "hidden_states") if "hidden_states" in self.targets else None
        )
        self.all = (
            SavedTensorOffloader(self.engine, "all", min_bytes=request.min_offload_bytes)
            if "all" in self.targets
            else None
        )
        self.sac_storage: Optional[Callable[..., Any]] = (
            offloading_sac_storage(self.engine) if "selective" in self.targets else None
        )
        self.in_step = False
        self._handles: List[Any] = []
        self._module: Optional[nn.Module] = None

    def install(
        self, module: nn.Module, output_heads: Sequence[Tuple[nn.Module, nn.Module]] = (), recompute: bool = True
    ) -> None:
        """Act on ``module``: its parameters and buffers never move, nor does what is saved from the call of an
        output head on (the logits and the loss over them: :meth:`SavedTensorOffloader.pause_from`).

        Args:
            module: The module trained.
            output_heads: ``(model, head)``: each transformers model and its output head.
            recompute: Whether the run checkpoints its layers (what a :class:`~lightning_ac.offload.HostMemoryError`
                advises depends on it: ``offload.hidden_states`` needs recompute).
        """
        self.engine.host_memory_fix = offload_less(self.targets, recompute)
        self._module = module
        self._refresh_skips()
        if self.all is not None:
            self._handles += [self.all.pause_from(head) for _, head in output_heads]
            self._handles += [self.all.resume_at(model) for model, _ in output_heads]

    def wrap_checkpoint(self, checkpoint_fn: Callable[..., Any]) -> Callable[..., Any]:
        """The checkpoint function a recompute engine should use: ``checkpoint_fn``, offloading each
        checkpointed layer's inputs when ``hidden_states`` is on."""
        return offloading_checkpoint(checkpoint_fn, self.hidden_states) if self.hidden_states else checkpoint_fn

    def describe(self) -> str:
        """Which targets move to the host, as the log line says it."""
        device = self.engine.device
        where = "copies on host" if device.type == "cpu" else str(device)
        return f"offloading {', '.join(self.targets)} to host memory ({where})"

    def describe_layer(self, recomputed: bool, selective: bool) -> List[str]:
        """What moves for one decoder layer (for the per-layer report).

        Args:
            recomputed: Whether the layer is checkpointed.
            selective: Whether a selective policy decides what that layer saves.
        """
        parts = []
        if self.hidden_states is not None and recomputed:
            parts.append("input → cpu")
        if self.all is not None:  # with recompute, what a checkpointed layer saves outside its region is its input
            parts.append("input → cpu" if recomputed else "saved activations → cpu")
        if self.sac_storage is not None and recomputed and selective:
            parts.append("SAC saves → cpu")
        return parts

    def _refresh_skips(self) -> None:
        """Parameters and buffers (and views of them, like a transposed weight) never move. Read again at each
        step: the strategy moves the module to its device after ``setup``, and sharding changes storages."""
        if self._module is None:
            return
        skips = {}
        for tensor in [*self._module.parameters(), *self._module.buffers()]:
            local = tensor.to_local() if type(tensor).__name__ == "DTensor" else tensor
            storage = local.untyped_storage()
            skips[storage.data_ptr()] = StorageWeakRef(storage)
        self.engine.skip_storages = skips

    def start_step(self) -> None:
        """Enter a training step: ``all``'s hooks are in force until :meth:`finish_step`."""
        self._refresh_skips()
        self.engine.start_step()
        if self.all is not None:
            self.all.push()
        self.in_step = True

    def finish_step(self) -> None:
        """Leave the training step: nothing in flight, ``last_step`` recorded."""
        if not self.in_step:
            return
        self.in_step = False
        if self.all is not None:
            self.all.pop()
        self.engine.finish_step()

    def close(self) -> None:
        """Leave nothing pushed, in flight or hooked (after an exception too)."""
        self.finish_step()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def last_step(self) -> Dict[str, Dict[str, int]]:
        """``{target: {"tensors": n, "bytes": n}}`` for the most recent training step, every target listed."""
        return {t: dict(self.engine.last_step.get(t, {"tensors": 0, "bytes": 0})) for t in OFFLOAD_TARGETS}
