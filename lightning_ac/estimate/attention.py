"""The attention implementation an estimate runs: what transformers picks for the model by default (SDPA where the
model supports it, else eager), or the one the user trains with.

``flash_attention_2`` cannot run on the CPU; what it saves for backward is what SDPA's flash kernel saves (q, k, v,
the output and the logsumexp), which is the kernel the CPU's SDPA runs for causal batches without padding. The
estimate therefore runs flash attention as SDPA, registered under a name of its own so that a model transformers
refuses under SDPA (Gemma 2's logit softcapping, GPT-OSS's sinks) still gets it: the softcap and the sinks change
values, not what is saved.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from lightning_ac.estimate.errors import EstimateError

__all__ = ["ATTENTIONS", "FLASH_STAND_IN", "attention_for", "stand_in_registered"]

ATTENTIONS = ("sdpa", "eager", "flash_attention_2")
FLASH_STAND_IN = "lightning_ac_fa_stand_in"  # no "sdpa" or "flash" in it: transformers checks names for those


def attention_for(config: Any, asked: Optional[str]) -> str:
    """The ``_attn_implementation`` the estimate builds ``config``'s model with.

    Args:
        config: The model's transformers config.
        asked: ``sdpa``, ``eager``, ``flash_attention_2``, or ``None`` for what transformers picks for the model.

    Raises:
        EstimateError: For an implementation not in :data:`ATTENTIONS`, or one the model does not support.
    """
    if asked is not None and asked not in ATTENTIONS:
        raise EstimateError(f"--attn {asked}: choose from {', '.join(ATTENTIONS)}")
    cls = _model_class(config)
    sdpa = bool(getattr(cls, "_supports_sdpa", False))
    if asked is None:
        return "sdpa" if sdpa else "eager"
    if asked == "sdpa" and not sdpa:
        raise EstimateError(
            f"--attn sdpa: transformers does not run {cls.__name__} under SDPA. Use --attn eager, or "
            "flash_attention_2 if that is what the run uses (or leave --attn out: the model's default)"
        )
    if asked == "flash_attention_2":
        if not getattr(cls, "_supports_flash_attn", False):
            raise EstimateError(
                f"--attn flash_attention_2: transformers does not run {cls.__name__} with flash attention. Use "
                "--attn eager or sdpa (or leave --attn out: the model's default)"
            )
        return FLASH_STAND_IN
    return asked


def _model_class(config: Any) -> type:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError as err:
        raise EstimateError(f"--model: transformers has no causal-LM model for {config.model_type}") from err


@contextlib.contextmanager
def stand_in_registered(config: Any) -> Iterator[None]:
    """Inside: the flash-attention stand-in is registered with transformers (its attention and mask functions) when
    ``config`` asks for it; on exit the registries are as they were (an estimate leaves the process as it found it)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import flash_attention_mask

    # the registries' own mapping: register() has no counterpart that removes a key
    registries = (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping)
    if getattr(config, "_attn_implementation", None) != FLASH_STAND_IN or FLASH_STAND_IN in registries[0]:
        yield
        return

    def flash_as_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        for name in ("softcap", "s_aux", "sliding_window"):  # values (the kernel's own window), not what is saved
            kwargs.pop(name, None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(FLASH_STAND_IN, flash_as_sdpa)
    # flash attention's mask: none for a batch without padding, so SDPA runs its causal flash kernel and keeps no
    # seq x seq mask (sdpa's would, past a sliding window)
    AttentionMaskInterface.register(FLASH_STAND_IN, flash_attention_mask)
    try:
        yield
    finally:
        for registry in registries:
            registry.pop(FLASH_STAND_IN, None)
