"""What an offloading step must hold on the device, worked out without the transfer engine (an oracle for its tests
and the estimator's).

:class:`SaveTrace` records a step run **without** offloading, through plain ``saved_tensors_hooks`` (and, for the
saves selective checkpointing keeps in its own storage, a plain storage of the same shape): which saves an offload
target would move (``select``), their bytes, the order backward unpacks them, and, since each unpack hands autograd a
tensor of its own (a fresh storage, as a reload is), how long autograd keeps what it was handed.
:func:`ideal_residency` then computes what an ideal engine of the documented design (Note [What the engine holds,
until when] in :mod:`lightning_ac.offload.engine`) holds on the device as each unpack begins: every copy autograd
still holds a reload of, every copy some save of which is still to be unpacked once loaded, and at most ``prefetch``
copies loaded ahead, each the copy of the nearest save packed before the one just unpacked that no unpack has asked
for. In forward, :func:`stash_bound` is what may wait on the device for its copy: two of the largest copies.

Saves that share bytes move once (a second view of a storage, the same tensor saved twice, unchanged since): a
copy here is the first such save's byte range on its storage, and a later save unchanged and inside it is its.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

__all__ = [
    "SaveTrace",
    "ideal_residency",
    "layer_inputs",
    "moved_by_all",
    "stash_bound",
    "tracing_sac_storage",
]


@dataclass
class _Copy:
    storage: Any  # weak reference to the device storage
    version: int
    start: int
    end: int
    nbytes: int
    saves: int = 0


@dataclass
class _Save:
    copy: int  # index into SaveTrace.copies


@dataclass
class _Unpack:
    save: int  # index into SaveTrace.saves
    handed: Set[int]  # copies autograd still holds an unpacked tensor of, as this unpack begins
    dead: Set[int]  # saves autograd has dropped by then (never to be unpacked)


@dataclass
class SaveTrace:
    """Records the saves a run without offloading would offload (see the module's docstring).

    Args:
        select: Whether a save (the tensor a pack hook receives) is one the offload target under test moves.
    """

    select: Callable[[torch.Tensor], bool]
    copies: List[_Copy] = field(default_factory=list)
    saves: List[_Save] = field(default_factory=list)
    unpacks: List[_Unpack] = field(default_factory=list)
    _handed: Dict[int, int] = field(default_factory=dict)  # copy -> unpacked tensors of it alive
    _dead: Set[int] = field(default_factory=set)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Plain saved-tensor hooks that record what autograd saves (enter them around the training step)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # -- recording ----------------------------------------------------------------------------------------

    def record_save(self, tensor: torch.Tensor, select: Optional[Callable[[torch.Tensor], bool]] = None) -> Any:
        """A save: its token where the target moves it (``select``, by default the trace's), else ``None``."""
        if torch._C._current_graph_task_id() != -1 or not (select or self.select)(tensor):
            return None
        storage = tensor.untyped_storage()
        start = tensor.storage_offset() * tensor.element_size()
        end = start + (sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1) * tensor.element_size()
        index = self._find_copy(storage, tensor._version, start, end, tensor.element_size())
        if index is None:
            index = len(self.copies)
            self.copies.append(_Copy(_storage_ref(storage), tensor._version, start, end, end - start))
        self.copies[index].saves += 1
        self.saves.append(_Save(index))
        token = _Token(len(self.saves) - 1, tensor)
        weakref.finalize(token, self._dead.add, token.save)
        return token

    def record_unpack(self, token: _Token) -> torch.Tensor:
        """A save unpacked: recorded, and a tensor of its own handed back (as a reload is)."""
        copy = self.saves[token.save].copy
        self.unpacks.append(_Unpack(token.save, {c for c, n in self._handed.items() if n > 0}, set(self._dead)))
        tensor = token.tensor
        data = tensor.untyped_storage().clone()
        out = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        out.set_(data, tensor.storage_offset(), tensor.shape, tensor.stride())
        self._handed[copy] = self._handed.get(copy, 0) + 1
        weakref.finalize(data, self._release, copy)
        return out

    def _find_copy(self, storage: Any, version: int, start: int, end: int, itemsize: int) -> Optional[int]:
        for i, c in enumerate(self.copies):
            same = c.storage() is not None and c.storage() == storage._cdata
            if (
                same
                and c.version == version
                and c.start <= start
                and end <= c.end
                and (start - c.start) % itemsize == 0
            ):
                return i
        return None

    def _release(self, copy: int) -> None:
        self._handed[copy] -= 1

    def _pack(self, tensor: torch.Tensor) -> Any:
        token = self.record_save(tensor)
        return tensor if token is None else token

    def _unpack(self, packed: Any) -> torch.Tensor:
        return self.record_unpack(packed) if isinstance(packed, _Token) else packed


class _Token:
    """What the trace's pack hook keeps: the save's index and the tensor's ``detach()`` (nothing moves; holding the
    tensor with its history would make a cycle through autograd's graph, and a dropped graph would never die)."""

    def __init__(self, save: int, tensor: torch.Tensor) -> None:
        self.save, self.tensor = save, tensor.detach()


def _storage_ref(storage: Any) -> Callable[[], Optional[int]]:
    """A reference to a storage that does not keep it alive: its ``_cdata`` while it lives."""
    from torch.multiprocessing.reductions import StorageWeakRef

    ref, cdata = StorageWeakRef(storage), storage._cdata
    return lambda: None if ref.expired() else cdata


def ideal_residency(trace: SaveTrace, prefetch: int = 1) -> List[int]:
    """Device bytes an ideal engine holds as each unpack of ``trace`` begins, in unpack order.

    Args:
        trace: A recorded run without offloading.
        prefetch: How many copies may be loaded ahead of any unpack asking for them.
    """
    nbytes = [c.nbytes for c in trace.copies]
    pending = [c.saves for c in trace.copies]
    saves_of: Dict[int, List[int]] = {}
    for index, save in enumerate(trace.saves):
        saves_of.setdefault(save.copy, []).append(index)
    loaded: Set[int] = set()  # copies the engine holds on the device
    ahead: List[Tuple[int, int]] = []  # ... of them, loaded ahead of any unpack asking for them: (copy, save guessed)
    unpacked: Set[int] = set()
    residency = []
    for event in trace.unpacks:
        residency.append(sum(nbytes[c] for c in loaded | event.handed))
        copy = trace.saves[event.save].copy
        loaded.add(copy)
        ahead = [(c, s) for c, s in ahead if c != copy]
        unpacked.add(event.save)
        for c, s in [(c, s) for c, s in ahead if s in event.dead]:  # guessed for a save dropped unused
            ahead.remove((c, s))
            if all(other in event.dead for other in saves_of[c]):
                loaded.discard(c)  # nothing refers to the copy any more
        below = event.save
        while len(ahead) < prefetch:
            below = next(
                (s for s in range(below - 1, -1, -1) if s not in unpacked and s not in event.dead),
                None,
            )
            if below is None or trace.saves[below].copy in loaded:
                break
            loaded.add(trace.saves[below].copy)
            ahead.append((trace.saves[below].copy, below))
        pending[copy] -= 1
        if pending[copy] <= 0:
            loaded.discard(copy)
    return residency


def stash_bound(trace: SaveTrace) -> int:
    """What may wait on the device in forward for its copy to the host: two of the largest copies."""
    return 2 * max((c.nbytes for c in trace.copies), default=0)


# -- what each target moves, said without the engine ---------------------------------------------------------


def _plain(tensor: torch.Tensor, model: nn.Module) -> bool:
    """Not a parameter or buffer (or a view of one), of the layout a byte copy carries, and not empty."""
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided or tensor.numel() == 0:
        return False
    if tensor.is_conj() or tensor.is_neg():
        return False
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    return tensor.untyped_storage().data_ptr() not in own


def moved_by_all(
    model: nn.Module, head: Optional[nn.Module], min_bytes: int = 0
) -> Tuple[Callable[[torch.Tensor], bool], Any]:
    """``offload.all``: every plain save of ``min_bytes`` or more, but those from the call of a transformers model's
    output head ``head`` on (its logits and the loss over them), until the model's next forward. Returns the selection
    and the hooks' handles."""
    state = {"paused": False}
    handles = (
        []
        if head is None
        else [
            head.register_forward_pre_hook(lambda *a: state.update(paused=True)),
            model.register_forward_pre_hook(lambda *a: state.update(paused=False)),
        ]
    )

    def select(tensor: torch.Tensor) -> bool:
        big = tensor.numel() * tensor.element_size() >= min_bytes
        return not state["paused"] and big and _plain(tensor, model)

    return select, handles


def layer_inputs(model: nn.Module, layers: List[nn.Module]) -> Tuple[Callable[[torch.Tensor], bool], Any]:
    """``offload.hidden_states``: the input each decoder layer is called with. Returns the selection and the hooks'
    handles."""
    inputs: List[Any] = []

    def seen(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        inputs.append(weakref.ref(hidden))

    handles = [layer.register_forward_pre_hook(seen, with_kwargs=True) for layer in layers]

    def select(tensor: torch.Tensor) -> bool:
        ptr = tensor.untyped_storage().data_ptr()
        return any(
            (t := ref()) is not None and t.untyped_storage().data_ptr() == ptr and t.shape == tensor.shape
            for ref in inputs
        )

    return select, handles


def tracing_sac_storage(trace: SaveTrace, select: Callable[[torch.Tensor], bool]) -> Callable[..., Any]:
    """A ``storage_factory`` for selective checkpointing that keeps its saves where they are and records them in
    ``trace`` (those ``select`` takes): SAC's saves bypass saved-tensor hooks."""
    from torch.utils._pytree import tree_map
    from torch.utils.checkpoint import _CachingTorchDispatchMode

    from lightning_ac._compat import SAC_STORAGE_INDEXED, cached_dispatch_mode
    from lightning_ac._reenterable import Reenterable

    def wrappers(entry: Any) -> Iterator[Any]:
        from torch.utils._pytree import tree_leaves

        return (w for w in tree_leaves(entry, is_leaf=_is_wrapper) if _is_wrapper(w))

    def on_save(entry: Any) -> Any:
        for wrapper in wrappers(entry):
            if isinstance(wrapper.val, torch.Tensor):
                token = trace.record_save(wrapper.val, select)
                if token is not None:
                    wrapper.token = token
        return entry

    def on_use(entry: Any) -> Any:
        def use(wrapper: Any) -> Any:
            token = getattr(wrapper, "token", None)
            if token is None:
                return wrapper
            out = type(wrapper)(trace.record_unpack(token))
            return out

        return tree_map(use, entry, is_leaf=_is_wrapper) if any(True for _ in wrappers(entry)) else entry

    class Slots(dict):
        def __setitem__(self, index: int, entry: Any) -> None:
            super().__setitem__(index, on_save(entry))

        def get(self, index: int, default: Any = None) -> Any:  # type: ignore[override]
            return on_use(super().get(index, default))

    class Queue(list):
        def append(self, entry: Any) -> None:
            super().append(on_save(entry))

        def pop(self, index: int = -1) -> Any:  # type: ignore[override]
            return on_use(super().pop(index))

    class Storage(dict):
        def __missing__(self, key: Any) -> Any:
            slots = self[key] = Slots() if SAC_STORAGE_INDEXED else Queue()
            return slots

    def factory(policy_fn: Callable[..., Any]) -> Tuple[Any, Any]:
        storage = Storage()
        cached = cached_dispatch_mode(policy_fn, storage)
        return _CachingTorchDispatchMode(policy_fn, storage), Reenterable(lambda: cached)

    return factory


def _is_wrapper(x: Any) -> bool:
    return type(x).__name__ == "_VersionWrapper"
