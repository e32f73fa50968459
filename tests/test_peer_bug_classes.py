"""The bug classes that shipped wrong results in other offloaders, each a test of ours.

Each test names the peer's report. They run on the host path and on the simulated asynchronous device (deferred
copies, poison, release and ordering checks, compute streams that a user can switch); the CUDA twins are in
tests/test_gpu.py.
"""

from __future__ import annotations

import gc
from typing import List, Tuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    BATCH,
    LM,
    SEQ,
    assert_same_training,
    batches,
    clone,
    fit,
    make_trainer,
    tiny_model,
    tiny_qlora_model,
)

from lightning_ac import ActivationCheckpointing, ActivationOffload, LayerOffload
from lightning_ac.offload import TransferEngine
from lightning_ac.testing.simulated import SimulatedDevice

HIDDEN = 64
LAYER_INPUT_BYTES = BATCH * SEQ * HIDDEN * 4  # fp32


class PackSpy:
    """Records what the transfer engine is asked to pack (wrapping the real method): each tensor's view geometry,
    the host copy it went to, and whether autograd was running backward at the time."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: List[Tuple[int, bool, object, bool]] = []
        pack = TransferEngine.pack

        def spy(engine: TransferEngine, tensor: torch.Tensor, target: str):
            packed = pack(engine, tensor, target)
            in_backward = torch._C._current_graph_task_id() != -1
            self.calls.append((tensor.storage_offset(), tensor.is_contiguous(), packed.copy, in_backward))
            return packed

        monkeypatch.setattr(TransferEngine, "pack", spy)


# -- a view with a storage offset, a non-contiguous view (Axolotl #3833 and its follow-up on sliced views) ------


class ViewsLM(LM):
    """A loss over views: the labels shifted by one (a view at a storage offset), two neighbouring slices of the
    hidden states (one at an offset, both non-contiguous) and transposed logits."""

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        hidden = self.model.model(input_ids=ids).last_hidden_state
        pairs = hidden[:, 1:] * hidden[:, :-1]  # mul saves both slices of one storage, each beside the other
        logits = self.model.lm_head(pairs)
        loss = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:])  # saves the labels, a view at offset 1
        self.losses.append(float(loss.detach()))
        return loss


@pytest.mark.parametrize("checkpointing", [False, True])
def test_views_at_an_offset_and_transposes_come_back_as_the_same_views(checkpointing, transfer, monkeypatch):
    base = tiny_model("llama")
    reference = fit(clone(base), max_steps=2, module_cls=ViewsLM)
    spy = PackSpy(monkeypatch)
    callbacks = [ActivationCheckpointing()] if checkpointing else []
    run = fit(
        clone(base),
        [*callbacks, ActivationOffload(all="cpu", min_offload_bytes=0, copy_on_host=True)],
        max_steps=2,
        module_cls=ViewsLM,
    )
    assert any(offset > 0 for offset, *_ in spy.calls), "a view at a storage offset was offloaded"
    assert any(not contiguous for _, contiguous, *_ in spy.calls), "a non-contiguous view was offloaded"
    assert_same_training(reference, run)


def test_neighbouring_views_of_one_storage_come_back_unclobbered(transfer):
    engine = TransferEngine(torch.device("cpu"), copy_on_host=True, stash_bytes=2**20)
    engine.start_step()
    storage = torch.arange(2 * 9 * 4, dtype=torch.float32).reshape(2, 9, 4)
    labels = torch.arange(2 * 9).reshape(2, 9)
    views = [storage[:, 1:], storage[:, :-1], storage[:, 3:5].transpose(1, 2), labels[:, 1:], labels[:, :-1]]
    expected = [v.clone() for v in views]
    packed = [engine.pack(v, "all") for v in views]
    for view, want, p in zip(reversed(views), reversed(expected), reversed(packed)):
        back = engine.unpack(p)
        assert torch.equal(back, want)
        assert (back.shape, back.stride(), back.dtype) == (view.shape, view.stride(), view.dtype)
    engine.finish_step()


# -- an offset tensor read before the wait for its reload (TRL #7195) -------------------------------------------


@pytest.mark.simulated
def test_an_offset_view_is_read_only_after_its_reload_has_landed():
    # The peer cloned an offset tensor before the compute stream waited for its reload, and cloned garbage. Here
    # copies land only when waited for (until then their memory is poison): what compute reads of each unpacked
    # view, at once, must be its data, and its memory must be recorded to the stream that reads it.
    with SimulatedDevice() as sim:
        engine = TransferEngine(torch.device("cpu"), stash_bytes=2**20, prefetch=0)
        engine.start_step()
        base = torch.arange(80.0).reshape(8, 10)
        views = [base[3:], base[:, 2:7], base.t()[4:], base.reshape(-1)[1:]]
        packed = [engine.pack(v, "all") for v in views]
        for view, p in zip(reversed(views), reversed(packed)):
            back = engine.unpack(p)
            assert torch.equal(back.clone(), view), "read before its reload landed"
            assert back.storage_offset() == view.storage_offset() - p.copy.start // view.element_size()
            assert sim.recorded_to(back) is sim.computing()
        engine.finish_step()


# -- the compute stream looked up once instead of at each use (TRL #7195) ----------------------------------------


class ComputeOnAnotherStream(pl.Callback):
    """Runs the training steps in ``steps`` on a compute stream of the user's, as a user or FSDP2 switches the
    stream between steps (it is entered before the suite's callbacks act on the step and left after them)."""

    def __init__(self, sim: SimulatedDevice, steps: Tuple[int, ...]) -> None:
        self.sim, self.steps = sim, steps
        self.stream = sim.new_stream(compute=True)
        self._active = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.steps:
            self._active = self.sim.use_stream(self.stream)
            self._active.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._active is not None:
            self._active.__exit__(None, None, None)
            self._active = None


@pytest.mark.simulated
@pytest.mark.parametrize(
    "suite",
    [
        "hidden_states",
        "all",
        "selective",
        "layer_offload",
    ],
)
def test_a_compute_stream_switched_between_steps_is_the_one_waited_on(suite):
    lora = suite == "layer_offload"
    base = tiny_model("llama", lora=lora)
    reference = fit(clone(base), max_steps=3)
    callbacks = {
        "hidden_states": [ActivationCheckpointing(), ActivationOffload(hidden_states="cpu", copy_on_host=True)],
        "all": [ActivationOffload(all="cpu", min_offload_bytes=0, copy_on_host=True)],
        "selective": [ActivationCheckpointing(selective=True), ActivationOffload(selective="cpu", copy_on_host=True)],
        "layer_offload": [ActivationCheckpointing(), LayerOffload(copy_on_host=True)],
    }[suite]
    with SimulatedDevice() as sim:
        switch = ComputeOnAnotherStream(sim, steps=(1,))  # step 0 on the device's stream, step 1 on the user's
        run = fit(clone(base), [switch, *callbacks], max_steps=3)
        assert sim.copies > 0
    # step 2's loss is computed with step 1's gradients
    assert_same_training(reference, run)


# -- a reload racing its own device-to-host copy (Megatron #7398) ------------------------------------------------


@pytest.mark.simulated
def test_a_reload_right_after_the_forward_waits_for_its_own_copy_to_the_host():
    # Backward that comes right after forward reloads tensors whose copy to the host has not finished: the reload
    # must be ordered after it (the simulator refuses a copy that reads host memory a pending copy writes).
    with SimulatedDevice() as sim:
        engine = TransferEngine(torch.device("cpu"), stash_bytes=2**20, prefetch=0)
        engine.start_step()
        saved = [torch.full((256,), float(i)) for i in range(3)]
        packed = [engine.pack(t, "all") for t in saved]
        side_stream_copies = sum(len(s.pending_copies()) for s in sim.streams)
        assert side_stream_copies == 3, "the copies to the host are still pending when backward starts"
        for tensor, p in zip(reversed(saved), reversed(packed)):
            assert torch.equal(engine.unpack(p).clone(), tensor)
        engine.finish_step()


def test_backward_right_after_forward_reloads_copies_still_in_flight(transfer):
    # The same in training: the stash holds two layer inputs, so the last two are still in flight when backward
    # starts reloading them.
    base = tiny_model("llama")
    reference = fit(clone(base))
    run = fit(clone(base), [ActivationCheckpointing(), ActivationOffload(hidden_states="cpu", copy_on_host=True)])
    assert_same_training(reference, run)


# -- recomputed outputs offloaded a second time in the recompute (Megatron #7044) ---------------------------------


@pytest.mark.parametrize(
    "checkpointing, offload",
    [
        ({}, {"all": "cpu", "min_offload_bytes": 0}),
        ({"reentrant": True}, {"all": "cpu", "min_offload_bytes": 0}),
        ({}, {"hidden_states": "cpu"}),
        ({"reentrant": True}, {"hidden_states": "cpu"}),
        ({"selective": True}, {"selective": "cpu", "hidden_states": "cpu"}),
        ({"selective": True}, {"selective": "cpu", "all": "cpu", "min_offload_bytes": 0}),
    ],
)
def test_the_recompute_offloads_nothing(checkpointing, offload, transfer, monkeypatch):
    spy = PackSpy(monkeypatch)
    offloading = ActivationOffload(copy_on_host=True, **offload)
    fit(tiny_model("llama"), [ActivationCheckpointing(**checkpointing), offloading])
    assert spy.calls
    assert not [call for call in spy.calls if call[3]], "packed during backward (the recompute)"
    copies = len({id(call[2]) for call in spy.calls})
    assert copies == sum(stats["tensors"] for stats in offloading.last_step.values())


# -- host memory growing step over step: a bitsandbytes base (TRL #5730), long runs (TRL #5700) -------------------


def live_host_bytes() -> int:
    """Bytes of every storage a live CPU tensor holds (each storage once), after a collection."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): some module-level objects warn when their __class__ is read
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and obj.layout is torch.strided:
            storage = obj.untyped_storage()
            try:
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a fake or functional tensor (a compiled graph's cache keeps some): no memory
                continue
    return sum(storages.values())


class HostBytesAtSteps(pl.Callback):
    """The live host bytes after the training steps in ``steps`` (after the suite's callbacks have finished them;
    a scan of every live object takes a fraction of a second, so not after each step)."""

    def __init__(self, steps: Tuple[int, ...]) -> None:
        self.steps = steps
        self.bytes: List[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps:
            self.bytes.append(live_host_bytes())


def assert_steady(measure: HostBytesAtSteps) -> None:
    # The first measure is taken once the pools have settled; a leak of even one offloaded layer input a step
    # (the smallest thing the suite moves here) would add more than this by the last measure.
    assert len(measure.bytes) == len(measure.steps)
    growth = max(measure.bytes) - measure.bytes[0]
    steps = measure.steps[-1] - measure.steps[0]
    assert growth < LAYER_INPUT_BYTES * steps / 2, measure.bytes


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
@pytest.mark.simulated
def test_host_memory_is_steady_step_over_step_with_a_bitsandbytes_base(tmp_path):
    pytest.importorskip("bitsandbytes")
    base = tiny_qlora_model(str(tmp_path))
    measure = HostBytesAtSteps(steps=(3, 6, 9))
    callbacks = [
        ActivationCheckpointing(),
        ActivationOffload(hidden_states="cpu", copy_on_host=True),
        LayerOffload(copy_on_host=True),
        measure,
    ]
    with SimulatedDevice():
        fit(base, callbacks, max_steps=9)
    assert_steady(measure)


@pytest.mark.slow  # 24 steps; the bitsandbytes base's steady host memory over 9 steps stays in the default run
def test_host_memory_is_steady_over_a_long_run(transfer):
    measure = HostBytesAtSteps(steps=(3, 12, 24))
    callbacks = [
        ActivationCheckpointing(selective=True),
        ActivationOffload(selective="cpu", all="cpu", min_offload_bytes=0, copy_on_host=True),
        measure,
    ]
    make_trainer(callbacks, max_steps=24).fit(LM(tiny_model("llama")), batches(n=24))
    assert_steady(measure)
