"""The optimizer an estimate's step runs, as the user builds it: by name (``adamw``, ``adamw_fused``, ``adamw_8bit``,
``sgd``, ``sgd_momentum``, ``none``), or in Python any ``torch.optim`` class with its keyword arguments.

What each holds is what the optimizer itself allocates on the fake tensors: its state (bitsandbytes' 8-bit AdamW
through its own ``init_state``: uint8 moments, a float32 absmax per block of 256, 32-bit state for tensors under
4096 elements) and the temporaries of its step (foreach AdamW makes parameter-sized ones; the fused kernels none).
Where torch keeps a state tensor on the host (the ``step`` counters of an optimizer that is neither fused nor
capturable), a CUDA estimate counts it there: :func:`state_on_host`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Type, Union

import torch
from torch import nn

from lightning_ac.estimate.errors import EstimateError
from lightning_ac.estimate.imports import import_bitsandbytes

__all__ = ["OPTIMIZERS", "OptimizerChoice", "optimizer_choice", "state_on_host"]

OPTIMIZERS = ("adamw", "adamw_fused", "adamw_8bit", "sgd", "sgd_momentum", "none")
_LR = 1e-6  # any: the step's memory does not depend on it

OptimizerArgument = Union[str, Type[torch.optim.Optimizer], Tuple[Type[torch.optim.Optimizer], Dict[str, Any]]]


@dataclass(frozen=True)
class OptimizerChoice:
    """The optimizer a fake step builds over the trainable parameters.

    Attributes:
        name: As the table names it (``adamw_fused``, ``Adafactor(...)``).
        cls: The optimizer class, ``None`` for no optimizer (gradients, no step).
        kwargs: Its keyword arguments besides the parameters.
    """

    name: str
    cls: Optional[Type[torch.optim.Optimizer]]
    kwargs: Dict[str, Any] = field(default_factory=dict)

    def build(self, params: Sequence[nn.Parameter]) -> Optional[torch.optim.Optimizer]:
        """The optimizer over ``params``, ``None`` for ``none``."""
        if self.cls is None:
            return None
        return self.cls(list(params), **self.kwargs)


def optimizer_choice(value: OptimizerArgument, target: str = "cuda") -> OptimizerChoice:
    """The optimizer ``value`` names.

    Args:
        value: A name (:data:`OPTIMIZERS`), an optimizer class, or ``(class, kwargs)``. ``adamw`` and ``sgd`` run
            their foreach implementation on a CUDA target (torch's default there) and the single-tensor one on the
            CPU (torch's default there); ``adamw_fused`` is ``AdamW(fused=True)``; ``adamw_8bit`` bitsandbytes'
            ``AdamW8bit``; ``sgd_momentum`` ``SGD(momentum=0.9)``.
        target: ``cuda`` or ``cpu``: which implementation torch picks by default.

    Raises:
        EstimateError: For a name not in :data:`OPTIMIZERS`, or a class that is not a ``torch.optim.Optimizer``.
    """
    if isinstance(value, str):
        foreach = target == "cuda"
        named: Dict[str, Callable[[], OptimizerChoice]] = {
            "adamw": lambda: OptimizerChoice("adamw", torch.optim.AdamW, {"lr": _LR, "foreach": foreach}),
            "adamw_fused": lambda: OptimizerChoice("adamw_fused", torch.optim.AdamW, {"lr": _LR, "fused": True}),
            "adamw_8bit": lambda: OptimizerChoice("adamw_8bit", _adamw_8bit(), {"lr": _LR}),
            "sgd": lambda: OptimizerChoice("sgd", torch.optim.SGD, {"lr": _LR, "foreach": foreach}),
            "sgd_momentum": lambda: OptimizerChoice(
                "sgd_momentum", torch.optim.SGD, {"lr": _LR, "momentum": 0.9, "foreach": foreach}
            ),
            "none": lambda: OptimizerChoice("none", None),
        }
        if value not in named:
            raise EstimateError(f"--optimizer {value}: choose from {', '.join(OPTIMIZERS)}")
        return named[value]()
    cls, kwargs = value if isinstance(value, tuple) else (value, {})
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or not isinstance(kwargs, dict):
        raise EstimateError(
            f"optimizer={value!r}: expected one of {', '.join(OPTIMIZERS)}, a torch.optim.Optimizer class, or "
            "(class, keyword arguments), e.g. (torch.optim.Adam, {'betas': (0.9, 0.95)})"
        )
    shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "lr")
    kwargs = {"lr": _LR, **kwargs}
    takes = inspect.signature(cls.__init__).parameters
    if target == "cuda" and "foreach" in takes and "foreach" not in kwargs and not kwargs.get("fused"):
        kwargs["foreach"] = True  # torch's default on CUDA tensors; the fake step's are CPU tensors
    return OptimizerChoice(f"{cls.__name__}({shown})", cls, kwargs)


def state_on_host(optimizer: Any, key: str, value: torch.Tensor) -> bool:
    """Whether torch keeps this state tensor in host memory on a CUDA run: the ``step`` counter of an optimizer that
    is neither fused nor capturable (``torch.optim``'s Adam family, Adagrad...: a 0-dim float32 CPU tensor)."""
    defaults = getattr(optimizer, "defaults", {})
    on_device = bool(defaults.get("fused")) or bool(defaults.get("capturable"))
    return key == "step" and value.dim() == 0 and not on_device and isinstance(optimizer, torch.optim.Optimizer)


def _adamw_8bit() -> Type[torch.optim.Optimizer]:
    try:
        bnb = import_bitsandbytes()
    except ImportError as err:
        raise EstimateError(
            "--optimizer adamw_8bit is bitsandbytes' AdamW8bit, and bitsandbytes is not installed: "
            "pip install bitsandbytes"
        ) from err
    return _fake_safe(bnb.optim.AdamW8bit)


_FAKE_SAFE: Dict[type, type] = {}


def _fake_safe(cls: type) -> type:
    """bitsandbytes' optimizer as a fake step runs it: its own ``init_state`` allocates the state (the layout is
    bitsandbytes'), the quantization maps are 256 float32 values each (their values are not the step's memory), and
    the update, one fused in-place kernel on CUDA that allocates nothing, is not run (its CPU path reads values)."""
    if cls not in _FAKE_SAFE:

        def fill_qmap(self: Any) -> None:
            self.name2qmap["dynamic"] = torch.empty(256, dtype=torch.float32)
            self.name2qmap["udynamic"] = torch.empty(256, dtype=torch.float32)

        def update_step(self: Any, group: Any, p: Any, gindex: int, pindex: int) -> None:
            self.state[p]["step"] += 1

        _FAKE_SAFE[cls] = type(cls.__name__, (cls,), {"fill_qmap": fill_qmap, "update_step": update_step})
    return _FAKE_SAFE[cls]
