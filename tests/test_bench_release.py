"""The benchmark frees each mode before the next starts (issue 57, item 13): a mode's model copy, optimizer state and
trainer lived until Python's cycle collector happened to run, so that 8 modes on cpu-small held nearly twice the
resident memory of 2, and on a GPU a later mode ran beside earlier ones' device memory. The benchmark runs here with
the collector on, as users run it, and the tests never collect themselves (but one, which shows what no collection
frees)."""

from __future__ import annotations

import gc
import weakref
from typing import Dict, List

# peft's first import (through bitsandbytes' lookup of a kernel on the Hugging Face hub) logs a warning whose argument
# is the exception, and with it the traceback of every frame that imported peft. pytest keeps a test's log records
# until the test ends: a first import inside a selective mode (lightning_ac.selective.matching imports peft there)
# kept that mode's frames, and its model, alive for the test. A user's run keeps no record; imported here first.
import peft  # noqa: F401
import pytest
import torch
from conftest import tiny_model
from test_bench import tiny_preset

import lightning_ac.bench.run as run
from lightning_ac.memory import measure_step

MODES = ["off", "full", "selective_attn", "budget_50"]


def _observe_modes(monkeypatch) -> List[Dict[str, bool]]:
    """Weak references to what each mode builds (its module, model copy, a parameter, its trainer, optimizer and an
    optimizer state tensor), and for each mode after the first, which of the previous mode's were still alive when
    it started: the list returned fills as the benchmark runs."""
    refs: Dict[str, weakref.ref] = {}
    alive_at_start: List[Dict[str, bool]] = []

    class Observed(run._BenchModule):
        def on_fit_start(self) -> None:
            refs.clear()
            refs.update(
                module=weakref.ref(self),
                model=weakref.ref(self.model),
                parameter=weakref.ref(next(self.model.parameters())),
                trainer=weakref.ref(self.trainer),
            )

        def on_train_start(self) -> None:
            refs["optimizer"] = weakref.ref(self.trainer.optimizers[0])

        def on_train_batch_end(self, *args) -> None:
            state = self.trainer.optimizers[0].state
            if "optimizer_state" not in refs and state:
                refs["optimizer_state"] = weakref.ref(next(iter(state.values()))["exp_avg"])

    original = run._run_mode

    def starting(*args, **kwargs):  # no local of its own that holds a mode's objects
        if refs:
            alive_at_start.append({name: ref() is not None for name, ref in refs.items()})
        return original(*args, **kwargs)

    monkeypatch.setattr(run, "_BenchModule", Observed)
    monkeypatch.setattr(run, "_run_mode", starting)
    return alive_at_start


def test_each_mode_is_freed_before_the_next_starts_with_the_collector_left_on(monkeypatch):
    tiny_preset(monkeypatch)
    alive_at_start = _observe_modes(monkeypatch)
    assert gc.isenabled(), "the collector runs as users run the benchmark"
    rows = run.run_benchmark("tiny", MODES, steps=1)
    assert [r.status for r in rows] == ["ok"] * len(MODES)
    assert len(alive_at_start) == len(MODES) - 1
    for mode, alive in zip(MODES[1:], alive_at_start):
        assert set(alive) == {"module", "model", "parameter", "trainer", "optimizer", "optimizer_state"}
        assert not any(alive.values()), f"alive when {mode} started: {[name for name, a in alive.items() if a]}"


def test_a_mode_that_fails_is_freed_before_the_next_starts(monkeypatch):
    """A failed mode's traceback holds the frames that built it (its model copy, trainer): it is freed too."""
    tiny_preset(monkeypatch)
    alive_at_start = _observe_modes(monkeypatch)

    def failing_step(model):  # an anchor whose first decoder layer raises inside the Trainer's first step
        def fail(*args, **kwargs):
            raise RuntimeError("a step that fails")

        model.model.layers[0].forward = fail

    monkeypatch.setitem(run.ALL_ANCHORS, "failing_anchor", failing_step)
    rows = run.run_benchmark("tiny", ["off", "failing_anchor", "full"], steps=1)
    assert [r.status for r in rows] == ["ok", "failed: RuntimeError: a step that fails", "ok"]
    assert len(alive_at_start) == 2
    failed = alive_at_start[1]  # what the failed mode had built when it started its first step
    assert {"module", "model", "parameter", "trainer", "optimizer"} <= set(failed)
    assert not any(failed.values()), f"alive when full started: {[name for name, a in failed.items() if a]}"


def test_a_measured_step_lets_go_of_its_graph_and_the_models_parameters():
    """The CPU measurement's module tracker hooked every module's inputs and dropped the hooks' handles: each hook
    and the autograd graph it watches hold each other partly in C++, where no collection reaches, so the measured
    step's graph, and every parameter it accumulates into, stayed alive for good (each benchmark mode's model)."""
    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    parameters = {name: weakref.ref(p) for name, p in model.named_parameters()}
    with measure_step([model], [optimizer], torch.device("cpu")) as measurement:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    assert measurement.result.activation_bytes > 0
    del model, optimizer, measurement  # the measurement names the model it measured
    gc.collect()  # what is left after a full collection is held for good
    assert [name for name, ref in parameters.items() if ref() is not None] == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_mode_starts_with_none_of_the_earlier_modes_device_memory_allocated_or_cached(monkeypatch):
    """What the device holds at each mode's start is the same from the second mode on (the libraries' workspaces,
    allocated in the first), and the allocator keeps no cached blocks beyond it."""
    tiny_preset(monkeypatch, hidden=256, seq=256)
    alive_at_start = _observe_modes(monkeypatch)
    device: List[tuple] = []
    original = run._run_mode

    def starting(*args, **kwargs):
        device.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
        return original(*args, **kwargs)

    monkeypatch.setattr(run, "_run_mode", starting)
    rows = run.run_benchmark("tiny", ["off", "full", "selective_attn"], steps=1)
    assert [r.status for r in rows] == ["ok"] * 3
    assert not any(any(alive.values()) for alive in alive_at_start), alive_at_start
    (_, _), (allocated_2, reserved_2), (allocated_3, reserved_3) = device
    assert allocated_3 == allocated_2, device
    assert reserved_2 - allocated_2 <= 2 * 2**20 and reserved_3 - allocated_3 <= 2 * 2**20, device
