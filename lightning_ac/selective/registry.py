"""Plugin-registered saves, applied ahead of ``save`` and the rules in every selective policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Union

__all__ = [
    "RegisteredSave",
    "register_mandatory_save",
    "register_preferred_save",
    "registered_saves",
    "registry_version",
]

OpSpec = Union[str, Any]  # a qualified-name substring ("aten::topk") or a torch op (torch.ops.aten.topk)


@dataclass(eq=False)
class RegisteredSave:
    """A registered save; ``remove()`` unregisters it.

    Attributes:
        pattern: Substring of the qualified op name.
        mandatory: Saved for correctness; the forward gets a clone of the output.
    """

    pattern: str
    mandatory: bool

    def matches(self, name: str) -> bool:
        return self.pattern in name and "backward" not in name

    def remove(self) -> None:
        global _version
        if self in _REGISTRY:
            _REGISTRY.remove(self)
            _version += 1


_REGISTRY: List[RegisteredSave] = []
_version = 0  # counts the changes to the registry: policies forget the decisions they cached by op kind


def _pattern(op: OpSpec) -> str:
    if isinstance(op, str):
        if not op:
            raise ValueError("register a non-empty op name, e.g. 'aten::topk'")
        return op
    for attr in ("_schema", "_qualified_op_name"):
        value = getattr(op, attr, None)
        if value is not None:
            return getattr(value, "name", value)
    name = getattr(op, "name", None)
    if callable(name):
        return name()
    raise TypeError(f"expected an op name or a torch op, got {op!r}")


def register_mandatory_save(op: OpSpec) -> RegisteredSave:
    """Always save ``op``'s output in checkpointed regions: its recompute would diverge from the forward.

    For example a router's ``topk``, whose near-ties could re-route tokens in the recompute, or a
    device-to-host copy that sizes a collective. The forward receives a clone of the saved output, so an
    in-place edit (a router normalising its top-k weights) cannot corrupt the cached copy.

    Args:
        op: A substring of the qualified op name (``"aten::topk"``) or a torch op (``torch.ops.aten.topk``).

    Returns:
        A handle whose ``remove()`` unregisters the save.
    """
    global _version
    entry = RegisteredSave(_pattern(op), mandatory=True)
    _REGISTRY.insert(sum(e.mandatory for e in _REGISTRY), entry)  # mandatory saves stay first
    _version += 1
    return entry


def register_preferred_save(op: OpSpec) -> RegisteredSave:
    """Save ``op``'s output in checkpointed regions to skip an expensive recompute (a memory trade only).

    Args:
        op: A substring of the qualified op name or a torch op.

    Returns:
        A handle whose ``remove()`` unregisters the save.
    """
    global _version
    entry = RegisteredSave(_pattern(op), mandatory=False)
    _REGISTRY.append(entry)
    _version += 1
    return entry


def registered_saves() -> List[RegisteredSave]:
    """The registered saves, mandatory ones first (kept in that order: the policy reads this for every op)."""
    return _REGISTRY


def registry_version() -> int:
    """A number that changes whenever a save is registered or removed."""
    return _version
