"""The simulated asynchronous device: the hazards it models, and the memory claims of the engines' accelerator
branch checked on it.

The exactness tests of tests/test_offload.py, tests/test_layer_offload.py and tests/test_selective.py run once
with ``copy_on_host`` (the synchronous branch) and once on the simulated device (the ``transfer`` fixture, marker
``simulated``). This module tests the simulator itself, and what only it can measure.

What the simulator cannot model (see lightning_ac/testing/simulated.py): its compute stream is the CPU, so
(1) a side stream can never read a compute output before it is written: the simulator instead requires a fresh
``wait_stream(compute)`` before each copy of a compute-produced tensor (``test_copy_of_a_compute_output_needs_a_wait``);
(2) compute has finished with a tensor before the allocator could reuse its memory, so a missing
``record_stream`` changes no value: ``test_what_compute_uses_is_recorded_to_its_stream`` checks the calls.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from conftest import assert_same_training, clone, fit, tiny_model
from torch import nn

from lightning_ac import ActivationCheckpointing, ActivationOffload, LayerOffload
from lightning_ac.offload import TransferEngine
from lightning_ac.offload.weights import LayerWeightStreamer, frozen_layer_parameters
from lightning_ac.testing.simulated import SimulatedDevice, SimulatedDeviceError

pytestmark = pytest.mark.simulated


# -- the simulator --------------------------------------------------------------------------------------------


def test_a_copy_lands_only_when_waited_for():
    with SimulatedDevice() as sim:
        side = sim.new_stream()
        src, dst = torch.arange(4.0), torch.zeros(4)
        side.wait_stream(sim.current_stream())
        with sim.use_stream(side):
            sim.copy_to_host(dst, src, "test copy")
            done = side.record_event()
        assert dst.isnan().all(), "poison until the copy runs"
        assert not done.query()
        sim.current_stream().wait_event(done)
        assert torch.equal(dst, src) and done.query()


def test_integer_poison_and_synchronize():
    with SimulatedDevice() as sim:
        side = sim.new_stream()
        host = sim.pinned_empty(32).view(torch.int64).fill_(7)
        with sim.use_stream(side):
            dst = sim.to_device(host, "test copy")
        assert (dst == -1).all()
        sim.synchronize()
        assert (dst == 7).all()


def test_a_source_released_under_a_pending_copy_is_an_error():
    with SimulatedDevice() as sim:
        side = sim.new_stream()
        src, dst = torch.randn(8), sim.pinned_empty(32)
        side.wait_stream(sim.current_stream())
        with sim.use_stream(side):
            sim.copy_to_host(dst.view(torch.float32), src, "host copy of a saved activation")
        del src  # nothing keeps the device tensor alive until its copy has run
        with pytest.raises(
            SimulatedDeviceError, match="source of a pending copy \\(host copy of a saved activation\\)"
        ):
            side.record_event()
        sim.synchronize()


def test_memory_written_by_a_pending_copy_on_another_stream_needs_a_wait():
    with SimulatedDevice() as sim:
        d2h, h2d = sim.new_stream(), sim.new_stream()
        host, saved = sim.pinned_empty(16), torch.ones(16, dtype=torch.uint8)
        d2h.wait_stream(sim.current_stream())
        with sim.use_stream(d2h):
            sim.copy_to_host(host, saved, "host copy")
            written = d2h.record_event()
        with sim.use_stream(h2d), pytest.raises(SimulatedDeviceError, match="reload.*without waiting"):
            sim.to_device(host, "reload")
        h2d.wait_event(written)
        with sim.use_stream(h2d):
            back = sim.to_device(host, "reload")
        sim.current_stream().wait_event(h2d.record_event())
        assert (back == 1).all()


def test_copy_of_a_compute_output_needs_a_wait():
    with SimulatedDevice() as sim:
        side = sim.new_stream()
        saved = torch.ones(16, dtype=torch.uint8)
        with sim.use_stream(side), pytest.raises(SimulatedDeviceError, match="has not waited on the compute stream"):
            sim.copy_to_host(sim.pinned_empty(16), saved, "host copy")


def test_memory_recorded_to_compute_is_held_until_compute_passes_its_release():
    with SimulatedDevice() as sim:
        h2d, host = sim.new_stream(), torch.ones(256)
        with sim.use_stream(h2d):
            weights = sim.to_device(host, "layer weights: layer 0")
            loaded = h2d.record_event()
        compute = sim.current_stream()
        compute.wait_event(loaded)
        sim.record_stream(weights, compute)
        assert sim.recorded_to_compute(weights)
        del weights
        released = compute.record_event()  # the device reaches this point after its last use
        with sim.use_stream(h2d):
            sim.to_device(host, "layer weights: layer 1")
        assert sim.peak_bytes["layer weights"] == 2 * 1024, "the first copy's memory is not reusable yet"
        released.synchronize()
        with sim.use_stream(h2d):
            sim.to_device(host, "layer weights: layer 2")
        assert sim.peak_bytes["layer weights"] == 2 * 1024


# -- the activation transfer engine ---------------------------------------------------------------------------


def test_the_stash_holds_two_of_the_largest_tensors_and_the_compute_stream_waits_for_the_rest():
    """What waits on the device for its copy to the host is bounded in bytes (two of the largest tensors offloaded,
    by default): at the bound the compute stream, not the host, waits for the oldest copy. With copies that run only
    when waited for, the device holds exactly the bound; forward asks the host to wait for nothing."""
    tensors = [torch.randn(64) for _ in range(10)]  # 256 bytes each
    with SimulatedDevice() as sim:
        engine = TransferEngine(torch.device("cpu"), copy_on_host=True)
        engine.start_step()
        packed = [engine.pack(t * 1, "all") for t in tensors]  # fresh compute outputs, dropped by the forward
        assert sim.host.host_waits == 0, "the host waited on a copy in forward"
        out = [engine.unpack(p) for p in reversed(packed)][::-1]
        engine.finish_step()
    d2h = sim.streams[0].name
    assert sim.peak_in_flight_bytes[d2h] == 2 * 256 and sim.peak_in_flight[d2h] == 2
    assert engine.stash_bound() == 2 * 256
    for a, b in zip(tensors, out):
        assert torch.equal(a, b)


def test_the_stash_bound_in_bytes_holds_smaller_tensors_up_to_it():
    sizes = [64, 16, 16, 16, 64, 16, 16]  # floats
    with SimulatedDevice() as sim:
        engine = TransferEngine(torch.device("cpu"), copy_on_host=True, stash_bytes=100 * 4)
        engine.start_step()
        tensors = [torch.randn(n) for n in sizes]
        packed = [engine.pack(t * 1, "all") for t in tensors]
        out = [engine.unpack(p) for p in reversed(packed)][::-1]
        engine.finish_step()
    d2h = sim.streams[0].name
    assert sim.peak_in_flight_bytes[d2h] == (64 + 16 + 16) * 4, "64 + 16 + 16 floats fit 100; a fourth does not"
    assert sim.host.host_waits == 2, "finish_step's end-of-step synchronize of both side streams, nothing before it"
    for a, b in zip(tensors, out):
        assert torch.equal(a, b)


def test_a_steady_step_copies_into_pooled_pinned_buffers_only():
    """Offload without recompute (``all: cpu``) moves every saved activation: after the first step every copy goes to
    a pinned buffer from the pool (no new pinned allocation, nothing through pageable memory, which is synchronous
    on a device), however much the step moves (no fixed cap on the pool: the host memory check bounds it)."""

    class PerStep(pl.Callback):
        def __init__(self, sim):
            self.sim, self.pinned, self.pageable = sim, [], []

        def on_train_batch_end(self, *args):
            self.pinned.append(self.sim.host.pinned_allocations)
            self.pageable.append(self.sim.host.pageable_copies)

    base = tiny_model("llama")
    reference = fit(clone(base), max_steps=3)
    with SimulatedDevice() as sim:
        per_step = PerStep(sim)
        offload = ActivationOffload(all="cpu", min_offload_bytes=0, copy_on_host=True)
        run = fit(clone(base), [offload, per_step], max_steps=3)
    assert reference.losses == run.losses
    assert per_step.pinned[0] > 0 and per_step.pinned == [per_step.pinned[0]] * 3, per_step.pinned
    assert per_step.pageable == [0, 0, 0]
    assert offload.request.max_pinned_bytes is None


def test_the_pinned_pool_has_no_fixed_cap_below_what_a_step_moves():
    """A step that moves more than 8 GiB (the pool's old cap; the H200's gpu-8k `offload_only` step moves about 10 GB)
    still copies into pinned memory: the buffer is only reserved here, never written."""
    with SimulatedDevice() as sim:
        engine = TransferEngine(torch.device("cpu"), copy_on_host=True)
        engine.start_step()
        owners = [torch.empty(0) for _ in range(3)]  # what the buffers are given back with
        buffers = [engine.host.take(3 * 2**30, owner) for owner in owners]
        assert all(pinned for _, pinned in buffers) and sim.host.pinned_allocations == 3
        capped = TransferEngine(torch.device("cpu"), copy_on_host=True, max_pinned_bytes=2**30)
        assert capped.host.take(2**30, owners[0])[1], "max_pinned_bytes still caps"
        assert not capped.host.take(2**20, owners[1])[1], "max_pinned_bytes still caps"
        del buffers


def test_an_edit_racing_the_copy_is_detected():
    with SimulatedDevice():
        engine = TransferEngine(torch.device("cpu"), copy_on_host=True)
        engine.start_step()
        saved = torch.ones(4)
        packed = engine.pack(saved, "all")
        saved.mul_(2)  # the compute stream edits it while the copy has not run yet
        engine.finish_step()
        with pytest.raises(RuntimeError, match="edited in place while it was being copied"):
            engine.unpack(packed, check_version=False)  # selective checkpointing's storage: SAC checks the version
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            engine.unpack(packed)


def test_what_compute_uses_is_recorded_to_its_stream():
    with SimulatedDevice() as sim:
        engine = TransferEngine(torch.device("cpu"), copy_on_host=True)
        engine.start_step()
        packed = engine.pack(torch.randn(16) * 1, "all")
        out = engine.unpack(packed)
        assert sim.recorded_to_compute(out), "reloaded bytes used by compute: record_stream(compute)"
        engine.finish_step()

        blocks = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))).requires_grad_(False)
        streamer = LayerWeightStreamer(list(blocks), frozen_layer_parameters(list(blocks)), torch.device("cpu"))
        streamer.install()
        seen = []
        blocks[1].register_forward_pre_hook(lambda m, a: seen.append(sim.recorded_to_compute(m.weight)))
        blocks(torch.randn(2, 8))
        streamer.close()
    assert seen == [True], "a layer's device copies used by compute: record_stream(compute)"


@pytest.mark.parametrize("offload", [{"hidden_states": "cpu"}, {"all": "cpu", "min_offload_bytes": 0}])
def test_gradient_accumulation(offload, transfer):
    base = tiny_model("llama", lora=True)
    reference = fit(clone(base), max_steps=2, accumulate_grad_batches=2)
    checkpointing = [ActivationCheckpointing()] if "hidden_states" in offload else []
    run = fit(clone(base), [*checkpointing, ActivationOffload(copy_on_host=True, **offload)], max_steps=2,
              accumulate_grad_batches=2)  # fmt: skip
    assert_same_training(reference, run)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_sliding_window_families_with_offloaded_selective_saves(family, transfer):
    base = tiny_model(family, lora=True)
    reference = fit(clone(base), max_steps=2)
    offload = ActivationOffload(hidden_states="cpu", selective="cpu", copy_on_host=True)
    run = fit(clone(base), [ActivationCheckpointing(selective=True), offload], max_steps=2)
    assert_same_training(reference, run)


# -- layer offloading: two layers at most, however far the CPU runs ahead -------------------------------------


def _layer_bytes(model: nn.Module) -> int:
    layer = model.base_model.model.model.layers[0]
    return sum(p.numel() * p.element_size() for p in layer.parameters() if not p.requires_grad)


@pytest.mark.parametrize(
    "others",
    [[], [ActivationCheckpointing], [lambda: ActivationOffload(all="cpu", copy_on_host=True, min_offload_bytes=0)]],
    ids=["alone", "checkpointed", "offload_all"],
)
def test_layer_offload_holds_two_layers_on_the_device(others):
    """The simulated device never catches up on its own (the CPU runs ahead as far as it can): the weights on
    the device still stay at two layers, because each copy waits for the release the device must pass first."""
    base = tiny_model("llama", lora=True, num_hidden_layers=8)
    reference = fit(clone(base), max_steps=2)
    with SimulatedDevice() as sim:
        run = fit(clone(base), [make() for make in others] + [LayerOffload(copy_on_host=True)], max_steps=2)
    assert_same_training(reference, run)
    assert sim.peak_bytes["layer weights"] == 2 * _layer_bytes(base)


def test_closing_after_an_exception_waits_for_the_copies_in_flight():
    """An exception between layers leaves the next layer's copy in flight; close() must let it finish before it
    gives the host buffers up (on CUDA: before cudaHostUnregister and freeing memory a DMA still reads)."""
    blocks = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))).requires_grad_(False)
    expected = [b.weight.detach().clone() for b in blocks]

    def boom(module, args, output):
        raise RuntimeError("boom")

    with SimulatedDevice():
        streamer = LayerWeightStreamer(list(blocks), frozen_layer_parameters(list(blocks)), torch.device("cpu"))
        streamer.install()
        blocks[0].register_forward_hook(boom)  # after the streamer's post hook, which started loading block 1
        with pytest.raises(RuntimeError, match="boom"):
            blocks(torch.randn(2, 8))
        streamer.close()
    for block, weight in zip(blocks, expected):
        assert torch.equal(block.weight, weight)


def test_a_new_host_buffer_waits_for_copies_still_reading_the_old_one():
    """A dtype conversion gives each streamed layer a new host buffer and unpins the old one; a prefetch released
    unused (after a failed step) may still be copying from it, so the unpin waits for the copies first."""
    blocks = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))).requires_grad_(False)
    expected = [b.weight.detach().double() for b in blocks]
    with SimulatedDevice() as sim:
        streamer = LayerWeightStreamer(list(blocks), frozen_layer_parameters(list(blocks)), torch.device("cpu"))
        streamer.install()
        blocks[0](torch.randn(2, 8))  # its post hook starts copying block 1 in
        streamer.start_step()  # released unused, as after a failed step: the copy is still pending
        blocks.to(torch.float64)
        assert sorted(sim.pinned_in_place.values()) == [(8 * 8 + 8) * 8] * 3, "one float64 buffer per layer"
        streamer.close()
    for block, weight in zip(blocks, expected):
        assert torch.equal(block.weight, weight)


@pytest.mark.parametrize(
    "offload", [{"hidden_states": "cpu"}, {"all": "cpu", "min_offload_bytes": 0}], ids=["hidden_states", "all"]
)
def test_the_estimates_held_copies_are_what_a_device_whose_copies_land_late_holds(offload):
    """The estimate's fake step holds the device bytes awaiting their copy as if no copy finished early
    (``hold_copies_in_flight``, on the synchronous path); on the simulated device, whose copies run only when waited
    for, the stash holds the same bytes, and they are what the device's copy stream had in flight at most: the bound,
    two of the largest tensors offloaded."""
    from lightning_ac.offload.device import hold_copies_in_flight

    class Held(pl.Callback):
        def __init__(self):
            self.steps = []

        def on_train_batch_end(self, *args):
            engine = offloading.plan.activation_offload.engine
            self.steps.append((engine.peak_held_bytes, engine.stash_bound()))

    base = tiny_model("llama")
    reference = fit(clone(base), [ActivationCheckpointing()], max_steps=2)
    held = {}
    for name, context in (("simulated", SimulatedDevice), ("held", hold_copies_in_flight)):
        held[name] = Held()
        offloading = ActivationOffload(copy_on_host=True, **offload)
        with context() as sim:
            run = fit(clone(base), [ActivationCheckpointing(), offloading, held[name]], max_steps=2)
        assert_same_training(reference, run)
        if name == "simulated":
            in_flight = sim.peak_in_flight_bytes[sim.streams[0].name]
    assert held["simulated"].steps == held["held"].steps
    peak, bound = held["held"].steps[-1]
    assert peak == bound == in_flight > 0
