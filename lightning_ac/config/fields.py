"""One parser per kind of field value (a switch, a count, a size, a placement, a layer list, ...), shared by the
block and the callbacks' arguments: each returns the typed value or raises a :class:`ConfigError` naming the field,
the value and the fix."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Mapping
from typing import Any, List, Optional

from lightning_ac.config.schema import AUTO, FIRST_PLANS, ConfigError, Placement
from lightning_ac.layers import LayerSpec, layer_class
from lightning_ac.units import size_from_text

__all__ = [
    "expected_error",
    "parse_bool",
    "parse_budget",
    "parse_count",
    "parse_first_plan",
    "parse_layers",
    "parse_placement",
    "parse_size",
    "parse_str_list",
    "parse_switch_or_mapping",
    "parse_tolerance",
    "parse_verify",
    "reject_unknown",
    "to_plain",
]


def to_plain(value: Any) -> Any:
    """DictConfig/ListConfig -> plain containers; dataclasses -> dicts (one level, fields kept as they are)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return value


def reject_unknown(mapping: Mapping, known: tuple, where: str) -> None:
    unknown = [k for k in mapping if k not in known]
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(repr(k) for k in unknown)}. "
            f"Valid fields are: {', '.join(known)}. Check the spelling or remove the field."
        )


def expected_error(name: str, expected: str, value: Any, fix: str = "") -> ConfigError:
    """The one shape of a field error: the field as the user wrote it, what it takes, what it got, the fix."""
    return ConfigError(f"{name}: expected {expected}, got {value!r}." + (f" {fix}" if fix else ""))


def _bool_text(value: Any) -> Optional[bool]:
    """``"true"``/``"false"`` in any case as the boolean they spell (a YAML or command-line boolean that reached us
    as text: jsonargparse keeps ``--x=true`` as text where the type also takes strings), else ``None``."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return None


def parse_bool(value: Any, name: str, *, allow_none: bool = False) -> Optional[bool]:
    """A boolean field: ``True`` or ``False``, or the text ``"true"``/``"false"`` in any case (as YAML and command
    lines write them). Other text (``"yes"``, ``"0"``) and numbers are errors, not truth values.

    Args:
        value: What the user gave.
        name: The field as the user wrote it (``activation_checkpointing.reentrant``, ``LayerOffload(verbose=...)``).
        allow_none: Whether ``None`` (automatic) is accepted.
    """
    if value is None and allow_none:
        return None
    text = _bool_text(value)
    if text is not None:
        return text
    if not isinstance(value, bool):
        expected = "true, false or null" if allow_none else "true or false"
        if isinstance(value, str):  # "yes" would read as true if taken as a truth value: say it is text
            booleans = "True, False or None" if allow_none else "True or False"
            raise expected_error(
                name, expected, value, f"It is text, not a boolean: set {name} to {expected} (in Python {booleans})."
            )
        raise expected_error(name, expected, value, f"Set {name} to {expected}.")
    return value


def parse_count(value: Any, name: str, *, minimum: int = 0, fix: str = "") -> int:
    """An integer field (a byte count, a layer count) of at least ``minimum``; booleans are rejected."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise expected_error(name, f"an integer >= {minimum}", value, fix)
    return value


def parse_size(value: Any, name: str) -> int:
    """A memory size: a positive int of bytes, or text with a unit (``"24GiB"``, ``"512MiB"``, ``"20GB"``,
    ``"300 MB"``; binary and decimal units, any case). Booleans, zero, negatives and unknown units are errors; so is
    ``auto``, which the ``budget`` field resolves itself (:func:`parse_budget`) before it asks for a size.

    Returns:
        The size in bytes.
    """
    expected = "a size: a positive whole number of bytes or text with a unit (24GiB, 512MiB, 20GB, 300 MB)"
    if isinstance(value, numbers.Number) and not isinstance(value, (bool, numbers.Integral)):
        # 1e9 (how YAML and Hydra read that override) or a numpy float: whole numbers of bytes are sizes
        whole = isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer()
        if not whole:
            raise expected_error(
                name,
                expected,
                value,
                "A size in bytes is a whole number: round it (e.g. 1500000000), or give it with a unit (1.5GB).",
            )
        value = int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # int, numpy integers
        value = int(value)
    if isinstance(value, bool) or (isinstance(value, int) and value <= 0):
        raise expected_error(name, expected, value, "Give the activation memory one training step may use.")
    if isinstance(value, int):
        return value
    size = size_from_text(value) if isinstance(value, str) else None
    if size is None:
        units = "B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (of 1024)"
        raise expected_error(name, expected, value, f"Units: {units}.")
    if size <= 0:
        raise expected_error(name, expected, value, "Give the activation memory one training step may use.")
    return size


def parse_budget(value: Any, name: str) -> Any:
    """The ``budget`` field: ``None`` (off), ``"auto"`` (any case) or a size (:func:`parse_size`, in bytes)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        return parse_size(value, name)
    except ConfigError as err:
        raise ConfigError(
            f"{err} Or write {AUTO} (on an accelerator: the device memory free when the first step starts, less a "
            "margin), or leave the field out to recompute every layer."
        ) from None


def parse_first_plan(value: Any, name: str) -> str:
    """The ``budget_first_plan`` field: ``measure`` (default) or ``estimate``."""
    if value is None:
        return "measure"
    if not isinstance(value, str) or value.strip().lower() not in FIRST_PLANS:
        raise expected_error(
            name,
            f"one of {', '.join(FIRST_PLANS)}",
            value,
            "measure: the first step recomputes every layer and measures each; estimate: a step on fake tensors "
            "before it makes the first plan.",
        )
    return value.strip().lower()


def parse_tolerance(value: Any, name: str) -> float:
    """A non-negative absolute tolerance (``0``: bit for bit); booleans are rejected."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise expected_error(name, "a number >= 0", value, "0 compares bit for bit.")
    return float(value)


def parse_verify(request: Any, where: str) -> None:
    parse_count(
        request.verify_steps,
        f"{where}(verify_steps=...)",
        fix="It counts the first optimizer steps run twice to check the transfers; 0 turns verify mode off.",
    )
    request.verify_atol = parse_tolerance(request.verify_atol, f"{where}(verify_atol=...)")


def parse_layers(value: Any, name: str) -> Optional[List[LayerSpec]]:
    """``layers=``: ``None`` (find transformers layers), or a list of layer classes / module-name globs. A string that
    imports as ``package.module.Class`` to an ``nn.Module`` subclass becomes that class (LightningCLI and YAML configs
    name classes by their path); any other string is a glob (:func:`~lightning_ac.layers.layer_class`)."""
    if value is None:
        return None
    if isinstance(value, (str, type)) or not all(isinstance(s, (str, type)) for s in value):
        raise expected_error(
            name,
            "a list of layer classes or module-name globs",
            value,
            "Write layers=[MyBlock], layers=['my_package.blocks.MyBlock'] or layers=['model.blocks.*'].",
        )
    return [(layer_class(s) or s) if isinstance(s, str) else s for s in value]


def parse_placement(value: Any, name: str) -> Placement:
    """Normalise one offload target (``none``/``cpu``, or ``true``/``false`` as booleans or text, any case);
    ``disk`` is rejected for now; ``auto`` is for ``hidden_states`` alone (the memory budget decides per layer)."""
    text = _bool_text(value)
    if text is not None:
        value = text
    if isinstance(value, bool):
        return Placement.cpu if value else Placement.none
    if value is None:
        return Placement.none
    if isinstance(value, str) and value.lower() in Placement.__members__:
        placement = Placement(value.lower())
        if placement is Placement.disk:
            raise ConfigError(
                f"{name}: 'disk' is rejected for now: disk offload is disabled pending a fix. "
                f"{_set_to(name, 'cpu')} to keep these tensors in host memory instead."
            )
        if placement is Placement.auto and "hidden_states" not in name:
            raise ConfigError(
                f"{name}: 'auto' is for hidden_states only: the memory budget decides, per decoder layer, whether its "
                f"input goes to host memory; it does not decide this target. {_set_to(name, 'cpu', 'none')}."
            )
        return placement
    raise expected_error(
        name,
        "none, cpu, auto, true or false" if "hidden_states" in name else "none, cpu, true or false",
        value,
        f"{_set_to(name, 'cpu', 'none')}.",
    )


def _set_to(name: str, *values: str) -> str:
    """How to set a field to one of ``values``, in the user's terms: ``Pass hidden_states='cpu' or
    hidden_states='none'`` for an argument written ``ActivationOffload(hidden_states=...)``, ``Set <key>: cpu or
    <key>: none`` for a block key."""
    argument = re.fullmatch(r"\w+\((\w+)=\.\.\.\)", name)
    if argument:
        return "Pass " + " or ".join(f"{argument.group(1)}={value!r}" for value in values)
    return "Set " + " or ".join(f"{name}: {value}" for value in values)


def parse_str_list(value: Any, name: str) -> List[str]:
    if isinstance(value, str):
        raise ConfigError(f"{name}: expected a list of strings, got the string {value!r}. Write {name}: [{value}].")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{name}: expected a list of non-empty strings, got {value!r}.")
    return list(value)


def parse_switch_or_mapping(value: Any, name: str, on: Any, example: str) -> Any:
    """A field that is off (``false``, ``None``), on with its defaults (``true``: ``on()``), or a mapping of its own
    fields (returned for the caller to check). ``"true"``/``"false"`` text counts as the boolean."""
    value = to_plain(value)
    flag = _bool_text(value)
    value = flag if flag is not None else value
    if value is None or value is False:
        return None
    if value is True:
        return on()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name}: expected true, false or a mapping, got {value!r}. {example}")
    return value
