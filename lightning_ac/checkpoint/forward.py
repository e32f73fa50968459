"""torch's checkpoint around each layer's ``forward``: for plain torch layers (the equivalent of transformers'
wrapper, installed per instance) and for ``implementation: fsdp`` (outside transformers, so FSDP's hooks stay
outside the recompute).

The wrapper replaces the layer instance's ``forward`` (not ``__call__``), as transformers does, so module
hooks stay outside the checkpoint and do not run twice. Nothing is re-parented, so ``state_dict`` keys do
not change; removing the instance attribute restores the class's ``forward``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ac._logging import rank_zero_warn
from lightning_ac.checkpoint.settings import CheckpointSettings

__all__ = ["wrap_layers", "TORCH_ATTRIBUTES"]

TORCH_ATTRIBUTES = ("forward",)
# Keyword arguments that would make a layer write to a KV cache: forced off whenever we checkpoint a layer.
_CACHE_FLAGS = ("use_cache",)
# The cache objects of transformers' layers (current and older names). Under checkpointing the recompute would
# write the cache a second time (SDPA then slices the doubled keys back, an op the forward never ran, which
# selective checkpointing rejects), and the cache, bound into the recompute, would keep every layer's keys and
# values alive until backward. Like transformers' own wrapper (which the model's ``gradient_checkpointing`` flag
# normally pairs with), a checkpointed call of a transformers layer runs without it, whether it is passed by
# keyword or positionally (GPT-2); layers that only read the cache say so with ``_can_checkpoint_with_cache``.
# Plain torch layers keep their arguments: there these names may be real inputs.
_CACHE_OBJECTS = ("cache", "past_key_values", "past_key_value", "layer_past")

_warned_classes: Set[str] = set()


def _drops_cache(layer: nn.Module) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # plain torch layers only
        return False
    return isinstance(layer, GradientCheckpointingLayer) and not getattr(layer, "_can_checkpoint_with_cache", False)


def _cache_positions(forward: Callable[..., Any]) -> Dict[str, int]:
    """Positions of the cache arguments in ``forward``'s signature (callers such as GPT-2 pass it positionally)."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {name: positional.index(name) for name in _CACHE_OBJECTS if name in positional}


def _without_cache(layer: nn.Module, positions: Dict[str, int], args: tuple, kwargs: Dict[str, Any]) -> tuple:
    """``args`` and ``kwargs`` with the cache objects set to None. A cache that already holds tokens (PEFT prefix
    tuning keeps its virtual tokens there) cannot be dropped without changing the result: that is an error."""
    args = list(args)
    found = [(name, kwargs[name]) for name in _CACHE_OBJECTS if kwargs.get(name) is not None]
    found += [(name, args[i]) for name, i in positions.items() if i < len(args) and args[i] is not None]
    for name, cache in found:
        length = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        if length:
            raise RuntimeError(
                f"{type(layer).__name__} was called with a KV cache ({name}) that already holds {length} tokens, e.g. "
                "PEFT prefix tuning's virtual tokens. A checkpointed layer runs without its cache (the recompute "
                "would write it twice), which would change the result. Disable activation checkpointing for this "
                "model, or use an adapter that does not live in the cache (LoRA)."
            )
    for name in _CACHE_OBJECTS:
        if kwargs.get(name) is not None:
            kwargs[name] = None
    for i in positions.values():
        if i < len(args):
            args[i] = None
    if found and type(layer).__name__ not in _warned_classes:
        _warned_classes.add(type(layer).__name__)  # once per layer class, like transformers' warning_once
        rank_zero_warn(
            f"{type(layer).__name__} runs checkpointed calls without its KV cache "
            f"({', '.join(name for name, _ in found)}): the recompute would write it a second time."
        )
    return tuple(args), kwargs


def _checkpointed_forward(
    layer: nn.Module, forward: Callable[..., Any], checkpoint_kwargs: Dict[str, Any], checkpoint_fn: Callable[..., Any]
) -> Callable[..., Any]:
    reentrant = checkpoint_kwargs.get("use_reentrant", False)
    drops_cache = _drops_cache(layer)
    positions = _cache_positions(forward) if drops_cache else {}

    @functools.wraps(forward)
    def forward_with_checkpointing(*args: Any, **kwargs: Any) -> Any:
        if not (layer.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        for flag in _CACHE_FLAGS:
            if kwargs.get(flag):
                kwargs[flag] = False
        if drops_cache:
            args, kwargs = _without_cache(layer, positions, args, kwargs)
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
    settings: CheckpointSettings,
    context_fn: Optional[Callable[[], Any]] = None,
    checkpoint_fn: Callable[..., Any] = checkpoint,
    layer_checkpoint_fns: Optional[Sequence[Callable[..., Any]]] = None,
) -> List[bool]:
    """Checkpoint every ``settings.every_n_layers``-th layer with ``torch.utils.checkpoint`` (or ``checkpoint_fn``, a
    wrapper of it, e.g. one that offloads the layer's inputs; or, per layer, ``layer_checkpoint_fns``: the memory
    budget's switches), with ``settings.checkpoint_kwargs``.

    Returns:
        For each layer, whether it is checkpointed.
    """
    kwargs: Dict[str, Any] = dict(settings.checkpoint_kwargs)
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    functions = list(layer_checkpoint_fns) if layer_checkpoint_fns is not None else [checkpoint_fn] * len(layers)
    applied = []
    for index, (layer, function) in enumerate(zip(layers, functions)):
        wrap = index % settings.every_n_layers == 0
        if wrap:
            layer.forward = _checkpointed_forward(layer, layer.forward, kwargs, function)  # type: ignore[method-assign]
        applied.append(wrap)
    return applied
