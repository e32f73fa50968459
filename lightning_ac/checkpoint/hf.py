"""The ``hf`` engine: transformers' own ``activation_checkpointing_enable`` with our arguments."""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ac.checkpoint.settings import CheckpointSettings
from lightning_ac.config import ConfigError

__all__ = ["enable_hf_checkpointing", "HF_ATTRIBUTES"]

# Attributes transformers sets while enabling checkpointing; the plan's journal restores them.
HF_ATTRIBUTES = (
    "gradient_checkpointing",
    "_gradient_checkpointing_func",
    "_require_grads_hook",
    "_require_grads_hooks",
)


def enable_hf_checkpointing(
    models: List[nn.Module],
    layers: List[nn.Module],
    settings: CheckpointSettings,
    context_fn: Optional[Callable[[], Any]] = None,
    checkpoint_fn: Callable[..., Any] = checkpoint,
    layer_checkpoint_fns: Optional[Sequence[Callable[..., Any]]] = None,
) -> List[bool]:
    """Turn on transformers' checkpointing on each model.

    Args:
        models: Outermost ``PreTrainedModel`` instances.
        layers: Their decoder layers, in order, to report which ones checkpoint.
        settings: The checkpoint function's arguments and which layers recompute.
        context_fn: A ``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant only), e.g. a SAC policy.
        checkpoint_fn: The checkpoint function the checkpointed layers call: ``torch.utils.checkpoint.checkpoint``
            or a wrapper of it (hidden-state offload passes one that offloads each layer's inputs).

    Returns:
        For each layer, whether it is checkpointed.
    """
    kwargs: Dict[str, Any] = dict(settings.checkpoint_kwargs)
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    for model in models:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(
                f"activation_checkpointing: {type(model).__name__} does not support transformers' activation "
                "checkpointing. Pass layers=[<decoder layer class>] to ActivationCheckpointing to wrap its "
                "layers with torch's checkpoint instead."
            )
        users_hooks = bool(getattr(model, "_require_grads_hooks", None) or getattr(model, "_require_grads_hook", None))
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs, every_n_layers=settings.every_n_layers
        )
        if not kwargs["use_reentrant"] and not users_hooks:
            # transformers also makes the input embeddings' output require grad, which reentrant recompute needs over
            # a frozen embedding (it has no other input that requires grad); non-reentrant recompute does not, and
            # the hook costs a hidden state's gradient in backward. A hook the user set (peft's
            # prepare_model_for_kbit_training) stays.
            model.disable_input_require_grads()
    checkpointed = [bool(getattr(layer, "gradient_checkpointing", False)) for layer in layers]
    functions = list(layer_checkpoint_fns) if layer_checkpoint_fns is not None else [checkpoint_fn] * len(layers)
    for layer, on, function in zip(layers, checkpointed, functions):
        if on and function is not checkpoint:
            layer._gradient_checkpointing_func = _with_function(layer._gradient_checkpointing_func, function)
    return checkpointed


def _with_function(installed: Any, checkpoint_fn: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' ``functools.partial(checkpoint, **kwargs)`` with ``checkpoint_fn`` in place of torch's."""
    if not (isinstance(installed, functools.partial) and installed.func is checkpoint):
        raise RuntimeError(
            f"transformers installed {installed!r} as the layers' checkpoint function, where lightning_ac expects "
            "functools.partial(torch.utils.checkpoint.checkpoint, ...); offload.hidden_states cannot route the "
            "layer inputs through it. Please report this with your transformers version."
        )
    return functools.partial(checkpoint_fn, *installed.args, **installed.keywords)
