"""Record a module tree's hooks and selected attributes, and put them back exactly as found.

Everything a plan installs (transformers' checkpointing flags, its input-grad hooks, our forward wrappers)
lives in module attributes or hook dictionaries. Snapshotting both before applying and restoring them on
removal leaves the model as we found it, whatever the engine touched in between.

A copy taken while the plan is applied (``copy.deepcopy``: a best-model snapshot, a teacher made in
``on_fit_start``) is a copy of the model as found: our wrappers are closures over the live modules (a copied
wrapper would compute with the live model's weights, during the run and after it, and cannot be pickled), so each
module we touched copies itself without them (:class:`_CopyAsFound`).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterable, List, Tuple

from torch import nn

__all__ = ["ModuleJournal"]

_MISSING = object()
# where ``copy.deepcopy`` looks for a module's own copier: an instance attribute is found before the class's
COPIER = "__deepcopy__"

# nn.Module's hook registries; RemovableHandle ids are their keys.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


class ModuleJournal:
    """A snapshot of ``attributes`` and hook registries on every module of ``root``.

    Args:
        root: The module tree to record.
        attributes: Instance attribute names to record on each module (a missing attribute is recorded as
            missing and deleted again on restore, so class-level defaults show through as before).
    """

    def __init__(self, root: nn.Module, attributes: Iterable[str]) -> None:
        self._attributes = tuple(attributes)
        self._modules: List[nn.Module] = list(root.modules())
        self._attrs: List[Dict[str, Any]] = [
            {name: m.__dict__.get(name, _MISSING) for name in self._attributes} for m in self._modules
        ]
        self._hooks: List[Dict[str, Tuple[Any, ...]]] = [
            {d: tuple(getattr(m, d, {}).keys()) for d in _HOOK_DICTS} for m in self._modules
        ]

    def commit(self) -> None:
        """Record what was installed since the snapshot as ours. From now on :meth:`restore` removes only that,
        so hooks and attributes that others add later (``fully_shard`` in ``configure_model``, the user's own
        ``setup``, other callbacks) survive our removal."""
        self._ours_hooks: List[Dict[str, Tuple[Any, ...]]] = []
        self._ours_attrs: List[Dict[str, Any]] = []
        for module, attrs, hooks in zip(self._modules, self._attrs, self._hooks):
            added = {}
            for dict_name, keys in hooks.items():
                registry = getattr(module, dict_name, {})
                added[dict_name] = tuple(k for k in registry if k not in keys)
            self._ours_hooks.append(added)
            self._ours_attrs.append(
                {
                    name: module.__dict__.get(name, _MISSING)
                    for name, before in attrs.items()
                    if module.__dict__.get(name, _MISSING) is not before
                }
            )
        self._committed = True
        self._copy_as_found()

    def _copy_as_found(self) -> None:
        """Each module we touched copies itself without what we installed (restored with the rest). A module whose
        class copies itself its own way keeps its way."""
        for index, module in enumerate(self._modules):
            touched = self._ours_attrs[index] or any(self._ours_hooks[index].values())
            if not touched or getattr(type(module), COPIER, None) is not None:
                continue
            copier = _CopyAsFound(self, index)
            self._attrs[index][COPIER] = module.__dict__.get(COPIER, _MISSING)
            self._ours_attrs[index][COPIER] = copier
            module.__dict__[COPIER] = copier

    def as_found(self, index: int) -> Dict[str, Any]:
        """The state of the ``index``-th module recorded, as its class gives it to a copy (``__getstate__``: torch
        leaves out a compiled call, Lightning the trainer), without the attributes and hooks we installed: the
        attributes as they were before (where they still hold ours), the hook registries less ours."""
        module = self._modules[index]
        state = dict(module.__getstate__())
        before, ours = self._attrs[index], self._ours_attrs[index]
        for name, value in ours.items():
            if state.get(name, _MISSING) is not value:
                continue  # changed by someone else since: theirs
            if before[name] is _MISSING:
                state.pop(name, None)
            else:
                state[name] = before[name]
        for dict_name, keys in self._ours_hooks[index].items():
            registry = state.get(dict_name)
            if registry is not None and keys:
                state[dict_name] = type(registry)((k, v) for k, v in registry.items() if k not in keys)
        return state

    def restore(self) -> None:
        """Put back what we changed: after :meth:`commit`, only our hooks and the attributes we set (where they
        still hold our value); before it (a failed apply), everything changed since the snapshot."""
        committed = getattr(self, "_committed", False)
        for index, (module, attrs, hooks) in enumerate(zip(self._modules, self._attrs, self._hooks)):
            for name, value in attrs.items():
                if committed:
                    ours = self._ours_attrs[index]
                    if name not in ours or module.__dict__.get(name, _MISSING) is not ours[name]:
                        continue  # not ours, or changed by someone else since: leave it
                if value is _MISSING:
                    module.__dict__.pop(name, None)
                else:
                    module.__dict__[name] = value
            for dict_name, keys in hooks.items():
                registry = getattr(module, dict_name, None)
                if registry is None:
                    continue
                if committed:
                    remove = [k for k in self._ours_hooks[index][dict_name] if k in registry]
                else:
                    remove = [k for k in registry if k not in keys]
                for key in remove:
                    del registry[key]


class _CopyAsFound:
    """A touched module's ``__deepcopy__`` while a plan is applied: the copy is made as ``copy.deepcopy`` makes a
    module's (a new instance, its state deep-copied, ``__setstate__``), from the state as found
    (:meth:`ModuleJournal.as_found`)."""

    def __init__(self, journal: ModuleJournal, index: int) -> None:
        self._journal = journal
        self._index = index

    def __call__(self, memo: Dict[int, Any]) -> nn.Module:
        module = self._journal._modules[self._index]
        copied = type(module).__new__(type(module))
        memo[id(module)] = copied  # before the state: a module that refers to itself, or a child to its parent
        copied.__setstate__(copy.deepcopy(self._journal.as_found(self._index), memo))
        return copied
