"""One training step of one mode on fake tensors, with the suite applied as a real ``fit`` applies it.

The model is built on the meta device and given fake storage (``to_empty`` under ``FakeTensorMode``: shapes, dtypes
and strides, no memory). A real Lightning ``Trainer`` fits it one step on the CPU with the mode's callbacks
(:func:`lightning_ac.callbacks_from_config`, ``copy_on_host`` so that the offload engines run their copies on a
CPU trainer), so the plan, the recompute engines, the save rules and the copy engines are the ones a run uses. The
step is the one after a first: the gradients of the step before exist until Lightning zeroes them after the
forward, and the optimizer's state exists (both made on the fake tensors before the step, without running the
model). :class:`~lightning_ac.estimate.tracker.MemoryTracker` counts it.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from lightning_ac.estimate.attention import stand_in_registered
from lightning_ac.estimate.flops import flop_registry
from lightning_ac.estimate.models import EstimateError, Training, build_model, fake_op_error
from lightning_ac.estimate.modes import Mode
from lightning_ac.estimate.optimizers import OptimizerArgument, OptimizerChoice, optimizer_choice, state_on_host
from lightning_ac.estimate.precision import Precision, as_precision
from lightning_ac.estimate.qlora import pack_four_bit
from lightning_ac.estimate.results import StepEstimate
from lightning_ac.estimate.tracker import Kind, MemoryTracker, Phase
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
        self, model: nn.Module, optimizer: OptimizerChoice, loss: str = "causal_lm", first_step: bool = False
    ) -> None:
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.first_step = first_step

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


class _Measure(Callback):
    """Runs the tracker over the training step (after the suite's callbacks began theirs, as the benchmark's
    measurement does) and marks where the decoder layers and the output head run."""

    def __init__(self, tracker: MemoryTracker) -> None:
        self.tracker = tracker
        self.layers: List[nn.Module] = []
        self.inputs: List[Any] = []  # weak references: a storage kept here would never be freed
        self.outputs: List[Any] = []
        self.head_start: Dict[str, Any] = {}
        self.head_bytes = 0
        self.host: List[torch.Tensor] = []
        self.start_live: List[int] = [0] * len(Kind)
        self._handles: List[Any] = []
        self._head_done = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        from lightning_ac.layers import find_decoder_layers

        self.layers = find_decoder_layers(pl_module).modules
        self.inputs = [None] * len(self.layers)
        self.outputs = [None] * len(self.layers)
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre_hook(index)))
            self._handles.append(layer.register_forward_hook(self._post_hook(index)))
        tracker = self.tracker
        tracker.track_external([pl_module], list(trainer.optimizers), host=tuple(self.host))
        self.start_live = list(tracker.live)
        tracker.watch_gradients([pl_module])
        tracker.watch_optimizers()
        tracker.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close()

    def close(self) -> None:
        if not self._handles:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.tracker.remove_hooks()
        self.tracker.__exit__(None, None, None)

    def _pre_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.tracker.region = index
            hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if hidden is not None and self.inputs[index] is None:
                self.inputs[index] = weakref.ref(hidden.untyped_storage())

        return hook

    def _post_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            hidden = output if isinstance(output, torch.Tensor) else output[0]
            self.outputs[index] = weakref.ref(hidden.untyped_storage())
            self.tracker.region = "outside"
            if index == len(self.layers) - 1 and not self.head_start:
                self._start_head(hidden)

        return hook

    def _start_head(self, hidden: torch.Tensor) -> None:
        """The output head starts: what the forward keeps, by where it was made; and a hook that ends the head's
        window when the gradient reaches the last layer's output."""
        tracker = self.tracker
        kept_inputs: Dict[int, int] = {}
        made_in: Dict[Any, int] = {}
        for ref in [*self.inputs, *self.outputs]:
            storage = ref() if ref is not None else None
            kept = tracker.kept(storage) if storage is not None else None
            if kept is not None and id(storage) not in kept_inputs:
                kept_inputs[id(storage)] = kept[0]
                made_in[kept[1]] = made_in.get(kept[1], 0) + kept[0]
        self.head_start = {
            "inputs": sum(kept_inputs.values()),
            "layers": [tracker.region_live.get(i, 0) - made_in.get(i, 0) for i in range(len(self.layers))],
            "outside": tracker.region_live.get("outside", 0) - made_in.get("outside", 0),
        }
        # the layers' inputs and outputs are not held past here by this callback
        self.inputs, self.outputs = [], []
        tracker.region = "head"
        tracker.head = True
        tracker.start_window()
        if hidden.requires_grad:
            hidden.register_hook(self._end_head)

    def _end_head(self, grad: torch.Tensor) -> None:
        if not self._head_done:
            self._head_done = True
            self.tracker.head = False
            self.tracker.region = "backward"
            self.head_bytes = self.tracker.end_window()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_head(None)  # type: ignore[arg-type]
        self.tracker.in_optimizer = True


@contextlib.contextmanager
def _engines_tagged(tracker: MemoryTracker) -> Iterator[None]:
    """What the copy engines allocate as host memory (activation offloading's host buffers) and as streamed weights
    (layer offloading's device copies of a layer) is counted as such."""
    from lightning_ac.offload.engine import TransferEngine
    from lightning_ac.offload.weights.residency import LayerResidency

    host_buffer = TransferEngine.__dict__["_host_buffer"]
    load = LayerResidency.__dict__["_load"]

    def tagged_host_buffer(self: Any, nbytes: int) -> Any:
        with tracker.tagging(Kind.HOST):
            return host_buffer(self, nbytes)

    def tagged_load(self: Any, *args: Any, **kwargs: Any) -> Any:
        with tracker.tagging(Kind.WEIGHTS):
            return load(self, *args, **kwargs)

    with patched(TransferEngine, "_host_buffer", tagged_host_buffer):
        with patched(LayerResidency, "_load", tagged_load):
            yield


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
) -> StepEstimate:
    """One training step of ``mode`` at ``batch`` x ``seq`` tokens on fake tensors (see the module's docstring);
    ``extra_callbacks`` run beside the suite's (the budget's plan reads its controller there). ``dtype``: the weights'
    dtype (its ``*-true`` precision), or a :class:`~lightning_ac.estimate.precision.Precision`.

    Raises:
        EstimateError: If an op has no fake implementation (naming the op and the mode), or the mode does not apply
            to the model (the suite's own :class:`~lightning_ac.ConfigError`, with the mode named).
    """
    from lightning_ac import release_gate
    from lightning_ac.config import ConfigError

    # a release newer than the tested ones checks each feature on real tensors, before the fake step (once a process)
    release_gate.ensure(_features(mode))
    started = time.perf_counter()
    choice = optimizer_choice(optimizer, target)
    precision = as_precision(dtype)
    dtype = precision.build_dtype(training.qlora)
    tracker = MemoryTracker(
        round_to=CUDA_BLOCK if target == "cuda" else 1,
        flop_registry=flop_registry(),
        host_state=state_on_host if target == "cuda" else None,
    )
    measure = _Measure(tracker)
    with fake_session(), _engines_tagged(tracker), stand_in_registered(config):
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
        module = _StepModule(model, choice, training.loss, training.first_step)
        trainer = step_trainer(
            [*callbacks, *extra_callbacks, _HostOfStreamer(measure), measure],
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
    return _result(mode.name, seq, batch, tracker, measure, ids, seconds)


class _HostOfStreamer(Callback):
    """Hands layer offloading's host copies (made in ``setup``, before the step) to the measurement as host memory."""

    def __init__(self, measure: _Measure) -> None:
        self.measure = measure

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        from lightning_ac.callbacks import SuiteCallback

        plans = [cb.plan for cb in trainer.callbacks if isinstance(cb, SuiteCallback) and cb.plan is not None]
        streamer = plans[0].weight_streamer if plans else None
        if streamer is not None:
            self.measure.host = [h for layer in streamer.layers for h in (layer.buffer, *layer.host) if h is not None]


class _OneBatch:
    """An iterable of one batch."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield self.ids


def _result(
    mode: str, seq: int, batch: int, tracker: MemoryTracker, measure: _Measure, ids: torch.Tensor, seconds: float
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
        device_total_bytes=tracker.device_peak + ids.numel() * ids.element_size(),
        one_memory_peak_bytes=tracker.one_memory_peak,
        flops={phase.value: tracker.flops[phase] for phase in (Phase.FORWARD, Phase.HEAD, Phase.BACKWARD,
                                                             Phase.RECOMPUTE, Phase.OPTIMIZER)},
        seconds=seconds,
    )  # fmt: skip
