"""The Lightning faces of the suite: thin callbacks that turn their arguments into typed requests
(:mod:`lightning_ac.config`) and share one :class:`~lightning_ac.plan.Plan` per Trainer run.

Whichever suite callback reaches ``setup`` first gathers the requests of every suite callback in
``trainer.callbacks``, builds the plan (which checks their combination) and applies it; the others find it
applied. Removal happens once, in ``teardown`` or ``on_exception``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Type, TypeVar, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

import lightning_ac.selfcheck as selfcheck
from lightning_ac._logging import rank_zero_info, rank_zero_warn
from lightning_ac.budget.first_plan import plan_from_fake_step
from lightning_ac.config import (
    OFFLOAD_TARGETS,
    ActivationOffloadRequest,
    CheckpointingRequest,
    ConfigError,
    LayerOffloadRequest,
    OffloadConfig,
    config_to_dict,
    parse_bool,
    parse_config,
    parse_count,
)
from lightning_ac.layers import LayerSpec
from lightning_ac.offload.device import available_host_bytes
from lightning_ac.plan import Plan
from lightning_ac.report import render_layer_table

__all__ = ["ActivationCheckpointing", "ActivationOffload", "LayerOffload", "SuiteCallback", "callbacks_from_config"]

_C = TypeVar("_C", bound="SuiteCallback")


class SuiteCallback(Callback):
    """Base of the suite callbacks: shares one plan per Trainer run, applies it in ``setup``, removes it in
    ``teardown`` and ``on_exception``."""

    _plan: Optional[Plan] = None
    _peers: List[SuiteCallback] = []
    verbose: bool = False
    prog_bar: bool = False
    _step: _OptimizerStep

    def _init_output(self, verbose: Any, prog_bar: Any) -> None:
        name = type(self).__name__
        self.verbose = bool(parse_bool(verbose, f"{name}(verbose=...)"))
        self.prog_bar = bool(parse_bool(prog_bar, f"{name}(prog_bar=...)"))

    @property
    def plan(self) -> Optional[Plan]:
        """The plan in force during a run, ``None`` outside one."""
        return self._plan

    def __getstate__(self) -> Dict[str, Any]:
        """What a copy (``copy.deepcopy``, ``pickle``) holds: the arguments and the latest figures, not the plan of a
        run in progress. The plan's hooks, engines and host buffers belong to the model it was applied to (its
        storage references must never be duplicated); a copy is applied to nothing until a Trainer sets it up."""
        state = self.__dict__.copy()
        # the run's: our plan and peers, and the LightningModule's log methods Lightning binds onto callbacks
        for name in ("_plan", "_peers", "log", "log_dict"):
            state.pop(name, None)
        return state

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._step = _OptimizerStep()  # a new run: no optimizer step under way
        self._shown_choices: Optional[tuple] = None  # the budget's choices the last table showed
        if self._plan is not None and self._plan.module is pl_module:
            return  # another suite callback applied the shared plan already
        peers = [cb for cb in trainer.callbacks if isinstance(cb, SuiteCallback)]
        plan = Plan(
            checkpointing=_request_of(peers, ActivationCheckpointing),
            activation_offload=_request_of(peers, ActivationOffload),
            layer_offload=_request_of(peers, LayerOffload),
        )
        for cb in peers:
            cb._plan, cb._peers = plan, peers
        plan.apply(trainer, pl_module)

    def _release(self, after_exception: bool = False) -> None:
        plan, peers = self._plan, self._peers
        if plan is None:
            return
        for cb in peers:
            cb._keep_after_run(plan)
        try:
            plan.remove(after_exception)
        finally:
            for cb in peers:
                cb._plan, cb._peers = None, []

    def _keep_after_run(self, plan: Plan) -> None:
        """What a callback keeps of the run's plan before it is removed (its figures, for after the run)."""

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._plan is not None and self._plan.chunked_loss is not None:
            self._plan.chunked_loss.explain(exception, trainer.training)
        self._release(after_exception=True)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._plan is None or not self._is_first() or not any(cb.verbose for cb in self._peers):
            return  # one table per run, from the first suite callback
        rows = self._plan.layer_rows()
        if rows:
            rank_zero_info("decoder layers\n" + render_layer_table(rows))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._is_first() and self._plan is not None:
            self._plan.check_train_mode()
        if self._is_first() and pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        budget = self._plan.budget if self._is_first() and self._plan is not None else None
        if budget is not None and budget.wants_fake_step:
            plan_from_fake_step(budget, pl_module, batch, batch_idx)
        if budget is not None:
            budget.begin_step(pl_module, trainer.optimizers)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._is_first() and self._plan is not None and self._plan.verifier is not None:
            self._plan.verifier.check_loss(trainer, pl_module, loss)
        if self._is_first() and self._plan is not None and self._plan.budget is not None:
            self._plan.budget.before_backward()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._is_first() and self._plan is not None and self._plan.verifier is not None:
            self._plan.verifier.check_gradients(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._is_first() and self._plan is not None and self._plan.verifier is not None:
            self._plan.verifier.step_done(trainer)
        budget = self._plan.budget if self._is_first() and self._plan is not None else None
        if budget is not None and budget.in_step:
            budget.end_step()
            for name, value in budget.metrics().items():
                pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
            self._show_settled_table(budget)
        if self._is_first() and pl_module.device.type == "cuda":
            peak = float(torch.cuda.max_memory_allocated(pl_module.device))
            pl_module.log(
                "lightning_ac/peak_memory_bytes", peak, on_step=True, on_epoch=False, batch_size=1,
                prog_bar=any(cb.prog_bar for cb in self._peers),
            )  # fmt: skip

    def _show_settled_table(self, budget: Any) -> None:
        """With ``verbose``: the per-layer table again when the budget's plan settles, and whenever a settled plan
        changes (the table at fit start shows the measuring step's choices)."""
        if not budget.settled or not any(cb.verbose for cb in self._peers) or self._plan is None:
            return
        choices = tuple(budget.choices)
        if choices == self._shown_choices:
            return
        self._shown_choices = choices
        rank_zero_info("decoder layers, as the budget settled\n" + render_layer_table(self._plan.layer_rows()))

    def _is_first(self) -> bool:
        return self._plan is not None and bool(self._peers) and self._peers[0] is self


def _request_of(peers: Sequence[SuiteCallback], kind: Type[_C]) -> Any:
    """The request of the one callback of ``kind`` among ``peers``, ``None`` if there is none."""
    found = [cb for cb in peers if isinstance(cb, kind)]
    if len(found) > 1:
        raise ConfigError(
            f"Trainer(callbacks=...) holds more than one {kind.__name__}. Each suite callback may appear once: "
            "merge their arguments into one instance."
        )
    return found[0].request if found else None


class ActivationCheckpointing(SuiteCallback):
    """Recompute decoder layers in backward instead of keeping their activations.

    Args:
        implementation: ``"hf"`` (transformers' checkpointing; plain torch layers get the equivalent torch
            wrapper) or ``"fsdp"`` (torch's non-reentrant checkpoint around each layer's ``forward``, outside
            transformers; needs an FSDP strategy).
        reentrant: ``use_reentrant``. ``None`` (default) picks non-reentrant checkpointing.
        kwargs: Extra ``torch.utils.checkpoint.checkpoint`` arguments (``preserve_rng_state``,
            ``determinism_check``, ``debug``, ``early_stop``) plus ``every_n_layers``.
        selective: Selective activation checkpointing: ``True`` (save attention) or a mapping with ``save``,
            ``save_modules``, ``save_matmul_min_k``, ``save_sliding_window``, ``recompute_layer_types``.
        layers: For models that are not transformers models: the decoder layers, as layer classes or globs
            over qualified module names (``"model.blocks.*"``). ``None`` finds transformers layers. A string that
            imports as ``package.module.Class`` to an ``nn.Module`` subclass names that class (a YAML or LightningCLI
            config names classes so); any other string is a glob.
        budget: The memory budget: the activation memory one training step may use, as bytes or text with a unit
            (``"24GiB"``, ``"512MiB"``, ``"20GB"``), or ``"auto"`` (CUDA: the memory free at the first step, less a
            margin). The first step recomputes every layer and measures each; from then on the layers that fit keep
            their activations, the rest are recomputed, at the least recompute time (see :mod:`lightning_ac.budget`).
            Not with ``kwargs.every_n_layers``, which chooses the layers itself.
        budget_first_plan: With ``budget``: ``"measure"`` (default: the first step recomputes every layer and
            measures each) or ``"estimate"`` (before the first step, this run's training step runs once on fake
            tensors at the first batch's shape, allocating nothing, and the first real step runs its plan and
            checks it). See :mod:`lightning_ac.budget.first_plan`.
        chunked_loss: Compute a transformers causal-LM model's training loss a chunk of tokens at a time, so that
            the output head's logits never exist whole (for a real vocabulary they hold most of a step's activation
            memory): ``True`` (``chunk_tokens: auto``: chunks whose logits hold as many elements as the final hidden
            states, at least 128 tokens) or ``{"chunk_tokens": N}``. In those forwards the output's
            ``logits`` is ``None``. See :mod:`lightning_ac.loss`.
        enabled: ``False`` recomputes no decoder layer (then ``chunked_loss`` is what the callback does).
        verbose: At fit start, print a table per decoder layer: recomputed or not, what SAC saves, what is
            offloaded where (rich when installed, plain text otherwise).
        prog_bar: Show ``lightning_ac/peak_memory_bytes`` (logged each step on CUDA) in the progress bar.

    Raises:
        ConfigError: If an argument is invalid; the message names the argument and the fix.

    Example::

        trainer = Trainer(callbacks=[ActivationCheckpointing(kwargs={"every_n_layers": 2})])
        trainer = Trainer(callbacks=[ActivationCheckpointing(budget="20GiB")])
    """

    def __init__(
        self,
        *,
        implementation: str = "hf",
        reentrant: Optional[bool] = None,
        kwargs: Optional[Mapping[str, Any]] = None,
        selective: Union[bool, Mapping[str, Any], None] = None,
        layers: Optional[Sequence[LayerSpec]] = None,
        budget: Union[int, str, None] = None,
        chunked_loss: Union[bool, Mapping[str, Any], None] = None,
        enabled: bool = True,
        budget_first_plan: str = "measure",
        verbose: bool = False,
        prog_bar: bool = False,
    ) -> None:
        self.request = CheckpointingRequest.from_arguments(
            implementation=implementation,
            reentrant=reentrant,
            kwargs=kwargs,
            selective=selective,
            layers=layers,
            budget=budget,
            chunked_loss=chunked_loss,
            enabled=enabled,
            budget_first_plan=budget_first_plan,
        )
        self._init_output(verbose, prog_bar)
        self._budget_state: Optional[Dict[str, Any]] = None  # a checkpoint's settled plan, until this run takes it
        self._budget_summary: Optional[Dict[str, Any]] = None

    @classmethod
    def _from_request(cls, request: CheckpointingRequest, verbose: bool = False) -> ActivationCheckpointing:
        """A callback for a request built from an already validated block (not validated again)."""
        callback = cls.__new__(cls)
        callback.request = request
        callback._init_output(verbose, False)
        callback._budget_state = callback._budget_summary = None
        return callback

    @property
    def config(self) -> Any:
        """The recompute part of the block this callback asks for."""
        return self.request.config

    @property
    def layers(self) -> Optional[List[LayerSpec]]:
        return self.request.layers

    @property
    def state_key(self) -> str:
        return "ActivationCheckpointing"

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"activation_checkpointing": config_to_dict(self.config)}
        budget = self._plan.budget if self._plan is not None else None
        if budget is not None and budget.settled:
            state["budget_plan"] = budget.state_dict()
        return state

    @property
    def budget_plan(self) -> Optional[Dict[str, Any]]:
        """With ``budget`` set: the plan of the latest run (per layer choices, estimated and measured peaks, its line),
        kept after the run ends; ``None`` before any run or without a budget."""
        budget = self._plan.budget if self._plan is not None else None
        return budget.summary() if budget is not None else self._budget_summary

    def _keep_after_run(self, plan: Plan) -> None:
        if plan.budget is not None and plan.budget.steps:  # a run that trained (validate and test keep the fit's)
            self._budget_summary = plan.budget.summary()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._hand_over_budget_state()

    def _hand_over_budget_state(self) -> None:
        """A checkpoint's settled plan goes to this run's budget (Lightning restores callback state after setup,
        and a plan deferred to configure_model exists only after that)."""
        budget = self._plan.budget if self._plan is not None else None
        if budget is not None and self._budget_state is not None:
            state, self._budget_state = self._budget_state, None
            budget.load_state_dict(state)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._hand_over_budget_state()
        super().on_fit_start(trainer, pl_module)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._budget_state = state_dict.get("budget_plan")
        self._hand_over_budget_state()
        saved = state_dict.get("activation_checkpointing")
        if saved is not None:
            saved = {"budget": None, **saved}  # written before the block had a budget
        if saved is not None and saved != config_to_dict(self.config):
            rank_zero_warn(
                f"resuming with activation_checkpointing {config_to_dict(self.config)}; the checkpoint was written "
                f"with {saved}. Memory use and step time may differ; gradients do not."
            )


class ActivationOffload(SuiteCallback):
    """Move saved activations to host memory until backward needs them.

    Targets (each ``"none"`` or ``"cpu"``; ``True``/``False``, or the text ``"true"``/``"false"`` in any case, mean
    cpu/none):

    - ``hidden_states``: each checkpointed decoder layer's input. Needs :class:`ActivationCheckpointing`.
    - ``selective``: what the selective checkpointing policy saves. Needs ``ActivationCheckpointing(selective=...)``.
    - ``all``: every activation saved in the training forward (with recompute: what is saved outside the
      layers plus each layer's input). Cannot be combined with ``hidden_states``.

    On an accelerator, copies run on side streams with pinned host buffers and are prefetched in backward.
    On a CPU-only trainer there is nothing to gain: the callback logs once and does nothing, unless
    ``copy_on_host=True`` forces the full pack/unpack path (copies into separate host buffers).

    Args:
        hidden_states: Placement of each checkpointed layer's input.
        selective: Placement of what the selective policy saves.
        all: Placement of every saved activation.
        copy_on_host: On a CPU device, still run the copies (tests, debugging).
        min_offload_bytes: ``all`` leaves smaller tensors on the device (copying them costs more than it saves).
        max_pinned_bytes: Upper bound of the reusable pinned host-buffer pool.
        host_reserve_bytes: Host memory left free; offloading past ``MemAvailable`` minus this raises
            :class:`~lightning_ac.offload.HostMemoryError` instead of an OOM kill.
        verify_steps: Verify mode: each micro-batch of the first ``verify_steps`` optimizer steps runs once more
            beforehand with every transfer synchronous, and the real loss and gradients must match it
            (:class:`~lightning_ac.OffloadVerificationError` before the optimizer steps otherwise). Costs one
            forward and backward per verified micro-batch and the reference gradients in host memory.
        verify_atol: The largest absolute difference verify mode accepts; ``0`` (default) compares bit for bit.
        verbose: At fit start, print a table per decoder layer (see :class:`ActivationCheckpointing`).
        prog_bar: Show ``lightning_ac/offload_bytes`` in the progress bar.

    Attributes:
        last_step: ``{"hidden_states": {"tensors": n, "bytes": n}, "selective": {...}, "all": {...}}`` for the
            most recent optimizer step (Lightning's step: every micro-batch under gradient accumulation). The
            same figures are logged, once per optimizer step, as ``lightning_ac/offload_bytes`` and
            ``lightning_ac/offload_<target>_bytes``.
    """

    def __init__(
        self,
        *,
        hidden_states: Union[str, bool] = "none",
        selective: Union[str, bool] = "none",
        all: Union[str, bool] = "none",
        copy_on_host: bool = False,
        min_offload_bytes: int = 2**16,
        max_pinned_bytes: int = 8 * 2**30,
        host_reserve_bytes: int = 2 * 2**30,
        verify_steps: int = 0,
        verify_atol: float = 0.0,
        verbose: bool = False,
        prog_bar: bool = False,
    ) -> None:
        self.request = ActivationOffloadRequest(
            OffloadConfig(hidden_states=hidden_states, selective=selective, all=all),
            copy_on_host=copy_on_host,
            min_offload_bytes=min_offload_bytes,
            max_pinned_bytes=max_pinned_bytes,
            host_reserve_bytes=host_reserve_bytes,
            verify_steps=verify_steps,
            verify_atol=verify_atol,
        )
        self._init_output(verbose, prog_bar)
        self.last_step: Dict[str, Dict[str, int]] = _no_transfers()
        self._reported_host_use = False
        self._step = _OptimizerStep()

    @property
    def offload(self) -> OffloadConfig:
        """Where each target's tensors go."""
        return self.request.offload

    @property
    def copy_on_host(self) -> bool:
        return self.request.copy_on_host

    @property
    def targets(self) -> List[str]:
        """The targets that move to the host."""
        return self.offload.targets

    def _report_host_use(self, step_bytes: int) -> None:
        """After the first step: how much host memory a step holds, and a warning when little is left."""
        available = available_host_bytes()
        free = f", {available / 2**30:.1f} GiB host memory available" if available is not None else ""
        rank_zero_info(f"offloading {step_bytes / 2**20:.1f} MiB to host memory per step{free}")
        if available is not None and step_bytes > 0.5 * available:
            rank_zero_warn(
                f"offloading holds {step_bytes / 2**30:.1f} GiB of host memory per step, more than half of the "
                f"{available / 2**30:.1f} GiB available; a larger batch or sequence will not fit. Consider "
                "offload.hidden_states instead of offload.all."
            )

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._reported_host_use = False
        super().setup(trainer, pl_module, stage)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        # the runtime's step itself starts with the training step (Plan), which an on_train_batch_start of the
        # LightningModule returning -1 skips
        if self._plan is not None and self._plan.activation_offload is not None and self._step.begin(trainer):
            self._totals = _no_transfers()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        runtime = self._plan.activation_offload if self._plan is not None else None
        if runtime is None:
            return
        runtime.finish_step()
        for target, moved in runtime.last_step.items():
            for key, value in moved.items():
                self._totals[target][key] += value
        if not self._step.done(trainer):
            return  # gradient accumulation: more micro-batches of this optimizer step follow
        self.last_step = self._totals
        total = sum(v["bytes"] for v in self.last_step.values())
        if not self._reported_host_use:
            self._reported_host_use = True
            self._report_host_use(total)
        pl_module.log(
            "lightning_ac/offload_bytes",
            float(total),
            on_step=True,
            on_epoch=False,
            batch_size=1,
            prog_bar=self.prog_bar,
        )
        for target in runtime.targets:
            pl_module.log(
                f"lightning_ac/offload_{target}_bytes", float(self.last_step[target]["bytes"]),
                on_step=True, on_epoch=False, batch_size=1,
            )  # fmt: skip


class LayerOffload(SuiteCallback):
    """Keep frozen decoder-layer parameters in host memory and stream them to the device one layer at a time.

    Before a decoder layer runs (forward, and backward in reverse), its frozen parameters are copied to the
    device on a side stream while the layer before it computes; afterwards the device copy is freed. Device
    memory drops by about the frozen parameters of all decoder layers minus two layers' worth (the one running
    and the one arriving), at the price of PCIe traffic each step. Best with LoRA/QLoRA, where almost every
    parameter is frozen; it stacks with :class:`ActivationCheckpointing` and :class:`ActivationOffload`.

    QLoRA bases stream as stored: bitsandbytes' 4-bit ``Params4bit`` weights move packed, with their quant state.
    Trainable parameters, other parameter subclasses (DTensor shards, other quantized formats), parameters shared
    between layers, and everything outside the decoder layers (embeddings, output head) stay on the device. The
    streamed weights move to host memory in ``setup``, before the strategy places the module, so the device never
    holds them whole. Between steps a
    streamed parameter's data is its host copy, so ``state_dict`` and checkpoints hold the right values; after
    the run every parameter has memory of its own again, on the same device as the rest of the module (the CPU
    once Lightning's teardown has moved it there). A parameter unfrozen during training (a fine-tuning schedule)
    leaves the stream at its layer's next call.

    Args:
        layers: For models that are not transformers models: the decoder layers, as layer classes or globs over
            qualified module names (see :class:`ActivationCheckpointing`).
        copy_on_host: On a CPU-only trainer, run the copies anyway (tests, debugging). Without it a CPU-only
            trainer is a :class:`ConfigError`: the parameters already live in host memory there.
        host_reserve_bytes: Host memory left free: if the frozen weights need more, ``setup`` raises
            :class:`~lightning_ac.offload.HostMemoryError` instead of meeting the OOM killer.
        resident_layers: Keep the frozen weights of the last ``k`` decoder layers (of each model) on the device
            for the whole run: they run last in forward and first in backward, so each saves two loads per step
            for one layer of device memory.
        verify_steps: Verify mode (see :class:`ActivationOffload`): the first optimizer steps are checked against
            the same steps with synchronous transfers.
        verify_atol: The largest absolute difference verify mode accepts; ``0`` (default) compares bit for bit.
        verbose: At fit start, print a table per decoder layer (see :class:`ActivationCheckpointing`).
        prog_bar: Show ``lightning_ac/layer_offload_bytes`` in the progress bar.

    Attributes:
        last_step: ``{"loads": n, "bytes": n, "max_resident_layers": n}`` for the most recent optimizer step
            (every micro-batch under gradient accumulation): layer copies to the device, bytes copied, and the
            most streamed layers on the device at once (resident layers not counted). ``bytes`` is also logged,
            once per optimizer step, as ``lightning_ac/layer_offload_bytes``.
        host_bytes: Bytes of parameters held in host memory.

    Raises:
        ConfigError: If an argument is invalid; in ``setup``, on a sharding strategy (FSDP, DeepSpeed), on a
            CPU-only trainer without ``copy_on_host``, for compiled decoder layers, or when the decoder layers
            have no frozen parameters.
    """

    def __init__(
        self,
        *,
        layers: Optional[Sequence[LayerSpec]] = None,
        copy_on_host: bool = False,
        host_reserve_bytes: int = 2 * 2**30,
        resident_layers: int = 0,
        verify_steps: int = 0,
        verify_atol: float = 0.0,
        verbose: bool = False,
        prog_bar: bool = False,
    ) -> None:
        self.request = LayerOffloadRequest(
            layers,
            copy_on_host=copy_on_host,
            host_reserve_bytes=host_reserve_bytes,
            resident_layers=resident_layers,
            verify_steps=verify_steps,
            verify_atol=verify_atol,
        )
        self._init_output(verbose, prog_bar)
        self.last_step: Dict[str, int] = _no_loads()
        self.host_bytes = 0
        self._step = _OptimizerStep()

    @property
    def layers(self) -> Optional[List[LayerSpec]]:
        return self.request.layers

    @property
    def copy_on_host(self) -> bool:
        return self.request.copy_on_host

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        streamer = self._plan.weight_streamer if self._plan is not None else None
        if streamer is not None:
            if self._step.begin(trainer):
                self._totals = _no_loads()
            streamer.start_step()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        streamer = self._plan.weight_streamer if self._plan is not None else None
        if streamer is None:
            return
        stats = streamer.stats
        self._totals["loads"] += stats["loads"]
        self._totals["bytes"] += stats["bytes"]
        self._totals["max_resident_layers"] = max(self._totals["max_resident_layers"], stats["max_resident_layers"])
        self.host_bytes = streamer.host_bytes
        if not self._step.done(trainer):
            return  # gradient accumulation: more micro-batches of this optimizer step follow
        self.last_step = self._totals
        pl_module.log(
            "lightning_ac/layer_offload_bytes", float(self.last_step["bytes"]),
            on_step=True, on_epoch=False, batch_size=1, prog_bar=self.prog_bar,
        )  # fmt: skip


def _no_transfers() -> Dict[str, Dict[str, int]]:
    return {t: {"tensors": 0, "bytes": 0} for t in OFFLOAD_TARGETS}


def _no_loads() -> Dict[str, int]:
    return {"loads": 0, "bytes": 0, "max_resident_layers": 0}


class _OptimizerStep:
    """Which micro-batches make up one optimizer step (Lightning's step: ``global_step``, the logger's x-axis).

    ``global_step`` counts optimizer steps: it stays the same over the micro-batches of one step under gradient
    accumulation and has moved on by the end of the micro-batch that stepped. Under manual optimization it
    moves with the optimizers ``self.optimizers()`` hands out; stepping a raw torch optimizer publishes nothing.
    """

    def __init__(self) -> None:
        self.global_step: Optional[int] = None

    def begin(self, trainer: pl.Trainer) -> bool:
        """At a micro-batch's start: whether it is the first of a new optimizer step."""
        if trainer.global_step == self.global_step:
            return False
        self.global_step = trainer.global_step
        return True

    def done(self, trainer: pl.Trainer) -> bool:
        """At a micro-batch's end: whether the optimizer stepped, so the optimizer step is complete."""
        return trainer.global_step != self.global_step


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
    callbacks: List[Callback] = []
    if cfg.enabled or cfg.chunked_loss is not None:  # without recompute, the chunked loss is all it does
        callbacks.append(ActivationCheckpointing._from_request(CheckpointingRequest.from_config(cfg), verbose))
    off = cfg.offload
    if off.targets:
        callbacks.append(
            ActivationOffload(
                hidden_states=off.hidden_states,
                selective=off.selective,
                all=off.all,
                copy_on_host=copy_on_host,
                verify_steps=verify_steps,
                verbose=verbose,
            )
        )
    if layer_offloading:
        callbacks.append(
            LayerOffload(
                copy_on_host=copy_on_host,
                resident_layers=layer_offloading_resident_layers,
                verify_steps=verify_steps,
                verbose=verbose,
            )
        )
    return callbacks


# The hooks the suite callbacks rely on, in the order Lightning calls them in a fit of one step (DESIGN.md).
_FIT_ORDER = (
    "setup",
    "configure_model",
    "on_fit_start",
    "on_train_batch_start",
    "training_step",
    "on_before_backward",
    "on_after_backward",
    "on_train_batch_end",
    "teardown",
)


class _HookProbe(Callback):
    """Records the hooks the suite callbacks implement as Lightning calls them, and overrides the module's
    ``configure_model`` and ``training_step`` on the instance in ``setup``, as the plan does."""

    def __init__(self) -> None:
        self.calls: List[str] = []

    def _record(self, name: str) -> None:
        self.calls.append(name)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._record("setup")
        configure_model, training_step = pl_module.configure_model, pl_module.training_step

        def configure_model_override() -> None:
            self._record("configure_model")
            configure_model()

        def training_step_override(*args: Any, **kwargs: Any) -> Any:
            self._record("training_step")
            return training_step(*args, **kwargs)

        pl_module.configure_model = configure_model_override  # type: ignore[method-assign]
        pl_module.training_step = training_step_override  # type: ignore[method-assign]

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._record("teardown")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._record("on_exception")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record("on_fit_start")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self._record("on_train_batch_start")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._record("on_before_backward")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record("on_after_backward")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self._record("on_train_batch_end")


class _ProbeModule(pl.LightningModule):
    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail:
            raise _ProbeFailure()
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _ProbeFailure(Exception):
    pass


@contextlib.contextmanager
def _without_trainer_environment() -> Iterator[None]:
    """The user's ``PL_TRAINER_*`` variables set aside: Lightning reads them as the defaults of every Trainer's
    arguments, and the probe's must be its own (``PL_TRAINER_LIMIT_TRAIN_BATCHES=0.5`` makes its one-batch fit raise).
    They are put back as they were, whatever happens."""
    saved = {name: value for name, value in os.environ.items() if name.startswith("PL_TRAINER_")}
    for name in saved:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(saved)


def _probe_fit(fail: bool) -> List[str]:
    """The hooks a one-step fit on the CPU calls, in order (``fail``: its training step raises)."""
    probe = _HookProbe()
    with _without_trainer_environment():
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=1, callbacks=[probe], barebones=True, num_sanity_val_steps=0
        )
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(2, 2)), batch_size=2)
    try:
        trainer.fit(_ProbeModule(fail), data)
    except _ProbeFailure:
        pass
    return probe.calls


@contextlib.contextmanager
def _lightning_quiet() -> Iterator[None]:
    """Lightning's own lines about the probe's Trainer (its devices, barebones mode) are not the user's run's."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _check_lightning_hooks(others: Any) -> None:
    """The Lightning hooks the suite callbacks implement exist on ``Callback`` with as many parameters (a hook that a
    release removed or reshaped would never be called, silently); and a one-step fit calls them, and the instance
    overrides of ``configure_model`` and ``training_step`` the plan installs, in the order the plan relies on, with
    ``on_exception`` and no ``teardown`` when the step raises."""
    import inspect

    for cls in (SuiteCallback, ActivationCheckpointing, ActivationOffload, LayerOffload):
        for name, ours in vars(cls).items():
            if not (name.startswith("on_") or name in ("setup", "teardown", "state_dict", "load_state_dict")):
                continue
            theirs = getattr(Callback, name, None)
            if theirs is None:
                raise selfcheck.SelfCheckFailed(
                    f"lightning's Callback has no {name} hook, which {cls.__name__}.{name} implements"
                )
            expected = list(inspect.signature(theirs).parameters)
            if len(inspect.signature(ours).parameters) != len(expected):
                raise selfcheck.SelfCheckFailed(f"lightning's Callback.{name} now takes ({', '.join(expected)})")
    with _lightning_quiet():
        calls, failing = _probe_fit(fail=False), _probe_fit(fail=True)
    if calls != list(_FIT_ORDER):
        raise selfcheck.SelfCheckFailed(
            f"a one-step fit called {', '.join(calls)}, where the suite callbacks rely on {', '.join(_FIT_ORDER)}"
        )
    if "on_exception" not in failing or "teardown" in failing:
        raise selfcheck.SelfCheckFailed(
            f"a fit whose step raised called {', '.join(failing)}: the suite callbacks remove what they installed in "
            "on_exception, which Lightning calls there instead of teardown"
        )


selfcheck.register(
    "callbacks",
    ("lightning",),
    None,
    _check_lightning_hooks,
    "compared the Lightning hooks the suite callbacks implement with Callback's, and ran a one-step fit recording them",
)
