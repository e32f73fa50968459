"""Installing layer offloading: which frozen weights stream (all decoder layers but the resident ones), the checks
that refuse what cannot stream, the broadcast that gives every DDP process process 0's streamed weights, and the
lines that say what streams."""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
from torch import nn

from lightning_ac._logging import rank_zero_info, rank_zero_warn
from lightning_ac.config import ConfigError, LayerOffloadRequest
from lightning_ac.layers import DecoderLayers, compiled_layers
from lightning_ac.offload.weights import LayerWeightStreamer, frozen_layer_parameters

__all__ = ["DDP_IGNORE", "log_weight_streamer", "resident_layers", "share_streamed_weights", "weight_streamer_for"]

# What DDP (and Lightning's state sync outside fit) leave out of the broadcast of the module's state at setup.
DDP_IGNORE = "_ddp_params_and_buffers_to_ignore"


def weight_streamer_for(
    module: nn.Module, layers: DecoderLayers, device: torch.device, request: LayerOffloadRequest
) -> LayerWeightStreamer:
    """The streamer of the decoder layers' frozen weights (not installed yet), or a :class:`ConfigError` when nothing
    can stream: compiled layers, every layer resident, or no frozen weight."""
    modules = layers.modules
    compiled = compiled_layers(module, layers).describe()
    if compiled:
        raise ConfigError(
            f"layer_offloading: {compiled}, but layer offloading swaps each parameter's data between host and "
            "device memory around every call, which compiled graphs are not built for (they guard on devices and "
            "addresses, and a graph compiled earlier skips the streaming hooks). Set layer_offloading: false, or "
            "leave the model and its decoder layers uncompiled."
        )
    params = frozen_layer_parameters(modules)
    resident = resident_layers(layers, request.resident_layers)
    params = [[] if keep else p for p, keep in zip(params, resident)]
    if not any(params) and any(resident):
        raise ConfigError(
            f"LayerOffload(resident_layers={request.resident_layers}) keeps every one of the "
            f"{len(modules)} decoder layers on the device, so nothing is offloaded. Use fewer resident layers, "
            "or set layer_offloading: false."
        )
    if not any(params):
        raise ConfigError(
            f"layer_offloading: true streams the frozen parameters of the decoder layers, but all "
            f"{len(modules)} layers train every parameter, so there is nothing to offload. Use it with "
            "frozen base weights (LoRA/QLoRA adapters), or set layer_offloading: false."
        )
    return LayerWeightStreamer(
        modules,
        params,
        device,
        copy_on_host=request.copy_on_host,
        host_reserve_bytes=request.host_reserve_bytes,
        groups=layers.owners,
        resident=resident,
    )


def resident_layers(layers: DecoderLayers, count: int) -> List[bool]:
    """For each decoder layer, whether it is among the last ``count`` of its model."""
    owners = layers.owners
    return [count > 0 and owners[i + 1 :].count(owners[i]) < count for i in range(len(owners))]


def share_streamed_weights(module: nn.Module, streamer: LayerWeightStreamer) -> None:
    """Under DDP: every process trains on process 0's weights. DDP broadcasts the module's state at setup,
    after moving the module to the device; the streamed parameters are kept out of that broadcast (they are in
    host memory, and must never be on the device whole) and broadcast here, one parameter at a time."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    streamed = {id(p) for p in streamer.streamed}
    names = [n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in streamed]
    ignored = list(getattr(module, DDP_IGNORE, []))
    setattr(module, DDP_IGNORE, ignored + [n for n in names if n not in ignored])
    streamer.broadcast(src=0)


def log_weight_streamer(streamer: LayerWeightStreamer, noun: str, precision: str, recomputed: List[bool]) -> None:
    """What streams (one line), and warnings where the saving is smaller than it looks: frozen weights it cannot
    move, or autocast's half-precision copies kept for backward in layers that are not recomputed."""
    rank_zero_info(streamer.describe(noun))
    streamed, kept = streamer.streamed_bytes, streamer.kept_frozen_bytes()
    if kept > streamed:
        rank_zero_warn(
            f"layer offloading streams {streamed / 2**20:.1f} MiB, but {kept / 2**20:.1f} MiB of frozen "
            "decoder-layer parameters stay on the device: they are parameter subclasses it cannot move (quantized "
            "formats other than bitsandbytes' 4-bit Params4bit, DTensor shards) or shared between layers."
        )
    fp32 = any(p.dtype == torch.float32 for p in streamer.streamed)
    recomputed_everywhere = bool(recomputed) and all(recomputed)
    if "mixed" in precision and fp32 and not recomputed_everywhere:
        rank_zero_warn(
            f"layer offloading under {precision} precision: autocast makes a half-precision copy of each "
            "float32 frozen weight, and autograd keeps that copy on the device until backward in layers that are "
            "not recomputed, which gives back part of the saving. Enable activation checkpointing on every "
            "layer, or keep the frozen base in bfloat16/float16."
        )
