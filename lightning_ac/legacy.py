"""Rewrite the deprecated keys into the ``activation_checkpointing`` block.

Implements the spec's migration table row by row. The result is validated with :func:`parse_config`, so a
migrated config is always one the block accepts.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any, Dict, List

from lightning_ac.config import CHECKPOINT_KWARGS, ConfigError, Placement, parse_config, parse_placement

__all__ = ["LEGACY_KEYS", "LegacyConfigWarning", "migrate_legacy"]

LEGACY_KEYS = (
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "selective_checkpointing",
    "activation_offloading",
    "fsdp_config.activation_checkpointing",
)


class LegacyConfigWarning(FutureWarning):
    """A deprecated checkpointing key was rewritten into the ``activation_checkpointing`` block."""


_DISK = "disk offload is disabled pending a fix (these settings never wrote to disk; they ran the CPU offloader)"


def _to_plain(mapping: Any) -> Dict[str, Any]:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(mapping, DictConfig):
            return OmegaConf.to_container(mapping, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover
        pass
    if not isinstance(mapping, Mapping):
        raise TypeError(f"migrate_legacy expects a mapping, got {type(mapping).__name__}")
    return copy.deepcopy(dict(mapping))


def _as_yaml(block: Any) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml({"activation_checkpointing": block}).rstrip()


def migrate_legacy(mapping: Any) -> Dict[str, Any]:
    """Rewrite deprecated checkpointing keys into the ``activation_checkpointing`` block.

    Args:
        mapping: A training config (``dict`` or ``DictConfig``) that may hold ``gradient_checkpointing``,
            ``gradient_checkpointing_kwargs``, ``selective_checkpointing``, ``activation_offloading`` or
            ``fsdp_config.activation_checkpointing``.

    Returns:
        A copy with the deprecated keys removed and an ``activation_checkpointing`` block in their place;
        other keys are untouched. A config without deprecated keys comes back as an equal copy.

    Raises:
        ConfigError: For combinations that failed before (disk offload, ``selective_checkpointing`` or
            ``activation_offloading: hidden_states`` without ``gradient_checkpointing``,
            ``gradient_checkpointing`` together with ``fsdp_config.activation_checkpointing``), and for a
            deprecated key set next to ``activation_checkpointing``.

    Warns:
        LegacyConfigWarning: Once, printing the replacement block as YAML.
    """
    cfg = _to_plain(mapping)
    fsdp_config = cfg.get("fsdp_config")
    has_fsdp_ac = isinstance(fsdp_config, Mapping) and "activation_checkpointing" in fsdp_config
    present = [k for k in LEGACY_KEYS[:-1] if k in cfg] + (
        ["fsdp_config.activation_checkpointing"] if has_fsdp_ac else []
    )
    if not present:
        return cfg
    if "activation_checkpointing" in cfg:
        raise ConfigError(
            f"{', '.join(present)} {'is' if len(present) == 1 else 'are'} deprecated and cannot be set next to "
            "activation_checkpointing. Move the setting into the activation_checkpointing block and remove "
            f"{', '.join(present)}."
        )

    gc = cfg.pop("gradient_checkpointing", None)
    gc_kwargs = cfg.pop("gradient_checkpointing_kwargs", None)
    selective = cfg.pop("selective_checkpointing", None)
    act_offload = cfg.pop("activation_offloading", None)
    fsdp_ac = None
    if has_fsdp_ac:
        fsdp_config = dict(fsdp_config)
        fsdp_ac = fsdp_config.pop("activation_checkpointing")
        cfg["fsdp_config"] = fsdp_config

    notes: List[str] = []
    block: Dict[str, Any] = {}
    offload: Dict[str, str] = {}

    # gradient_checkpointing: true | false | offload | offload_disk
    if gc == "offload_disk" or act_offload == "disk":
        key = "gradient_checkpointing: offload_disk" if gc == "offload_disk" else "activation_offloading: disk"
        raise ConfigError(f"{key}: rejected, {_DISK}. Use activation_checkpointing: {{offload: {{all: cpu}}}} instead.")
    if not (gc is None or isinstance(gc, bool) or gc == "offload"):
        raise ConfigError(
            f"gradient_checkpointing: expected true, false or offload, got {gc!r}. "
            "Replace it with activation_checkpointing: true."
        )
    if gc == "offload":
        offload["all"] = "cpu"
    if fsdp_ac is not None and not isinstance(fsdp_ac, bool):
        raise ConfigError(
            f"fsdp_config.activation_checkpointing: expected true or false, got {fsdp_ac!r}. "
            "Replace it with activation_checkpointing: {implementation: fsdp}."
        )
    if gc and fsdp_ac:
        raise ConfigError(
            "gradient_checkpointing and fsdp_config.activation_checkpointing cannot both be true (transformers' "
            "Trainer rejected the two together). Use activation_checkpointing: true, or "
            "activation_checkpointing: {implementation: fsdp} for FSDP's wrapper."
        )
    if fsdp_ac:
        block["implementation"] = "fsdp"
    recompute = bool(gc) or bool(fsdp_ac)

    # gradient_checkpointing_kwargs: use_reentrant, offload, and torch.utils.checkpoint arguments
    if gc_kwargs is not None:
        if not isinstance(gc_kwargs, Mapping):
            raise ConfigError(f"gradient_checkpointing_kwargs: expected a mapping, got {gc_kwargs!r}.")
        gc_kwargs = dict(gc_kwargs)
        if not recompute:
            notes.append(
                f"gradient_checkpointing_kwargs {gc_kwargs} had no effect without gradient_checkpointing "
                "and was dropped"
            )
        else:
            if "use_reentrant" in gc_kwargs:
                block["reentrant"] = gc_kwargs.pop("use_reentrant")
            if (
                parse_placement(gc_kwargs.pop("offload", None), "gradient_checkpointing_kwargs.offload")
                != Placement.none
            ):
                offload["hidden_states"] = "cpu"
            dropped = sorted(k for k in gc_kwargs if k not in CHECKPOINT_KWARGS | {"every_n_layers"})
            if dropped:
                notes.append(
                    f"gradient_checkpointing_kwargs {', '.join(dropped)} dropped: torch.utils.checkpoint does not "
                    "accept them"
                )
            kept = {k: v for k, v in gc_kwargs.items() if k not in dropped}
            if kept:
                block["kwargs"] = kept

    # selective_checkpointing: true | {...} (with its own offload)
    if selective is not None and selective is not False:
        if not recompute:
            raise ConfigError(
                "selective_checkpointing needs gradient_checkpointing: true (selective checkpointing refines "
                "recompute). Use activation_checkpointing: {selective: true}."
            )
        if isinstance(selective, Mapping):
            selective = dict(selective)
            if parse_placement(selective.pop("offload", None), "selective_checkpointing.offload") != Placement.none:
                offload["selective"] = "cpu"
            block["selective"] = selective if selective else True
        else:
            block["selective"] = selective

    # activation_offloading: true | legacy | hidden_states | disk
    if act_offload is not None and act_offload is not False:
        if act_offload is True or act_offload == "legacy":
            offload["all"] = "cpu"
            if not recompute:
                block["enabled"] = False
        elif act_offload == "hidden_states":
            if not recompute:
                raise ConfigError(
                    "activation_offloading: hidden_states needs gradient_checkpointing: true, since only "
                    "checkpointed layer inputs are offloaded. Use "
                    "activation_checkpointing: {offload: {hidden_states: cpu}}."
                )
            offload["hidden_states"] = "cpu"
        else:
            raise ConfigError(
                f"activation_offloading: expected true, legacy or hidden_states, got {act_offload!r}. "
                "Use activation_checkpointing: {offload: {all: cpu}}."
            )

    if offload:
        block["offload"] = offload
    new: Any
    if block:
        new = block
    else:
        new = recompute  # true when recompute was on, false when every legacy key was off

    parse_config(new)  # combinations the block rejects (e.g. offload.all with offload.hidden_states) fail here
    cfg["activation_checkpointing"] = new
    message = (
        f"{', '.join(present)} {'is' if len(present) == 1 else 'are'} deprecated and will be removed in a future "
        f"release. Replace {'it' if len(present) == 1 else 'them'} with:\n\n{_as_yaml(new)}\n"
    )
    if notes:
        message += "\nNote: " + "; ".join(notes) + "."
    warnings.warn(message, LegacyConfigWarning, stacklevel=2)
    return cfg
