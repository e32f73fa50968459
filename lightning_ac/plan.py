"""One validated plan for all suite callbacks on a module: built once from their requests, applied once,
removed once.

The plan knows the requests (:mod:`lightning_ac.config`) and the engines, never the callbacks. Each engine
owns what it knows: the recompute engines take the checkpoint function to use, the activation-offload runtime
installs itself (its output-head pause included), the selective policy, the offload runtime and the weight
streamer describe what they do to each layer for the report.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, List, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_ac.selfcheck as selfcheck
from lightning_ac._logging import rank_zero_info, rank_zero_warn
from lightning_ac.budget import BudgetController, Choice
from lightning_ac.budget.first_plan import check_first_plan
from lightning_ac.checkpoint import enable_hf_checkpointing, wrap_layers
from lightning_ac.checkpoint.forward import TORCH_ATTRIBUTES
from lightning_ac.checkpoint.hf import HF_ATTRIBUTES
from lightning_ac.checkpoint.packed import notice_for
from lightning_ac.config import (
    AUTO,
    ActivationOffloadRequest,
    CheckpointingRequest,
    ConfigError,
    LayerOffloadRequest,
    decoder_layer_spec,
    merge_requests,
)
from lightning_ac.journal import ModuleJournal
from lightning_ac.layers import (
    CompiledModules,
    DecoderLayers,
    compiled_layers,
    find_decoder_layers,
    transformers_models,
)
from lightning_ac.loss import ChunkedLoss
from lightning_ac.offload.activations import ActivationOffloadRuntime
from lightning_ac.offload.compiled import (
    COMPILED_CALL_ATTRIBUTES,
    checkpointed_inside_too,
    compiled_call,
    offload_inputs_of_compiled_layer,
)
from lightning_ac.offload.device import format_bytes
from lightning_ac.offload.weights import LayerWeightStreamer, frozen_layer_parameters
from lightning_ac.report import LayerRow
from lightning_ac.selective.apply import build_policy
from lightning_ac.selective.policy import SelectivePolicy
from lightning_ac.train_mode import check_train_mode
from lightning_ac.verify import StepVerifier

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Plan"]


# Strategies that run implementation: fsdp; with DeepSpeed, the strategies that shard parameters, which layer
# offloading (whole parameters) cannot work on. isinstance, so that a user's subclass counts too.
_FSDP_STRATEGIES = (FSDPStrategy, ModelParallelStrategy)
_SHARDING_STRATEGIES = (*_FSDP_STRATEGIES, DeepSpeedStrategy)
# Precision plugins whose convert_module swaps modules (new parameters) after Callback.setup.
_MODULE_REPLACING_PRECISIONS = ("BitsandbytesPrecision", "TransformerEnginePrecision")
# What DDP (and Lightning's state sync outside fit) leave out of the broadcast of the module's state at setup.
_DDP_IGNORE = "_ddp_params_and_buffers_to_ignore"


class Plan:
    """What the suite callbacks of one Trainer do to one module, and how to undo it.

    Args:
        checkpointing: ``ActivationCheckpointing``'s request, if that callback is present.
        activation_offload: ``ActivationOffload``'s request, if present.
        layer_offload: ``LayerOffload``'s request, if present.

    Raises:
        ConfigError: If the requests do not combine (the block's own rules, :func:`merge_requests`).

    Attributes:
        config: The combined, validated block.
        layers: The decoder layers found (after :meth:`apply`).
        recomputed: For each layer, whether it is recomputed in backward.
        selective: The selective checkpointing policy in force, if any.
        activation_offload: The activation-offload runtime in force, if any.
        weight_streamer: The layer-offloading runtime in force, if any.
        budget: The memory budget's controller, when the block sets ``budget``.
    """

    def __init__(
        self,
        checkpointing: Optional[CheckpointingRequest] = None,
        activation_offload: Optional[ActivationOffloadRequest] = None,
        layer_offload: Optional[LayerOffloadRequest] = None,
    ) -> None:
        self.config = merge_requests(checkpointing, activation_offload, layer_offload)
        self.layer_spec = decoder_layer_spec(checkpointing, layer_offload)
        self.checkpointing_request = checkpointing
        self.activation_offload_request = activation_offload
        self.layer_offload_request = layer_offload
        self.module: Optional[nn.Module] = None
        self.device: Optional[torch.device] = None
        self.layers: Optional[DecoderLayers] = None
        self.recomputed: List[bool] = []
        self.selective: Optional[SelectivePolicy] = None
        self.activation_offload: Optional[ActivationOffloadRuntime] = None
        self.weight_streamer: Optional[LayerWeightStreamer] = None
        self.budget: Optional[BudgetController] = None
        self.chunked_loss: Optional[ChunkedLoss] = None
        self._journal: Optional[ModuleJournal] = None
        self._deferred = False
        self._offload_here = False  # offload targets set, and useful on this device (decided once, in apply)
        self._precision = ""
        self._fitting = True  # trainer.fit (validate, test and predict run no backward)
        self._cache_configs: List[Any] = []  # model configs whose use_cache is off for the run
        self.verifier: Optional[StepVerifier] = None
        self._trainer: Any = None
        self._stage = "fit"
        self._engine = ""  # the recompute engine in force: hf, torch or fsdp
        self._compiled_note = ""  # what compiling changes, for the applied line's compiled part
        self._inputs_around_compiled = 0  # compiled layers whose inputs offload.hidden_states moves around the call

    @property
    def applied(self) -> bool:
        return self._journal is not None

    @property
    def _chunked_loss_here(self) -> bool:
        """The block asks for the chunked loss, and this run trains (no other stage computes a training loss)."""
        return self.config.chunked_loss is not None and self._fitting

    # -- apply ----------------------------------------------------------------------------------------------

    def check_strategy(self, trainer: pl.Trainer) -> None:
        """Strategy rules that the block alone cannot check (subclasses of the strategies count too)."""
        strategy = trainer.strategy
        name = type(strategy).__name__
        if self.config.enabled and self.config.implementation == "fsdp" and not isinstance(strategy, _FSDP_STRATEGIES):
            raise ConfigError(
                f"activation_checkpointing.implementation: fsdp needs an FSDP strategy, but the Trainer uses "
                f"{name}. Use implementation: hf, or train with strategy='fsdp' / ModelParallelStrategy."
            )
        if self.config.enabled and self.config.budget == AUTO and strategy.root_device.type != "cuda":
            raise ConfigError(
                f"activation_checkpointing.budget: auto reads the memory free on a CUDA device, but the Trainer runs "
                f"on {strategy.root_device.type}. Give the budget as a size (budget: 2GiB), or train on a GPU."
            )
        if self.layer_offload_request is not None:
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
            if strategy.root_device.type == "cpu" and not self.layer_offload_request.copy_on_host:
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
        self._fitting = trainer.state.fn == "fit"
        self._trainer = trainer
        self._stage = str(trainer.state.fn.value if trainer.state.fn is not None else "run")
        self._offload_here = self._offload_wanted()
        self._check_releases()
        if not self.config.enabled and self.layer_offload_request is None:  # offloading without recompute only
            if not self._offload_here and not self._chunked_loss_here:
                return
            layers = find_decoder_layers(module)
            if layers.hf_models or not _is_lightning_module(module):
                self._apply_to(layers)
            else:  # the model may be built in configure_model; the output head must be found to stay put
                self._defer_until_configured(module, require_layers=False)
            return
        layers = find_decoder_layers(module, self.layer_spec)
        if len(layers):
            self._apply_to(layers)
        elif _is_lightning_module(module):
            # built later: in configure_model, or in LightningModule.setup (which runs after Callback.setup)
            self._defer_until_configured(module)
        else:
            raise self._no_layers_error(module)

    def _check_releases(self) -> None:
        """On a release newer than the tested ones, the features this plan applies check themselves first (only the
        callbacks' hooks outside fit: validate, test and predict run no backward, so nothing else acts)."""
        if not self._fitting:
            selfcheck.ensure(["callbacks"])
            return
        cfg, request = self.config, self.activation_offload_request
        targets = request.offload.targets if request is not None and self._offload_here else []
        layer_offloading = self.layer_offload_request is not None
        budget, chunked = cfg.budget is not None, cfg.chunked_loss is not None
        selfcheck.ensure(
            selfcheck.features_of(cfg.enabled, cfg.selective is not None, targets, layer_offloading, budget, chunked)
        )

    def _resolve_reentrant(self, trainer: pl.Trainer) -> None:
        """``reentrant: null`` means non-reentrant, except under DeepSpeed ZeRO-3, where non-reentrant recompute
        raises a CheckpointError: there it means reentrant."""
        strategy = trainer.strategy
        config = getattr(strategy, "config", None) or {}
        zero3 = isinstance(strategy, DeepSpeedStrategy) and config.get("zero_optimization", {}).get("stage") == 3
        if not (zero3 and self.config.enabled and self.config.reentrant is None):
            return
        if self.config.selective is not None:
            raise ConfigError(
                "activation_checkpointing.selective needs non-reentrant checkpointing, which raises a CheckpointError "
                "under DeepSpeed ZeRO-3. Remove selective, or use another strategy (FSDP)."
            )
        self.config = dataclasses.replace(self.config, reentrant=True)

    def _no_layers_error(self, module: nn.Module) -> ConfigError:
        where = type(module).__name__
        requests = (
            ("ActivationCheckpointing", self.checkpointing_request),
            ("LayerOffload", self.layer_offload_request),
        )
        if self.layer_spec is not None:
            # the callbacks the user gave layers= to (both only with the same value: decoder_layer_spec)
            givers = [name for name, request in requests if request is not None and request.layers is not None]
            shown = [s.__name__ if isinstance(s, type) else repr(s) for s in self.layer_spec]
            given = " and ".join(f"{name}(layers=[{', '.join(shown)}])" for name in givers)
            names = [n for n, _ in module.named_modules() if n and n.count(".") <= 2][:8]
            return ConfigError(
                f"{given} matched no module in {where}. A class matches its instances; a string that imports as "
                "package.module.Class to an nn.Module subclass names that class; any other string is a glob over "
                f"qualified module names, and the module names here start with: {', '.join(names) or '(no submodules)'}"
                ". Fix layers=..., e.g. layers=['<the layers container>.*'] (print(model) shows the names)."
            )
        name = " and ".join(name for name, request in requests if request is not None)
        models = transformers_models(module)
        if models:
            return ConfigError(
                f"{name} found no decoder layers in {where}: it contains the transformers model(s) "
                f"{', '.join(models)}, whose layers transformers cannot checkpoint (they are not "
                "GradientCheckpointingLayer instances), so they are not found on their own. Name them with "
                "layers=[<layer class>] or layers=['<module name glob>']."
            )
        return ConfigError(
            f"{name} found no decoder layers in {where}: it finds the layers of transformers models (plain or "
            "PEFT-wrapped) on its own, and this module holds none. For other models pass layers=[<layer class>] or "
            "layers=['<module name glob>'], e.g. layers=['model.blocks.*']."
        )

    def _defer_until_configured(self, module: nn.Module, require_layers: bool = True) -> None:
        original = module.configure_model
        plan = self

        def configure_model_then_apply() -> None:
            module.__dict__.pop("configure_model", None)
            plan._deferred = False
            original()
            layers = find_decoder_layers(module, plan.layer_spec) if require_layers else find_decoder_layers(module)
            if require_layers and not len(layers):
                raise plan._no_layers_error(module)
            plan._apply_to(layers)

        module.configure_model = configure_model_then_apply  # type: ignore[method-assign]
        self._deferred = True

    def _offload_wanted(self) -> bool:
        """Whether any offload target is set and can do something on this device."""
        request = self.activation_offload_request
        if request is None:
            return False
        if not request.offload.targets:
            rank_zero_warn(
                "ActivationOffload() has no target, so nothing is offloaded. Pass hidden_states='cpu', selective='cpu' "
                "or all='cpu' (Hydra: activation_checkpointing.offload.<target>: cpu), or remove the callback."
            )
            return False
        if self.device is not None and self.device.type == "cpu" and not request.copy_on_host:
            rank_zero_info(
                "activation offloading does nothing on a CPU-only trainer (the activations already live in host "
                "memory); to force the copies, for tests and debugging, pass ActivationOffload(copy_on_host=True) "
                "(Hydra: offload_copy_on_host=true)"
            )
            return False
        return True

    def _apply_to(self, layers: DecoderLayers) -> None:
        assert self.module is not None and self.device is not None
        cfg = self.config
        self.layers = layers
        self._journal = ModuleJournal(
            self.module, HF_ATTRIBUTES + TORCH_ATTRIBUTES + COMPILED_CALL_ATTRIBUTES + (_DDP_IGNORE, "training_step")
        )
        modules = layers.modules
        try:
            if self._offload_here:
                assert self.activation_offload_request is not None
                self.activation_offload = ActivationOffloadRuntime(self.activation_offload_request, self.device)
                self.activation_offload.install(self.module, output_heads=layers.models_and_heads())
            if self.layer_offload_request is not None:
                self._install_weight_streamer(modules)
            if cfg.enabled:
                self._install_recompute(layers)
                if self._fitting:
                    self._cache_off_for_the_run(layers)
            if self._chunked_loss_here:
                self._install_chunked_loss(layers)
            self._install_verifier()
            self._wrap_training_step()
            self._journal.commit()
        except BaseException:
            self.remove()
            raise
        parts = []
        if not self._fitting:
            if cfg.enabled or self.activation_offload is not None:
                # installed all the same (removed at teardown), but there is no backward to recompute for
                rank_zero_info(f"{self._stage}: no backward, so nothing is recomputed and no activation is offloaded")
        else:
            if cfg.enabled:
                counted = f"{sum(self.recomputed)}/{len(modules)} {layers.noun}"
                parts.append(f"checkpointing {counted} ({self._describe()})")
            if self.chunked_loss is not None:
                parts.append(self.chunked_loss.describe() + ("" if cfg.enabled else ", nothing recomputed"))
            if self.activation_offload is not None:
                described = self.activation_offload.describe() + ("" if cfg.enabled else ", nothing recomputed")
                if self._inputs_around_compiled:
                    described += (
                        f" (compiled {layers.noun}: {self._inputs_around_compiled}, their inputs moved after each "
                        "compiled forward, from what its graph saves)"
                    )
                parts.append(described)
        if parts:
            rank_zero_info("; ".join(parts))
        self._log_weight_streamer()
        if self.verifier is not None:
            self.verifier.announce()

    def _install_chunked_loss(self, layers: DecoderLayers) -> None:
        """The causal-LM loss of each transformers model a chunk of tokens at a time (checked before it installs)."""
        assert self.config.chunked_loss is not None
        if not layers.hf_models:
            raise ConfigError(
                "activation_checkpointing.chunked_loss: the model has no transformers causal-LM model (a "
                "...ForCausalLM with an lm_head and a loss_function), whose loss the chunks compute. Set chunked_loss: "
                "false, or compute your own loss in chunks."
            )
        self.chunked_loss = ChunkedLoss(self.config.chunked_loss.chunk_tokens, layers.hf_models)
        self.chunked_loss.install()

    def _install_verifier(self) -> None:
        """Verify mode, when a request asks for it and something is transferred in this run."""
        requests = [r for r in (self.activation_offload_request, self.layer_offload_request) if r is not None]
        steps = max((r.verify_steps for r in requests), default=0)
        if not steps or not self._fitting:
            return
        targets = [f"offload.{t}" for t in self.activation_offload.targets] if self.activation_offload else []
        targets += ["layer offloading"] if self.weight_streamer is not None else []
        if not targets:
            rank_zero_info("verify mode: nothing is transferred in this run, so there is nothing to verify")
            return
        assert self.module is not None
        StepVerifier.check(self._trainer, self.module)
        atol = max(r.verify_atol for r in requests)
        self.verifier = StepVerifier(steps, atol, targets, self._reset_engines)

    def _reset_engines(self) -> None:
        """After verify mode's reference pass: the engines' step state and figures, as before it."""
        if self.activation_offload is not None:
            self.activation_offload.finish_step()
        if self.weight_streamer is not None:
            self.weight_streamer.start_step()

    def _wrap_training_step(self) -> None:
        """What happens at the training step itself, not at ``on_train_batch_start`` (a LightningModule whose
        ``on_train_batch_start`` returns -1 skips the step and the rest of the epoch, and nothing of ours may stay
        hooked through ``on_train_epoch_end`` and validation; the module's own hooks have run by then; Lightning
        zeroes the gradients after this call, before backward, which is why verify mode compares at
        ``on_before_backward``):

        - the offload runtime's step starts (``offload.all``'s saved-tensor hooks); it ends at
          ``on_train_batch_end``, after backward and the optimizer step;
        - the memory budget counts what the step saves outside the decoder layers, while it measures (its step itself
          starts at ``on_train_batch_start``, as the memory measurements of the benchmark do: MemTracker's module
          hooks must see the wrapped module's whole forward under DDP);
        - in verify mode, the reference pass runs first, on the same arguments.
        """
        module, runtime, verifier, budget = self.module, self.activation_offload, self.verifier, self.budget
        if not _is_lightning_module(module) or (runtime is None and verifier is None and budget is None):
            return
        original = module.training_step
        trainer = self._trainer

        def step(*args: Any, **kwargs: Any) -> Any:
            if runtime is not None and not runtime.in_step:  # a closure an optimizer calls again (LBFGS): same step
                runtime.start_step()
            if budget is not None:
                with budget.meter.outside(module):  # what the step saves outside the layers, while measuring
                    return original(*args, **kwargs)
            return original(*args, **kwargs)

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            if verifier is not None:
                verifier.reference_pass(trainer, module, step, args, kwargs)
            return step(*args, **kwargs)

        module.training_step = training_step  # type: ignore[method-assign]

    def check_train_mode(self) -> None:
        """At a training batch's start, before anything of the step runs: the modules that act only in training mode
        are in it (:mod:`lightning_ac.train_mode`)."""
        if self.layers is None or not self._fitting:
            return
        chunked_models = self.chunked_loss.models if self.chunked_loss is not None else []
        # what the budget chose is in self.recomputed (it may change from step to step)
        check_train_mode(self.layers.modules, self.recomputed, chunked_models, self.layers.noun)

    def _cache_off_for_the_run(self, layers: DecoderLayers) -> None:
        """transformers turns the KV cache off in a checkpointed training forward anyway, with a warning in every
        run whose model config asks for the cache: the configs say use_cache=False for the run instead (put back
        at removal), so the log keeps to what a user should read. Without a cache transformers masks packed
        documents apart: a packed batch is said (:mod:`lightning_ac.checkpoint.packed`)."""
        for model in layers.hf_models:
            for module in model.modules():
                config = getattr(module, "config", None)
                if getattr(config, "use_cache", False) is True and all(config is not c for c in self._cache_configs):
                    config.use_cache = False
                    self._cache_configs.append(config)
                    notice_for(module)  # packed batches are masked otherwise without the cache: said once

    def _install_recompute(self, layers: DecoderLayers) -> None:
        """Checkpoint the decoder layers with the engine the block names, and the policy and checkpoint
        function the other parts of the plan ask for."""
        assert self.module is not None
        cfg = self.config
        modules = layers.modules
        # the recompute engine: transformers' own; else (plain torch layers, or implementation: fsdp) torch's
        # non-reentrant checkpoint around each layer's forward, outside transformers (FSDP2's hooks stay outside)
        if layers.hf_models and cfg.implementation == "hf":
            self._engine = "hf"
        else:
            self._engine = "fsdp" if cfg.implementation == "fsdp" else "torch"
        found = compiled_layers(self.module, layers)
        # layers whose checkpoint call is inside a compiled graph of their own, and where eager code calls it
        calls = {i: compiled_call(self.module, *layers.layers[i], self._engine) for i in found.layers}
        compiled = {i: call for i, call in calls.items() if call is not None}
        outside = [i for i, call in calls.items() if call is None]
        self._check_compiled(found, outside, [i for i in outside if checkpointed_inside_too(modules[i], self._engine)])
        context_fn: Optional[Callable[[], Any]] = None
        if cfg.selective is not None:
            storage = self.activation_offload.sac_storage if self.activation_offload is not None else None
            self.selective = build_policy(cfg.selective, self.module, layers, storage_factory=storage)
            self.selective.install()
            context_fn = self.selective.checkpoint_context_fn()
        checkpoint_fn = self.activation_offload.wrap_checkpoint(checkpoint) if self.activation_offload else checkpoint
        switches = None
        hidden_states = self.activation_offload.hidden_states if self.activation_offload is not None else None
        if hidden_states is not None and compiled:
            # a compiled layer's inputs move around its compiled call (offload/compiled.py): hooks around its
            # checkpoint call would be inside the compiled region
            switches = [checkpoint if i in compiled else checkpoint_fn for i in range(len(modules))]
        if cfg.budget is not None:
            assert self.device is not None
            runtime = self.activation_offload
            moved = runtime.targets if runtime is not None and self.device.type != "cpu" else []
            if cfg.budget_first_plan == "estimate":
                offloads = runtime is not None and bool(runtime.targets)
                check_first_plan(self.module, offloads, self.layer_offload_request is not None)
            self.budget = BudgetController(
                cfg.budget,
                modules,
                checkpoint_fn,
                self.device,
                input_held="hidden_states" not in moved,
                on_change=self._budget_changed,
                noun=layers.noun,
                policy=self.selective,
                rules_held="selective" not in moved,
                layer_types=layers.layer_types,
                # what the loss holds can shrink: the nothing-fits advice may name chunked_loss
                head_chunkable=cfg.chunked_loss is None and bool(layers.output_heads()),
                first_plan=cfg.budget_first_plan,
                head_chunks=lambda: self.chunked_loss.last_chunks if self.chunked_loss is not None else None,
            )
            switches = self.budget.switches
        if self._engine == "hf":
            self.recomputed = enable_hf_checkpointing(
                layers.hf_models, modules, cfg, context_fn, checkpoint_fn, layer_checkpoint_fns=switches
            )
        else:
            self.recomputed = wrap_layers(modules, cfg, context_fn, checkpoint_fn, layer_checkpoint_fns=switches)
        if self.selective is not None:
            self.selective.set_checkpointed(self.recomputed)
        if found.above or compiled:
            self._compiled_note = "recomputed inside the graphs, where the partitioner keeps attention's outputs"
        elif found.layers:  # the checkpoint wraps each compiled call from outside
            self._compiled_note = (
                "each checkpoint wraps a compiled layer, whose compiled forward the recompute runs again"
            )
        if hidden_states is not None:
            for index, call in compiled.items():
                if self.recomputed[index]:
                    offload_inputs_of_compiled_layer(modules[index], call, hidden_states)
                    self._inputs_around_compiled += 1

    def _check_compiled(self, found: CompiledModules, outside: List[int], inside_too: List[int]) -> None:
        """Refuse what would make dynamo run compiled decoder layers eagerly, uncompiled, without a word, or fail
        (the selective policy checks its own parts under compile, and layer offloading its own).

        Args:
            found: What is compiled around the decoder layers (:func:`~lightning_ac.layers.compiled_layers`).
            outside: The compiled layers whose checkpoint wraps their compiled call from outside, in eager.
            inside_too: Those of them whose compiled forward checkpoints inside as well
                (:func:`~lightning_ac.offload.compiled.checkpointed_inside_too`).
        """
        compiled = found.describe()
        if not compiled:
            return
        if self.config.budget is not None:
            raise ConfigError(
                f"activation_checkpointing.budget: {compiled}, and the budget measures each layer's activations and "
                "recompute time with dispatch modes and hooks around its calls, under which dynamo would run the "
                "layers eagerly, uncompiled, without a word. Choose a mode instead (full, kwargs.every_n_layers, "
                "selective save rules), or leave the layers uncompiled."
            )
        if outside and not found.above and self.config.selective is not None:
            raise ConfigError(
                f"activation_checkpointing.selective: {compiled}, and the checkpoint of decoder layers {outside} "
                "wraps their compiled call from outside (the layers selected are the compiled wrappers themselves, or "
                "their compiled forward is what the checkpoint calls), where the selective policy, a dispatch mode "
                "around the call, would make dynamo run the layers eagerly, uncompiled, or fail in backward. Put the "
                "checkpoint inside the graphs: select the layers inside the wrappers (layers=[<layer class>], or the "
                "'..._orig_mod' names), or compile each layer with layer.compile(); or drop selective (full "
                "checkpointing recomputes the compiled forward from outside)."
            )
        hidden_states = self.activation_offload is not None and self.activation_offload.hidden_states is not None
        if inside_too and hidden_states:
            raise ConfigError(
                f"activation_checkpointing.offload.hidden_states: {compiled}, and transformers' checkpoint around a "
                f"forward compiled in the class of decoder layers {inside_too} checkpoints inside that compiled "
                "forward as well, where offload.hidden_states' hooks would make dynamo run the layers eagerly, "
                "uncompiled, without a word. Compile the layer instances instead (layer.compile(), layers[i] = "
                "torch.compile(layers[i])), or select the layers with layers=[...] (torch's checkpoint then wraps the "
                "compiled forward from outside, where the hooks work)."
            )
        if found.above and hidden_states:
            raise ConfigError(
                f"activation_checkpointing.offload.hidden_states: {compiled}, and offload.hidden_states moves each "
                "layer's input with saved-tensor hooks around its call, which would be inside the compiled region: "
                "dynamo cannot trace them and would run the layers eagerly, uncompiled, without a word. Compile the "
                "decoder layers one by one instead (layers[i] = torch.compile(layers[i]), torchtitan's way; their "
                "inputs then move after each compiled forward), use offload.all (its hooks take what the compiled "
                "graph saves, after its forward), or leave the model uncompiled."
            )

    def _budget_changed(self, choices: List[Choice]) -> None:
        """The budget chose again: the report and the selective policy follow."""
        self.recomputed = [c is not Choice.keep for c in choices]
        if self.selective is not None:
            self.selective.set_checkpointed([c is Choice.selective for c in choices])

    def _install_weight_streamer(self, modules: List[nn.Module]) -> None:
        assert self.device is not None and self.layer_offload_request is not None
        compiled = compiled_layers(self.module, self.layers).describe()
        if compiled:
            raise ConfigError(
                f"layer_offloading: {compiled}, but layer offloading swaps each parameter's data between host and "
                "device memory around every call, which compiled graphs are not built for (they guard on devices and "
                "addresses, and a graph compiled earlier skips the streaming hooks). Set layer_offloading: false, or "
                "leave the model and its decoder layers uncompiled."
            )
        params = frozen_layer_parameters(modules)
        resident = self._resident_layers()
        params = [[] if keep else p for p, keep in zip(params, resident)]
        if not any(params) and any(resident):
            raise ConfigError(
                f"LayerOffload(resident_layers={self.layer_offload_request.resident_layers}) keeps every one of the "
                f"{len(modules)} decoder layers on the device, so nothing is offloaded. Use fewer resident layers, "
                "or set layer_offloading: false."
            )
        if not any(params):
            raise ConfigError(
                f"layer_offloading: true streams the frozen parameters of the decoder layers, but all "
                f"{len(modules)} layers train every parameter, so there is nothing to offload. Use it with "
                "frozen base weights (LoRA/QLoRA adapters), or set layer_offloading: false."
            )
        self.weight_streamer = LayerWeightStreamer(
            modules,
            params,
            self.device,
            copy_on_host=self.layer_offload_request.copy_on_host,
            host_reserve_bytes=self.layer_offload_request.host_reserve_bytes,
            groups=self.layers.owners if self.layers is not None else None,
            resident=resident,
        )
        self.weight_streamer.install()
        self._share_streamed_weights()

    def _share_streamed_weights(self) -> None:
        """Under DDP: every process trains on process 0's weights. DDP broadcasts the module's state at setup,
        after moving the module to the device; the streamed parameters are kept out of that broadcast (they are in
        host memory, and must never be on the device whole) and broadcast here, one parameter at a time."""
        streamer = self.weight_streamer
        assert streamer is not None and self.module is not None
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        streamed = {id(p) for p in streamer.streamed}
        names = [n for n, p in self.module.named_parameters(remove_duplicate=False) if id(p) in streamed]
        ignored = list(getattr(self.module, _DDP_IGNORE, []))
        setattr(self.module, _DDP_IGNORE, ignored + [n for n in names if n not in ignored])
        streamer.broadcast(src=0)

    def _resident_layers(self) -> List[bool]:
        """For each decoder layer, whether it is among the last ``resident_layers`` of its model."""
        assert self.layers is not None and self.layer_offload_request is not None
        k = self.layer_offload_request.resident_layers
        owners = self.layers.owners
        return [k > 0 and owners[i + 1 :].count(owners[i]) < k for i in range(len(owners))]

    def _log_weight_streamer(self) -> None:
        streamer = self.weight_streamer
        if streamer is None:
            return
        rank_zero_info(streamer.describe(self.layers.noun if self.layers is not None else "decoder layers"))
        streamed, kept = streamer.streamed_bytes, streamer.kept_frozen_bytes()
        if kept > streamed:
            rank_zero_warn(
                f"layer offloading streams {streamed / 2**20:.1f} MiB, but {kept / 2**20:.1f} MiB of frozen "
                "decoder-layer parameters stay on the device: they are parameter subclasses it cannot move (quantized "
                "formats other than bitsandbytes' 4-bit Params4bit, DTensor shards) or shared between layers."
            )
        fp32 = any(p.dtype == torch.float32 for p in streamer.streamed)
        recomputed_everywhere = bool(self.recomputed) and all(self.recomputed)
        if "mixed" in self._precision and fp32 and not recomputed_everywhere:
            rank_zero_warn(
                f"layer offloading under {self._precision} precision: autocast makes a half-precision copy of each "
                "float32 frozen weight, and autograd keeps that copy on the device until backward in layers that are "
                "not recomputed, which gives back part of the saving. Enable activation checkpointing on every "
                "layer, or keep the frozen base in bfloat16/float16."
            )

    def _describe(self) -> str:
        """The recompute engine and options in force, as the log line shows them."""
        cfg = self.config
        parts = [self._engine, "reentrant" if cfg.use_reentrant else "non-reentrant"]
        if cfg.every_n_layers > 1:
            parts.append(f"every {cfg.every_n_layers} layers")
        if self.budget is not None:
            what = "auto" if cfg.budget == AUTO else format_bytes(cfg.budget)
            how = "a first plan from a step on fake tensors" if cfg.budget_first_plan == "estimate" else None
            parts.append(f"budget {what}: {how or 'measuring in the first step'}, then choosing per layer")
        if cfg.selective is not None:
            saves = [*cfg.selective.save, *(f"module {m}" for m in cfg.selective.save_modules)]
            if cfg.selective.save_matmul_min_k:
                saves.append(f"matmuls with K >= {cfg.selective.save_matmul_min_k}")
            parts.append(f"selective: save {', '.join(saves) or 'registered ops only'}")
        compiled = [self._compiled_note] if self._compiled_note else []
        if self.selective is not None and self.selective.compiled:
            compiled.append("the save rules apply when the graphs are traced (no warning about saves never replayed)")
        if compiled:
            parts.append("compiled: " + "; ".join(compiled))
        return ", ".join(parts)

    # -- report ---------------------------------------------------------------------------------------------

    def layer_rows(self) -> List[LayerRow]:
        """One row per decoder layer of an applied plan, each part described by the engine that does it."""
        if self.layers is None:
            return []
        rows = []
        for index, (name, _) in enumerate(self.layers.layers):
            recomputed = bool(self.recomputed[index]) if index < len(self.recomputed) else False
            layer_type = self.layers.layer_types[index] if index < len(self.layers.layer_types) else None
            # under a budget, the save rules apply to the layers it makes selective, not to every recomputed one
            ruled = recomputed if self.budget is None else self.budget.choices[index] is Choice.selective
            saves = self.selective.describe_layer(index, ruled) if self.selective is not None else None
            if self.budget is not None:
                saves = "; ".join(filter(None, [self.budget.describe_layer(index), saves]))
            offloaded = []
            if self.weight_streamer is not None:
                offloaded += filter(None, [self.weight_streamer.describe_layer(index)])
            if self.activation_offload is not None:
                offloaded += self.activation_offload.describe_layer(recomputed, self.selective is not None and ruled)
            rows.append(LayerRow(index, name, layer_type or "—", recomputed, saves or "—", ", ".join(offloaded) or "—"))
        return rows

    # -- remove ---------------------------------------------------------------------------------------------

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
        for config in self._cache_configs:
            config.use_cache = True
        self._cache_configs = []
        self.verifier, self._trainer = None, None
        offload, selective, journal = self.activation_offload, self.selective, self._journal
        streamer, budget, chunked_loss = self.weight_streamer, self.budget, self.chunked_loss
        self.activation_offload = self.selective = self._journal = self.weight_streamer = self.budget = None
        self.chunked_loss = None
        self.recomputed = []
        self._compiled_note, self._inputs_around_compiled = "", 0
        # Each step runs even if an earlier one raised; streamed parameters get memory of their own first.
        home = torch.device("cpu") if after_exception else self._home_device(streamer)
        steps = [
            budget.abort_step if budget is not None else None,
            chunked_loss.remove if chunked_loss is not None else None,
            functools.partial(streamer.close, home) if streamer is not None else None,
            offload.close if offload is not None else None,
            selective.remove if selective is not None else None,
            journal.restore if journal is not None else None,
        ]
        _run_all([step for step in steps if step is not None])

    def _home_device(self, streamer: Optional[LayerWeightStreamer]) -> Optional[torch.device]:
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
    return isinstance(module, LightningModule)
