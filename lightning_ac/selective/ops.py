"""Recognising ops at the dispatcher level: attention kernels, matmuls and their contraction dim."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

__all__ = [
    "ATTENTION_PATTERNS",
    "MATH_ATTENTION_OPS",
    "MATH_ATTENTION_OUTPUT",
    "MATH_ATTENTION_SOFTMAX",
    "MATMUL_OPS",
    "is_attention",
    "is_matmul",
    "matmul_k",
    "op_name",
    "sliding_window_of",
]

# What `save: [attention]` names: one kernel per SDPA backend (SDPBackend) but math, and flash-attention ops. Matched
# as substrings of the qualified op name; backward ops never match.
ATTENTION_PATTERNS = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",  # SDPBackend.OVERRIDEABLE (XPU, out-of-tree devices)
    "aten::_scaled_dot_product_attention_math_for_mps",  # the math backend on MPS is one kernel
    "aten::_flash_attention_forward",
    "flash_attn::",  # FA2 custom ops
    "flash_attn_3::",  # FA3
    "_flash_attn_",  # hub kernels register e.g. <kernel_ns>::_flash_attn_forward / _flash_attn_varlen_forward
)
# SDPA's math backend, where no fused kernel takes a call (float32 on CUDA with grouped-query heads: flash and cuDNN
# take only half precision, the efficient kernel no enable_gqa; dropout on the CPU), is aten ops, not one kernel:
# QK^T (bmm), the mask, `_safe_softmax` (eager attention calls `_softmax` instead), dropout, then probs @ V (bmm). Its
# output is the first bmm after `_safe_softmax`: `attention` saves that one. The probabilities (seq x seq per head)
# stay recomputed: the backward needs them, and keeping them is the memory checkpointing exists to drop.
MATH_ATTENTION_SOFTMAX = "aten::_safe_softmax"
MATH_ATTENTION_OUTPUT = "aten::bmm"
MATH_ATTENTION_OPS = frozenset({MATH_ATTENTION_SOFTMAX, MATH_ATTENTION_OUTPUT})
# Matmuls whose output the module and threshold rules may save. bmm is left out on purpose: in math
# attention its K is the sequence length, not a projection's in_features. In-place variants never match.
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::_grouped_mm"})
_BNB_GEMM = ("bitsandbytes::gemm_4bit", "bitsandbytes::gemv_4bit", "bitsandbytes::int8_linear_matmul")


# The policy classifies every op of every checkpointed forward: the answers per op are cached.
@functools.lru_cache(maxsize=4096)
def op_name(func: Any) -> str:
    """The qualified op name without overload, e.g. ``aten::mm``."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return schema.name
    return str(func)


def _is_backward(name: str) -> bool:
    return "backward" in name


@functools.lru_cache(maxsize=4096)
def is_attention(name: str) -> bool:
    """Whether ``name`` is an attention forward kernel that ``attention`` names."""
    return not _is_backward(name) and any(p in name for p in ATTENTION_PATTERNS)


@functools.lru_cache(maxsize=4096)
def is_matmul(name: str) -> bool:
    """Whether ``name`` is a matmul that the module and threshold rules consider."""
    return name in MATMUL_OPS or any(name.startswith(p) for p in _BNB_GEMM)


def matmul_k(name: str, args: tuple) -> Optional[int]:
    """The contraction dim K of a matmul call, ``None`` when it cannot be read."""
    if name == "aten::addmm":
        mat = args[1] if len(args) > 1 else None
    else:
        mat = args[0] if args else None
    if isinstance(mat, torch.Tensor) and mat.dim() >= 1:
        return int(mat.shape[-1])
    return None


def sliding_window_of(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a flash-attention call carries a sliding window (``window_size_left >= 0``).

    SDPA has no window argument (the window lives in the mask); those calls are classified by the layer's
    type instead.
    """
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    for index, argument in enumerate(schema.arguments):
        if argument.name not in ("window_size_left", "window_size"):
            continue
        value = kwargs.get(argument.name, args[index] if index < len(args) else None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = int(value)
        return isinstance(value, int) and value >= 0
    return False
