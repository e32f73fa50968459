"""Autograd's check on in-place edits, for saves that saved-tensor hooks take over.

Autograd compares a saved tensor's version counter with the one it had when saved only for saves without hooks: a
pack hook that keeps a tensor (below ``min_offload_bytes``, a parameter, the output head's saves) or moves it turns
the check off, and an edit after the save then trains on silently wrong gradients (or on right ones by luck: a copy
taken before the edit). Each save the offloaders take over carries a :class:`SavedVersion`, which their unpack checks
and which raises torch's own error, word for word.

A moved tensor's version counter is read through a handle that shares it and holds no memory: a ``detach()`` of the
tensor (which shares the counter, not autograd's history) set to an empty storage, the counter kept as it was.
"""

from __future__ import annotations

import re
import weakref
from typing import Optional, Tuple

import torch

__all__ = ["SavedVersion", "Kept"]


def _version_handle(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """A tensor with ``tensor``'s version counter and no storage of its own; ``None`` where torch refuses."""
    try:
        with torch.no_grad():
            handle = tensor.detach()
            with torch.autograd._unsafe_preserve_version_counter(handle):
                handle.set_(torch.empty(0, dtype=tensor.dtype, device=tensor.device))
        return handle
    except RuntimeError:  # a torch that refuses set_ on a detached tensor: no check for moved tensors
        return None


def _read_template() -> str:
    """torch's own message for a saved tensor edited in place (SavedVariable::unpack's), as this torch words it: read
    once, at import, from a plain in-place error (no saved-tensor hooks are in force then: under hooks autograd does
    not check, and this check itself would run again)."""
    try:
        with torch.enable_grad(), torch.autograd.set_detect_anomaly(False):
            leaf = torch.ones(1, requires_grad=True, device="cpu")
            out = torch.sigmoid(leaf)
            out.mul_(2)
            out.backward()
    except RuntimeError as error:
        return str(error)
    return ""


_TEMPLATE = _read_template()


def _torch_message(
    kind: str, shape: Tuple[int, ...], node: Optional[str], output_nr: int, version: int, expected: int
) -> str:
    """:data:`_TEMPLATE` filled in for one tensor."""
    head, _, rest = _TEMPLATE.partition("[torch.FloatTensor [1]]")
    _, _, hint = rest.partition("instead.")
    if not head or not hint:  # a wording this code does not know: the gist of it
        head = "one of the variables needed for gradient computation has been modified by an inplace operation: "
        hint = ""
    if torch.is_anomaly_enabled():
        hint = (
            " Hint: the backtrace further above shows the operation that failed to compute its gradient. The variable "
            "in question was changed in there or anywhere later. Good luck!"
        )
    where = f", which is output {output_nr} of {node}," if node else ""
    return (
        f"{head}[{kind} [{', '.join(map(str, shape))}]]{where} is at version {version}; expected version {expected} "
        f"instead.{hint}"
    )


class SavedVersion:
    """A saved tensor's version counter as autograd would check it, without holding the tensor's memory or history.

    Args:
        tensor: The tensor being saved (what the pack hook receives).
        counter: A tensor sharing ``tensor``'s version counter that the caller keeps anyway (a kept save's
            ``detach()``); ``None``: a handle that holds no memory.
    """

    __slots__ = ("_counter", "version", "_shape", "_made_by", "_output_nr", "_tensor")

    def __init__(self, tensor: torch.Tensor, counter: Optional[torch.Tensor] = None) -> None:
        self.version = tensor._version
        self._counter = _version_handle(tensor) if counter is None else counter
        self._shape = tuple(tensor.shape)
        # what torch's message names: the node that made the tensor (a name and a weak reference: holding the node or
        # the tensor would make a cycle through autograd's graph, which Python's collector cannot see)
        grad_fn = tensor.grad_fn
        self._made_by = grad_fn.name() if grad_fn is not None else None
        self._output_nr = tensor.output_nr
        self._tensor = weakref.ref(tensor)

    def edits(self) -> int:
        """In-place edits since the save."""
        return 0 if self._counter is None else self._counter._version - self.version

    def check(self) -> None:
        """Raise torch's error if the tensor was edited in place since it was saved.

        The message names the tensor as torch does: a saved output by the node that saved it, an input by the node that
        made it last (the in-place op's, once edited), a leaf by nothing.
        """
        if self.edits() == 0:
            return
        node = torch._C._current_autograd_node()
        made_by, output_nr = self._made_by, self._output_nr
        if made_by is None or node is None or node.name() != made_by:  # an input: as it is now, if it still lives
            alive = self._tensor()
            if alive is not None:
                made_by = alive.grad_fn.name() if alive.grad_fn is not None else None
                output_nr = alive.output_nr
        name = re.sub(r"Backward\d*$", "", made_by) if made_by else None
        version = self.version + self.edits()
        raise RuntimeError(_torch_message(self._counter.type(), self._shape, name, output_nr, version, self.version))


class Kept:
    """A save a pack hook keeps on the device, with its version at the save (autograd's check, done at unpack).

    It holds the tensor's ``detach()`` (the same memory and version counter, no history): a save of a node's own output
    holding that output would make a cycle through the graph, and a graph dropped without backward would never be
    freed.
    """

    __slots__ = ("tensor", "saved")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.saved = SavedVersion(tensor, counter=self.tensor)

    def unpack(self) -> torch.Tensor:
        self.saved.check()
        return self.tensor
