"""Record a module tree's hooks and selected attributes, and put them back exactly as found.

Everything a plan installs (transformers' checkpointing flags, its input-grad hooks, our forward wrappers)
lives in module attributes or hook dictionaries. Snapshotting both before applying and restoring them on
removal leaves the model as we found it, whatever the engine touched in between.

A copy or a pickle taken while the plan is applied (``copy.deepcopy``: a best-model snapshot, a teacher made in
``on_fit_start``; ``torch.save``, EMA and checkpointing code that pickles modules) is of the model as found: our
wrappers are closures over the live modules (a copied wrapper would compute with the live model's weights, during the
run and after it, and cannot be pickled). Each module we touched gives a copy its state as found
(:class:`_StateAsFound`).

That state is given through the module's own ``__getstate__``, which both ``copy.deepcopy`` and pickle read from the
instance. Not ``__deepcopy__``: ``nn.Module`` has none, so a wrapper that forwards unknown attributes to the model it
wraps (PEFT's models, ``torch.compile``'s ``OptimizedModule``) would find the wrapped model's and copy itself as that.
``nn.Module`` has a ``__getstate__``, so the instance's is found on that instance only.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple

from torch import nn

__all__ = ["ModuleJournal"]

_MISSING = object()
# where copies and pickles read a module's state: an instance attribute is found before the class's
STATE_AS_FOUND = "__getstate__"
# a class that copies or pickles itself its own way keeps its way
_OWN_WAYS = ("__deepcopy__", "__reduce__", "__reduce_ex__")

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
        self._give_state_as_found()

    def _give_state_as_found(self) -> None:
        """Each module we touched gives copies and pickles its state as found (restored with the rest). A module whose
        class copies itself its own way keeps its way."""
        for index, module in enumerate(self._modules):
            touched = self._ours_attrs[index] or any(self._ours_hooks[index].values())
            if not touched or any(way in vars(type(module)) for way in _OWN_WAYS):
                continue
            self._attrs[index][STATE_AS_FOUND] = module.__dict__.get(STATE_AS_FOUND, _MISSING)
            self._ours_attrs[index][STATE_AS_FOUND] = module.__dict__[STATE_AS_FOUND] = _StateAsFound(self, index)

    def as_found(self, index: int) -> Dict[str, Any]:
        """The state of the ``index``-th module recorded, as its class gives it to a copy (``__getstate__``: torch
        leaves out a compiled call, Lightning the trainer), without the attributes and hooks we installed: the
        attributes as they were before (where they still hold ours), the hook registries less ours."""
        module = self._modules[index]
        state = dict(type(module).__getstate__(module))
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


class _StateAsFound:
    """A touched module's ``__getstate__`` while a plan is applied: its state as found
    (:meth:`ModuleJournal.as_found`), for ``copy.deepcopy`` and pickle alike."""

    def __init__(self, journal: ModuleJournal, index: int) -> None:
        self._journal = journal
        self._index = index

    def __call__(self) -> Dict[str, Any]:
        return self._journal.as_found(self._index)
