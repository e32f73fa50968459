"""Packed batches under the KV cache the checkpointed run turns off.

transformers masks packed sequences (several documents in one row: ``position_ids`` restart at 0, no
``attention_mask``) document by document only when the model runs without a cache; with one (``use_cache=True``, a
loaded model's default) it attends across the documents. A checkpointed run has no cache (transformers turns it off
under its own checkpointing too), so such a batch trains otherwise than the same model without the suite. That is not
the suite's to decide: it says so, once, naming ``use_cache`` and what changes.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch
from torch import nn

from lightning_ac._logging import rank_zero_warn

__all__ = ["CHECKED_FORWARDS", "PackedBatchNotice", "is_packed", "notice_for"]

# The training forwards checked (each check reads the position ids back from the device, a wait on an accelerator):
# a packed data set packs its first batches too.
CHECKED_FORWARDS = 8


def is_packed(position_ids: torch.Tensor) -> bool:
    """Whether a row of ``position_ids`` restarts (transformers' ``find_packed_sequence_indices`` test)."""
    if position_ids.dim() == 0 or position_ids.shape[-1] < 2:
        return False
    return bool((torch.diff(position_ids, dim=-1) != 1).any())


class PackedBatchNotice:
    """A forward pre-hook for a transformers model whose ``use_cache`` the run turned off: warns once when a training
    forward gets a packed batch."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.checked = 0
        self.warned = False

    def install(self, model: nn.Module) -> Any:
        return model.register_forward_pre_hook(self._check, with_kwargs=True)

    def _check(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if self.warned or self.checked >= CHECKED_FORWARDS or not (module.training and torch.is_grad_enabled()):
            return
        positions, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
        if not isinstance(positions, torch.Tensor) or mask is not None:
            return
        self.checked += 1
        if is_packed(positions):
            self.warned = True
            rank_zero_warn(
                f"{self.model_name} gets packed sequences (position_ids restart within a row, no attention_mask). "
                "Checkpointed training runs without the KV cache (use_cache=False, as transformers' own "
                "checkpointing does), and without a cache transformers masks each packed document apart; the same "
                "model with use_cache=True (the config's default) attends across the documents. So this run trains "
                "otherwise than without activation checkpointing. To train the same either way, set "
                "model.config.use_cache = False for runs without it too (documents apart), or pass an attention_mask."
            )


def notice_for(model: nn.Module) -> Callable[..., Any]:
    """Install a :class:`PackedBatchNotice` on ``model``; returns the hook handle."""
    return PackedBatchNotice(type(model).__name__).install(model)
