"""What a dropout keeps for its backward, as the target device runs it.

A dropout in training keeps a mask for its backward, and which mask depends on the device. CUDA runs torch's fused
kernel (``native_dropout``), which keeps a 1-byte (``bool``) mask per element. The CPU multiplies by a scaled mask of
the input's dtype, which it keeps: a full-size copy (4 bytes an element in float32, against CUDA's 1). The fake step
runs on the CPU, so on a CUDA target each dropout is sent to the fused kernel (:func:`dropout_as_on_cuda`); on a CPU
target it runs as the CPU runs it.

LoRA's dropout (PEFT's ``lora_dropout``) costs more than its mask: each adapted linear drops its input apart and its
``lora_A`` keeps the dropped copy, a full-size tensor per adapted linear that without dropout it shares with the
frozen linear (Llama-3-8B, r=16 on all seven linears at 8k tokens, ``full+chunked_loss``: 5.07 GiB of activations
without, 6.54 GiB with 0.05 by the CPU's semantics).

Attention's dropout: with it the CPU's SDPA runs its math kernel, which keeps a seq x seq matrix per layer (GPT-2 XL at
4 x 1,024 tokens: 104.87 GiB against 46.88); CUDA's flash kernel takes dropout and keeps what it keeps without it (and
the random generator's seed and offset: bytes), so on a CUDA target the fake step runs it without
(:func:`attention_as_on_cuda`).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch

from lightning_ac.fake import patched

__all__ = ["ATTENTION_DROPOUTS", "attention_as_on_cuda", "dropout_as_on_cuda"]

# The config fields of an attention dropout (Llama's and Qwen's, GPT-2's, BERT-style models')
ATTENTION_DROPOUTS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def attention_as_on_cuda(config: Any) -> Any:
    """``config`` with its attention dropout at 0, for the fake step of a CUDA target (the module's docstring says
    why); ``config`` itself when it has none."""
    dropouts = [name for name in ATTENTION_DROPOUTS if (getattr(config, name, 0) or 0) > 0]
    if not dropouts:
        return config
    config = copy.deepcopy(config)
    for name in dropouts:
        setattr(config, name, 0.0)
    return config


@contextlib.contextmanager
def dropout_as_on_cuda() -> Iterator[None]:
    """Inside, each ``torch.nn.functional.dropout`` of a training step (``nn.Dropout``'s: LoRA's, a model's hidden
    dropout) runs torch's fused kernel, which keeps a 1-byte mask per element as CUDA's does: the same values' shapes
    and dtypes otherwise. An in-place dropout, or one that keeps nothing (``p`` 0 or 1, not training), runs as it is.

    A patch of the function, not a ``TorchFunctionMode``: a mode is off inside its own handler, and so in the backward
    that ``loss.backward()`` runs there, where a checkpointed layer's recompute would drop as the CPU does."""
    original = torch.nn.functional.dropout

    def fused(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if training and not inplace and 0.0 < p < 1.0:
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    with patched(torch.nn.functional, "dropout", fused):
        yield
