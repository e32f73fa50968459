"""Rewrite the deprecated keys into the ``activation_checkpointing`` block.

Implements the spec's migration table row by row. The result is validated with :func:`parse_config`, so a
migrated config is always one the block accepts.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Tuple

from lightning_ac._logging import rank_zero_warn
from lightning_ac.config import CHECKPOINT_KWARGS, ConfigError, Placement, parse_config, parse_placement

__all__ = ["LEGACY_KEYS", "LegacyConfigWarning", "find_legacy_keys", "migrate_legacy"]

LEGACY_KEYS = (
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "selective_checkpointing",
    "activation_offloading",
    "fsdp_config.activation_checkpointing",
)
_FSDP_AC = "fsdp_config.activation_checkpointing"


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
        raise ConfigError(
            f"migrate_legacy(config): expected the training config as a mapping (dict or DictConfig) that may hold "
            f"the legacy keys ({', '.join(LEGACY_KEYS)}), got {type(mapping).__name__} {mapping!r:.80}. Pass the "
            "whole config, e.g. migrate_legacy({'gradient_checkpointing': True}) or migrate_legacy(cfg)."
        )
    return copy.deepcopy(dict(mapping))


def _as_yaml(block: Any) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml({"activation_checkpointing": block}).rstrip()


def find_legacy_keys(mapping: Mapping[str, Any]) -> List[str]:
    """The deprecated checkpointing keys set in a config, in :data:`LEGACY_KEYS` order.

    Args:
        mapping: A training config (``dict`` or ``DictConfig``).

    Returns:
        The top-level deprecated keys present, then ``"fsdp_config.activation_checkpointing"`` when
        ``fsdp_config`` is a mapping holding ``activation_checkpointing``. Empty when none is set.
    """
    present = [key for key in LEGACY_KEYS if key != _FSDP_AC and key in mapping]
    fsdp_config = mapping.get("fsdp_config")
    if isinstance(fsdp_config, Mapping) and "activation_checkpointing" in fsdp_config:
        present.append(_FSDP_AC)
    return present


@dataclass
class _Migration:
    """What the rewriters build, each from its own legacy key.

    Attributes:
        block: The ``activation_checkpointing`` block, without ``offload``.
        offload: The block's ``offload`` mapping (target -> placement), added to ``block`` last.
        notes: Settings dropped on the way, appended to the warning.
        recompute: Whether ``gradient_checkpointing`` or ``fsdp_config.activation_checkpointing`` turned
            recompute on; the later keys refine recompute, so their rewriters read it.
    """

    block: Dict[str, Any] = field(default_factory=dict)
    offload: Dict[str, str] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    recompute: bool = False

    def result(self) -> Any:
        """The migrated block: a mapping, or a bare ``true``/``false`` when no key needed more than that."""
        if self.offload:
            self.block["offload"] = self.offload
        # true when recompute was on, false when every legacy key was off
        return self.block if self.block else self.recompute


def _reject_disk(gc: Any, act_offload: Any) -> None:
    """Disk offload under either key fails before any other check: it is the error users hit before."""
    if gc == "offload_disk" or act_offload == "disk":
        key = "gradient_checkpointing: offload_disk" if gc == "offload_disk" else "activation_offloading: disk"
        raise ConfigError(f"{key}: rejected, {_DISK}. Use activation_checkpointing: {{offload: {{all: cpu}}}} instead.")


def _gradient_checkpointing(state: _Migration, gc: Any) -> None:
    """``gradient_checkpointing: true | false | offload`` (``offload_disk`` is rejected earlier)."""
    if not (gc is None or isinstance(gc, bool) or gc == "offload"):
        raise ConfigError(
            f"gradient_checkpointing: expected true, false or offload, got {gc!r}. "
            "Replace it with activation_checkpointing: true."
        )
    if gc == "offload":
        state.offload["all"] = "cpu"
    state.recompute = bool(gc)


def _fsdp_activation_checkpointing(state: _Migration, fsdp_ac: Any) -> None:
    """``fsdp_config.activation_checkpointing: true | false``: recompute through FSDP's wrapper."""
    if fsdp_ac is not None and not isinstance(fsdp_ac, bool):
        raise ConfigError(
            f"fsdp_config.activation_checkpointing: expected true or false, got {fsdp_ac!r}. "
            "Replace it with activation_checkpointing: {implementation: fsdp}."
        )
    # state.recompute holds gradient_checkpointing alone here: this rewriter runs right after it
    if state.recompute and fsdp_ac:
        raise ConfigError(
            "gradient_checkpointing and fsdp_config.activation_checkpointing cannot both be true (transformers' "
            "Trainer rejected the two together). Use activation_checkpointing: true, or "
            "activation_checkpointing: {implementation: fsdp} for FSDP's wrapper."
        )
    if fsdp_ac:
        state.block["implementation"] = "fsdp"
        state.recompute = True


def _gradient_checkpointing_kwargs(state: _Migration, gc_kwargs: Any) -> None:
    """``gradient_checkpointing_kwargs``: ``use_reentrant``, ``offload`` and torch.utils.checkpoint arguments."""
    if gc_kwargs is None:
        return
    if not isinstance(gc_kwargs, Mapping):
        raise ConfigError(f"gradient_checkpointing_kwargs: expected a mapping, got {gc_kwargs!r}.")
    gc_kwargs = dict(gc_kwargs)
    if not state.recompute:
        state.notes.append(
            f"gradient_checkpointing_kwargs {gc_kwargs} had no effect without gradient_checkpointing and was dropped"
        )
        return
    if "use_reentrant" in gc_kwargs:
        state.block["reentrant"] = gc_kwargs.pop("use_reentrant")
    if parse_placement(gc_kwargs.pop("offload", None), "gradient_checkpointing_kwargs.offload") != Placement.none:
        state.offload["hidden_states"] = "cpu"
    dropped = sorted(k for k in gc_kwargs if k not in CHECKPOINT_KWARGS | {"every_n_layers"})
    if dropped:
        state.notes.append(
            f"gradient_checkpointing_kwargs {', '.join(dropped)} dropped: torch.utils.checkpoint does not accept them"
        )
    kept = {k: v for k, v in gc_kwargs.items() if k not in dropped}
    if kept:
        state.block["kwargs"] = kept


def _selective_checkpointing(state: _Migration, selective: Any) -> None:
    """``selective_checkpointing: true | {...}``, with its own ``offload``; it refines recompute."""
    if selective is None or selective is False:
        return
    if not state.recompute:
        raise ConfigError(
            "selective_checkpointing needs gradient_checkpointing: true (selective checkpointing refines "
            "recompute). Use activation_checkpointing: {selective: true}."
        )
    if isinstance(selective, Mapping):
        selective = dict(selective)
        if parse_placement(selective.pop("offload", None), "selective_checkpointing.offload") != Placement.none:
            state.offload["selective"] = "cpu"
        state.block["selective"] = selective if selective else True
    else:
        state.block["selective"] = selective


def _activation_offloading(state: _Migration, act_offload: Any) -> None:
    """``activation_offloading: true | legacy | hidden_states`` (``disk`` is rejected earlier)."""
    if act_offload is None or act_offload is False:
        return
    if act_offload is True or act_offload == "legacy":
        state.offload["all"] = "cpu"
        if not state.recompute:
            state.block["enabled"] = False
    elif act_offload == "hidden_states":
        if not state.recompute:
            raise ConfigError(
                "activation_offloading: hidden_states needs gradient_checkpointing: true, since only "
                "checkpointed layer inputs are offloaded. Use "
                "activation_checkpointing: {offload: {hidden_states: cpu}}."
            )
        state.offload["hidden_states"] = "cpu"
    else:
        raise ConfigError(
            f"activation_offloading: expected true, legacy or hidden_states, got {act_offload!r}. "
            "Use activation_checkpointing: {offload: {all: cpu}}."
        )


# The order rewriters run in, which is also the order errors are found in and keys enter the block (and so the
# YAML in the warning). The two keys that turn recompute on come first, since the others read state.recompute.
_REWRITERS: Tuple[Tuple[str, Callable[[_Migration, Any], None]], ...] = (
    ("gradient_checkpointing", _gradient_checkpointing),
    (_FSDP_AC, _fsdp_activation_checkpointing),
    ("gradient_checkpointing_kwargs", _gradient_checkpointing_kwargs),
    ("selective_checkpointing", _selective_checkpointing),
    ("activation_offloading", _activation_offloading),
)


# Fields of the migrated block and the legacy keys their values came from, most specific first.
_LEGACY_FIELDS = (
    ("activation_checkpointing.reentrant", "gradient_checkpointing_kwargs.use_reentrant"),
    ("activation_checkpointing.kwargs", "gradient_checkpointing_kwargs"),
    ("activation_checkpointing.selective", "selective_checkpointing"),
)


def _in_legacy_terms(message: str, present: List[str]) -> str:
    """A ConfigError about the migrated block, reworded to name the legacy key the user wrote."""
    for new, legacy in _LEGACY_FIELDS:
        if message.startswith(new):
            field_name = message.split(":", 1)[0]
            return f"{message.replace(new, legacy)} (in the activation_checkpointing block: {field_name})"
    return f"migrating {', '.join(present)}: {message}"


def _pop_legacy(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Remove every legacy key from ``cfg`` (in place) and return their values, ``None`` for keys not set."""
    values = {key: cfg.pop(key, None) for key in LEGACY_KEYS if key != _FSDP_AC}
    fsdp_config = cfg.get("fsdp_config")
    values[_FSDP_AC] = None
    if isinstance(fsdp_config, Mapping) and "activation_checkpointing" in fsdp_config:
        fsdp_config = dict(fsdp_config)
        values[_FSDP_AC] = fsdp_config.pop("activation_checkpointing")
        cfg["fsdp_config"] = fsdp_config
    return values


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
            Also if ``mapping`` is not a mapping. Errors in a migrated value name the legacy key it came from.

    Warns:
        LegacyConfigWarning: Once, printing the replacement block as YAML.
    """
    cfg = _to_plain(mapping)
    present = find_legacy_keys(cfg)
    if not present:
        return cfg
    if "activation_checkpointing" in cfg:
        raise ConfigError(
            f"{', '.join(present)} {'is' if len(present) == 1 else 'are'} deprecated and cannot be set next to "
            "activation_checkpointing. Move the setting into the activation_checkpointing block and remove "
            f"{', '.join(present)}."
        )
    values = _pop_legacy(cfg)
    _reject_disk(values["gradient_checkpointing"], values["activation_offloading"])
    state = _Migration()
    for key, rewrite in _REWRITERS:
        rewrite(state, values[key])
    new = state.result()

    try:
        parse_config(new)  # values and combinations the block rejects fail here
    except ConfigError as err:
        raise ConfigError(_in_legacy_terms(str(err), present)) from None
    cfg["activation_checkpointing"] = new
    message = (
        f"{', '.join(present)} {'is' if len(present) == 1 else 'are'} deprecated and will be removed in a future "
        f"release. Replace {'it' if len(present) == 1 else 'them'} with:\n\n{_as_yaml(new)}\n"
    )
    if state.notes:
        message += "\nNote: " + "; ".join(state.notes) + "."
    rank_zero_warn(message, LegacyConfigWarning, stacklevel=6)
    return cfg
