"""Checkpointing for plain torch layers: the equivalent of transformers' wrapper, installed per instance.

The wrapper replaces the layer instance's ``forward`` (not ``__call__``), as transformers does, so module
hooks stay outside the checkpoint and do not run twice. Nothing is re-parented, so ``state_dict`` keys do
not change; removing the instance attribute restores the class's ``forward``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ac.config import ActivationCheckpointingConfig

__all__ = ["wrap_layers", "TORCH_ATTRIBUTES"]

TORCH_ATTRIBUTES = ("forward",)
# Keyword arguments through which a layer writes to a KV cache. Under checkpointing the recompute would write it a
# second time (transformers then slices the doubled keys back, an op the forward never ran, which selective
# checkpointing rejects), and the cache, bound into the recompute, would keep every layer's keys and values alive
# until backward. Like transformers' own wrapper, a checkpointed call runs without them; transformers' layers that
# only read the cache say so with ``_can_checkpoint_with_cache``.
_CACHE_FLAGS = ("use_cache",)
_CACHE_OBJECTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _checkpointed_forward(
    layer: nn.Module, forward: Callable[..., Any], checkpoint_kwargs: Dict[str, Any], checkpoint_fn: Callable[..., Any]
) -> Callable[..., Any]:
    reentrant = checkpoint_kwargs.get("use_reentrant", False)

    @functools.wraps(forward)
    def forward_with_checkpointing(*args: Any, **kwargs: Any) -> Any:
        if not (layer.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        for flag in _CACHE_FLAGS:
            if kwargs.get(flag):
                kwargs[flag] = False
        if not getattr(layer, "_can_checkpoint_with_cache", False):
            for name in _CACHE_OBJECTS:
                if kwargs.get(name) is not None:
                    kwargs[name] = None
        if reentrant and any(isinstance(v, torch.Tensor) and v.requires_grad for v in kwargs.values()):
            raise RuntimeError(
                f"{type(layer).__name__} was called with a tensor that requires grad as a keyword argument "
                f"({', '.join(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad)}); "
                "reentrant checkpointing only passes gradients to positional inputs, so its gradient would be lost. "
                "Use non-reentrant checkpointing (reentrant: false), or pass the tensor positionally."
            )
        if reentrant:
            # Reentrant checkpoint only backpropagates into its region when an input requires grad. With a
            # frozen base (LoRA), the first layer's input does not, and the adapters' gradients would vanish.
            args = tuple(
                a.detach().requires_grad_(True)
                if isinstance(a, torch.Tensor) and a.is_floating_point() and not a.requires_grad
                else a
                for a in args
            )
        return checkpoint_fn(functools.partial(forward, **kwargs), *args, **checkpoint_kwargs)

    return forward_with_checkpointing


def wrap_layers(
    layers: List[nn.Module],
    config: ActivationCheckpointingConfig,
    context_fn: Optional[Callable[[], Any]] = None,
    checkpoint_fn: Callable[..., Any] = checkpoint,
) -> List[bool]:
    """Checkpoint every ``every_n_layers``-th layer with ``torch.utils.checkpoint`` (or ``checkpoint_fn``, a
    wrapper of it, e.g. one that offloads the layer's inputs).

    Returns:
        For each layer, whether it is checkpointed.
    """
    kwargs: Dict[str, Any] = dict(config.checkpoint_kwargs)
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    applied = []
    for index, layer in enumerate(layers):
        wrap = index % config.every_n_layers == 0
        if wrap:
            layer.forward = _checkpointed_forward(layer, layer.forward, kwargs, checkpoint_fn)  # type: ignore[method-assign]
        applied.append(wrap)
    return applied
