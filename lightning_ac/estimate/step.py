"""One training step of one mode on fake tensors, with the suite applied as a real ``fit`` applies it.

The model is built on the meta device and given fake storage (``to_empty`` under ``FakeTensorMode``: shapes, dtypes
and strides, no memory). A real Lightning ``Trainer`` fits it one step on the CPU with the mode's callbacks
(:func:`lightning_ac.callbacks_from_config`, ``copy_on_host`` so that the offload engines run their copies on a
CPU trainer), so the plan, the recompute engines, the save rules and the copy engines are the ones a run uses. The
step is the one after a first: the gradients of the step before exist until Lightning zeroes them after the
forward, and the optimizer's state exists (both made on the fake tensors before the step, without running the
model). :class:`~lightning_ac.estimate.tracker.MemoryTracker` counts it. Per rank of N under DDP or FSDP2, the step
is rank 0's on torch's fake process group, the model wrapped where Lightning wraps it
(:mod:`~lightning_ac.estimate.ranks`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from lightning_ac.estimate.attention import stand_in_registered
from lightning_ac.estimate.dropout import attention_as_on_cuda, dropout_as_on_cuda
from lightning_ac.estimate.flops import flop_registry
from lightning_ac.estimate.meter import HostOfStreamer, StepMeter, engines_tagged
from lightning_ac.estimate.models import EstimateError, Training, build_model, fake_op_error
from lightning_ac.estimate.modes import Mode
from lightning_ac.estimate.optimizers import OptimizerArgument, OptimizerChoice, optimizer_choice, state_on_host
from lightning_ac.estimate.precision import Precision, as_precision
from lightning_ac.estimate.qlora import pack_four_bit
from lightning_ac.estimate.ranks import Ranks, counted, distribute, fake_world
from lightning_ac.estimate.results import StepEstimate
from lightning_ac.estimate.tracker import Kind, MemoryTracker, Phase
from lightning_ac.estimate.workspaces import workspace_bytes
from lightning_ac.fake import fake_mode, fake_session, patched

__all__ = ["fake_step", "flop_registry"]

CUDA_BLOCK = 512  # bytes: the CUDA caching allocator rounds every allocation up to a multiple of this


class _InPlace(SingleDeviceStrategy):
    """The CPU strategy, but the module stays as it is at setup: it is on its device already, and moving fake
    parameters "to" the device they are on makes ``nn.Module._apply`` swap them (which fake tensors refuse)."""

    def model_to_device(self) -> None:
        pass

    def teardown(self) -> None:
        module = self.lightning_module
        if module is None:
            return super().teardown()
        with patched(module, "cpu", lambda: module):  # teardown moves the module to the CPU, where it is
            super().teardown()


class _StepModule(pl.LightningModule):
    """The benchmark's training step (``labels=input_ids``, no cache), or the loss ``last_logit_mean``
    (:class:`~lightning_ac.estimate.models.Training`), and the optimizer asked for."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerChoice,
        loss: str = "causal_lm",
        first_step: bool = False,
        distribute: Optional[Callable[[nn.Module], nn.Module]] = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.first_step = first_step
        self.distribute = distribute

    def configure_model(self) -> None:
        """The strategy's wrapping (:func:`~lightning_ac.estimate.ranks.distribute`), where Lightning's
        ``ModelParallelStrategy`` runs ``fully_shard``: after the suite's ``setup``."""
        if self.distribute is not None:
            self.model = self.distribute(self.model)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.loss == "last_logit_mean":
            return self.model(input_ids=batch, use_cache=False, logits_to_keep=1).logits.float().mean()
        return self.model(input_ids=batch, labels=batch, use_cache=False).loss

    def log(self, *args: Any, **kwargs: Any) -> None:
        """What the callbacks log (Lightning's metric states are copied by value, which fake tensors have none of)
        is not kept: the estimate reads the figures itself."""

    def configure_optimizers(self) -> Any:
        return self.optimizer.build([p for p in self.parameters() if p.requires_grad])

    def on_train_start(self) -> None:
        """What the step before left: every trainable parameter's gradient, and the optimizer's state (nothing
        before a first step)."""
        if self.first_step:
            return
        trainable = [p for p in self.parameters() if p.requires_grad]
        for p in trainable:
            p.grad = torch.zeros_like(p)
        for optimizer in self.trainer.optimizers:
            if isinstance(optimizer, torch.optim.Optimizer):
                optimizer.step()


def _features(mode: Mode) -> List[str]:
    from lightning_ac import release_gate
    from lightning_ac.config import parse_config

    cfg = parse_config(mode.block)
    targets = list(cfg.offload.targets)
    layer_offload = mode.layer_offload is not None
    return release_gate.features_of(
        cfg.enabled, cfg.selective is not None, targets, layer_offload, False, cfg.chunked_loss is not None
    )


def mode_callbacks(mode: Mode, layers: int) -> List[Callback]:
    """The suite's callbacks for ``mode`` on a model of ``layers`` decoder layers, with the copies run on a CPU
    trainer (``copy_on_host``)."""
    from lightning_ac.callbacks import callbacks_from_config

    return callbacks_from_config(
        mode.block,
        layer_offloading=mode.layer_offload is not None,
        layer_offloading_resident_layers=mode.resident_layers(layers),
        copy_on_host=True,
    )


def step_trainer(
    callbacks: List[Callback], max_steps: int = 1, strategy: Any = "auto", precision: Optional[str] = None
) -> pl.Trainer:
    """A CPU Trainer that trains ``max_steps`` steps with ``callbacks`` and nothing else (no logger, checkpoints,
    progress bar or summary); the user's ``PL_TRAINER_*`` variables are not its defaults. ``precision``: Lightning's
    (``bf16-mixed``: autocast), ``None`` for the model's own dtype."""
    from lightning_ac.private_trainer import without_trainer_environment

    with without_trainer_environment():
        return pl.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=strategy,
            precision=precision or "32-true",
            max_steps=max_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=callbacks,
        )


def fake_step(
    config: Any,
    dtype: Union[torch.dtype, Precision],
    training: Training,
    mode: Mode,
    seq: int,
    batch: int,
    optimizer: OptimizerArgument = "adamw",
    target: str = "cuda",
    extra_callbacks: Sequence[Callback] = (),
    ranks: Optional[Ranks] = None,
) -> StepEstimate:
    """One training step of ``mode`` at ``batch`` x ``seq`` tokens on fake tensors (see the module's docstring);
    ``extra_callbacks`` run beside the suite's (the budget's plan reads its controller there). ``dtype``: the weights'
    dtype (its ``*-true`` precision), or a :class:`~lightning_ac.estimate.precision.Precision`. ``ranks``: the
    step of rank 0 of N under DDP or FSDP2 (:mod:`~lightning_ac.estimate.ranks`), at the per-rank ``batch``.

    Raises:
        EstimateError: If an op has no fake implementation (naming the op and the mode), or the mode does not apply
            to the model (the suite's own :class:`~lightning_ac.ConfigError`, with the mode named).
    """
    from lightning_ac import release_gate
    from lightning_ac.config import ConfigError

    # a release newer than the tested ones checks each feature on real tensors, before the fake step (once a process)
    release_gate.ensure(_features(mode))
    started = time.perf_counter()
    if target == "cuda":
        config = attention_as_on_cuda(config)
    ranks = ranks or Ranks()
    choice = optimizer_choice(optimizer, target)
    precision = as_precision(dtype)
    dtype = precision.build_dtype(training.qlora)
    tracker = MemoryTracker(
        round_to=CUDA_BLOCK if target == "cuda" else 1,
        flop_registry=flop_registry(),
        host_state=state_on_host if target == "cuda" else None,
    )
    measure = StepMeter(tracker)
    with contextlib.ExitStack() as session:
        session.enter_context(fake_session())
        session.enter_context(engines_tagged(tracker))
        session.enter_context(stand_in_registered(config))
        mesh = session.enter_context(fake_world(ranks))  # one rank of N: lightning_ac.estimate.ranks
        session.enter_context(counted(ranks, tracker))
        if target == "cuda":
            session.enter_context(dropout_as_on_cuda())  # its masks as CUDA keeps them (lightning_ac.estimate.dropout)
        model = build_model(config, dtype, training)
        fake = fake_mode()
        with fake:
            model.to_empty(device="cpu")
            if getattr(config, "tie_word_embeddings", False):
                model.tie_weights()
            if training.qlora:
                pack_four_bit(model, dtype, training.quant_type, training.double_quant)
            ids = torch.zeros(batch, seq, dtype=torch.long)
        callbacks = mode_callbacks(mode, config.num_hidden_layers)
        wrap = (lambda m: distribute(m, ranks, mesh, tracker)) if ranks.distributed else None
        module = _StepModule(model, choice, training.loss, training.first_step, wrap)
        trainer = step_trainer(
            [*callbacks, *extra_callbacks, HostOfStreamer(measure), measure],
            1,
            _InPlace(device=torch.device("cpu")),
            precision=precision.autocast,
        )
        loader = _OneBatch(ids)  # not a DataLoader, which draws its seed from the random state
        try:
            with fake:
                trainer.fit(module, loader)
        except EstimateError:
            raise
        except ConfigError as err:
            raise EstimateError(f"mode {mode.name}: {err}") from err
        except Exception as err:
            fake = fake_op_error(err, mode.name, tracker.op_that_raised(err))
            if fake is not None:
                raise fake from err
            raise
        finally:
            measure.close()
    seconds = time.perf_counter() - started
    return _result(mode.name, seq, batch, tracker, measure, ids, seconds, workspace_bytes(target))


class _OneBatch:
    """An iterable of one batch."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield self.ids


def _result(
    mode: str,
    seq: int,
    batch: int,
    tracker: MemoryTracker,
    measure: StepMeter,
    ids: torch.Tensor,
    seconds: float,
    workspaces: int,
) -> StepEstimate:
    start = measure.start_live
    head = measure.head_start or {"inputs": 0, "layers": [], "outside": 0}
    return StepEstimate(
        mode=mode,
        seq=seq,
        batch=batch,
        parameter_bytes=start[Kind.PARAMETER],
        buffer_bytes=start[Kind.BUFFER],
        gradient_bytes=start[Kind.GRADIENT],
        optimizer_bytes=start[Kind.OPTIMIZER],
        activation_peak_bytes=tracker.activation_peak,
        activation_peak_at=tracker.activation_peak_at,
        head_bytes=measure.head_bytes,
        layer_saved_bytes=list(head["layers"]),
        layer_input_bytes=head["inputs"],
        outside_bytes=head["outside"],
        streamed_weight_bytes=tracker.weights_peak,
        host_bytes=tracker.host_peak,
        device_total_bytes=tracker.device_peak + ids.numel() * ids.element_size() + workspaces,
        workspace_bytes=workspaces,
        one_memory_peak_bytes=tracker.one_memory_peak,
        flops={phase.value: tracker.flops[phase] for phase in (Phase.FORWARD, Phase.HEAD, Phase.BACKWARD,
                                                             Phase.RECOMPUTE, Phase.OPTIMIZER)},
        seconds=seconds,
        ops={phase.value: count for phase, count in tracker.ops.items()},
        moved_bytes={phase.value: count for phase, count in tracker.moved.items()},
    )  # fmt: skip
