"""The attention implementation an estimate runs: what transformers picks for the model by default (SDPA where the
model supports it, else eager), or the one the user trains with.

``flash_attention_2`` cannot run on the CPU; what it saves for backward is what SDPA's flash kernel saves (q, k, v,
the output and the logsumexp), which is the kernel the CPU's SDPA runs for causal batches without padding. The
estimate therefore runs flash attention as SDPA, registered under a name of its own so that a model transformers
refuses under SDPA (Gemma 2's logit softcapping, GPT-OSS's sinks) still gets it: the softcap and the sinks change
values, not what is saved.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_ac.estimate.errors import EstimateError

__all__ = ["ATTENTIONS", "FLASH_STAND_IN", "attention_for"]

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
        _register_flash_stand_in()
        return FLASH_STAND_IN
    return asked


def _model_class(config: Any) -> type:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError as err:
        raise EstimateError(f"--model: transformers has no causal-LM model for {config.model_type}") from err


def _register_flash_stand_in() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def flash_as_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        for name in ("softcap", "s_aux", "sliding_window"):  # values, not what is saved
            kwargs.pop(name, None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(FLASH_STAND_IN, flash_as_sdpa)
    AttentionMaskInterface.register(FLASH_STAND_IN, sdpa_mask)
