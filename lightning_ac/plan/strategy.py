"""The plan's rules about the Trainer: what the strategy and precision plugin allow, which the block alone cannot
check (subclasses of the strategies count too), and what ``reentrant: null`` means under each strategy."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

from lightning_ac._logging import rank_zero_info, rank_zero_warn
from lightning_ac.config import (
    AUTO,
    ActivationCheckpointingConfig,
    ActivationOffloadRequest,
    ConfigError,
    LayerOffloadRequest,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["check_strategy", "offload_wanted", "resolve_reentrant"]

# Strategies that run implementation: fsdp; with DeepSpeed, the strategies that shard parameters, which layer
# offloading (whole parameters) cannot work on. isinstance, so that a user's subclass counts too.
_FSDP_STRATEGIES = (FSDPStrategy, ModelParallelStrategy)
_SHARDING_STRATEGIES = (*_FSDP_STRATEGIES, DeepSpeedStrategy)
# Precision plugins whose convert_module swaps modules (new parameters) after Callback.setup.
_MODULE_REPLACING_PRECISIONS = ("BitsandbytesPrecision", "TransformerEnginePrecision")


def check_strategy(
    config: ActivationCheckpointingConfig, layer_offload: Optional[LayerOffloadRequest], trainer: pl.Trainer
) -> None:
    """Strategy rules that the block alone cannot check: a :class:`ConfigError` naming the strategy and the fix.

    Args:
        config: The combined block.
        layer_offload: ``LayerOffload``'s request, if that callback is present.
        trainer: The Trainer the plan applies under.
    """
    strategy = trainer.strategy
    name = type(strategy).__name__
    if config.enabled and config.implementation == "fsdp" and not isinstance(strategy, _FSDP_STRATEGIES):
        raise ConfigError(
            f"activation_checkpointing.implementation: fsdp needs an FSDP strategy, but the Trainer uses "
            f"{name}. Use implementation: hf, or train with strategy='fsdp' / ModelParallelStrategy."
        )
    if config.enabled and config.budget == AUTO and strategy.root_device.type != "cuda":
        raise ConfigError(
            f"activation_checkpointing.budget: auto reads the memory free on a CUDA device, but the Trainer runs "
            f"on {strategy.root_device.type}. Give the budget as a size (budget: 2GiB), or train on a GPU."
        )
    if layer_offload is None:
        return
    if isinstance(strategy, _SHARDING_STRATEGIES):
        raise ConfigError(
            f"layer_offloading: true moves whole frozen parameters to host memory, but {name} shards "
            "them. Use the strategy's own CPU offload (FSDP's CPUOffloadPolicy, DeepSpeed's offload_param) "
            "and set layer_offloading: false."
        )
    precision = type(strategy.precision_plugin).__name__
    if precision in _MODULE_REPLACING_PRECISIONS:
        raise ConfigError(
            f"layer_offloading: true moves the frozen weights to host memory in setup, but {precision} "
            "replaces the model's linear layers with new ones after that (in the strategy's setup), which "
            "would then sit on the device whole while the old weights stream. Quantize the model before "
            "training instead (transformers' BitsAndBytesConfig: a 4-bit base streams as it is), or set "
            "layer_offloading: false."
        )
    if strategy.root_device.type == "cpu" and not layer_offload.copy_on_host:
        raise ConfigError(
            "layer_offloading: true needs an accelerator: on a CPU-only trainer the parameters already live "
            "in host memory. Set layer_offloading: false, or run the copies anyway (tests, debugging) with "
            "LayerOffload(copy_on_host=True) (Hydra: offload_copy_on_host=true)."
        )


def resolve_reentrant(config: ActivationCheckpointingConfig, trainer: pl.Trainer) -> ActivationCheckpointingConfig:
    """The block with ``reentrant: null`` resolved: non-reentrant, except under DeepSpeed ZeRO-3, where non-reentrant
    recompute raises a CheckpointError: there it means reentrant (and selective, which needs non-reentrant, is an
    error)."""
    strategy = trainer.strategy
    deepspeed = getattr(strategy, "config", None) or {}
    zero3 = isinstance(strategy, DeepSpeedStrategy) and deepspeed.get("zero_optimization", {}).get("stage") == 3
    if not (zero3 and config.enabled and config.reentrant is None):
        return config
    if config.selective is not None:
        raise ConfigError(
            "activation_checkpointing.selective needs non-reentrant checkpointing, which raises a CheckpointError "
            "under DeepSpeed ZeRO-3. Remove selective, or use another strategy (FSDP)."
        )
    return dataclasses.replace(config, reentrant=True)


def offload_wanted(request: Optional[ActivationOffloadRequest], device: Optional[torch.device]) -> bool:
    """Whether ``ActivationOffload``'s request sets a target that can do something on ``device`` (a line says why
    not: no target, or a CPU-only trainer without ``copy_on_host``)."""
    if request is None:
        return False
    if not request.offload.targets:
        rank_zero_warn(
            "ActivationOffload() has no target, so nothing is offloaded. Pass hidden_states='cpu', selective='cpu' "
            "or all='cpu' (Hydra: activation_checkpointing.offload.<target>: cpu), or remove the callback."
        )
        return False
    if device is not None and device.type == "cpu" and not request.copy_on_host:
        rank_zero_info(
            "activation offloading does nothing on a CPU-only trainer (the activations already live in host "
            "memory); to force the copies, for tests and debugging, pass ActivationOffload(copy_on_host=True) "
            "(Hydra: offload_copy_on_host=true)"
        )
        return False
    return True
