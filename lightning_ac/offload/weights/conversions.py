"""Module conversions under layer offloading: ``.to()``, ``.half()``, ``.cuda()`` leave the streamed parameters in
host memory and change only their dtype there."""

from __future__ import annotations

import types
from typing import Any, Callable, Dict, List, Sequence

import torch
from torch import nn

from lightning_ac.offload.weights.slots import StreamedLayer

__all__ = ["CONVERSION_ATTRIBUTES", "ConversionGuard"]

# what the guard sets on a streamed submodule (the plan's journal records it: a copy or a pickle leaves it out)
CONVERSION_ATTRIBUTES = ("_apply",)


class ConversionGuard:
    """Gives each submodule that holds a streamed parameter an ``_apply`` (what the conversions call) that hides
    the parameters still streamed from the conversion, then converts their dtype on the host if the conversion
    changes it.

    Args:
        refresh: Called for a layer that is not loaded after a conversion changed its parameters: it gets a new
            host buffer in the new dtype.
    """

    def __init__(self, refresh: Callable[[StreamedLayer], None]) -> None:
        self._refresh = refresh
        self._guarded: List[nn.Module] = []

    def guard(self, layer: StreamedLayer, module: nn.Module) -> None:
        """Guard the submodules of ``module`` that hold one of ``layer``'s streamed parameters."""
        streamed = {id(p) for p in layer.params}
        for sub in module.modules():
            holds = any(p is not None and id(p) in streamed for p in sub._parameters.values())
            if holds and "_apply" not in sub.__dict__:
                sub._apply = _ApplyGuard(self, layer, sub)
                self._guarded.append(sub)

    def converted(self, layer: StreamedLayer, params: Sequence[nn.Parameter], fn: Any) -> None:
        """After a module conversion that skipped ``params``: apply its dtype change to their host copies."""
        for param in params:
            # What the conversion makes of a tensor of this dtype, without allocating one on the device
            dtype = fn(torch.empty(0, dtype=param.dtype)).dtype
            if dtype != param.dtype:
                param.data = param.data.to(dtype)  # still host memory
        if layer.device is None:
            self._refresh(layer)

    def remove(self) -> None:
        """Give every guarded submodule its class's ``_apply`` back."""
        for sub in self._guarded:
            sub.__dict__.pop("_apply", None)
        self._guarded = []


class _ApplyGuard:
    """A streamed submodule's ``_apply`` while layer offloading is installed: the parameters still streamed sit out
    the conversion, which then reaches their host copies' dtype only. A deep copy of the module (Lightning's
    StochasticWeightAveraging, user code) gets the plain ``_apply`` of its own class instead: the copy is not
    streamed, and must not convert the original."""

    def __init__(self, guard: ConversionGuard, layer: StreamedLayer, module: nn.Module) -> None:
        self.guard, self.layer, self.module = guard, layer, module

    def __call__(self, fn: Any, recurse: bool = True) -> nn.Module:
        module = self.module
        streamed = {id(p) for p in self.layer.params}  # now: a parameter unfrozen since is converted as usual
        held = {n: p for n, p in module._parameters.items() if p is not None and id(p) in streamed}
        for name in held:
            module._parameters[name] = None  # skipped by nn.Module._apply; the key keeps its place
        try:
            type(module)._apply(module, fn, recurse)
        finally:
            for name, param in held.items():
                module._parameters[name] = param
        self.guard.converted(self.layer, list(held.values()), fn)
        return module

    def __deepcopy__(self, memo: Dict[int, Any]) -> Any:
        copy = memo.get(id(self.module))
        return types.MethodType(type(copy)._apply, copy) if copy is not None else None
