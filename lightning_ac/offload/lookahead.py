"""Which copy backward needs next: the transfer engine's guess for its prefetch (Note [What the engine holds, until
when] in :mod:`lightning_ac.offload.engine`).

Backward runs roughly in reverse of forward, but a node unpacks its saves in forward order and a recompute replays a
layer forwards, so "the save packed just before this one" has often just been used. The guess is the nearest save
packed before the one being unpacked that is alive and not yet unpacked: a copy whose saves have all been unpacked is
never brought back.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Tuple

from lightning_ac.offload.copies import HostCopy, Packed

__all__ = ["Lookahead"]


class Lookahead:
    """One step's saves in pack order (referred to weakly: a save lives as long as autograd keeps it), and the copies
    loaded ahead of any unpack asking for them."""

    def __init__(self) -> None:
        self._packed: List[Any] = []  # weak refs to the saves, in pack order
        self._below: List[int] = []  # per save: the next earlier save that may still be to come
        self._ahead: List[Tuple[HostCopy, Any]] = []  # copies loaded ahead, and a weak ref to the save guessed

    def add(self, make: Any) -> Packed:
        """Record the save ``make(index)`` returns, ``index`` its position in pack order."""
        index = len(self._packed)
        packed = make(index)
        self._packed.append(weakref.ref(packed))
        self._below.append(index - 1)
        return packed

    def owns(self, packed: Packed) -> bool:
        """Whether ``packed`` is one of this step's saves (a graph kept from an earlier step is not)."""
        return packed.index < len(self._packed) and self._packed[packed.index]() is packed

    @property
    def ahead(self) -> List[HostCopy]:
        """The copies loaded ahead of any unpack asking for them, held until asked for or the step's end; a copy
        guessed for a save autograd has dropped since (a graph freed without backward, a gradient not asked for) no
        longer counts, and is held only as long as another save of it lives."""
        self._ahead = [(copy, save) for copy, save in self._ahead if save() is not None]
        return [copy for copy, _ in self._ahead]

    def loaded_ahead(self, copy: HostCopy, packed: Packed) -> None:
        """``copy`` was loaded ahead, guessed for ``packed``."""
        self._ahead.append((copy, weakref.ref(packed)))

    def asked(self, copy: HostCopy) -> None:
        """An unpack asked for ``copy``: it is no longer loaded ahead."""
        if not copy.asked:
            copy.asked = True
            self._ahead = [(c, save) for c, save in self._ahead if c is not copy]

    def still_to_come(self, index: int) -> Optional[Packed]:
        """The nearest save packed before ``index`` that is alive and not yet unpacked (the saves passed over are
        remembered, so a step's searches cost about one look per save)."""
        passed = []
        earlier = self._below[index]
        while earlier >= 0:
            packed = self._packed[earlier]()
            if packed is not None and not packed.unpacked:
                break
            passed.append(earlier)
            earlier = self._below[earlier]
        for skipped in passed:
            self._below[skipped] = earlier
        self._below[index] = earlier
        return self._packed[earlier]() if earlier >= 0 else None
