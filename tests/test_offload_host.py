"""What activation offloading holds in host memory: the pinned pool across lengths, the host memory check counting what
is allocated, a pinning failure, passes outside the training step, and autograd's in-place check."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from conftest import BATCH, LM, VOCAB, assert_same_training, clone, fit, make_trainer, tiny_model
from torch import nn

from lightning_ac import ActivationCheckpointing, ActivationOffload, LightningACWarning
from lightning_ac.offload import HostMemoryError, TransferEngine
from lightning_ac.offload.activations import SavedTensorOffloader
from lightning_ac.offload.device import AcceleratorDevice
from lightning_ac.testing.simulated import SimulatedDevice

RELOADED = "reloaded activation bytes"


def _varying_lengths(lengths):
    """One batch per length: batches grouped by length, as padding to each batch's longest gives them."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, VOCAB, (BATCH, n), generator=g),) for n in lengths]
    return torch.utils.data.DataLoader(batches, batch_size=None)


class PerStep(pl.Callback):
    def __init__(self, sim, offload):
        self.sim, self.offload = sim, offload
        self.pinned, self.moved, self.allocations = [], [], []

    def on_train_batch_end(self, *args):
        self.pinned.append(self.sim.host.pinned_bytes)
        self.moved.append(sum(t["bytes"] for t in self.offload.last_step.values()))
        self.allocations.append(self.sim.host.pinned_allocations)


def _offload_all_over(lengths) -> PerStep:
    """A step a batch of each length, offloading everything, on the simulated device."""
    with SimulatedDevice() as sim:
        offload = ActivationOffload(all="cpu", min_offload_bytes=0, copy_on_host=True)
        per_step = PerStep(sim, offload)
        module = LM(tiny_model("llama"))
        make_trainer([offload, per_step], max_steps=len(lengths)).fit(module, _varying_lengths(lengths))
    return per_step


@pytest.mark.simulated
def test_the_pinned_pool_stays_near_what_the_largest_step_moves():
    """20 steps whose lengths vary (64..512 tokens, in no order): the pool holds at most 1.5x the most any step so far
    moved (it held the sum of every length's buffers: 72 MiB after 8 steps that moved at most 16 MiB)."""
    lengths = [64, 512, 96, 256, 128, 448, 64, 320, 192, 512, 80, 384, 160, 224, 64, 480, 288, 128, 352, 96]
    per_step = _offload_all_over(lengths)
    largest = 0
    for pinned, moved in zip(per_step.pinned, per_step.moved):
        largest = max(largest, moved)
        assert pinned <= 1.5 * largest, (per_step.pinned, per_step.moved)


@pytest.mark.simulated
def test_a_steady_length_allocates_no_pinned_memory_after_its_first_step():
    per_step = _offload_all_over([512, 64, 64, 64, 64, 64])
    assert per_step.allocations[1:] == [per_step.allocations[1]] * 5, "64 tokens fit the 512-token step's arenas"


@pytest.mark.simulated
def test_an_arena_no_step_slices_is_released():
    """After a long step, short ones: the arenas the short steps do not reach are freed a few steps later."""
    per_step = _offload_all_over([512] + [64] * 7)
    assert per_step.pinned[-1] < per_step.pinned[0] / 2, per_step.pinned
    assert per_step.pinned[-1] <= 1.5 * max(per_step.moved[1:]) + 2**20, per_step.pinned


def _step_of_small_tensors(engine, sizes):
    engine.start_step()
    held = [engine.pack(torch.ones(n // 4) * 1, "all") for n in sizes]
    return held


@pytest.mark.simulated
def test_the_host_check_counts_the_memory_allocated_not_the_tensors_bytes(monkeypatch):
    """30 tensors of 128-256 KiB and a few bytes: the check counts the buffers the copies take (each slice starts at a
    multiple of 512 bytes), which is what MemAvailable loses. It counted the tensors' own bytes, while each buffer was
    rounded up to 1 MiB: a host with room for the tensors and not for their buffers met the OOM killer."""
    sizes = [(128 + 128 * (i % 2)) * 2**10 + 4 * (i + 1) for i in range(30)]
    aligned = sum(-(-n // 512) * 512 for n in sizes)
    with SimulatedDevice() as sim:
        free = TransferEngine(torch.device("cpu"), copy_on_host=True)
        held = _step_of_small_tensors(free, sizes)
        allocated = sim.host.pinned_bytes
        assert free.host.held_bytes == allocated >= aligned > sum(sizes), "the count is what was allocated"
        del held
    room = {"bytes": 0}
    monkeypatch.setattr(
        "lightning_ac.offload.host_pool.host_limit", lambda reserve: room["bytes"] - sim.host.pinned_bytes
    )
    for room["bytes"], fits in ((sum(sizes) + 512, False), (allocated, True)):
        with SimulatedDevice() as sim:
            engine = TransferEngine(torch.device("cpu"), copy_on_host=True)
            if fits:
                _step_of_small_tensors(engine, sizes)
            else:
                with pytest.raises(HostMemoryError, match="more host memory"):
                    _step_of_small_tensors(engine, sizes)


def test_on_cuda_the_count_sees_the_pinned_allocators_rounding():
    """torch's pinned allocator rounds each block up to a power of two: 3 MiB pins 4."""
    device = AcceleratorDevice(torch.device("cuda"))
    assert device.pinned_nbytes(3 * 2**20) == 4 * 2**20 and device.pinned_nbytes(2**20) == 2**20


@pytest.mark.simulated
def test_memavailable_is_read_again_when_the_pool_must_grow(monkeypatch):
    """It was read once per fit: a host that filled up since was not seen."""
    reads = []

    def limit(reserve):
        reads.append(reserve)
        return 2**40

    monkeypatch.setattr("lightning_ac.offload.host_pool.host_limit", limit)
    counts = []
    with SimulatedDevice():
        engine = TransferEngine(torch.device("cpu"), copy_on_host=True)
        for sizes in ([2**20] * 4, [2**20] * 4, [2**20] * 4, [2**24] * 2):
            held = _step_of_small_tensors(engine, sizes)
            counts.append(len(reads))
            del held
            engine.finish_step()
    assert counts[0] >= 1, "read as the pool first grows"
    assert counts[1] == counts[2] == counts[0], "steady steps allocate nothing and read nothing"
    assert counts[3] > counts[2], "read again as the pool grows"


class _PinningRefused(SimulatedDevice):
    def pinned_empty(self, nbytes):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")


@pytest.mark.simulated
def test_a_pinning_failure_falls_back_to_pageable_copies_with_one_warning():
    base = tiny_model("llama")
    reference = fit(clone(base), max_steps=2)
    with _PinningRefused() as sim, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = fit(clone(base), [ActivationOffload(all="cpu", min_offload_bytes=0, copy_on_host=True)], max_steps=2)
    assert_same_training(reference, run)
    ours = [w for w in caught if issubclass(w.category, LightningACWarning) and "pinned" in str(w.message)]
    assert len(ours) == 1 and "pageable memory from now on" in str(ours[0].message)
    assert sim.host.pageable_copies > 0


class FisherLM(LM):
    """An EWC-style Fisher estimate at each epoch's end: forward and backward in training mode, outside the step."""

    passes = 16

    def __init__(self, model, offload):
        super().__init__(model)
        self.offload, self.in_use = offload, []

    def on_train_epoch_end(self):
        ids = torch.randint(0, VOCAB, (BATCH, 32), generator=torch.Generator().manual_seed(0))
        engine = self.offload.plan.activation_offload.engine
        for _ in range(self.passes):
            self.model(input_ids=ids, labels=ids).loss.backward()
            self.in_use.append(engine.host.in_use_bytes)
        self.model.zero_grad()


@pytest.mark.simulated
def test_passes_outside_the_step_give_their_copies_back_after_their_backward(monkeypatch):
    """16 passes, each needing a quarter of the host's room: the copies of each go back when its backward has used
    them (they were held until the next training step, and the check added them all up: an error after 3 passes)."""
    base = tiny_model("llama")
    one_pass = {}

    class Measure(pl.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            one_pass["bytes"] = sum(t["bytes"] for t in offload.last_step.values())

    with SimulatedDevice() as sim:
        offload = ActivationOffload(hidden_states="cpu", selective="cpu", copy_on_host=True)
        module = FisherLM(clone(base), offload)
        room = {"bytes": None}

        def limit(reserve):
            return (
                None
                if room["bytes"] is None
                else room["bytes"] - offload.plan.activation_offload.engine.host.held_bytes
            )

        monkeypatch.setattr("lightning_ac.offload.host_pool.host_limit", limit)
        trainer = make_trainer([ActivationCheckpointing(selective=True), offload, Measure()], max_epochs=1)
        trainer.fit(module, _varying_lengths([32]))
        assert module.in_use == [0] * FisherLM.passes, "nothing held once each pass's backward is done"
        assert sim.live_bytes(RELOADED) == 0


def test_an_in_place_edit_of_a_saved_tensor_is_refused_as_plain_torch_refuses_it():
    """A value head ``sigmoid(v(h)).mul_(2).sub_(1)``: plain torch refuses the backward; a pack hook that keeps or
    moves the sigmoid's output turned that check off: gradients silently wrong (kept) or right by luck (moved)."""
    v = nn.Linear(8, 1)
    h = torch.randn(4, 16, 8, requires_grad=True)

    def step():
        torch.sigmoid(v(h)).mul_(2).sub_(1).sum().backward()

    with pytest.raises(RuntimeError) as plain:
        step()
    for min_bytes in (0, 2**20):  # moved, kept
        offloader = SavedTensorOffloader(TransferEngine(torch.device("cpu"), copy_on_host=True), "all", min_bytes)
        offloader.engine.start_step()
        with offloader.hooks(), pytest.raises(RuntimeError) as offloaded:
            step()
        assert str(offloaded.value) == str(plain.value), min_bytes


class ValueHeadLM(LM):
    """A causal LM with a value head edited in place after its sigmoid (a reward model's tanh-like squashing)."""

    def __init__(self, model):
        super().__init__(model)
        self.value = nn.Linear(model.config.hidden_size, 1)

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        out = self.model(input_ids=ids, labels=ids, output_hidden_states=True)
        value = torch.sigmoid(self.value(out.hidden_states[-1])).mul_(2).sub_(1)
        return out.loss + value.mean()


@pytest.mark.parametrize("min_offload_bytes", [0, 2**16], ids=["moved", "kept"])
def test_a_value_head_edited_in_place_fails_with_offloading_as_without(min_offload_bytes):
    base = tiny_model("llama")
    with pytest.raises(RuntimeError) as plain:
        make_trainer().fit(ValueHeadLM(clone(base)), _varying_lengths([32]))
    offload = ActivationOffload(all="cpu", min_offload_bytes=min_offload_bytes, copy_on_host=True)
    with pytest.raises(RuntimeError) as offloaded:
        make_trainer([offload]).fit(ValueHeadLM(clone(base)), _varying_lengths([32]))
    assert str(offloaded.value) == str(plain.value)
    assert "modified by an inplace operation" in str(plain.value)


@pytest.mark.simulated
def test_a_copy_the_cycle_collector_frees_inside_the_pool_gives_its_slice_back():
    """A copy reachable only through a cycle (an exception's traceback) is freed by the cycle collector, which may run
    at any allocation, inside the pool's own code too: its finalizer only queues what it gives back (it took a lock
    the pool held, and the thread hung)."""
    import gc

    class Owner:
        pass

    with SimulatedDevice():
        memory = TransferEngine(torch.device("cpu"), copy_on_host=True).host
        owner = Owner()
        owner.cycle = owner
        memory.take(1024, owner)
        del owner
        slice_arena = memory._slice

        def collecting(nbytes):
            gc.collect()
            return slice_arena(nbytes)

        memory._slice = collecting
        kept = torch.empty(0)
        memory.take(1024, kept)
        assert memory.in_use_bytes == 1024


@pytest.mark.simulated
def test_a_pinned_cap_is_kept_without_freeing_the_pool_every_other_step():
    """Steps moving more than ``max_pinned_bytes``: the arenas under the cap stay, the rest goes through pageable
    memory (the pool was freed and pinned again every other step); a cap below one aligned copy pins nothing."""
    with SimulatedDevice() as sim:
        engine = TransferEngine(torch.device("cpu"), copy_on_host=True, max_pinned_bytes=4 * 2**20)
        allocations = []
        for _ in range(4):
            held = _step_of_small_tensors(engine, [2**20] * 6)
            allocations.append(sim.host.pinned_allocations)
            del held
            engine.finish_step()
        assert allocations[1:] == [allocations[0]] * 3 and sim.host.pinned_bytes <= 4 * 2**20
        tiny = TransferEngine(torch.device("cpu"), copy_on_host=True, max_pinned_bytes=1000)
        _, pinned = tiny.host.take(1000, torch.empty(0))
        assert not pinned and tiny.host.pinned_bytes == 0
