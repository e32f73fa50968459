"""The callbacks' typed requests: each suite callback turns its arguments into one, validated where it is built with
the block's field parsers, and the plan merges them (:func:`merge_requests`) into one block, checked with the
block's own rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, List, Optional

from lightning_ac.config.block import mark_validated, parse_chunked_loss, parse_config, parse_tiled_mlp
from lightning_ac.config.fields import (
    expected_error,
    parse_bool,
    parse_budget,
    parse_count,
    parse_first_plan,
    parse_layers,
    parse_placement,
    parse_verify,
    to_plain,
)
from lightning_ac.config.rules import check_combination, check_offload_targets
from lightning_ac.config.schema import (
    FIRST_PLAN_FIELD,
    OFFLOAD_TARGETS,
    ActivationCheckpointingConfig,
    ConfigError,
    OffloadConfig,
)
from lightning_ac.layers import LayerSpec
from lightning_ac.units import DEFAULT_HOST_RESERVE_BYTES

__all__ = [
    "ActivationOffloadRequest",
    "CheckpointingRequest",
    "LayerOffloadRequest",
    "decoder_layer_spec",
    "merge_requests",
]


@dataclass
class CheckpointingRequest:
    """What :class:`~lightning_ac.ActivationCheckpointing` asks for.

    Attributes:
        config: The recompute part of the block (``offload`` left at none: offloading is another request).
        layers: Layer classes or module-name globs, ``None`` to find transformers layers.
    """

    config: ActivationCheckpointingConfig
    layers: Optional[List[LayerSpec]] = None
    # the whole block this request was cut from, already checked across its fields (callbacks_from_config)
    block: Optional[ActivationCheckpointingConfig] = field(default=None, repr=False, compare=False)

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
        tiled_mlp: Any = None,
    ) -> CheckpointingRequest:
        """Validate ``ActivationCheckpointing``'s arguments with the block's own rules."""
        layers = parse_layers(layers, "ActivationCheckpointing(layers=...)")
        if kwargs is not None and not isinstance(to_plain(kwargs), Mapping):
            raise expected_error(
                "ActivationCheckpointing(kwargs=...)", "a mapping of torch.utils.checkpoint arguments", kwargs
            )
        given_budget = budget
        budget = parse_budget(budget, "ActivationCheckpointing(budget=...)")
        chunked = parse_chunked_loss(chunked_loss, "ActivationCheckpointing(chunked_loss=...)")
        tiled = parse_tiled_mlp(tiled_mlp, "ActivationCheckpointing(tiled_mlp=...)")
        enabled = parse_bool(enabled, "ActivationCheckpointing(enabled=...)")
        recompute_only = {
            "implementation": implementation if implementation != "hf" else None,
            "reentrant": reentrant,
            "kwargs": kwargs or None,
            "selective": selective if selective is not False else None,
            # with tiled_mlp, layers names the layers whose MLPs to tile
            "layers": layers if tiled is None else None,
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
        if not enabled and chunked is None and tiled is None:
            raise ConfigError(
                "ActivationCheckpointing(enabled=False) recomputes no decoder layer, and without chunked_loss or "
                "tiled_mlp it would do nothing. Pass chunked_loss=True to compute the loss in chunks only, or "
                "tiled_mlp=True to run each MLP a tile of tokens at a time, or remove the callback."
            )
        block = {"implementation": implementation, "reentrant": reentrant, "kwargs": kwargs, "selective": selective}
        block = {**block, "budget": budget, "chunked_loss": chunked, "enabled": enabled, "tiled_mlp": tiled}
        first_plan = parse_first_plan(budget_first_plan, f"ActivationCheckpointing({FIRST_PLAN_FIELD}=...)")
        block[FIRST_PLAN_FIELD] = first_plan
        return cls(parse_config(block), layers)

    @classmethod
    def from_config(cls, config: ActivationCheckpointingConfig) -> CheckpointingRequest:
        """The recompute part of a block that :func:`parse_config` returned (not validated again)."""
        return cls(mark_validated(dataclasses.replace(config, offload=OffloadConfig())), block=config)


@dataclass
class ActivationOffloadRequest:
    """What :class:`~lightning_ac.ActivationOffload` asks for, typed (:meth:`from_arguments` validates the
    callback's arguments; :func:`~lightning_ac.callbacks_from_config` builds one from a validated block).

    Its fields are the callback's arguments of the same names, the targets' placements gathered in ``offload``.
    """

    offload: OffloadConfig = field(default_factory=OffloadConfig)
    copy_on_host: bool = False
    min_offload_bytes: int = 2**16
    max_pinned_bytes: Optional[int] = None
    host_reserve_bytes: int = DEFAULT_HOST_RESERVE_BYTES
    verify_steps: int = 0
    verify_atol: float = 0.0

    @classmethod
    def from_arguments(cls, **arguments: Any) -> ActivationOffloadRequest:
        """Validate ``ActivationOffload``'s arguments (the fields above, with the targets' placements as keywords
        ``hidden_states``, ``selective``, ``all``) with the block's own field parsers."""
        where = "ActivationOffload"
        offload = OffloadConfig(
            **{t: parse_placement(arguments.pop(t, "none"), f"{where}({t}=...)") for t in OFFLOAD_TARGETS}
        )
        check_offload_targets(offload, where)
        request = cls(offload, **arguments)
        request.copy_on_host = bool(parse_bool(request.copy_on_host, f"{where}(copy_on_host=...)"))
        for name in ("min_offload_bytes", "host_reserve_bytes"):
            parse_count(getattr(request, name), f"{where}({name}=...)")
        if request.max_pinned_bytes is not None:  # None: no cap but the host memory check
            parse_count(request.max_pinned_bytes, f"{where}(max_pinned_bytes=...)")
        parse_verify(request, where)
        return request


@dataclass
class LayerOffloadRequest:
    """What :class:`~lightning_ac.LayerOffload` asks for, typed (:meth:`from_arguments` validates the callback's
    arguments).

    Its fields are the callback's arguments of the same names.
    """

    layers: Optional[List[LayerSpec]] = None
    copy_on_host: bool = False
    host_reserve_bytes: int = DEFAULT_HOST_RESERVE_BYTES
    resident_layers: int = 0
    verify_steps: int = 0
    verify_atol: float = 0.0

    @classmethod
    def from_arguments(cls, **arguments: Any) -> LayerOffloadRequest:
        """Validate ``LayerOffload``'s arguments (the fields above) with the block's own field parsers."""
        where = "LayerOffload"
        request = cls(**arguments)
        request.layers = parse_layers(request.layers, f"{where}(layers=...)")
        request.copy_on_host = bool(parse_bool(request.copy_on_host, f"{where}(copy_on_host=...)"))
        parse_count(request.host_reserve_bytes, f"{where}(host_reserve_bytes=...)")
        parse_count(
            request.resident_layers,
            f"{where}(resident_layers=...)",
            fix="It counts the last decoder layers whose frozen weights stay on the device; 0 streams them all.",
        )
        parse_verify(request, where)
        return request


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
            arguments = ", ".join(f"{t}={str(getattr(offload, t))!r}" for t in needs)
            add = "ActivationCheckpointing(budget=...)" if "auto" in arguments else "ActivationCheckpointing()"
            raise ConfigError(
                f"ActivationOffload({arguments}) acts on checkpointed decoder layers, but the Trainer has no "
                f"ActivationCheckpointing. Add {add} to the callbacks, or use ActivationOffload(all='cpu') to offload "
                "without recompute."
            )
        base = ActivationCheckpointingConfig(enabled=False)
    else:
        base = checkpointing.config
    cfg = dataclasses.replace(base, offload=offload)
    if checkpointing is None or checkpointing.block != cfg:  # the requests of one checked block need no check
        check_combination(cfg)
    return mark_validated(cfg)


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
