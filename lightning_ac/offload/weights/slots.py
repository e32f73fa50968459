"""What layer offloading moves: which parameters, the tensors each one stands for, and a layer's record of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_ac.offload.device import stands_for_plain

__all__ = [
    "ParamView",
    "Slot",
    "StreamedLayer",
    "frozen_layer_parameters",
    "holds",
    "is_params4bit",
    "nbytes",
    "slots_of",
]


def frozen_layer_parameters(layers: Sequence[nn.Module]) -> List[List[nn.Parameter]]:
    """For each layer, the parameters layer offloading moves: frozen, plain ``nn.Parameter`` or bitsandbytes'
    4-bit ``Params4bit`` (with its quant state; other subclasses, such as DTensor shards, stay put), and used by
    that layer only (a parameter shared between layers stays put)."""
    owners: Dict[int, int] = {}
    for layer in layers:
        for p in layer.parameters():  # each parameter once per layer (parameters() drops duplicates)
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [
        [p for p in layer.parameters() if not p.requires_grad and _streamable(p) and owners[id(p)] == 1]
        for layer in layers
    ]


def _streamable(p: nn.Parameter) -> bool:
    if type(p) is nn.Parameter or (stands_for_plain(p) and isinstance(p, nn.Parameter)):
        return True
    return is_params4bit(p) and getattr(p, "quant_state", None) is not None


def is_params4bit(p: torch.Tensor) -> bool:
    """bitsandbytes' 4-bit parameter, recognised without importing bitsandbytes."""
    cls = type(p)
    return cls.__name__ == "Params4bit" and cls.__module__.startswith("bitsandbytes")


def nbytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def holds(current: torch.Tensor, data: torch.Tensor) -> bool:
    """Whether ``current`` (a parameter's ``.data``, a new tensor object at each access) is ``data``: compare
    devices, storages and offsets."""
    return (
        current.device == data.device
        and current.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
        and current.storage_offset() == data.storage_offset()
    )


@dataclass(eq=False)
class Slot:
    """One tensor a layer streams: a parameter's ``.data``, or a tensor of a 4-bit parameter's quant state
    (``absmax``, ``code``; with double quantization also ``offset`` and the nested state's), which the
    dequantizing kernels read next to the packed weight."""

    param: nn.Parameter
    owner: Any  # the parameter, or the (nested) QuantState holding the tensor
    attr: str  # "data", or the QuantState attribute

    def get(self) -> torch.Tensor:
        """The tensor the slot holds now."""
        return self.owner.data if self.attr == "data" else getattr(self.owner, self.attr)

    def set(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the one the slot holds."""
        if self.attr == "data":
            self.owner.data = tensor
        else:
            setattr(self.owner, self.attr, tensor)


def slots_of(param: nn.Parameter) -> List[Slot]:
    """What streaming ``param`` moves: its data, and for a 4-bit parameter the tensors of its quant state."""
    slots = [Slot(param, param, "data")]
    state = getattr(param, "quant_state", None) if is_params4bit(param) else None
    if state is not None:
        slots += [Slot(param, state, "absmax"), Slot(param, state, "code")]
        if getattr(state, "nested", False):
            slots += [Slot(param, state, "offset"), Slot(param, state.state2, "absmax")]
            slots += [Slot(param, state.state2, "code")]
    return slots


@dataclass(eq=False)
class StreamedLayer:
    """One decoder layer's streamed parameters and where their tensors are."""

    index: int
    params: List[nn.Parameter]
    slots: List[Slot] = field(default_factory=list)  # what moves for ``params``, in order
    host: List[torch.Tensor] = field(default_factory=list)  # each slot's tensor between uses
    buffer: Optional[torch.Tensor] = None  # the host buffer ``host`` slices
    device: Optional[List[torch.Tensor]] = None  # each slot's device copy while the layer is loaded
    event: Any = None  # accelerator event: the host -> device copy has finished
    nbytes: int = 0

    def copy_of(self, slot: Slot) -> Optional[torch.Tensor]:
        """The device copy of ``slot`` while the layer is loaded (found by identity: a call that replaced some of
        the layer's tensors can change which slots the layer has), else ``None``."""
        if self.device is None:
            return None
        return next((t for s, t in zip(self.slots, self.device) if s is slot), None)


@dataclass(eq=False)
class ParamView:
    """What the saved-tensor hook keeps instead of a view of a loaded parameter."""

    layer: StreamedLayer
    slot: Slot
    offset: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
