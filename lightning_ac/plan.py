"""One validated plan for all suite callbacks on a module: gathered once, applied once, removed once.

Whichever suite callback reaches ``setup`` first gathers every suite callback in ``trainer.callbacks``,
validates the combination through :func:`parse_config` (the same rules as YAML), and applies one plan. The
others find it applied. Removal happens once, in ``teardown`` or ``on_exception``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ac._logging import rank_zero_log
from lightning_ac.checkpoint import enable_hf_checkpointing, wrap_layers
from lightning_ac.checkpoint.hf import HF_ATTRIBUTES
from lightning_ac.checkpoint.torch_layers import TORCH_ATTRIBUTES
from lightning_ac.config import ActivationCheckpointingConfig, ConfigError, parse_config
from lightning_ac.journal import ModuleJournal
from lightning_ac.layers import DecoderLayers, LayerSpec, find_decoder_layers
from lightning_ac.offload.layer_params import LayerParamStreamer, frozen_layer_parameters
from lightning_ac.offload.runtime import OffloadRuntime
from lightning_ac.offload.targets import offloading_checkpoint
from lightning_ac.selective.apply import build_policy, compiled_layers
from lightning_ac.selective.policy import SelectivePolicy

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_ac.callbacks import ActivationCheckpointing, ActivationOffload, LayerOffload, SuiteCallback

__all__ = ["Plan"]

_FSDP_STRATEGIES = ("FSDPStrategy", "ModelParallelStrategy")
# Strategies that shard parameters: layer offloading moves whole parameters and cannot work on shards.
_SHARDING_STRATEGIES = (*_FSDP_STRATEGIES, "DeepSpeedStrategy")


@dataclass
class Plan:
    """What the suite callbacks of one Trainer do to one module, and how to undo it.

    Attributes:
        callbacks: The suite callbacks that share this plan.
        config: The combined, validated block.
        layers: The decoder layers found (after :meth:`apply`).
        checkpointed: For each layer, whether it is recomputed in backward.
        selective: The selective checkpointing policy in force, if any (its ``report()`` shows what each
            layer saves).
        layer_streamer: The layer-offloading runtime in force, if any.
    """

    callbacks: List[SuiteCallback]
    config: ActivationCheckpointingConfig
    checkpointing: Optional[ActivationCheckpointing] = None
    offloading: Optional[ActivationOffload] = None
    layer_offloading: Optional[LayerOffload] = None
    module: Optional[nn.Module] = None
    layers: Optional[DecoderLayers] = None
    checkpointed: List[bool] = field(default_factory=list)
    selective: Optional[SelectivePolicy] = None
    offload: Optional[OffloadRuntime] = None
    layer_streamer: Optional[LayerParamStreamer] = None
    device: Optional[torch.device] = None
    _journal: Optional[ModuleJournal] = None
    _deferred: bool = False
    _offload_here: bool = False  # offload targets set, and useful on this device (decided once, in apply)
    _precision: str = ""

    @classmethod
    def gather(cls, trainer: pl.Trainer) -> Plan:
        """Collect the suite callbacks of ``trainer`` and validate their combination."""
        from lightning_ac.callbacks import ActivationCheckpointing, ActivationOffload, LayerOffload, SuiteCallback

        callbacks = [cb for cb in trainer.callbacks if isinstance(cb, SuiteCallback)]
        seen: Dict[type, Any] = {}
        for cb in callbacks:
            if type(cb) in seen:
                raise ConfigError(
                    f"Trainer(callbacks=...) holds more than one {type(cb).__name__}. Each suite callback may "
                    "appear once: merge their arguments into one instance."
                )
            seen[type(cb)] = cb
        block: Dict[str, Any] = {}
        checkpointing = seen.get(ActivationCheckpointing)
        if checkpointing is None:
            block["enabled"] = False
            needs = [cb.needs_checkpointing() for cb in callbacks if hasattr(cb, "needs_checkpointing")]
            needs = [n for n in needs if n]
            if needs:
                raise ConfigError(
                    f"{needs[0]} acts on checkpointed decoder layers, but the Trainer has no ActivationCheckpointing. "
                    "Add ActivationCheckpointing() to the callbacks, or use ActivationOffload(all='cpu') to offload "
                    "without recompute."
                )
        else:
            block.update(checkpointing.block())
        for cb in callbacks:
            if not isinstance(cb, ActivationCheckpointing):
                block.update(cb.block())
        return cls(callbacks, parse_config(block), checkpointing, seen.get(ActivationOffload), seen.get(LayerOffload))

    @property
    def applied(self) -> bool:
        return self._journal is not None

    def check_strategy(self, trainer: pl.Trainer) -> None:
        """Strategy rules that the block alone cannot check."""
        strategy = type(trainer.strategy).__name__
        if self.config.enabled and self.config.implementation == "fsdp":
            if strategy not in _FSDP_STRATEGIES:
                raise ConfigError(
                    f"activation_checkpointing.implementation: fsdp needs an FSDP strategy, but the Trainer uses "
                    f"{strategy}. Use implementation: hf, or train with strategy='fsdp' / ModelParallelStrategy."
                )
        if self.layer_offloading is not None:
            if strategy in _SHARDING_STRATEGIES:
                raise ConfigError(
                    f"layer_offloading: true moves whole frozen parameters to host memory, but {strategy} shards "
                    "them. Use the strategy's own CPU offload (FSDP's CPUOffloadPolicy, DeepSpeed's offload_param) "
                    "and set layer_offloading: false."
                )
            device = trainer.strategy.root_device
            if device.type == "cpu" and not self.layer_offloading.copy_on_host:
                raise ConfigError(
                    "layer_offloading: true needs an accelerator: on a CPU-only trainer the parameters already live "
                    "in host memory. Set layer_offloading: false, or run the copies anyway (tests, debugging) with "
                    "LayerOffload(copy_on_host=True) (Hydra: offload_copy_on_host=true)."
                )

    def apply(self, trainer: pl.Trainer, module: nn.Module) -> None:
        """Apply the plan to ``module``; defers to just after ``configure_model`` if the layers do not exist yet."""
        if self.applied or self._deferred:
            return
        self.check_strategy(trainer)
        self._resolve_reentrant(trainer)
        self.module = module
        self.device = trainer.strategy.root_device
        self._precision = str(trainer.precision)
        self._offload_here = self._offload_wanted()
        if not self.config.enabled and self.layer_offloading is None:  # offloading without recompute only
            if not self._offload_here:
                return
            layers = find_decoder_layers(module)
            if layers.hf_models or not _is_lightning_module(module):
                self._apply_to(layers)
            else:  # the model may be built in configure_model; the output head must be found to stay put
                self._defer_until_configured(module, require_layers=False)
            return
        layers = self._find_layers(module)
        if len(layers):
            self._apply_to(layers)
        elif _is_lightning_module(module):
            # built later: in configure_model, or in LightningModule.setup (which runs after Callback.setup)
            self._defer_until_configured(module)
        else:
            raise self._no_layers_error(module)

    def _resolve_reentrant(self, trainer: pl.Trainer) -> None:
        """``reentrant: null`` means non-reentrant, except under DeepSpeed ZeRO-3, where non-reentrant recompute
        raises a CheckpointError: there it means reentrant."""
        strategy = trainer.strategy
        config = getattr(strategy, "config", None) or {}
        zero3 = type(strategy).__name__ == "DeepSpeedStrategy" and (
            config.get("zero_optimization", {}).get("stage") == 3
        )
        if not (zero3 and self.config.enabled and self.config.reentrant is None):
            return
        if self.config.selective is not None:
            raise ConfigError(
                "activation_checkpointing.selective needs non-reentrant checkpointing, which raises a CheckpointError "
                "under DeepSpeed ZeRO-3. Remove selective, or use another strategy (FSDP)."
            )
        self.config = dataclasses.replace(self.config, reentrant=True)

    def _layer_spec(self) -> Optional[List[LayerSpec]]:
        """``layers=`` as given to ActivationCheckpointing, else to LayerOffload (they must agree)."""
        given = [cb for cb in (self.checkpointing, self.layer_offloading) if cb is not None and cb.layers is not None]
        if len(given) == 2 and given[0].layers != given[1].layers:
            raise ConfigError(
                f"ActivationCheckpointing(layers={given[0].layers!r}) and LayerOffload(layers={given[1].layers!r}) "
                "name different decoder layers. Pass layers= to one of them, or the same value to both."
            )
        return given[0].layers if given else None

    def _find_layers(self, module: nn.Module) -> DecoderLayers:
        return find_decoder_layers(module, self._layer_spec())

    def _no_layers_error(self, module: nn.Module) -> ConfigError:
        name = type(self.checkpointing or self.layer_offloading).__name__
        return ConfigError(
            f"{name} found no decoder layers in {type(module).__name__}: it finds transformers "
            "models (plain or PEFT-wrapped) on its own. For other models pass layers=[<layer class>] or "
            "layers=['<module name glob>'], e.g. layers=['model.blocks.*']."
        )

    def _defer_until_configured(self, module: nn.Module, require_layers: bool = True) -> None:
        original = module.configure_model
        plan = self

        def configure_model_then_apply() -> None:
            module.__dict__.pop("configure_model", None)
            plan._deferred = False
            original()
            layers = plan._find_layers(module) if require_layers else find_decoder_layers(module)
            if require_layers and not len(layers):
                raise plan._no_layers_error(module)
            plan._apply_to(layers)

        module.configure_model = configure_model_then_apply  # type: ignore[method-assign]
        self._deferred = True

    def _offload_wanted(self) -> bool:
        """Whether any offload target is set and can do something on this device."""
        offload = self.offloading
        if offload is None or not offload.targets:
            return False
        if self.device is not None and self.device.type == "cpu" and not offload.copy_on_host:
            rank_zero_log(
                "lightning_ac: activation offloading does nothing on a CPU-only trainer (the activations already "
                "live in host memory); ActivationOffload(copy_on_host=True) forces the copies, for tests and debugging"
            )
            return False
        return True

    def _build_offload(self) -> OffloadRuntime:
        assert self.offloading is not None and self.module is not None and self.device is not None
        runtime = OffloadRuntime(self.config.offload, self.device, **self.offloading.runtime_kwargs())
        runtime.skip_module_tensors(self.module)
        return runtime

    def _apply_to(self, layers: DecoderLayers) -> None:
        assert self.module is not None
        cfg = self.config
        self.layers = layers
        self._journal = ModuleJournal(self.module, HF_ATTRIBUTES + TORCH_ATTRIBUTES)
        modules = [m for _, m in layers.layers]
        try:
            if self._offload_here:
                self.offload = self._build_offload()
            if self.offload is not None and self.offload.all is not None:
                for model in layers.hf_models:
                    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
                    if head is not None:  # the output head's activations stay on the device
                        self.offload.handles.extend(self.offload.all.pause_in(head))
            if self.layer_offloading is not None:
                self._install_layer_streamer(modules)
            if not cfg.enabled:
                assert self._journal is not None
                self._journal.commit()
                if self.offload is not None:
                    rank_zero_log(f"lightning_ac: {self.describe_offload()}, nothing recomputed")
                self._log_layer_offload()
                return
            context_fn = None
            if cfg.selective is not None:
                will_checkpoint = [i % cfg.every_n_layers == 0 for i in range(len(modules))]
                storage = self.offload.sac_storage if self.offload is not None else None
                self.selective = build_policy(cfg.selective, self.module, layers, will_checkpoint, storage)
                self.selective.install()
                context_fn = self.selective.context_fn
            hidden = self.offload.hidden_states if self.offload is not None else None
            if layers.hf_models and cfg.implementation == "hf":
                engine = "hf"
                self.checkpointed = enable_hf_checkpointing(layers.hf_models, modules, cfg, context_fn)
                if hidden is not None:
                    for layer, on in zip(modules, self.checkpointed):
                        if on:
                            layer._gradient_checkpointing_func = offloading_checkpoint(
                                layer._gradient_checkpointing_func, hidden
                            )
            else:
                # plain torch layers, or implementation: fsdp: torch's non-reentrant checkpoint around each
                # layer's forward, outside transformers; FSDP2's hooks stay outside the recompute
                engine = "fsdp" if cfg.implementation == "fsdp" else "torch"
                checkpoint_fn = offloading_checkpoint(checkpoint, hidden) if hidden is not None else checkpoint
                self.checkpointed = wrap_layers(modules, cfg, context_fn, checkpoint_fn)
            self._journal.commit()
        except BaseException:
            self.remove()
            raise
        offloaded = f"; {self.describe_offload()}" if self.offload is not None else ""
        rank_zero_log(
            f"lightning_ac: checkpointing {sum(self.checkpointed)}/{len(modules)} decoder layers "
            f"({self.describe(engine)}){offloaded}"
        )
        self._log_layer_offload()

    def _install_layer_streamer(self, modules: List[nn.Module]) -> None:
        assert self.layer_offloading is not None and self.device is not None
        compiled = compiled_layers(modules)
        if compiled:
            raise ConfigError(
                f"layer_offloading: decoder layers {compiled} are compiled with torch.compile, but layer offloading "
                "swaps each parameter's data between host and device memory around every call, which compiled "
                "graphs are not built for (they guard on devices and addresses). Set layer_offloading: false, or "
                "leave the decoder layers uncompiled."
            )
        params = frozen_layer_parameters(modules)
        if not any(params):
            raise ConfigError(
                f"layer_offloading: true streams the frozen parameters of the decoder layers, but all "
                f"{len(modules)} layers train every parameter, so there is nothing to offload. Use it with "
                "frozen base weights (LoRA/QLoRA adapters), or set layer_offloading: false."
            )
        self.layer_streamer = LayerParamStreamer(
            modules,
            params,
            self.device,
            copy_on_host=self.layer_offloading.copy_on_host,
            host_reserve_bytes=self.layer_offloading.host_reserve_bytes,
        )
        self.layer_streamer.install()

    def _log_layer_offload(self) -> None:
        streamer = self.layer_streamer
        if streamer is None:
            return
        with_params = [layer for layer in streamer.layers if layer.params]
        total = sum(p.numel() * p.element_size() for layer in with_params for p in layer.params)
        where = "copies on host" if self.device is not None and self.device.type == "cpu" else str(self.device)
        rank_zero_log(
            f"lightning_ac: layer offloading: frozen parameters of {len(with_params)}/{len(streamer.layers)} decoder "
            f"layers ({total / 2**20:.1f} MiB) live in host memory and visit {where} one layer at a time"
        )
        streamed = {id(p) for p in streamer.streamed}
        frozen_kept = {
            id(p): p.numel() * p.element_size()
            for module in streamer.modules
            for p in module.parameters()
            if not p.requires_grad and id(p) not in streamed
        }
        kept = sum(frozen_kept.values())
        if kept > total:
            rank_zero_log(
                f"lightning_ac: layer offloading streams {total / 2**20:.1f} MiB, but {kept / 2**20:.1f} MiB of frozen "
                "decoder-layer parameters stay on the device: they are parameter subclasses (quantized weights such "
                "as bitsandbytes' Params4bit, DTensor shards) or shared between layers, which it does not move.",
                logging.WARNING,
            )
        fp32 = any(p.dtype == torch.float32 for p in streamer.streamed)
        recomputed_everywhere = bool(self.checkpointed) and all(self.checkpointed)
        if "mixed" in self._precision and fp32 and not recomputed_everywhere:
            rank_zero_log(
                f"lightning_ac: layer offloading under {self._precision} precision: autocast makes a half-precision "
                "copy of each float32 frozen weight, and autograd keeps that copy on the device until backward in "
                "layers that are not recomputed, which gives back part of the saving. Enable activation "
                "checkpointing on every layer, or keep the frozen base in bfloat16/float16.",
                logging.WARNING,
            )

    def describe_offload(self) -> str:
        """Which targets move to the host, as the log line shows them."""
        assert self.offload is not None
        where = "copies on host" if self.device is not None and self.device.type == "cpu" else str(self.device)
        return f"offloading {', '.join(self.offload.targets)} to host memory ({where})"

    def describe(self, engine: str) -> str:
        """The engine and options in force, as the log line shows them."""
        cfg = self.config
        parts = [engine, "reentrant" if cfg.use_reentrant else "non-reentrant"]
        if cfg.every_n_layers > 1:
            parts.append(f"every {cfg.every_n_layers} layers")
        if cfg.selective is not None:
            saves = [*cfg.selective.save, *(f"module {m}" for m in cfg.selective.save_modules)]
            if cfg.selective.save_matmul_min_k:
                saves.append(f"matmuls with K >= {cfg.selective.save_matmul_min_k}")
            parts.append(f"selective: save {', '.join(saves) or 'registered ops only'}")
        return ", ".join(parts)

    def remove(self, after_exception: bool = False) -> None:
        """Undo everything :meth:`apply` installed. Safe to call more than once.

        Args:
            after_exception: Called from ``on_exception``. Lightning moves the module to the CPU right after, so
                streamed parameters go back to host memory rather than allocating every frozen weight on the
                device again (perhaps right after running out of device memory).
        """
        if self.module is not None and self._deferred:
            self.module.__dict__.pop("configure_model", None)
            self._deferred = False
        offload, selective, journal, streamer = self.offload, self.selective, self._journal, self.layer_streamer
        self.offload = self.selective = self._journal = self.layer_streamer = None
        self.checkpointed = []
        # Each step runs even if an earlier one raised; streamed parameters get memory of their own first.
        home = torch.device("cpu") if after_exception else self._home_device(streamer)
        steps = [
            functools.partial(streamer.close, home) if streamer is not None else None,
            offload.close if offload is not None else None,
            selective.remove if selective is not None else None,
            journal.restore if journal is not None else None,
        ]
        _run_all([step for step in steps if step is not None])

    def _home_device(self, streamer: Optional[LayerParamStreamer]) -> Optional[torch.device]:
        """Where the module's other parameters are now: after a successful run Lightning has already moved the
        module to the CPU (``strategy.teardown`` runs before ``Callback.teardown``)."""
        if streamer is None or self.module is None:
            return None
        streamed = {id(p) for p in streamer.streamed}
        return next((p.device for p in self.module.parameters() if id(p) not in streamed), self.device)


def _run_all(steps: List[Any]) -> None:
    """Call every step; re-raise the first exception after all have run."""
    error: Optional[BaseException] = None
    for step in steps:
        try:
            step()
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the other steps
            error = error or err
    if error is not None:
        raise error


def _is_lightning_module(module: nn.Module) -> bool:
    from lightning.pytorch import LightningModule

    return isinstance(module, LightningModule)
