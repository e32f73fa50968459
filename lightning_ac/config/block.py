"""The ``activation_checkpointing`` block: :func:`parse_config` validates every form a user can write (``bool``,
``None``, a mapping, an OmegaConf ``DictConfig`` or an already-built dataclass) into an
:class:`~lightning_ac.config.schema.ActivationCheckpointingConfig`, once."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Dict, Optional

from lightning_ac.config.fields import (
    expected_error,
    parse_bool,
    parse_budget,
    parse_count,
    parse_first_plan,
    parse_placement,
    parse_str_list,
    parse_switch_or_mapping,
    reject_unknown,
    to_plain,
)
from lightning_ac.config.rules import check_combination
from lightning_ac.config.schema import (
    AUTO,
    BLOCK_FIELDS,
    CHECKPOINT_KWARGS,
    CHUNKED_LOSS_FIELDS,
    FIRST_PLAN_FIELD,
    IMPLEMENTATIONS,
    KWARG_TYPES,
    OFFLOAD_TARGETS,
    SELECTIVE_FIELDS,
    SET_BY_US,
    TILED_MLP_FIELDS,
    ActivationCheckpointingConfig,
    ChunkedLossConfig,
    ConfigError,
    OffloadConfig,
    SelectiveConfig,
    TiledMLPConfig,
)

__all__ = [
    "check_block_key",
    "config_to_dict",
    "mark_validated",
    "parse_chunked_loss",
    "parse_config",
    "parse_tiled_mlp",
]


# Set on configs that parse_config returned, so that passing one on (the Hydra job hands its parsed block to
# callbacks_from_config) does not validate it a second time.
_VALIDATED = "_lightning_ac_validated"


def check_block_key(key: str) -> None:
    """A dotted key into the block, as a Hydra override writes it (``activation_checkpointing.offload.gpu=cpu``):
    a :class:`ConfigError` naming the unknown field and the valid ones, as :func:`parse_config` would, when the block
    has no such field. A command line can then fail on the key the user wrote rather than on the name of the
    structured config behind it. Keys outside the block, and the free-form ``kwargs``, are not checked here.
    """
    parts = key.split(".")
    if parts[0] != "activation_checkpointing" or len(parts) < 2:
        return
    reject_unknown([parts[1]], BLOCK_FIELDS, "activation_checkpointing")
    nested = {"offload": OFFLOAD_TARGETS, "selective": SELECTIVE_FIELDS}
    if len(parts) > 2 and parts[1] in nested:
        reject_unknown([parts[2]], nested[parts[1]], f"activation_checkpointing.{parts[1]}")


def _parse_selective(value: Any) -> Optional[SelectiveConfig]:
    value = parse_switch_or_mapping(
        value,
        "activation_checkpointing.selective",
        SelectiveConfig,
        "Write selective: true to save attention, or selective: {save: [attention]}.",
    )
    if not isinstance(value, Mapping):
        return value
    reject_unknown(value, SELECTIVE_FIELDS, "activation_checkpointing.selective")
    where = "activation_checkpointing.selective"
    defaults = SelectiveConfig()
    min_k = value.get("save_matmul_min_k", None)
    if min_k is not None:
        parse_count(
            min_k,
            f"{where}.save_matmul_min_k",
            minimum=1,
            fix="It is a matmul's contraction dim: set it to a linear layer's in_features, e.g. 4096, or leave it out.",
        )
    return SelectiveConfig(
        save=parse_str_list(value.get("save", defaults.save), f"{where}.save"),
        save_modules=parse_str_list(value.get("save_modules", defaults.save_modules), f"{where}.save_modules"),
        save_matmul_min_k=min_k,
        save_sliding_window=bool(parse_bool(value.get("save_sliding_window", False), f"{where}.save_sliding_window")),
        recompute_layer_types=parse_str_list(
            value.get("recompute_layer_types", defaults.recompute_layer_types), f"{where}.recompute_layer_types"
        ),
    )


def parse_chunked_loss(value: Any, name: str = "activation_checkpointing.chunked_loss") -> Optional[ChunkedLossConfig]:
    """The ``chunked_loss`` field: ``false``/``None`` (off), ``true`` (``chunk_tokens: auto``), ``auto`` (on where the
    memory budget needs it) or a mapping ``{chunk_tokens: N | auto, budget_decides: true | false}``."""
    example = "Write chunked_loss: true (chunk_tokens: auto), or chunked_loss: {chunk_tokens: 512}."
    if _is_auto(value):
        return ChunkedLossConfig(budget_decides=True)
    value = parse_switch_or_mapping(value, name, ChunkedLossConfig, example)
    if not isinstance(value, Mapping):
        return value
    reject_unknown(value, CHUNKED_LOSS_FIELDS, name)
    fix = "It counts the tokens whose logits exist at once, e.g. 512; or write auto (the default)."
    decides = parse_bool(value.get("budget_decides", False), f"{name}.budget_decides")
    return ChunkedLossConfig(chunk_tokens=_tokens_or_auto(value, "chunk_tokens", name, fix), budget_decides=decides)


def _is_auto(value: Any) -> bool:
    """``auto`` as the whole field: on where the memory budget needs it."""
    return isinstance(value, str) and value.strip().lower() == AUTO


def _tokens_or_auto(value: Mapping, key: str, name: str, fix: str) -> Any:
    """``value[key]``: a count of tokens (``>= 1``), or ``auto`` (also when absent)."""
    tokens = value.get(key, AUTO)
    if isinstance(tokens, str) and tokens.strip().lower() == AUTO:
        return AUTO
    parse_count(tokens, f"{name}.{key}", minimum=1, fix=fix)
    return tokens


def parse_tiled_mlp(value: Any, name: str = "activation_checkpointing.tiled_mlp") -> Optional[TiledMLPConfig]:
    """The ``tiled_mlp`` field: ``false``/``None`` (off), ``true`` (``tile_tokens: auto``), ``auto`` (on where the
    memory budget needs it) or a mapping
    ``{tile_tokens: N | auto, norms: true | false, mlp_modules: [NAME, ...], budget_decides: true | false}``."""
    example = "Write tiled_mlp: true (tile_tokens: auto), or tiled_mlp: {tile_tokens: 4096}."
    if _is_auto(value):
        return TiledMLPConfig(budget_decides=True)
    value = parse_switch_or_mapping(value, name, TiledMLPConfig, example)
    if not isinstance(value, Mapping):
        return value
    reject_unknown(value, TILED_MLP_FIELDS, name)
    norms = parse_bool(value.get("norms", True), f"{name}.norms")  # "false" as YAML and command lines write it
    mlp_modules = value.get("mlp_modules")
    if mlp_modules is not None:
        if isinstance(mlp_modules, str) or not isinstance(mlp_modules, Sequence):
            mlp_modules = [mlp_modules]
        if not mlp_modules or not all(isinstance(m, str) and m.strip() for m in mlp_modules):
            raise ConfigError(
                f"{name}.mlp_modules: expected a list of module names or globs relative to each layer, got "
                f"{value.get('mlp_modules')!r}. Write mlp_modules: [ffn], or leave it out (each layer's mlp)."
            )
        mlp_modules = [m.strip() for m in mlp_modules]
    fix = "It counts the tokens whose MLP intermediates exist at once, e.g. 4096; or write auto (the default)."
    tokens = _tokens_or_auto(value, "tile_tokens", name, fix)
    decides = parse_bool(value.get("budget_decides", False), f"{name}.budget_decides")
    return TiledMLPConfig(tile_tokens=tokens, norms=norms, mlp_modules=mlp_modules, budget_decides=decides)


def _parse_kwargs(value: Any) -> Dict[str, Any]:
    value = to_plain(value)
    if value is None:
        return {}
    where = "activation_checkpointing.kwargs"
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping of torch.utils.checkpoint arguments, got {value!r}.")
    kwargs = dict(value)
    for key, arg in list(kwargs.items()):
        if key in SET_BY_US:
            raise ConfigError(
                f"{where}.{key}: lightning_ac sets {key} itself, so it cannot be passed. Remove it from kwargs."
            )
        if key == "offload":
            raise ConfigError(
                f"{where}.offload: offloading is configured in the offload mapping, not in kwargs. "
                "Remove kwargs.offload and set activation_checkpointing.offload.hidden_states: cpu."
            )
        if key == "use_reentrant":
            raise ConfigError(
                f"{where}.use_reentrant: set activation_checkpointing.reentrant: {str(arg).lower()} instead "
                "of passing use_reentrant in kwargs."
            )
        if key == "every_n_layers":
            parse_count(
                arg,
                f"{where}.every_n_layers",
                minimum=1,
                fix="Use 1 to checkpoint every decoder layer, 2 for every second one.",
            )
            continue
        if key not in CHECKPOINT_KWARGS:
            raise ConfigError(
                f"{where}.{key}: torch.utils.checkpoint.checkpoint does not accept {key!r}; torch would pass it "
                "on to each checkpointed layer's forward, where it is ignored or overrides the layer's own "
                f"argument. Accepted keys: {', '.join(sorted(CHECKPOINT_KWARGS | {'every_n_layers'}))}."
            )
        types = KWARG_TYPES.get(key)
        if types == (bool,):
            kwargs[key] = parse_bool(arg, f"{where}.{key}")
        elif types and not isinstance(arg, types):
            raise expected_error(f"{where}.{key}", types[0].__name__, arg)
    if "determinism_check" in kwargs and kwargs["determinism_check"] not in ("default", "none"):
        raise expected_error(f"{where}.determinism_check", "'default' or 'none'", kwargs["determinism_check"])
    return kwargs


def _parse_offload(value: Any) -> OffloadConfig:
    value = to_plain(value)
    if value is None:
        return OffloadConfig()
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"activation_checkpointing.offload: offload is a mapping, not a value; got {value!r}. "
            "Name a target, e.g. offload: {all: cpu} or offload: {hidden_states: cpu}."
        )
    reject_unknown(value, OFFLOAD_TARGETS, "activation_checkpointing.offload")
    return OffloadConfig(
        **{t: parse_placement(value.get(t), f"activation_checkpointing.offload.{t}") for t in OFFLOAD_TARGETS}
    )


def parse_config(value: Any) -> ActivationCheckpointingConfig:
    """Validate and normalise an ``activation_checkpointing`` block.

    Args:
        value: ``True`` (recompute with defaults), ``False``/``None`` (everything off), a mapping or
            ``DictConfig`` with the block's fields (``enabled`` defaults to true), or an
            :class:`ActivationCheckpointingConfig`.

    Returns:
        A normalised :class:`ActivationCheckpointingConfig`.

    Raises:
        ConfigError: If any field or combination of fields is invalid. The message names the field, the
            value and the fix.

    A config that ``parse_config`` returned passes through as it is (it is not validated again).
    """
    if getattr(value, _VALIDATED, False):
        return value
    return mark_validated(_parse_block(value))


def _parse_block(value: Any) -> ActivationCheckpointingConfig:
    """Validate a block that has not been validated yet (the work :func:`parse_config` does once per block)."""
    value = to_plain(value)
    if value is None or value is False:
        return ActivationCheckpointingConfig(enabled=False)
    if value is True:
        return ActivationCheckpointingConfig()
    if isinstance(value, str):
        raise ConfigError(
            f"activation_checkpointing: expected true, false or a mapping, got the text {value!r}. YAML text is not "
            "parsed here: load it first (OmegaConf.create(text) or yaml.safe_load(text)) and pass the mapping, or "
            "pass a dict such as {'selective': True}."
        )
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"activation_checkpointing: expected true, false or a mapping, got {value!r}. "
            "Write activation_checkpointing: true, or a mapping such as {selective: true}."
        )
    reject_unknown(value, BLOCK_FIELDS, "activation_checkpointing")
    implementation = value.get("implementation", "hf")
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(
            f"activation_checkpointing.implementation: expected one of {', '.join(IMPLEMENTATIONS)}, "
            f"got {implementation!r}. Use hf (transformers' checkpointing) or fsdp (torch's checkpoint around each "
            "layer, under an FSDP strategy)."
        )
    cfg = ActivationCheckpointingConfig(
        enabled=bool(parse_bool(value.get("enabled", True), "activation_checkpointing.enabled")),
        implementation=implementation,
        reentrant=parse_bool(value.get("reentrant"), "activation_checkpointing.reentrant", allow_none=True),
        kwargs=_parse_kwargs(value.get("kwargs")),
        selective=_parse_selective(value.get("selective")),
        offload=_parse_offload(value.get("offload")),
        budget=parse_budget(value.get("budget"), "activation_checkpointing.budget"),
        chunked_loss=parse_chunked_loss(value.get("chunked_loss")),
        tiled_mlp=parse_tiled_mlp(value.get("tiled_mlp")),
        budget_first_plan=parse_first_plan(
            value.get("budget_first_plan"), f"activation_checkpointing.{FIRST_PLAN_FIELD}"
        ),
    )
    check_combination(cfg)
    return cfg


def config_to_dict(cfg: ActivationCheckpointingConfig) -> Dict[str, Any]:
    """The normalised block as plain data (strings, lists, dicts), e.g. for ``summary.json`` or YAML."""
    data = dataclasses.asdict(cfg)
    data["offload"] = {k: str(v) for k, v in data["offload"].items()}
    return data


def mark_validated(cfg: ActivationCheckpointingConfig) -> ActivationCheckpointingConfig:
    setattr(cfg, _VALIDATED, True)
    return cfg
