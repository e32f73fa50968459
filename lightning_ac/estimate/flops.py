"""What each op of the fake step costs in floating-point operations: torch's formulas, and the CPU's attention
kernels counted as the target's."""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence

import torch

__all__ = ["attention_backward_flops", "attention_flops", "count_work", "flop_registry"]


def flop_registry() -> Dict[Any, Callable[..., int]]:
    """``torch.utils.flop_counter``'s formulas, and the CPU's flash-attention kernels, which it has none for (the
    same count as CUDA's flash kernel: what the target runs)."""
    from torch.utils import flop_counter as fc

    registry = dict(fc.flop_registry)
    aten = torch.ops.aten

    def cpu_flash(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return attention_flops(query.shape, key.shape, value.shape)

    def cpu_flash_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        return attention_backward_flops(grad_out.shape, query.shape, key.shape, value.shape)

    registry[aten._scaled_dot_product_flash_attention_for_cpu] = cpu_flash
    registry[aten._scaled_dot_product_flash_attention_for_cpu_backward] = cpu_flash_backward
    return registry


# torch's own sdpa_flop_count counts grouped-query attention (fewer key/value heads than query heads) only from torch
# 2.13; before, it asserts equal head counts, and every Llama-3, Qwen3 and Mistral estimate crashed on torch 2.11.
# These are torch 2.13's formulas, written out so that every torch the package installs with counts the same: the
# kernel broadcasts each key/value head to its group of query heads, so the work is that of h_q heads.


def attention_flops(query: Sequence[int], key: Sequence[int], value: Sequence[int]) -> int:
    """The FLOPs of attention's forward: scores ``q @ k^T`` and output ``scores @ v``, per query head.

    Args:
        query: ``(batch, query heads, query length, head dim)``.
        key: ``(batch, key/value heads, key length, head dim)``; the key/value heads divide the query heads.
        value: ``(batch, key/value heads, key length, value head dim)``.
    """
    b, h_q, s_q, d_q, s_k, d_v = _attention_dims(query, key, value)
    return 2 * b * h_q * s_q * s_k * d_q + 2 * b * h_q * s_q * s_k * d_v


def attention_backward_flops(
    grad_out: Sequence[int], query: Sequence[int], key: Sequence[int], value: Sequence[int]
) -> int:
    """The FLOPs of attention's backward: the scores recomputed, then the gradients of v, of the scores (through
    ``v``), of q and of k; shapes as for :func:`attention_flops`, ``grad_out`` as the output's."""
    b, h_q, s_q, d_q, s_k, d_v = _attention_dims(query, key, value)
    if tuple(grad_out) != (b, h_q, s_q, d_v):
        raise ValueError(f"attention's output gradient {tuple(grad_out)} is not the output's {(b, h_q, s_q, d_v)}")
    scores = 2 * b * h_q * s_q * s_k * d_q
    return scores + 2 * (2 * b * h_q * s_q * s_k * d_v) + 2 * (2 * b * h_q * s_q * s_k * d_q)


def _attention_dims(query: Sequence[int], key: Sequence[int], value: Sequence[int]) -> tuple:
    b, h_q, s_q, d_q = query
    b_k, h_kv, s_k, d_k = key
    b_v, h_v, s_v, d_v = value
    if not (b == b_k == b_v and h_kv == h_v and s_k == s_v and d_q == d_k) or h_kv == 0 or h_q % h_kv:
        raise ValueError(
            f"attention's shapes do not go together: query {tuple(query)}, key {tuple(key)}, value {tuple(value)} "
            "(batch, heads, length, head dim; the key/value heads must divide the query heads)"
        )
    return b, h_q, s_q, d_q, s_k, d_v


def count_work(tracker: Any, phase: Any, func: Any, args: Any, kwargs: Any, out: Any, written: int) -> None:
    """An op's work in its phase, on ``tracker`` (:class:`~lightning_ac.estimate.tracker.MemoryTracker`): its FLOPs
    (matmuls, attention: ``tracker.flop_registry``), one op, and what an op without FLOPs wrote (``written``)."""
    flops = tracker.flop_registry.get(func._overloadpacket)
    if flops is not None:
        tracker.flops[phase] += int(flops(*args, **kwargs, out_val=out))
    tracker.ops[phase] += 1
    tracker.moved[phase] += written if flops is None else 0
