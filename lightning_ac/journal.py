"""Record a module tree's hooks and selected attributes, and put them back exactly as found.

Everything a plan installs (transformers' checkpointing flags, its input-grad hooks, our forward wrappers)
lives in module attributes or hook dictionaries. Snapshotting both before applying and restoring them on
removal leaves the model as we found it, whatever the engine touched in between.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple

from torch import nn

__all__ = ["ModuleJournal"]

_MISSING = object()

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
