"""What each op of the fake step costs in floating-point operations: torch's formulas, and the CPU's attention
kernels counted as the target's."""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch

__all__ = ["flop_registry"]


def flop_registry() -> Dict[Any, Callable[..., int]]:
    """``torch.utils.flop_counter``'s formulas, and the CPU's flash-attention kernels, which it has none for (the
    same count as CUDA's flash kernel: what the target runs)."""
    from torch.utils import flop_counter as fc

    registry = dict(fc.flop_registry)
    aten = torch.ops.aten

    def cpu_flash(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return fc.sdpa_flop_count(query.shape, key.shape, value.shape)

    def cpu_flash_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        return fc.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)

    registry[aten._scaled_dot_product_flash_attention_for_cpu] = cpu_flash
    registry[aten._scaled_dot_product_flash_attention_for_cpu_backward] = cpu_flash_backward
    return registry
