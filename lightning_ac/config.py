"""The ``activation_checkpointing`` block and the callbacks' typed requests: dataclasses, validation, rules.

One source of truth for the rules. :func:`parse_config` validates every form a user can write (``bool``,
``None``, a mapping, an OmegaConf ``DictConfig`` or an already-built dataclass). Each suite callback turns its
arguments into a request (:class:`CheckpointingRequest`, :class:`ActivationOffloadRequest`,
:class:`LayerOffloadRequest`), validated where it is built with the same field checks, and the plan merges the
requests with :func:`merge_requests`, which checks the combination with :func:`check_combination`, the function
the block uses. Every message has one shape: the field as the user wrote it, what it expects, what it got, and
the fix.

The block's dataclasses double as Hydra structured configs, so the fields that accept several forms
(``selective``, the offload targets) are typed ``Any`` for OmegaConf and normalised here.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

import torch.utils.checkpoint

from lightning_ac.layers import LayerSpec, layer_class

__all__ = [
    "ActivationCheckpointingConfig",
    "ActivationOffloadRequest",
    "CheckpointingRequest",
    "ConfigError",
    "LayerOffloadRequest",
    "OffloadConfig",
    "Placement",
    "SelectiveConfig",
    "check_block_key",
    "check_combination",
    "merge_requests",
    "parse_bool",
    "parse_config",
    "parse_count",
    "parse_layers",
    "parse_placement",
    "parse_budget",
    "parse_first_plan",
    "parse_chunked_loss",
    "parse_size",
    "CHECKPOINT_KWARGS",
    "OFFLOAD_TARGETS",
]


class ConfigError(ValueError):
    """A rejected ``activation_checkpointing`` block or callback argument.

    The message names the field, the value that was given, and how to fix it.
    """


class Placement(str, Enum):
    """Where an offload target's tensors live. Compares equal to its string value (``"cpu"``)."""

    none = "none"
    cpu = "cpu"
    disk = "disk"

    def __str__(self) -> str:  # "cpu", not "Placement.cpu", in messages and YAML
        return self.value


DEFAULT_SAVE = ("attention",)
DEFAULT_RECOMPUTE_LAYER_TYPES = ("sliding_attention", "chunked_attention")


@dataclass
class SelectiveConfig:
    """Selective activation checkpointing: which ops a checkpointed layer saves instead of recomputing.

    Attributes:
        save: Op names matched as substrings of the qualified op name (``aten::mm``); ``attention`` names
            the attention kernels. ``[]`` saves nothing through the list.
        save_modules: Module names (exact, dotted suffix or glob) whose matmuls are saved.
        save_matmul_min_k: Save every matmul whose contraction dim is at least this (``>= 1``).
        save_sliding_window: Also save sliding-window attention calls.
        recompute_layer_types: Layer types whose attention is recomputed rather than saved.
    """

    save: List[str] = field(default_factory=lambda: list(DEFAULT_SAVE))
    save_modules: List[str] = field(default_factory=list)
    save_matmul_min_k: Optional[int] = None
    save_sliding_window: bool = False
    recompute_layer_types: List[str] = field(default_factory=lambda: list(DEFAULT_RECOMPUTE_LAYER_TYPES))


# budget: auto and chunked_loss.chunk_tokens: auto
AUTO = "auto"


@dataclass
class ChunkedLossConfig:
    """The causal-LM loss computed a chunk of tokens at a time (:mod:`lightning_ac.loss`).

    Attributes:
        chunk_tokens: Tokens per chunk (``>= 1``), or ``"auto"``: per call, as many tokens as make a chunk's logits
            the size of the final hidden states (``tokens x hidden_size / vocab_size``, rounded up to a power of
            two), and at least 128 (smaller chunks run matmuls too small to be fast), so that the head's working set
            stays about the size of one layer's input. A chunk's working set is about ``chunk_tokens x vocabulary``
            float32 logits and their gradient; fewer tokens hold less and run more, smaller matmuls, each reading
            the head's whole weight.
    """

    chunk_tokens: Any = AUTO


@dataclass
class OffloadConfig:
    """Where each offload target's tensors go: ``none`` (default) or ``cpu``; ``true``/``false`` mean cpu/none.

    Attributes:
        hidden_states: Each checkpointed decoder layer's input.
        selective: What the selective policy saves.
        all: Every activation saved during the training forward.
    """

    hidden_states: Any = Placement.none
    selective: Any = Placement.none
    all: Any = Placement.none

    @property
    def targets(self) -> List[str]:
        """The targets that move to the host, in :data:`OFFLOAD_TARGETS` order."""
        return [t for t in OFFLOAD_TARGETS if getattr(self, t) != Placement.none]

    @property
    def needs_checkpointing(self) -> List[str]:
        """The targets that act on checkpointed decoder layers."""
        return [t for t in self.targets if t in ("hidden_states", "selective")]


@dataclass
class ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` block.

    After :func:`parse_config`, ``selective`` is ``None`` or a :class:`SelectiveConfig`, ``kwargs`` a plain
    dict, and every offload target a :class:`Placement`.

    Attributes:
        enabled: Recompute decoder layers in backward. ``False`` leaves only ``offload.all`` in effect.
        implementation: ``hf`` (transformers' checkpointing; plain torch layers get torch's checkpoint around
            their ``forward``) or ``fsdp`` (torch's non-reentrant checkpoint around each decoder layer's
            ``forward``, outside transformers, so FSDP's hooks stay outside the recompute; needs an FSDP
            strategy).
        reentrant: ``use_reentrant``; ``None`` picks the default (non-reentrant).
        kwargs: Extra ``torch.utils.checkpoint.checkpoint`` arguments, plus ``every_n_layers``.
        selective: Selective activation checkpointing, ``None`` when off.
        offload: Offload placement of each target.
        budget: The memory budget: the activation memory one training step may use, in bytes (an int after
            :func:`parse_config`; text with a unit before), or ``"auto"`` (the device memory free at the first step,
            less a margin; accelerators only). The suite then chooses per decoder layer what to keep and what to
            recompute (:mod:`lightning_ac.budget`). ``None``: every layer the other fields name is recomputed.
        chunked_loss: The causal-LM loss computed a chunk of tokens at a time, ``None`` when off. Applies with
            ``enabled: false`` too.
        budget_first_plan: Where the budget's first plan comes from: ``measure`` (the first training step
            recomputes every layer and measures each) or ``estimate`` (before the first step, the user's training
            step runs once on fake tensors at the first batch's shape, which allocates nothing, and the first real
            step already runs the plan; see :mod:`lightning_ac.budget.first_plan`). Only with ``budget``.
    """

    enabled: bool = True
    implementation: str = "hf"
    reentrant: Optional[bool] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)
    selective: Any = None
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    budget: Any = None
    chunked_loss: Optional[ChunkedLossConfig] = None
    budget_first_plan: str = "measure"

    @property
    def use_reentrant(self) -> bool:
        """The resolved ``use_reentrant``: ``reentrant`` when set, else non-reentrant."""
        return bool(self.reentrant)

    @property
    def every_n_layers(self) -> int:
        """Checkpoint every n-th decoder layer (``kwargs.every_n_layers``, default 1)."""
        return int(self.kwargs.get("every_n_layers", 1))

    @property
    def checkpoint_kwargs(self) -> Dict[str, Any]:
        """The keyword arguments handed to ``torch.utils.checkpoint.checkpoint`` (``use_reentrant`` included)."""
        kwargs = {k: v for k, v in self.kwargs.items() if k != "every_n_layers"}
        return {"use_reentrant": self.use_reentrant, **kwargs}


IMPLEMENTATIONS = ("hf", "fsdp")
FIRST_PLANS = ("measure", "estimate")
_FIRST_PLAN = "budget_first_plan"

# What torch.utils.checkpoint.checkpoint accepts besides the function, its inputs and the keys we set ourselves.
# preserve_rng_state is read from **kwargs by torch; the rest are named parameters in 2.13.
_SET_BY_US = {"context_fn", "respect_saved_tensors_hooks"}
CHECKPOINT_KWARGS = frozenset(
    {"preserve_rng_state"}
    | {
        name
        for name, p in inspect.signature(torch.utils.checkpoint.checkpoint).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in _SET_BY_US | {"use_reentrant"}
    }
)
_KWARG_TYPES: Dict[str, tuple] = {
    "preserve_rng_state": (bool,),
    "debug": (bool,),
    "early_stop": (bool,),
    "determinism_check": (str,),
}
_FIELDS = tuple(f.name for f in dataclasses.fields(ActivationCheckpointingConfig))
_SELECTIVE_FIELDS = tuple(f.name for f in dataclasses.fields(SelectiveConfig))
_CHUNKED_LOSS_FIELDS = tuple(f.name for f in dataclasses.fields(ChunkedLossConfig))
# The offload targets, in the order messages, metrics and reports list them.
OFFLOAD_TARGETS = tuple(f.name for f in dataclasses.fields(OffloadConfig))
# Set on configs that parse_config returned, so that passing one on (the Hydra job hands its parsed block to
# callbacks_from_config) does not validate it a second time.
_VALIDATED = "_lightning_ac_validated"


def _plain(value: Any) -> Any:
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


def _reject_unknown(mapping: Mapping, known: tuple, where: str) -> None:
    unknown = [k for k in mapping if k not in known]
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(repr(k) for k in unknown)}. "
            f"Valid fields are: {', '.join(known)}. Check the spelling or remove the field."
        )


def check_block_key(key: str) -> None:
    """A dotted key into the block, as a Hydra override writes it (``activation_checkpointing.offload.gpu=cpu``):
    a :class:`ConfigError` naming the unknown field and the valid ones, as :func:`parse_config` would, when the block
    has no such field. A command line can then fail on the key the user wrote rather than on the name of the
    structured config behind it. Keys outside the block, and the free-form ``kwargs``, are not checked here.
    """
    parts = key.split(".")
    if parts[0] != "activation_checkpointing" or len(parts) < 2:
        return
    _reject_unknown([parts[1]], _FIELDS, "activation_checkpointing")
    nested = {"offload": OFFLOAD_TARGETS, "selective": _SELECTIVE_FIELDS}
    if len(parts) > 2 and parts[1] in nested:
        _reject_unknown([parts[2]], nested[parts[1]], f"activation_checkpointing.{parts[1]}")


def _expected(name: str, expected: str, value: Any, fix: str = "") -> ConfigError:
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
            raise _expected(
                name, expected, value, f"It is text, not a boolean: set {name} to {expected} (in Python {booleans})."
            )
        raise _expected(name, expected, value, f"Set {name} to {expected}.")
    return value


def parse_count(value: Any, name: str, *, minimum: int = 0, fix: str = "") -> int:
    """An integer field (a byte count, a layer count) of at least ``minimum``; booleans are rejected."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _expected(name, f"an integer >= {minimum}", value, fix)
    return value


_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")


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
            raise _expected(
                name,
                expected,
                value,
                "A size in bytes is a whole number: round it (e.g. 1500000000), or give it with a unit (1.5GB).",
            )
        value = int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # int, numpy integers
        value = int(value)
    if isinstance(value, bool) or (isinstance(value, int) and value <= 0):
        raise _expected(name, expected, value, "Give the activation memory one training step may use.")
    if isinstance(value, int):
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        units = "B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (of 1024)"
        raise _expected(name, expected, value, f"Units: {units}.")
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise _expected(name, expected, value, "Give the activation memory one training step may use.")
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
        raise _expected(
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
        raise _expected(name, "a number >= 0", value, "0 compares bit for bit.")
    return float(value)


def _parse_verify(request: Any, where: str) -> None:
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
        raise _expected(
            name,
            "a list of layer classes or module-name globs",
            value,
            "Write layers=[MyBlock], layers=['my_package.blocks.MyBlock'] or layers=['model.blocks.*'].",
        )
    return [(layer_class(s) or s) if isinstance(s, str) else s for s in value]


def parse_placement(value: Any, name: str) -> Placement:
    """Normalise one offload target (``none``/``cpu``, or ``true``/``false`` as booleans or text, any case);
    ``disk`` is rejected for now."""
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
        return placement
    raise _expected(name, "none, cpu, true or false", value, f"{_set_to(name, 'cpu', 'none')}.")


def _set_to(name: str, *values: str) -> str:
    """How to set a field to one of ``values``, in the user's terms: ``Pass hidden_states='cpu' or
    hidden_states='none'`` for an argument written ``ActivationOffload(hidden_states=...)``, ``Set <key>: cpu or
    <key>: none`` for a block key."""
    argument = re.fullmatch(r"\w+\((\w+)=\.\.\.\)", name)
    if argument:
        return "Pass " + " or ".join(f"{argument.group(1)}={value!r}" for value in values)
    return "Set " + " or ".join(f"{name}: {value}" for value in values)


def _parse_str_list(value: Any, name: str) -> List[str]:
    if isinstance(value, str):
        raise ConfigError(f"{name}: expected a list of strings, got the string {value!r}. Write {name}: [{value}].")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{name}: expected a list of non-empty strings, got {value!r}.")
    return list(value)


def _switch_or_mapping(value: Any, name: str, on: Any, example: str) -> Any:
    """A field that is off (``false``, ``None``), on with its defaults (``true``: ``on()``), or a mapping of its own
    fields (returned for the caller to check). ``"true"``/``"false"`` text counts as the boolean."""
    value = _plain(value)
    flag = _bool_text(value)
    value = flag if flag is not None else value
    if value is None or value is False:
        return None
    if value is True:
        return on()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name}: expected true, false or a mapping, got {value!r}. {example}")
    return value


def _parse_selective(value: Any) -> Optional[SelectiveConfig]:
    value = _switch_or_mapping(
        value,
        "activation_checkpointing.selective",
        SelectiveConfig,
        "Write selective: true to save attention, or selective: {save: [attention]}.",
    )
    if not isinstance(value, Mapping):
        return value
    _reject_unknown(value, _SELECTIVE_FIELDS, "activation_checkpointing.selective")
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
        save=_parse_str_list(value.get("save", defaults.save), f"{where}.save"),
        save_modules=_parse_str_list(value.get("save_modules", defaults.save_modules), f"{where}.save_modules"),
        save_matmul_min_k=min_k,
        save_sliding_window=bool(parse_bool(value.get("save_sliding_window", False), f"{where}.save_sliding_window")),
        recompute_layer_types=_parse_str_list(
            value.get("recompute_layer_types", defaults.recompute_layer_types), f"{where}.recompute_layer_types"
        ),
    )


def parse_chunked_loss(value: Any, name: str = "activation_checkpointing.chunked_loss") -> Optional[ChunkedLossConfig]:
    """The ``chunked_loss`` field: ``false``/``None`` (off), ``true`` (``chunk_tokens: auto``) or a mapping
    ``{chunk_tokens: N}``."""
    example = "Write chunked_loss: true (chunk_tokens: auto), or chunked_loss: {chunk_tokens: 512}."
    value = _switch_or_mapping(value, name, ChunkedLossConfig, example)
    if not isinstance(value, Mapping):
        return value
    _reject_unknown(value, _CHUNKED_LOSS_FIELDS, name)
    tokens = value.get("chunk_tokens", AUTO)
    if isinstance(tokens, str) and tokens.strip().lower() == AUTO:
        return ChunkedLossConfig()
    parse_count(
        tokens,
        f"{name}.chunk_tokens",
        minimum=1,
        fix="It counts the tokens whose logits exist at once, e.g. 512; or write auto (the default).",
    )
    return ChunkedLossConfig(chunk_tokens=tokens)


def _parse_kwargs(value: Any) -> Dict[str, Any]:
    value = _plain(value)
    if value is None:
        return {}
    where = "activation_checkpointing.kwargs"
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping of torch.utils.checkpoint arguments, got {value!r}.")
    kwargs = dict(value)
    for key, arg in list(kwargs.items()):
        if key in _SET_BY_US:
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
        types = _KWARG_TYPES.get(key)
        if types == (bool,):
            kwargs[key] = parse_bool(arg, f"{where}.{key}")
        elif types and not isinstance(arg, types):
            raise _expected(f"{where}.{key}", types[0].__name__, arg)
    if "determinism_check" in kwargs and kwargs["determinism_check"] not in ("default", "none"):
        raise _expected(f"{where}.determinism_check", "'default' or 'none'", kwargs["determinism_check"])
    return kwargs


def _parse_offload(value: Any) -> OffloadConfig:
    value = _plain(value)
    if value is None:
        return OffloadConfig()
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"activation_checkpointing.offload: offload is a mapping, not a value; got {value!r}. "
            "Name a target, e.g. offload: {all: cpu} or offload: {hidden_states: cpu}."
        )
    _reject_unknown(value, OFFLOAD_TARGETS, "activation_checkpointing.offload")
    return OffloadConfig(
        **{t: parse_placement(value.get(t), f"activation_checkpointing.offload.{t}") for t in OFFLOAD_TARGETS}
    )


def check_offload_targets(offload: OffloadConfig, where: str) -> None:
    """The rule between offload targets, for the block and for ``ActivationOffload`` alike."""
    if offload.hidden_states != Placement.none and offload.all != Placement.none:
        raise ConfigError(
            f"{where}: hidden_states: cpu cannot be combined with all: cpu, which already offloads each layer's "
            "input. Keep one of them."
        )


def check_combination(cfg: ActivationCheckpointingConfig) -> None:
    """The rules that tie fields together; shared by YAML and Python (:func:`merge_requests`)."""
    off = Placement.none
    if not cfg.enabled:
        ignored = []
        if cfg.selective is not None:
            ignored.append("selective")
        if cfg.offload.hidden_states != off:
            ignored.append("offload.hidden_states")
        if cfg.offload.selective != off:
            ignored.append("offload.selective")
        if cfg.reentrant is not None:
            ignored.append("reentrant")
        if cfg.kwargs:
            ignored.append("kwargs")
        if cfg.implementation == "fsdp":
            ignored.append("implementation: fsdp")
        if cfg.budget is not None:
            ignored.append("budget")
        if ignored:
            raise ConfigError(
                f"activation_checkpointing: enabled is false, so nothing is recomputed and only offload.all and "
                f"chunked_loss apply, but {', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} set. "
                "Set enabled: true to recompute decoder layers, or remove "
                f"{', '.join(i.split(':')[0] for i in ignored)}."
            )
    check_offload_targets(cfg.offload, "activation_checkpointing.offload")
    if cfg.budget is None and cfg.budget_first_plan != "measure":
        raise ConfigError(
            f"activation_checkpointing.budget_first_plan: {cfg.budget_first_plan} says where the memory budget's "
            "first plan comes from, but budget is not set. Set budget (e.g. budget: 20GiB), or remove "
            "budget_first_plan."
        )
    if cfg.budget is not None and "every_n_layers" in cfg.kwargs:
        raise ConfigError(
            f"activation_checkpointing.budget: {cfg.budget!r} chooses which decoder layers are recomputed, and so "
            f"does kwargs.every_n_layers: {cfg.kwargs['every_n_layers']}. Keep one of them: remove "
            "kwargs.every_n_layers to let the budget choose, or remove budget."
        )
    if cfg.offload.selective != off and cfg.selective is None:
        raise ConfigError(
            "activation_checkpointing.offload.selective: cpu needs selective checkpointing, which decides what "
            "is saved. Add selective: true (save attention), or remove offload.selective."
        )
    if cfg.selective is not None and cfg.reentrant:
        raise ConfigError(
            "activation_checkpointing.selective: selective checkpointing requires non-reentrant checkpointing, "
            "but reentrant is true. Set reentrant: false (or leave it out), or remove selective."
        )
    if cfg.kwargs.get("debug") and (cfg.selective is not None or cfg.reentrant):
        what = "selective checkpointing (a custom context_fn)" if cfg.selective is not None else "reentrant: true"
        raise ConfigError(
            f"activation_checkpointing.kwargs.debug: torch's checkpoint debug mode does not work with {what}; torch "
            "would raise at the first training step. Remove kwargs.debug, or remove "
            f"{'selective' if cfg.selective is not None else 'reentrant: true'}."
        )
    if cfg.implementation == "fsdp" and cfg.reentrant:
        raise ConfigError(
            "activation_checkpointing.reentrant: implementation: fsdp runs torch's non-reentrant checkpoint around "
            "each layer, but reentrant is true. Set reentrant: false, or use implementation: hf."
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
    return _validated(_parse_block(value))


def _parse_block(value: Any) -> ActivationCheckpointingConfig:
    """Validate a block that has not been validated yet (the work :func:`parse_config` does once per block)."""
    value = _plain(value)
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
    _reject_unknown(value, _FIELDS, "activation_checkpointing")
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
        budget_first_plan=parse_first_plan(value.get("budget_first_plan"), f"activation_checkpointing.{_FIRST_PLAN}"),
    )
    check_combination(cfg)
    return cfg


def config_to_dict(cfg: ActivationCheckpointingConfig) -> Dict[str, Any]:
    """The normalised block as plain data (strings, lists, dicts), e.g. for ``summary.json`` or YAML."""
    data = dataclasses.asdict(cfg)
    data["offload"] = {k: str(v) for k, v in data["offload"].items()}
    return data


# -- the callbacks' requests ----------------------------------------------------------------------------------


@dataclass
class CheckpointingRequest:
    """What :class:`~lightning_ac.ActivationCheckpointing` asks for.

    Attributes:
        config: The recompute part of the block (``offload`` left at none: offloading is another request).
        layers: Layer classes or module-name globs, ``None`` to find transformers layers.
    """

    config: ActivationCheckpointingConfig
    layers: Optional[List[LayerSpec]] = None

    @classmethod
    def from_arguments(
        cls,
        *,
        implementation: Any = "hf",
        reentrant: Any = None,
        kwargs: Any = None,
        selective: Any = None,
        layers: Any = None,
        budget: Any = None,
        chunked_loss: Any = None,
        enabled: Any = True,
        budget_first_plan: Any = None,
    ) -> CheckpointingRequest:
        """Validate ``ActivationCheckpointing``'s arguments with the block's own rules."""
        layers = parse_layers(layers, "ActivationCheckpointing(layers=...)")
        if kwargs is not None and not isinstance(_plain(kwargs), Mapping):
            raise _expected(
                "ActivationCheckpointing(kwargs=...)", "a mapping of torch.utils.checkpoint arguments", kwargs
            )
        given_budget = budget
        budget = parse_budget(budget, "ActivationCheckpointing(budget=...)")
        chunked = parse_chunked_loss(chunked_loss, "ActivationCheckpointing(chunked_loss=...)")
        enabled = parse_bool(enabled, "ActivationCheckpointing(enabled=...)")
        recompute_only = {
            "implementation": implementation if implementation != "hf" else None,
            "reentrant": reentrant,
            "kwargs": kwargs or None,
            "selective": selective if selective is not False else None,
            "layers": layers,
            "budget": given_budget,
            # "measure" is the default: only another value asks for something
            "budget_first_plan": budget_first_plan if budget_first_plan not in (None, "measure") else None,
        }
        ignored = [name for name, value in recompute_only.items() if value is not None]
        if not enabled and ignored:
            given = ", ".join(f"{name}={recompute_only[name]!r}" for name in ignored)
            raise ConfigError(
                f"ActivationCheckpointing(enabled=False, {given}): enabled=False recomputes no decoder layer, and "
                f"{', '.join(ignored)} {'says' if len(ignored) == 1 else 'say'} how to recompute them, so "
                f"{'it' if len(ignored) == 1 else 'they'} would do nothing. Remove {', '.join(ignored)}, or set "
                "enabled=True (the default) to recompute."
            )
        if not enabled and chunked is None:
            raise ConfigError(
                "ActivationCheckpointing(enabled=False) recomputes no decoder layer, and without chunked_loss it would "
                "do nothing. Pass chunked_loss=True to compute the loss in chunks only, or remove the callback."
            )
        block = {"implementation": implementation, "reentrant": reentrant, "kwargs": kwargs, "selective": selective}
        block = {**block, "budget": budget, "chunked_loss": chunked, "enabled": enabled}
        first_plan = parse_first_plan(budget_first_plan, f"ActivationCheckpointing({_FIRST_PLAN}=...)")
        block[_FIRST_PLAN] = first_plan
        return cls(parse_config(block), layers)

    @classmethod
    def from_config(cls, config: ActivationCheckpointingConfig) -> CheckpointingRequest:
        """The recompute part of a block that :func:`parse_config` returned (not validated again)."""
        return cls(_validated(dataclasses.replace(config, offload=OffloadConfig())))


@dataclass
class ActivationOffloadRequest:
    """What :class:`~lightning_ac.ActivationOffload` asks for; validated when built.

    Attributes:
        offload: Where each target's tensors go.
        copy_on_host: On a CPU device, still run the copies (tests, debugging).
        min_offload_bytes: ``all`` leaves smaller tensors on the device.
        max_pinned_bytes: Upper bound of the reusable pinned host-buffer pool.
        host_reserve_bytes: Host memory left free.
        verify_steps: The first optimizer steps checked against synchronous transfers (verify mode).
        verify_atol: The largest difference verify mode accepts (``0``: bit for bit).
    """

    offload: OffloadConfig = field(default_factory=OffloadConfig)
    copy_on_host: bool = False
    min_offload_bytes: int = 2**16
    max_pinned_bytes: int = 8 * 2**30
    host_reserve_bytes: int = 2 * 2**30
    verify_steps: int = 0
    verify_atol: float = 0.0

    def __post_init__(self) -> None:
        where = "ActivationOffload"
        self.offload = OffloadConfig(
            **{t: parse_placement(getattr(self.offload, t), f"{where}({t}=...)") for t in OFFLOAD_TARGETS}
        )
        check_offload_targets(self.offload, where)
        self.copy_on_host = bool(parse_bool(self.copy_on_host, f"{where}(copy_on_host=...)"))
        for name in ("min_offload_bytes", "max_pinned_bytes", "host_reserve_bytes"):
            parse_count(getattr(self, name), f"{where}({name}=...)")
        _parse_verify(self, where)


@dataclass
class LayerOffloadRequest:
    """What :class:`~lightning_ac.LayerOffload` asks for; validated when built.

    Attributes:
        layers: Layer classes or module-name globs, ``None`` to find transformers layers.
        copy_on_host: On a CPU device, run the copies anyway (tests, debugging).
        host_reserve_bytes: Host memory left free.
        resident_layers: The last decoder layers (of each model) whose frozen weights stay on the device.
        verify_steps: The first optimizer steps checked against synchronous transfers (verify mode).
        verify_atol: The largest difference verify mode accepts (``0``: bit for bit).
    """

    layers: Optional[List[LayerSpec]] = None
    copy_on_host: bool = False
    host_reserve_bytes: int = 2 * 2**30
    resident_layers: int = 0
    verify_steps: int = 0
    verify_atol: float = 0.0

    def __post_init__(self) -> None:
        where = "LayerOffload"
        self.layers = parse_layers(self.layers, f"{where}(layers=...)")
        self.copy_on_host = bool(parse_bool(self.copy_on_host, f"{where}(copy_on_host=...)"))
        parse_count(self.host_reserve_bytes, f"{where}(host_reserve_bytes=...)")
        parse_count(
            self.resident_layers,
            f"{where}(resident_layers=...)",
            fix="It counts the last decoder layers whose frozen weights stay on the device; 0 streams them all.",
        )
        _parse_verify(self, where)


def merge_requests(
    checkpointing: Optional[CheckpointingRequest],
    activation_offload: Optional[ActivationOffloadRequest],
    layer_offload: Optional[LayerOffloadRequest] = None,
) -> ActivationCheckpointingConfig:
    """The block that the requests of one Trainer add up to, checked with the block's own rules.

    Raises:
        ConfigError: If the requests do not combine (an offload target that needs checkpointing without it,
            ``offload.selective`` without ``selective``...).
    """
    offload = activation_offload.offload if activation_offload is not None else OffloadConfig()
    if checkpointing is None:
        needs = offload.needs_checkpointing
        if needs:
            arguments = ", ".join(f"{t}='cpu'" for t in needs)
            raise ConfigError(
                f"ActivationOffload({arguments}) acts on checkpointed decoder layers, but the Trainer has no "
                "ActivationCheckpointing. Add ActivationCheckpointing() to the callbacks, or use "
                "ActivationOffload(all='cpu') to offload without recompute."
            )
        base = ActivationCheckpointingConfig(enabled=False)
    else:
        base = checkpointing.config
    cfg = dataclasses.replace(base, offload=offload)
    check_combination(cfg)
    return _validated(cfg)


def decoder_layer_spec(
    checkpointing: Optional[CheckpointingRequest], layer_offload: Optional[LayerOffloadRequest]
) -> Optional[List[LayerSpec]]:
    """``layers=`` as given to ActivationCheckpointing, else to LayerOffload (they must agree)."""
    given = [r.layers for r in (checkpointing, layer_offload) if r is not None and r.layers is not None]
    if len(given) == 2 and given[0] != given[1]:
        raise ConfigError(
            f"ActivationCheckpointing(layers={given[0]!r}) and LayerOffload(layers={given[1]!r}) name different "
            "decoder layers. Pass layers= to one of them, or the same value to both."
        )
    return given[0] if given else None


def _validated(cfg: ActivationCheckpointingConfig) -> ActivationCheckpointingConfig:
    setattr(cfg, _VALIDATED, True)
    return cfg
