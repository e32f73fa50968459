"""The precision an estimate's step runs in, as Lightning names it (``Trainer(precision=...)``).

``*-true`` builds the weights in that dtype and runs every op in it. ``*-mixed`` keeps the weights, gradients and
optimizer state in float32 and runs the step under autocast, as Lightning's ``MixedPrecision`` plugin does: the
activations autocast keeps are bf16 or fp16 where the op runs in it, and a trainable float32 weight's low-precision
copy is cached for the forward. The fake step runs Lightning's own plugin on the CPU, so what it counts is what CPU
autocast does (CUDA's autocast casts the same matmuls and linears; its float32 op list differs in a few pointwise
ops). ``16-mixed`` is counted as ``bf16-mixed``: CPU autocast runs it the same way, in two-byte floats, and the
gradient scaler holds a few scalars. A QLoRA model under autocast is built as the recipe loads it: a bf16 base
whose 4-bit layers compute in bf16 (:meth:`Precision.build_dtype`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from lightning_ac.estimate.errors import EstimateError

__all__ = ["PRECISIONS", "Precision", "as_precision", "precision_for"]

PRECISIONS = ("32-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed")
_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 32: "32-true", 16: "16-mixed"}
_TRUE_DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "16-true": torch.float16}


@dataclass(frozen=True)
class Precision:
    """A step's precision.

    Attributes:
        name: Lightning's name (``bf16-mixed``).
        weights: The dtype the weights (and their gradients and optimizer state) are built in.
        autocast: The Lightning precision the fake step's Trainer runs with (``bf16-mixed``), ``None`` where the
            weights' dtype is the step's.
    """

    name: str
    weights: torch.dtype
    autocast: Optional[str] = None

    def build_dtype(self, qlora: bool) -> torch.dtype:
        """The dtype the model is built in: the weights', but for a QLoRA model under autocast bf16, as the recipe
        loads it (``torch_dtype=bfloat16`` with a bf16 compute dtype; ``prepare_model_for_kbit_training`` then casts
        what is not 4-bit to float32)."""
        return torch.bfloat16 if qlora and self.autocast is not None else self.weights

    @property
    def dtype_name(self) -> str:
        """The weights' dtype as the table names it (``float32``)."""
        return str(self.weights).replace("torch.", "")


def precision_for(name: Union[str, int]) -> Precision:
    """The precision Lightning's ``name`` stands for (its aliases too: ``bf16`` is ``bf16-mixed``, ``16``
    ``16-mixed``, ``32`` ``32-true``).

    Raises:
        EstimateError: For ``transformer-engine`` (its FP8 kernels are not ops a fake step can run) and any other
            name.
    """
    key = _ALIASES.get(name, name)
    if isinstance(key, str) and key.startswith("transformer-engine"):
        raise EstimateError(
            f"--precision {name}: NVIDIA Transformer Engine replaces the model's linears with FP8 kernels of its own, "
            "which have no fake implementation and keep their own workspaces; the estimate cannot count them. "
            "Estimate bf16-mixed for an upper bound."
        )
    if key in _TRUE_DTYPES:
        return Precision(str(key), _TRUE_DTYPES[key])
    if key in ("bf16-mixed", "16-mixed"):
        return Precision(str(key), torch.float32, "bf16-mixed")
    raise EstimateError(f"--precision {name}: choose from {', '.join(PRECISIONS)} (as Trainer(precision=...) takes)")


def as_precision(value: Union[torch.dtype, Precision]) -> Precision:
    """A precision from a weights' dtype (``torch.bfloat16`` is ``bf16-true``) or a :class:`Precision`."""
    if isinstance(value, Precision):
        return value
    names = {dtype: name for name, dtype in _TRUE_DTYPES.items()}
    if value not in names:
        raise EstimateError(f"dtype {value}: the estimate builds weights in {', '.join(map(str, names))}")
    return Precision(names[value], value)
