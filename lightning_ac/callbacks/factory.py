"""The suite callbacks an ``activation_checkpointing`` block asks for (:func:`callbacks_from_config`)."""

from __future__ import annotations

from typing import Any, List

from lightning.pytorch.callbacks import Callback

from lightning_ac.callbacks.activation_offload import ActivationOffload
from lightning_ac.callbacks.checkpointing import ActivationCheckpointing
from lightning_ac.callbacks.layer_offload import LayerOffload
from lightning_ac.config import (
    ActivationOffloadRequest,
    CheckpointingRequest,
    ConfigError,
    LayerOffloadRequest,
    parse_bool,
    parse_config,
    parse_count,
)

__all__ = ["callbacks_from_config"]


def callbacks_from_config(
    block: Any,
    *,
    layer_offloading: bool = False,
    layer_offloading_resident_layers: int = 0,
    copy_on_host: bool = False,
    verify_steps: int = 0,
    verbose: bool = False,
) -> List[Callback]:
    """Build the suite callbacks an ``activation_checkpointing`` block asks for.

    Args:
        block: The block in any form :func:`~lightning_ac.parse_config` accepts (a block it returned is not
            validated again).
        layer_offloading: The separate ``layer_offloading`` key.
        layer_offloading_resident_layers: :class:`LayerOffload`'s ``resident_layers`` (Hydra:
            ``layer_offloading_resident_layers``).
        copy_on_host: Passed to :class:`ActivationOffload` and :class:`LayerOffload`: run the offload copies on a
            CPU-only trainer too.
        verify_steps: Passed to :class:`ActivationOffload` and :class:`LayerOffload` (Hydra:
            ``offload_verify_steps``): verify mode for the first optimizer steps.
        verbose: Print the per-layer table at fit start.

    Returns:
        The callbacks to pass to ``Trainer(callbacks=...)``; empty when everything is off.

    Raises:
        ConfigError: If the block or ``layer_offloading`` is invalid.
    """
    cfg = parse_config(block)
    layer_offloading = bool(parse_bool(layer_offloading, "layer_offloading"))
    verbose = bool(parse_bool(verbose, "verbose"))
    # checked whatever the block, not only when the callback that takes them is built
    copy_on_host = bool(parse_bool(copy_on_host, "callbacks_from_config(copy_on_host=...)"))
    verify_steps = parse_count(
        verify_steps,
        "callbacks_from_config(verify_steps=...)",
        fix="It counts the first optimizer steps run twice to check the transfers; 0 turns verify mode off.",
    )
    layer_offloading_resident_layers = parse_count(
        layer_offloading_resident_layers,
        "layer_offloading_resident_layers",
        fix="It counts the last decoder layers whose frozen weights stay on the device; 0 streams them all.",
    )
    # a setting that does nothing is an error, as everywhere in the block
    if layer_offloading_resident_layers and not layer_offloading:
        raise ConfigError(
            f"layer_offloading_resident_layers: {layer_offloading_resident_layers} keeps the last decoder layers' "
            "frozen weights on the device while layer offloading streams the others, but layer_offloading is false, "
            "so nothing streams. Set layer_offloading: true, or remove layer_offloading_resident_layers."
        )
    if verify_steps and not cfg.offload.targets and not layer_offloading:
        raise ConfigError(
            f"callbacks_from_config(verify_steps={verify_steps}) (Hydra: offload_verify_steps) checks the first "
            "optimizer steps' offload transfers, but the block offloads nothing (no offload target, layer_offloading "
            "false). Remove verify_steps, or set an offload target or layer_offloading: true."
        )
    # the block was validated above and the arguments here: the callbacks take their requests as they are
    callbacks: List[Callback] = []
    # without recompute, the chunked loss and the tiled MLP are all it does
    if cfg.enabled or cfg.chunked_loss is not None or cfg.tiled_mlp is not None:
        checkpointing = CheckpointingRequest.from_config(cfg)
        callbacks.append(ActivationCheckpointing.from_request(checkpointing, verbose=verbose))
    if cfg.offload.targets:
        offload = ActivationOffloadRequest(cfg.offload, copy_on_host=copy_on_host, verify_steps=verify_steps)
        callbacks.append(ActivationOffload.from_request(offload, verbose=verbose))
    if layer_offloading:
        layer_offload = LayerOffloadRequest(
            copy_on_host=copy_on_host, resident_layers=layer_offloading_resident_layers, verify_steps=verify_steps
        )
        callbacks.append(LayerOffload.from_request(layer_offload, verbose=verbose))
    return callbacks
