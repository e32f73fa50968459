"""The plan: what the suite callbacks of one Trainer do to one module, applied once (or deferred until the layers
exist), and removed once, whatever happened in between."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, List, Optional

import torch
from lightning.pytorch import LightningModule
from torch import nn

import lightning_ac.release_gate as release_gate
from lightning_ac._logging import rank_zero_info
from lightning_ac.budget import BudgetController, Choice
from lightning_ac.checkpoint.forward import TORCH_ATTRIBUTES
from lightning_ac.checkpoint.hf import HF_ATTRIBUTES
from lightning_ac.config import (
    ActivationOffloadRequest,
    CheckpointingRequest,
    ConfigError,
    LayerOffloadRequest,
    decoder_layer_spec,
    merge_requests,
)
from lightning_ac.journal import ModuleJournal
from lightning_ac.layers import DecoderLayers, find_decoder_layers
from lightning_ac.loss import ChunkedLoss
from lightning_ac.loss.install import LOSS_ATTRIBUTES, install_chunked_loss
from lightning_ac.offload.activations import ActivationOffloadRuntime
from lightning_ac.offload.compiled import COMPILED_CALL_ATTRIBUTES
from lightning_ac.offload.weights import LayerWeightStreamer
from lightning_ac.offload.weights.conversions import CONVERSION_ATTRIBUTES
from lightning_ac.plan.layer_table import describe_untrained, layer_rows, untrained_layers
from lightning_ac.plan.layers_found import no_layers_error
from lightning_ac.plan.recompute import Recompute, cache_off_for_the_run, describe_recompute, install_recompute
from lightning_ac.plan.strategy import check_strategy, offload_wanted, resolve_reentrant
from lightning_ac.plan.training_step import transferred, verifier_for, wrap_training_step
from lightning_ac.plan.weights import DDP_IGNORE, log_weight_streamer, share_streamed_weights, weight_streamer_for
from lightning_ac.report import LayerRow
from lightning_ac.selective.policy import SelectivePolicy
from lightning_ac.tiled_mlp.install import TiledMLP, install_tiled_mlp
from lightning_ac.train_mode import TrainModeGuard
from lightning_ac.verify import StepVerifier

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Plan"]


# the module attributes a plan may set, recorded before it applies: put back at removal, left out of a copy
JOURNALED_ATTRIBUTES = (
    HF_ATTRIBUTES
    + TORCH_ATTRIBUTES
    + COMPILED_CALL_ATTRIBUTES
    + LOSS_ATTRIBUTES
    + CONVERSION_ATTRIBUTES
    + (DDP_IGNORE, "training_step")
)


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
        self.recompute: Optional[Recompute] = None
        self.activation_offload: Optional[ActivationOffloadRuntime] = None
        self.weight_streamer: Optional[LayerWeightStreamer] = None
        self.chunked_loss: Optional[ChunkedLoss] = None
        self.tiled_mlp: Optional[TiledMLP] = None
        self.train_mode: Optional[TrainModeGuard] = None
        self._journal: Optional[ModuleJournal] = None
        self._deferred = False
        self._offload_here = False  # offload targets set, and useful on this device (decided once, in apply)
        self._precision = ""
        self._fitting = True  # trainer.fit (validate, test and predict run no backward)
        self.verifier: Optional[StepVerifier] = None
        self._trainer: Any = None
        self._stage = "fit"

    @property
    def applied(self) -> bool:
        return self._journal is not None

    @property
    def recomputed(self) -> List[bool]:
        return self.recompute.recomputed if self.recompute is not None else []

    @property
    def selective(self) -> Optional[SelectivePolicy]:
        return self.recompute.selective if self.recompute is not None else None

    @property
    def budget(self) -> Optional[BudgetController]:
        return self.recompute.budget if self.recompute is not None else None

    @property
    def _loss_or_mlp_here(self) -> bool:
        """The block asks for the chunked loss or the tiled MLP, and this run trains (no other stage computes a
        training loss, or has a backward to tile)."""
        return (self.config.chunked_loss is not None or self.config.tiled_mlp is not None) and self._fitting

    # -- apply ----------------------------------------------------------------------------------------------

    def check_strategy(self, trainer: pl.Trainer) -> None:
        """Strategy rules that the block alone cannot check (:func:`~lightning_ac.plan.strategy.check_strategy`)."""
        check_strategy(self.config, self.layer_offload_request, trainer)

    def apply(self, trainer: pl.Trainer, module: nn.Module) -> None:
        """Apply the plan to ``module``; defers to just after ``configure_model`` if the layers do not exist yet."""
        if self.applied or self._deferred:
            return
        self.check_strategy(trainer)
        self.config = resolve_reentrant(self.config, trainer)
        self.module = module
        self.device = trainer.strategy.root_device
        self._precision = str(trainer.precision)
        self._fitting = trainer.state.fn == "fit"
        self._trainer = trainer
        self._stage = str(trainer.state.fn.value if trainer.state.fn is not None else "run")
        self._offload_here = offload_wanted(self.activation_offload_request, self.device)
        self._check_releases()
        if not self.config.enabled and self.layer_offload_request is None:  # offloading without recompute only
            if not self._offload_here and not self._loss_or_mlp_here:
                return
            # the tiled MLP needs the layers whose MLPs it tiles (named with layers= in a plain torch model)
            tiled = self.config.tiled_mlp is not None and self._fitting
            layers = find_decoder_layers(module, self.layer_spec)
            if layers.hf_models or len(layers) or not isinstance(module, LightningModule):
                if tiled and not len(layers):
                    raise self._no_layers_error(module)
                self._apply_to(layers)
            else:  # the model may be built in configure_model; the output head must be found to stay put
                self._defer_until_configured(module, require_layers=tiled)
            return
        layers = find_decoder_layers(module, self.layer_spec)
        if len(layers):
            self._apply_to(layers)
        elif isinstance(module, LightningModule):
            # built later: in configure_model, or in LightningModule.setup (which runs after Callback.setup)
            self._defer_until_configured(module)
        else:
            raise self._no_layers_error(module)

    def _check_releases(self) -> None:
        """On a release newer than the tested ones, the features this plan applies check themselves first (only the
        callbacks' hooks outside fit: validate, test and predict run no backward, so nothing else acts)."""
        if not self._fitting:
            release_gate.ensure(["callbacks"])
            return
        cfg, request = self.config, self.activation_offload_request
        targets = request.offload.targets if request is not None and self._offload_here else []
        layer_offloading = self.layer_offload_request is not None
        budget, chunked = cfg.budget is not None, cfg.chunked_loss is not None
        release_gate.ensure(
            release_gate.features_of(cfg.enabled, cfg.selective is not None, targets, layer_offloading, budget, chunked)
        )

    def _no_layers_error(self, module: nn.Module) -> ConfigError:
        return no_layers_error(module, self.layer_spec, self.checkpointing_request, self.layer_offload_request)

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

    def _apply_to(self, layers: DecoderLayers) -> None:
        assert self.module is not None and self.device is not None
        cfg = self.config
        self.layers = layers
        self._journal = ModuleJournal(self.module, JOURNALED_ATTRIBUTES)
        try:
            if self._offload_here:
                assert self.activation_offload_request is not None
                self.activation_offload = ActivationOffloadRuntime(self.activation_offload_request, self.device)
                self.activation_offload.install(self.module, layers.models_and_heads(), cfg.enabled)
            if self.layer_offload_request is not None:
                self.weight_streamer = weight_streamer_for(self.module, layers, self.device, self.layer_offload_request)
                self.weight_streamer.install()
                share_streamed_weights(self.module, self.weight_streamer)
            if cfg.enabled:
                self.recompute = Recompute()
                install_recompute(
                    self.recompute,
                    cfg,
                    self.module,
                    layers,
                    self.device,
                    self.activation_offload,
                    layer_offloading=self.layer_offload_request is not None,
                    on_budget_change=self._budget_changed,
                    tools=lambda: [t for t in (self.chunked_loss, self.tiled_mlp) if t is not None],
                )
                if self._fitting:
                    cache_off_for_the_run(layers)
            if self._fitting:
                self.chunked_loss = install_chunked_loss(cfg.chunked_loss, layers)
                self.tiled_mlp = install_tiled_mlp(cfg.tiled_mlp, layers)
                # what acts only in training mode, checked where the step reaches it (the budget's choice may change)
                self.train_mode = TrainModeGuard.install_on(
                    self.module, layers, lambda: self.recomputed, self.chunked_loss, LightningModule
                )
            self._install_verifier()
            self._wrap_training_step()
            self._journal.commit()
        except BaseException:
            self.remove()
            raise
        self._say_what_applied(layers)
        if self.weight_streamer is not None:
            log_weight_streamer(self.weight_streamer, layers.noun, self._precision, self.recomputed)
        if self.verifier is not None:
            self.verifier.announce()

    def _say_what_applied(self, layers: DecoderLayers) -> None:
        """The applied line (rank zero): what is recomputed, chunked and offloaded in this run."""
        cfg, parts = self.config, []
        if not self._fitting:
            if cfg.enabled or self.activation_offload is not None:
                # installed all the same (removed at teardown), but there is no backward to recompute for
                rank_zero_info(f"{self._stage}: no backward, so nothing is recomputed and no activation is offloaded")
            return
        if self.recompute is not None:  # what a step recomputes: not the layers of models with nothing to train
            untrained = untrained_layers(self.module, layers, self.recomputed)
            counted = f"{sum(self.recomputed) - sum(untrained.values())}/{len(layers.modules)} {layers.noun}"
            how = describe_recompute(cfg, self.recompute) + describe_untrained(untrained, layers.noun)
            parts.append(f"checkpointing {counted} ({how})")
        for extra in (self.chunked_loss, self.tiled_mlp):
            if extra is not None:
                parts.append(extra.describe() + ("" if cfg.enabled else ", nothing recomputed"))
        if self.activation_offload is not None:
            described = self.activation_offload.describe() + ("" if cfg.enabled else ", nothing recomputed")
            around = self.recompute.inputs_around_compiled if self.recompute is not None else 0
            if around:
                described += (
                    f" (compiled {layers.noun}: {around}, their inputs moved after each compiled forward, from what "
                    "its graph saves)"
                )
            parts.append(described)
        if parts:
            rank_zero_info("; ".join(parts))

    def _install_verifier(self) -> None:
        """Verify mode, when a request asks for it and something is transferred in this run."""
        requests = [r for r in (self.activation_offload_request, self.layer_offload_request) if r is not None]
        if self._fitting and self.module is not None:
            transfers = transferred(self.activation_offload, self.weight_streamer)
            self.verifier = verifier_for(requests, transfers, self._trainer, self.module, self._reset_engines)

    def _reset_engines(self) -> None:
        """After verify mode's reference pass: the engines' step state and figures, as before it."""
        if self.activation_offload is not None:
            self.activation_offload.finish_step()
        if self.weight_streamer is not None:
            self.weight_streamer.start_step()

    def _wrap_training_step(self) -> None:
        if isinstance(self.module, LightningModule):
            wrap_training_step(
                self.module, self._trainer, self.activation_offload, self.verifier, self.budget, self.train_mode
            )

    def _budget_changed(self, choices: List[Choice]) -> None:
        """The budget chose again: the report and the selective policy follow."""
        assert self.recompute is not None
        self.recompute.recomputed = [c is not Choice.keep for c in choices]
        if self.selective is not None:
            self.selective.set_checkpointed([c is Choice.selective for c in choices])

    # -- report ---------------------------------------------------------------------------------------------

    def layer_rows(self) -> List[LayerRow]:
        """One row per decoder layer of an applied plan, each part described by the engine that does it."""
        if self.layers is None:
            return []
        return layer_rows(
            self.layers,
            self.recomputed,
            self.selective,
            self.budget,
            self.weight_streamer,
            self.activation_offload,
            self.tiled_mlp,
        )

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
        self.verifier, self._trainer = None, None
        offload, selective, journal = self.activation_offload, self.selective, self._journal
        streamer, budget, chunked_loss, tiled = self.weight_streamer, self.budget, self.chunked_loss, self.tiled_mlp
        restore_dynamo_config = self.recompute.restore_dynamo_config if self.recompute is not None else None
        self.activation_offload = self._journal = self.weight_streamer = self.recompute = None
        self.chunked_loss = self.tiled_mlp = None
        train_mode, self.train_mode = self.train_mode, None
        # Each step runs even if an earlier one raised; streamed parameters get memory of their own first.
        home = torch.device("cpu") if after_exception else _home_device(self.module, streamer, self.device)
        steps = [
            budget.abort_step if budget is not None else None,
            chunked_loss.remove if chunked_loss is not None else None,
            tiled.remove if tiled is not None else None,
            train_mode.remove if train_mode is not None else None,
            functools.partial(streamer.close, home) if streamer is not None else None,
            offload.close if offload is not None else None,
            selective.remove if selective is not None else None,
            journal.restore if journal is not None else None,
            restore_dynamo_config,
        ]
        _run_all([step for step in steps if step is not None])


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


def _home_device(
    module: Optional[nn.Module], streamer: Optional[LayerWeightStreamer], device: Optional[torch.device]
) -> Optional[torch.device]:
    """Where the module's other parameters are now: after a successful run Lightning has already moved the module
    to the CPU (``strategy.teardown`` runs before ``Callback.teardown``)."""
    if streamer is None or module is None:
        return None
    streamed = {id(p) for p in streamer.streamed}
    return next((p.device for p in module.parameters() if id(p) not in streamed), device)
