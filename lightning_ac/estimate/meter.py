"""What the estimate's fake step reads while it runs: the tracker over the training step, where the decoder layers and
the output head run, and which allocations are the copy engines' (host memory, streamed weights).

:class:`StepMeter` is a Lightning callback beside the suite's; :func:`engines_tagged` tags what the offload engines
allocate; :class:`HostOfStreamer` hands layer offloading's host copies to the meter.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, Iterator, List

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_ac.estimate.tracker import Kind, MemoryTracker
from lightning_ac.fake import patched

__all__ = ["HostOfStreamer", "StepMeter", "engines_tagged", "tagged_method"]


class StepMeter(Callback):
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
def tagged_method(tracker: MemoryTracker, owner: Any, name: str, kind: Kind) -> Iterator[None]:
    """Inside: what the method ``owner.name`` allocates counts as ``kind`` (the method as found afterwards)."""
    method = owner.__dict__[name]

    def tagged(*args: Any, **kwargs: Any) -> Any:
        with tracker.tagging(kind):
            return method(*args, **kwargs)

    with patched(owner, name, tagged):
        yield


@contextlib.contextmanager
def engines_tagged(tracker: MemoryTracker) -> Iterator[None]:
    """What the copy engines allocate as host memory (activation offloading's host buffers) and as streamed weights
    (layer offloading's device copies of a layer) is counted as such."""
    from lightning_ac.offload.engine import TransferEngine
    from lightning_ac.offload.weights.residency import LayerResidency

    with tagged_method(tracker, TransferEngine, "_host_buffer", Kind.HOST):
        with tagged_method(tracker, LayerResidency, "_load", Kind.WEIGHTS):
            yield


class HostOfStreamer(Callback):
    """Hands layer offloading's host copies (made in ``setup``, before the step) to the measurement as host memory."""

    def __init__(self, measure: StepMeter) -> None:
        self.measure = measure

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        from lightning_ac.callbacks import SuiteCallback

        plans = [cb.plan for cb in trainer.callbacks if isinstance(cb, SuiteCallback) and cb.plan is not None]
        streamer = plans[0].weight_streamer if plans else None
        if streamer is not None:
            self.measure.host = [h for layer in streamer.layers for h in (layer.buffer, *layer.host) if h is not None]
