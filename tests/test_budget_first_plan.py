"""The memory budget's first plan from the run's own training step on fake tensors (``budget_first_plan:
estimate``): in a real Trainer, bit-exact at every step, the first real step's recompute counted with a
TorchDispatchMode and its peak measured with MemTracker (the benchmark's StepMetrics)."""

from __future__ import annotations

from typing import Any, List

import lightning.pytorch as pl
import pytest
import torch
from conftest import clone, make_trainer, model_fingerprint, tiny_model
from test_budget_mode import MM, STEPS, Controller, StepLM, assert_exact, loader, recomputed, train

from lightning_ac import ActivationCheckpointing, ActivationOffload, ConfigError, LayerOffload, parse_config
from lightning_ac.budget import Choice

FIRST_LINE = "budget: the first plan, from the training step on fake tensors at the first batch's shape (2x32)"


class FakeableLM(StepLM):
    """A training step that reads no tensor's value (the loss is recorded after the step, from its output), and logs
    its loss with ``self.log``."""

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("train_loss", loss, on_step=True, batch_size=batch[0].shape[0])
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"].detach()))
        super().on_train_batch_end(outputs, batch, batch_idx)


class StartChoices(pl.Callback):
    """The budget's choices as each step starts (after the suite's callbacks set them) and what the model holds."""

    def __init__(self) -> None:
        self.choices: List[List[Choice]] = []
        self.fake_tensors = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from torch._subclasses.fake_tensor import FakeTensor

        cb = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
        self.choices.append(list(cb.plan.budget.choices))
        tensors = [*pl_module.parameters(), *pl_module.buffers()]
        self.fake_tensors += sum(isinstance(t, FakeTensor) for t in tensors)


@pytest.fixture(scope="module")
def references():
    base = tiny_model("llama")
    off, off_peak, _, _ = train(base, steps=STEPS)
    full, full_peak, _, _ = train(base, [ActivationCheckpointing()])
    return {"base": base, "off": off, "off_peak": off_peak, "full": full, "full_peak": full_peak}


def run(refs, fraction: float, first_plan: str, lm=FakeableLM, **kwargs: Any):
    budget = int(refs["full_peak"] + fraction * (refs["off_peak"] - refs["full_peak"]))
    start = StartChoices()
    callback = ActivationCheckpointing(budget=budget, budget_first_plan=first_plan)
    module, _, probe, trainer = train(refs["base"], [callback, start], measure_step=0, lm=lm, **kwargs)
    return budget, module, probe, start, trainer


@pytest.mark.parametrize("fraction", [0.25, 0.6])
def test_the_first_real_step_runs_the_plan_a_fake_step_made_and_checks_it(references, fraction, caplog):
    budget, module, probe, start, trainer = run(references, fraction, "estimate")
    measured_budget, _, measured, _, _ = run(references, fraction, "measure")
    assert budget == measured_budget
    # the measured run's first step recomputes every layer; the estimate's runs the plan that step would have made
    # (as many layers kept: between alike layers the fake step's host times, which say nothing of the device, pick)
    first = start.choices[0]
    assert first != [Choice.recompute] * 4 and recomputed(first) == recomputed(measured.choices[0])
    off_mm = references["off"].step_ops[-1][MM]
    assert module.step_ops[0][MM] == off_mm + 6 * recomputed(first) < references["full"].step_ops[0][MM]
    # the first real step checked the plan: it fit, so it stayed, with no correction, and settled there
    assert probe.choices[0] == first and probe.budget.settled and probe.budget.corrections == 0
    assert probe.budget.measured_peak <= budget
    estimated = probe.budget.estimated_peak
    assert abs(estimated - probe.budget.measured_peak) <= 0.02 * probe.budget.measured_peak
    assert_exact(references["off"], module)
    assert len(module.losses) == STEPS and start.fake_tensors == 0
    assert sum(FIRST_LINE in m for m in caplog.messages) == 1, "one line, for the estimated run"
    # what the fake step logged was not kept: the logged loss is the last real step's
    assert float(trainer.callback_metrics["train_loss"]) == module.losses[-1]


def test_the_fake_step_leaves_the_run_and_the_model_as_they_were(references):
    """The random state after the run is the one a measured first step leaves (the fake step drew nothing), and the
    model's parameters are the same objects, unchanged."""
    after = {}
    for first_plan in ("measure", "estimate"):
        module = FakeableLM(clone(references["base"]))
        fingerprint, parameters = model_fingerprint(module), [id(p) for p in module.parameters()]
        dtype = torch.get_default_dtype()
        callback = ActivationCheckpointing(budget=references["full_peak"] * 2, budget_first_plan=first_plan)
        torch.manual_seed(7)
        make_trainer([callback], max_steps=1).fit(module, loader(seqs=(32,)))
        after[first_plan] = torch.get_rng_state()
        assert [id(p) for p in module.parameters()] == parameters and torch.get_default_dtype() == dtype
        assert not {"log", "log_dict"} & set(vars(module)), "the class's methods, not copies left in the instance"
        assert all(p.grad is None or p.grad.device.type == "cpu" for p in module.parameters())
        assert model_fingerprint(module) == fingerprint and module.losses, "as found, and readable: real storage"
    assert torch.equal(after["measure"], after["estimate"])


def test_a_step_that_cannot_run_on_fake_tensors_is_warned_and_the_first_step_measures(references):
    # conftest's LM reads the loss's value in training_step (float(loss)), which a fake tensor does not have
    with pytest.warns(UserWarning, match=r"budget_first_plan: estimate: the training step could not run on fake tensors"
                      r" \(DataDependentOutputException.*loss.item\(\)") as warned:  # fmt: skip
        _, module, probe, start, _ = run(references, 0.5, "estimate", lm=StepLM)
    assert len([w for w in warned if "fake tensors" in str(w.message)]) == 1
    assert start.choices[0] == [Choice.recompute] * 4, "measured as with budget_first_plan: measure"
    assert probe.budget.settled and recomputed(probe.choices[-1]) < 4
    assert_exact(references["off"], module)
    assert len(module.losses) == STEPS, "the fake step left nothing in the module's records"


def test_the_field_names_its_values_and_needs_a_budget():
    assert parse_config({"budget": "1GiB"}).budget_first_plan == "measure"
    assert parse_config({"budget": "1GiB", "budget_first_plan": "Estimate"}).budget_first_plan == "estimate"
    with pytest.raises(ConfigError, match=r"activation_checkpointing.budget_first_plan: expected one of measure, "
                       r"estimate, got 'guess'\. measure: the first step"):  # fmt: skip
        parse_config({"budget": "1GiB", "budget_first_plan": "guess"})
    with pytest.raises(ConfigError, match=r"ActivationCheckpointing\(budget_first_plan=\.\.\.\): expected one of"):
        ActivationCheckpointing(budget="1GiB", budget_first_plan=True)
    with pytest.raises(ConfigError, match="budget_first_plan: estimate says where.*budget is not set. Set budget"):
        parse_config({"budget_first_plan": "estimate"})
    with pytest.raises(ConfigError, match="budget is not set"):
        ActivationCheckpointing(budget_first_plan="estimate")


class ManualLM(FakeableLM):
    def __init__(self, model):
        super().__init__(model)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.manual_backward(loss)
        self.optimizers().step()
        return loss


@pytest.mark.parametrize("case", ["manual", "activation-offload", "layer-offload"])
def test_what_a_fake_step_cannot_run_is_a_config_error_at_setup(references, case):
    block = ActivationCheckpointing(budget=references["full_peak"] * 2, budget_first_plan="estimate")
    others = {"activation-offload": [ActivationOffload(hidden_states="cpu", copy_on_host=True)],
              "layer-offload": [LayerOffload(copy_on_host=True)]}.get(case, [])  # fmt: skip
    base = tiny_model("llama", lora=case == "layer-offload")
    module = (ManualLM if case == "manual" else FakeableLM)(clone(base))
    fix = "budget_first_plan: measure"
    match = {"manual": "uses manual optimization", "activation-offload": "activation offloading \\(offload.\\*\\)",
             "layer-offload": "layer offloading cannot run"}[case]  # fmt: skip
    with pytest.raises(ConfigError, match=f"activation_checkpointing.budget_first_plan: estimate .*{match}.*{fix}"):
        make_trainer([block, *others], max_steps=2).fit(module, loader())
    assert module.losses == [] and model_fingerprint(module) == model_fingerprint(FakeableLM(clone(base)))


def test_a_resumed_plan_takes_no_fake_step(references, tmp_path, caplog):
    budget = int((references["full_peak"] + references["off_peak"]) / 2)
    callback = ActivationCheckpointing(budget=budget, budget_first_plan="estimate")
    _, _, probe, _ = train(references["base"], [callback], steps=3, default_root_dir=tmp_path,
                           enable_checkpointing=True, lm=FakeableLM)  # fmt: skip
    ckpt = next(tmp_path.rglob("*.ckpt"))
    caplog.clear()
    again, start = Controller(), StartChoices()
    resumed = ActivationCheckpointing(budget=budget, budget_first_plan="estimate")
    trainer = make_trainer([resumed, again, start], max_steps=5, default_root_dir=tmp_path)
    trainer.fit(FakeableLM(clone(references["base"])), loader(), ckpt_path=ckpt)
    assert not any(FIRST_LINE in m for m in caplog.messages)
    assert start.choices[0] == probe.choices[-1], "the checkpoint's plan, not a fake step's"


def test_the_first_real_step_times_every_layer_on_the_devices_clock(references, monkeypatch):
    """The fake step's layer times are the host's time for ops that computed nothing (on CUDA, device events around
    no work would read zero): the first real step times each layer's forward, and the figures take those."""
    import lightning_ac.callbacks.base as callbacks_module

    fake_times = []
    make_plan = callbacks_module.plan_from_fake_step

    def recording(controller, *args):
        made = make_plan(controller, *args)
        fake_times.append([f.recompute_seconds for f in controller.figures])
        return made

    monkeypatch.setattr(callbacks_module, "plan_from_fake_step", recording)
    _, _, probe, _, _ = run(references, 0.5, "estimate")
    (fake,) = fake_times
    real = [f.recompute_seconds for f in probe.budget.figures]
    assert all(r > 0 for r in real) and all(r != f for r, f in zip(real, fake)), (real, fake)


def test_alike_layers_times_in_another_order_on_the_device_do_not_move_the_plan(references, monkeypatch):
    """Alike layers cost alike; their measured times differ by the clock's noise, in any order. The fake step's
    (descending here) and the first real step's (ascending) pick the same layers, so the real step settles the plan
    with no correction. Before, each clock's order picked its own alike layer to keep: a loaded machine moved the
    plan in a correction step that changed nothing but which alike layer was kept."""
    from lightning_ac.budget.measure import LayerMeter

    stop = LayerMeter.stop
    stops = []

    def in_order(self):
        readings = stop(self)
        order = range(len(readings)) if stops else reversed(range(len(readings)))
        stops.append(None)
        for reading, rank in zip(readings, order):
            reading.forward_seconds = 0.01 * (1 + 0.05 * rank)
        return readings

    monkeypatch.setattr(LayerMeter, "stop", in_order)
    _, module, probe, start, _ = run(references, 0.6, "estimate")  # some layers kept, some not: which, the times say
    first = start.choices[0]
    assert Choice.keep in first and Choice.recompute in first
    assert probe.choices[0] == first and probe.budget.settled and probe.budget.corrections == 0
    assert len({f.recompute_seconds for f in probe.budget.figures}) == 1, "one time for alike layers"
    # the fake step's peak (every layer recomputed) is not among the real steps' measured choices
    assert list(probe.budget._measured) == [tuple(first)]
    assert_exact(references["off"], module)


def test_no_layer_keeps_the_fake_steps_clock_when_every_alike_layer_runs_the_save_rules(references, monkeypatch):
    """The first real step retimes every layer on the device's clock; where every alike layer ran the save rules
    (no whole forward of their kind to time), each takes its own forward's time, not the fake step's host time."""
    from test_budget_mode import _slow_recompute

    from lightning_ac.budget.measure import LayerMeter

    _slow_recompute(monkeypatch)  # the save rules look faster than a whole recompute: chosen wherever they fit
    stop, stops = LayerMeter.stop, []

    def host_clock_apart(self):
        readings = stop(self)
        if not stops:  # the fake step: a time no real forward of this tiny model takes
            for reading in readings:
                reading.forward_seconds = 1000.0
        stops.append(None)
        return readings

    monkeypatch.setattr(LayerMeter, "stop", host_clock_apart)
    budget = int(references["full_peak"] + 0.1 * (references["off_peak"] - references["full_peak"]))
    start = StartChoices()
    callback = ActivationCheckpointing(budget=budget, budget_first_plan="estimate", selective=True)
    module, _, probe, _ = train(references["base"], [callback, start], lm=FakeableLM)
    assert start.choices[0] == [Choice.selective] * 4, start.choices[0]
    assert all(f.recompute_seconds < 1000.0 for f in probe.budget.figures), probe.budget.figures
    assert_exact(references["off"], module)


class FirstFigures(pl.Callback):
    """The budget's figures once its first plan is made: after the fake step (estimate) or the first step (measure)."""

    def __init__(self) -> None:
        self.figures: Any = None

    def _take(self, trainer) -> None:
        cb = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
        if self.figures is None and cb.plan.budget.figures is not None:
            figures = cb.plan.budget.figures
            self.figures = [(f.saved_bytes, f.input_bytes, f.input_saved_bytes) for f in figures]
            self.head = (cb.plan.budget.outside_bytes, cb.plan.budget.head_bytes)

    def on_train_batch_start(self, trainer, *args):
        self._take(trainer)

    def on_train_batch_end(self, trainer, *args):
        self._take(trainer)


def test_the_fake_step_runs_in_the_trainers_precision(references):
    """Under ``bf16-mixed`` Lightning runs the training step in the precision plugin's autocast: the fake step too, so
    its figures are those the measuring step takes (in fp32 it measured the layers' activations twice as large)."""
    taken = {}
    budget = int(references["off_peak"])
    for first_plan in ("measure", "estimate"):
        first = FirstFigures()
        callback = ActivationCheckpointing(budget=budget, budget_first_plan=first_plan)
        train(references["base"], [callback, first], steps=2, lm=FakeableLM, precision="bf16-mixed")
        taken[first_plan] = first.figures, first.head
    assert taken["estimate"][0] == taken["measure"][0], "each layer's figures, to the byte"
    (outside, head), (measured_outside, measured_head) = taken["estimate"][1], taken["measure"][1]
    # the head's working set differs by a few scalars' bytes under autocast (28 of 99,572), not by a dtype
    assert outside == measured_outside and abs(head - measured_head) <= 64, (head, measured_head)


class KeepingLM(FakeableLM):
    """A training step that keeps what it computed beside its parameters, as Lightning's docs suggest in place of
    ``training_epoch_end``: each step's loss appended to a list, and a running sum rebound to a new tensor."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.step_outputs: List[torch.Tensor] = []
        self.loss_sum = torch.zeros(())

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.step_outputs.append(loss.detach())
        self.loss_sum = self.loss_sum + loss.detach()
        return loss


def test_what_the_step_keeps_beside_its_parameters_is_the_real_steps_alone(references):
    """The fake step's appends and rebinds do not stay: the list holds each real step's loss, the sum theirs, and no
    fake tensor is left on the module."""
    from torch._subclasses.fake_tensor import FakeTensor

    budget = int(references["full_peak"] + 0.6 * (references["off_peak"] - references["full_peak"]))
    callback = ActivationCheckpointing(budget=budget, budget_first_plan="estimate")
    module, _, _, _ = train(references["base"], [callback], lm=KeepingLM)
    assert [float(loss) for loss in module.step_outputs] == module.losses and len(module.losses) == STEPS
    assert not isinstance(module.loss_sum, FakeTensor) and float(module.loss_sum) == pytest.approx(sum(module.losses))
