"""Where ``--set`` puts its values in a config, and the checks on the config they make.

A multimodal model's config (Gemma 3's, Llama 4's, LLaVA's: a ``text_config`` beside a ``vision_config``) is
estimated for its language model, the part that trains here, so an undotted key (``num_hidden_layers``) is its
``text_config``'s: set at the top, transformers would keep it there as an attribute the language model never reads.
A dotted key (``text_config.hidden_size``, ``vision_config.image_size``) goes where it names.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from lightning_ac.estimate.errors import EstimateError

__all__ = ["apply_overrides", "check_heads", "check_layers", "padding_hint"]

TEXT = "text_config"


def _sub_configs(model_type: Any) -> Tuple[str, ...]:
    """The nested configs of ``model_type``'s config class (``text_config``, ``vision_config``...); none for a model
    type transformers does not know (its own error comes when the config is built)."""
    from transformers import CONFIG_MAPPING

    try:
        cls = CONFIG_MAPPING[model_type]
    except (KeyError, TypeError):
        return ()
    return tuple(getattr(cls, "sub_configs", None) or ())


def _placed(key: str, sub_configs: Tuple[str, ...]) -> List[str]:
    """The path in the config's dict that ``--set key=...`` sets."""
    if "." not in key and TEXT in sub_configs and key not in sub_configs:
        return [TEXT, key]
    return key.split(".")


def apply_overrides(data: Dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """``overrides`` set in ``data`` (a config as a dict, its ``model_type`` in it), in place: dotted keys reach
    nested configs, and on a multimodal config an undotted key is its language model's (see the module's docstring).
    A ``layer_types`` list is dropped where ``num_hidden_layers`` is set without it: it was made for the old depth,
    and the model's default pattern for the new one is used.

    Raises:
        EstimateError: A dotted key goes through a value that is not a nested config.
    """
    sub_configs = _sub_configs(data.get("model_type"))
    paths = {key: _placed(key, sub_configs) for key in overrides}
    given = {tuple(path) for path in paths.values()}
    for key, value in overrides.items():
        *parents, leaf = paths[key]
        target = data
        for parent in parents:
            target = target.setdefault(parent, {})
            if not isinstance(target, dict):
                raise EstimateError(f"--set {key}: {parent} is not a nested config")
        if leaf == "num_hidden_layers" and (*parents, "layer_types") not in given:
            target.pop("layer_types", None)
        target[leaf] = value


def check_heads(config: Any, overrides: Mapping[str, Any]) -> None:
    """Key/value heads that divide the attention heads (grouped-query attention), named as the user set them.

    Raises:
        EstimateError: They do not.
    """
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        given = next((f"--set {k}={overrides[k]!r}" for k in ("num_key_value_heads", "num_attention_heads") if k in
                      overrides), "the config's")  # fmt: skip
        raise EstimateError(
            f"{given}: {kv_heads} key/value heads do not divide {heads} attention heads (each key/value head serves a "
            "group of query heads). Set num_key_value_heads to a divisor of num_attention_heads."
        )


def check_layers(config: Any) -> None:
    """A model with at least one decoder layer: transformers builds one with none, and every mode acts on them.

    Raises:
        EstimateError: It has none.
    """
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < 1:
        raise EstimateError(
            f"--set num_hidden_layers={layers}: the model would have no decoder layer, and every mode acts on decoder "
            "layers. Give at least 1."
        )


def padding_hint(config: Any) -> str:
    """Why transformers cannot build ``config``'s embedding when its ``pad_token_id`` is outside the vocabulary
    (``nn.Embedding``'s ``padding_idx`` must be one of its rows: Phi-3 keeps 32000, which ``--set vocab_size=1000``
    leaves out), and how to fix it; ``""`` when it is inside."""
    pad, vocab = getattr(config, "pad_token_id", None), getattr(config, "vocab_size", None)
    if not isinstance(pad, int) or not isinstance(vocab, int) or isinstance(pad, bool) or -vocab <= pad < vocab:
        return ""
    larger = f", or a vocab_size above {pad}" if pad > 0 else ""
    return (
        f"The config's pad_token_id {pad} is outside the vocabulary of {vocab} tokens (vocab_size), and the "
        "embedding keeps row pad_token_id for padding. Set a pad_token_id inside the vocabulary (--set "
        f"pad_token_id=0, or --set pad_token_id=null for no padding token){larger}."
    )
