"""The memory budget in a real Trainer: bit-exact at every step, recompute counted with a TorchDispatchMode, the peak
measured with MemTracker (the benchmark's StepMetrics, apart from the budget's own measurements)."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Dict, List

import lightning.pytorch as pl
import pytest
import torch
from conftest import LM, VOCAB, OpCounter, clone, make_trainer, model_fingerprint, tiny_model

from lightning_ac import (
    ActivationCheckpointing,
    ActivationOffload,
    ConfigError,
    LayerOffload,
    LightningACWarning,
    callbacks_from_config,
    parse_config,
)
from lightning_ac.bench.memory import StepMetrics
from lightning_ac.budget import Choice
from lightning_ac.budget.measure import LayerReading

STEPS = 5
MM = "aten.mm"
SDPA = "aten._scaled_dot_product_flash_attention_for_cpu"
LINE = re.compile(
    r"budget [\d.]+ [KMG]iB: keeping (\d)/4 decoder layers, (?:selective in (\d), )?recomputing (\d) "
    r"\(estimated peak [\d.]+ [KMG]iB, measured [\d.]+ [KMG]iB; recompute \d+% of full's\)"
)


class StepLM(LM):
    """Records the loss, the gradients and the backward's op counts of every step. The gradients are copied in the
    module's ``on_train_batch_end``, which Lightning calls after the callbacks': outside the memory measurements."""

    def __init__(self, model: torch.nn.Module, lr: float = 0.1) -> None:
        super().__init__(model, lr)
        self.step_grads: List[Dict[str, torch.Tensor]] = []
        self.step_ops: List[Counter] = []

    def on_before_backward(self, loss):
        self._counter = OpCounter()
        self._counter.__enter__()

    def on_after_backward(self):
        self._counter.__exit__(None, None, None)
        self.step_ops.append(self._counter.counts)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None})


def loader(seqs=(32,) * 4, seed: int = 1) -> torch.utils.data.DataLoader:
    """Batches of 2 sequences, of the given lengths, in order."""
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randint(0, VOCAB, (2, seq), generator=g),) for seq in seqs]
    return torch.utils.data.DataLoader(data, batch_size=None)


class Controller(pl.Callback):
    """Keeps the run's budget controller (the plan lets go of it at teardown) and its choices at each step's end."""

    def __init__(self) -> None:
        self.budget: Any = None
        self.choices: List[List[Choice]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        cb = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
        self.budget = cb.plan.budget
        self.choices.append(list(self.budget.choices))


class MaskLM(StepLM):
    """Batches of ``(ids,)`` or ``(ids, attention_mask)``: padded positions are masked and their labels ignored."""

    def training_step(self, batch, batch_idx):
        ids, mask = batch[0], batch[1] if len(batch) > 1 else None
        labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        self.losses.append(float(loss.detach()))
        return loss


def train(base, callbacks=(), steps: int = STEPS, data=None, measure_step: int = STEPS - 1, lm=StepLM, **kwargs):
    """A run of ``steps`` steps; the StepMetrics peak of ``measure_step`` (after the budget settled)."""
    module = lm(clone(base))
    metrics = StepMetrics(measure_step=measure_step, warmup_steps=0)
    probe = Controller()
    has_budget = any(isinstance(c, ActivationCheckpointing) and c.config.budget is not None for c in callbacks)
    trainer = make_trainer([*callbacks, metrics, *([probe] if has_budget else [])], max_steps=steps, **kwargs)
    trainer.fit(module, data if data is not None else loader())
    return module, metrics.peak.activation_bytes if metrics.peak else None, probe, trainer


def assert_exact(reference: StepLM, run: StepLM) -> None:
    """Same losses and bit-identical gradients at every step (of the run: the reference may have run longer)."""
    steps = len(run.losses)
    assert reference.losses[:steps] == run.losses and len(reference.step_grads) >= steps
    for step, (expected, got) in enumerate(zip(reference.step_grads, run.step_grads)):
        assert expected.keys() == got.keys()
        for name, grad in expected.items():
            assert torch.equal(grad, got[name]), f"step {step}: {name}"


@pytest.fixture(scope="module")
def references():
    """The base model, the unmodified run, and the activation peaks of off and full."""
    base = tiny_model("llama")
    off, off_peak, _, _ = train(base, steps=STEPS + 2)  # as long as the longest run compared with it
    full, full_peak, _, _ = train(base, [ActivationCheckpointing()])
    assert full_peak < off_peak
    return {"base": base, "off": off, "off_peak": off_peak, "full": full, "full_peak": full_peak}


def between(refs, fraction: float) -> int:
    return int(refs["full_peak"] + fraction * (refs["off_peak"] - refs["full_peak"]))


def recomputed(choices) -> int:
    return sum(c is not Choice.keep for c in choices)


# -- the field ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [(2**20, 2**20), ("24GiB", 24 * 2**30), ("512MiB", 512 * 2**20), ("20GB", 20 * 10**9), ("300 MB", 300 * 10**6)],
)
def test_budget_values(value, expected):
    assert parse_config({"budget": value}).budget == expected
    assert ActivationCheckpointing(budget=value).config.budget == expected
    assert parse_config({"budget": "AUTO"}).budget == "auto"


@pytest.mark.parametrize("value", [0, -5, True, 1.5, "12", "12 parsecs", "lots", [1]])
def test_rejected_budgets_name_the_field_the_value_and_the_fix(value):
    with pytest.raises(ConfigError) as err:
        parse_config({"budget": value})
    message = str(err.value)
    assert message.startswith("activation_checkpointing.budget: expected a size") and repr(value) in message
    assert "auto" in message and "GiB" in message
    with pytest.raises(ConfigError, match=r"ActivationCheckpointing\(budget=\.\.\.\)"):
        ActivationCheckpointing(budget=value)


def test_budget_with_enabled_false_or_every_n_layers_is_an_error():
    with pytest.raises(ConfigError, match="enabled is false.*budget is set.*remove budget"):
        parse_config({"enabled": False, "budget": "1GiB"})
    with pytest.raises(ConfigError, match="budget.*chooses which decoder layers.*every_n_layers: 2"):
        parse_config({"budget": "1GiB", "kwargs": {"every_n_layers": 2}})
    with pytest.raises(ConfigError, match="every_n_layers"):
        ActivationCheckpointing(budget="1GiB", kwargs={"every_n_layers": 2})
    # with everything else in the block it composes
    cfg = parse_config({"budget": "1GiB", "selective": True, "reentrant": False, "offload": {"hidden_states": "cpu"}})
    assert cfg.budget == 2**30 and len(callbacks_from_config(cfg, copy_on_host=True)) == 2


def test_auto_on_a_cpu_only_trainer_is_an_error_before_training(references):
    module = StepLM(clone(references["base"]))
    with pytest.raises(ConfigError, match="budget: auto reads the memory free on a CUDA device.*runs on cpu"):
        make_trainer([ActivationCheckpointing(budget="auto")]).fit(module, loader())
    assert module.losses == []


# -- what it chooses ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_budgets_between_full_and_off_recompute_fewer_layers_under_the_budget(references, fraction, caplog):
    budget = between(references, fraction)
    run, peak, probe, trainer = train(references["base"], [ActivationCheckpointing(budget=budget)])
    assert_exact(references["off"], run)
    assert peak <= budget, "MemTracker's peak of a step after the plan settled"
    assert probe.budget.settled and probe.budget.measured_peak <= budget
    final = probe.choices[-1]
    # alike layers: a quarter of the way from full's peak to off's keeps one layer, half two, three quarters three;
    # the last layer among them (its backward runs first, before the earlier layers' inputs are freed)
    assert final.count(Choice.keep) == int(4 * fraction) and final[-1] is Choice.keep, final
    # the first step recomputes every layer; the last one exactly the chosen layers (6 replayed matmuls each)
    off_mm, full_mm = references["off"].step_ops[-1][MM], references["full"].step_ops[-1][MM]
    assert run.step_ops[0][MM] == references["full"].step_ops[0][MM]
    assert run.step_ops[-1][MM] == off_mm + 6 * recomputed(final) < full_mm
    assert run.step_ops[-1].get(SDPA, 0) == recomputed(final)
    lines = [m for m in map(LINE.search, caplog.messages) if m]
    assert len(lines) == 1 and int(lines[0].group(1)) == 4 - recomputed(final)
    assert trainer.callback_metrics["lightning_ac/budget_recomputed_layers"] == recomputed(final)
    assert trainer.callback_metrics["lightning_ac/budget_measured_peak_bytes"] <= budget


def test_a_budget_at_off_peak_recomputes_nothing_after_the_first_step(references):
    """A budget 1% above off's first step's peak (the estimate may be a few hundred bytes over the measured peak):
    every layer is kept from the first choice on."""
    _, off_first_step, _, _ = train(references["base"], measure_step=0)
    assert off_first_step >= references["off_peak"]
    run, _, probe, _ = train(references["base"], [ActivationCheckpointing(budget=int(off_first_step * 1.01))])
    assert_exact(references["off"], run)
    assert probe.choices[0] == [Choice.keep] * 4, "chosen at the end of the first step"
    for ops in run.step_ops[1:]:
        assert ops[MM] == references["off"].step_ops[-1][MM] and ops.get(SDPA, 0) == 0


def test_a_budget_at_off_reported_peak_settles_on_recomputing_nothing(references):
    # at the lower figure of later steps (above), the first choice may still recompute a layer; the next measured
    # step calibrates to that figure, and from then on nothing is recomputed
    run, _, probe, _ = train(references["base"], [ActivationCheckpointing(budget=int(references["off_peak"] * 1.01))])
    assert_exact(references["off"], run)
    settled = next(i for i, choices in enumerate(probe.choices) if choices == [Choice.keep] * 4)
    assert settled <= 1 and probe.budget.settled
    assert probe.budget.summary()["corrections"] == 0, "the first choice fit: nothing was corrected"
    for ops in run.step_ops[settled + 1 :]:
        assert ops[MM] == references["off"].step_ops[-1][MM] and ops.get(SDPA, 0) == 0


def test_a_budget_below_full_warns_once_and_recomputes_everything(references):
    budget = references["full_peak"] // 2
    with pytest.warns(LightningACWarning, match="over the budget; training goes on recomputing every layer") as w:
        run, _, probe, _ = train(references["base"], [ActivationCheckpointing(budget=budget)])
    ours = [str(m.message) for m in w if "over the budget" in str(m.message)]
    # only advice that lowers the peak here: on the CPU host memory is the device's, so not offload.hidden_states;
    # never layer offloading, whose streamed copies add to the activations' peak
    assert len(ours) == 1 and "a smaller batch or shorter sequences" in ours[0]
    assert "offload.hidden_states" not in ours[0] and "layer_offloading" not in ours[0]
    assert_exact(references["off"], run)
    assert all(choices == [Choice.recompute] * 4 for choices in probe.choices)
    assert [ops[MM] for ops in run.step_ops] == [ops[MM] for ops in references["full"].step_ops]


def test_a_wrong_estimate_is_corrected_by_the_closed_loop(references, monkeypatch, caplog):
    budget = between(references, 0.5)
    figures = LayerReading.figures

    def underestimated(self, *args):  # a planted error: every layer looks 10x cheaper to keep than it is
        found = figures(self, *args)
        return type(found)(**{**found.__dict__, "saved_bytes": found.saved_bytes // 10})

    monkeypatch.setattr(LayerReading, "figures", underestimated)
    run, peak, probe, _ = train(references["base"], [ActivationCheckpointing(budget=budget)], steps=6, measure_step=5)
    assert_exact(references["off"], run)
    assert probe.choices[0] == [Choice.keep] * 4, "the wrong figures keep every layer"
    assert any("over the budget" in m and "choosing again with more recompute" in m for m in caplog.messages)
    assert probe.budget.corrections >= 1 and probe.budget.settled
    assert peak <= budget and recomputed(probe.choices[-1]) > 0


def test_a_longer_batch_is_planned_again_before_it_runs(references, caplog):
    budget = between(references, 0.6)
    data = loader(seqs=(32, 32, 32, 64, 64))
    # the step with 64 tokens a sequence is measured by StepMetrics, apart from the budget's measurements
    run, peak, probe, _ = train(references["base"], [ActivationCheckpointing(budget=budget)], data=data, measure_step=3)
    assert any("this step has 128 tokens, more than the 64 measured" in m for m in caplog.messages)
    before, longer = probe.choices[2], probe.choices[3]
    assert recomputed(longer) > recomputed(before), "more recompute for twice the tokens"
    assert peak <= budget, "the longer step's own peak"
    plain, _, _, _ = train(references["base"], data=data, measure_step=3)
    assert_exact(plain, run)


def padded_loader(unpadded: int, padded: int, seq: int = 32) -> torch.utils.data.DataLoader:
    """``unpadded`` batches of 2 full sequences, then ``padded`` batches as long whose second sequence ends in
    padding (an attention mask with zeros): as many tokens a step, another shape of work."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, seq // 2 :] = 0
    data = [(torch.randint(0, VOCAB, (2, seq), generator=g),) for _ in range(unpadded)]
    data += [(torch.randint(0, VOCAB, (2, seq), generator=g), mask) for _ in range(padded)]
    return torch.utils.data.DataLoader(data, batch_size=None)


def test_padded_batches_after_the_plan_settled_are_measured_and_kept_under_the_budget(references, caplog):
    # The budget is the unpadded plan's own settled peak: the padded steps' attention mask (and the attention path
    # it takes) adds activations the settled plan's figures never saw. They ran about 10% over it, silently: as many
    # tokens, so no re-plan, and on the CPU a settled plan was never measured again.
    base = references["base"]
    _, settled_peak, _, _ = train(base, [ActivationCheckpointing(budget=between(references, 0.5))])
    budget = settled_peak
    data = padded_loader(unpadded=3, padded=5)
    plain, plain_padded_peak, _, _ = train(base, data=data, steps=8, measure_step=7, lm=MaskLM)
    caplog.clear()
    run, peak, probe, _ = train(
        base, [ActivationCheckpointing(budget=budget)], data=data, steps=8, measure_step=7, lm=MaskLM
    )
    assert any("another shape of work" in m for m in caplog.messages)
    assert probe.budget.settled and peak <= budget, (peak, budget)
    assert recomputed(probe.choices[-1]) > recomputed(probe.choices[2]), "more recompute for the padded batches"
    assert_exact(plain, run)


def test_the_first_padded_step_after_the_plan_settled_stays_under_the_budget(references):
    """The new shape of work is seen before the step's first layer runs: that step recomputes every layer (as the
    measuring step does) instead of running the settled plan over the budget (by 9.6% when it did)."""
    base = references["base"]
    _, settled_peak, _, _ = train(base, [ActivationCheckpointing(budget=between(references, 0.5))])
    data = padded_loader(unpadded=3, padded=2)
    in_force = []  # the choices each step's layers ran with (the probe's are those after each step's end)

    class InForce(pl.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            cb = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
            in_force.append(list(cb.plan.budget.choices))

    callback = ActivationCheckpointing(budget=settled_peak)
    run, peak, probe, _ = train(base, [callback, InForce()], data=data, steps=5, measure_step=3, lm=MaskLM)
    assert recomputed(in_force[2]) < 4, "the unpadded plan keeps a layer"
    assert in_force[3] == [Choice.recompute] * 4, "the first padded step recomputes every layer"
    assert peak <= settled_peak, (peak, settled_peak)
    assert probe.budget.corrections == 0, "measuring the new shape is not a correction"


def test_a_longer_batch_gets_corrections_of_its_own_and_the_settled_plan_reports_its_own_peak(references, monkeypatch):
    # With the corrections spent before, a re-plan for twice the tokens that needs correcting fell straight back to
    # "the fastest plan measured under the budget", measured at the old token count: the run stayed over its budget.
    # Planted: the layers measured at the longer batch look 10x cheaper to keep than they are.
    from lightning_ac.budget import controller

    monkeypatch.setattr(controller, "MAX_CORRECTIONS", 1)
    figures, first_input = LayerReading.figures, []

    def underestimated_when_longer(self, *args):
        found = figures(self, *args)
        first_input.append(first_input[0] if first_input else self.input_bytes)
        if self.input_bytes <= first_input[0]:
            return found
        return type(found)(**{**found.__dict__, "saved_bytes": found.saved_bytes // 10})

    data = loader(seqs=(32, 32, 32, 64, 64, 64, 64, 64))
    plain, off_peak, _, _ = train(references["base"], data=data, steps=8, measure_step=7)
    _, full_peak, _, _ = train(references["base"], [ActivationCheckpointing()], data=data, steps=8, measure_step=7)
    budget = (off_peak + full_peak) // 2  # at 64 tokens a sequence
    monkeypatch.setattr(LayerReading, "figures", underestimated_when_longer)
    run, peak, probe, _ = train(
        references["base"], [ActivationCheckpointing(budget=budget)], data=data, steps=8, measure_step=7
    )
    assert probe.budget.settled and peak <= budget, (peak, budget)
    assert probe.budget.corrections == 1, "one correction at the longer batch, not a fallback on spent corrections"
    # the settled plan reports its own peak: a step of it measured apart reads the same
    assert probe.budget.measured_peak == peak
    assert_exact(plain, run)


def test_recompute_share_is_of_the_figures_held_now(references, caplog):
    # With every layer recomputed the share of full's recompute is 100%, whatever the step it was measured in: it
    # read 110%-157% after a re-plan for a longer batch (full's time was the first step's).
    data = loader(seqs=(32, 32, 64, 64, 64))
    with pytest.warns(LightningACWarning, match="over the budget"):
        _, _, probe, _ = train(references["base"], [ActivationCheckpointing(budget=references["full_peak"] // 2)],
                               data=data)  # fmt: skip
    lines = [m for m in caplog.messages if re.search(r"budget [\d.]+ [KMG]iB: keeping 0/4", m)]
    assert len(lines) >= 2 and probe.budget.tokens == 128, lines
    assert all("recompute 100% of full's" in m for m in lines), lines


def test_resume_starts_from_the_settled_plan(references, tmp_path, caplog):
    budget = between(references, 0.5)
    callback = ActivationCheckpointing(budget=budget)
    _, _, probe, _ = train(
        references["base"], [callback], steps=4, default_root_dir=tmp_path, enable_checkpointing=True
    )
    ckpt = next(tmp_path.rglob("*.ckpt"))
    saved = torch.load(ckpt, weights_only=False)["callbacks"]["ActivationCheckpointing"]["budget_plan"]
    assert saved["settled"] and saved["choices"] == [c.value for c in probe.choices[-1]]
    caplog.clear()
    resumed = StepLM(clone(references["base"]))
    again = Controller()
    trainer = make_trainer([ActivationCheckpointing(budget=budget), again], max_steps=6, default_root_dir=tmp_path)
    trainer.fit(resumed, loader(), ckpt_path=ckpt)
    assert any("resuming with the checkpoint's plan" in m for m in caplog.messages)
    assert again.choices[0] == probe.choices[-1], "the first resumed step runs the settled plan, not a measurement"
    assert resumed.step_ops[0][MM] == references["off"].step_ops[-1][MM] + 6 * recomputed(probe.choices[-1])
    # another budget measures again
    caplog.clear()
    other = make_trainer([ActivationCheckpointing(budget=budget * 2)], max_steps=6, default_root_dir=tmp_path)
    other.fit(StepLM(clone(references["base"])), loader(), ckpt_path=ckpt)
    assert any("measuring again" in m for m in caplog.messages)


def test_a_resumed_plan_is_checked_by_its_first_step(references, tmp_path, caplog):
    # A checkpoint's plan made for activations this run does not have (another precision, other save rules, another
    # model of as many layers): here figures a tenth of the model's, which keep every layer. On the CPU a settled
    # plan is not measured again, so the resumed run went over the budget for good; its first step now checks it.
    budget = between(references, 0.5)
    train(references["base"], [ActivationCheckpointing(budget=budget)], steps=4, default_root_dir=tmp_path,
          enable_checkpointing=True)  # fmt: skip
    ckpt = next(tmp_path.rglob("*.ckpt"))
    state = torch.load(ckpt, weights_only=False)
    plan = state["callbacks"]["ActivationCheckpointing"]["budget_plan"]
    plan["figures"] = [{**f, "saved_bytes": f["saved_bytes"] // 10} for f in plan["figures"]]
    plan["choices"] = [Choice.keep.value] * 4
    torch.save(state, ckpt)
    caplog.clear()
    resumed, metrics, probe = (
        StepLM(clone(references["base"])),
        StepMetrics(measure_step=7, warmup_steps=0),
        Controller(),
    )
    trainer = make_trainer([ActivationCheckpointing(budget=budget), metrics, probe], max_steps=8)
    trainer.fit(resumed, loader(seqs=(32,) * 8), ckpt_path=ckpt)
    assert any("resuming with the checkpoint's plan" in m and "its first step checks it" in m for m in caplog.messages)
    assert probe.choices[0] != [Choice.keep] * 4, "the first step's peak was over the budget: more recompute"
    assert probe.budget.settled and metrics.peak.activation_bytes <= budget


# -- compositions: bit-exact with everything else in the block ----------------------------------------------------


@pytest.mark.parametrize(
    "arguments",
    [
        {"reentrant": True},
        {"kwargs": {"preserve_rng_state": False}},
        {"layers": ["model.model.layers.*"]},  # the torch engine
        {"selective": True},
    ],
    ids=["reentrant", "kwargs", "torch-engine", "selective"],
)
def test_budget_composes_with_the_block(references, arguments):
    budget = between(references, 0.5)
    run, peak, probe, _ = train(references["base"], [ActivationCheckpointing(budget=budget, **arguments)])
    assert_exact(references["off"], run)
    assert probe.budget.settled and peak <= budget
    final = probe.choices[-1]
    assert final.count(Choice.keep) == 2 and final[-1] is Choice.keep, "half way from full to off: two layers kept"


def test_selective_layers_are_chosen_where_they_measure_faster(references, monkeypatch):
    """Where the save rules measure slower than recomputing a whole layer (planted first: a fast recompute), they are
    tried where they fit, measured, and dropped in every layer; where they measure faster (planted next: a slow
    recompute), the budget runs them. The run stays exact either way."""
    budget = between(references, 0.1)
    with monkeypatch.context() as planted:
        _slow_recompute(planted, factor=0.01)  # the rules measure slower than a whole recompute in every layer
        run, peak, probe, _ = train(references["base"], [ActivationCheckpointing(budget=budget, selective=True)])
    figures = probe.budget.figures
    assert all(f.selective_bytes is not None for f in figures) and all(probe.budget.selective_measured)
    assert all(f.selective_seconds > f.recompute_seconds for f in figures), figures
    assert Choice.selective not in probe.choices[-1], "tried where they fit, measured slower, and dropped"
    assert_exact(references["off"], run)

    _slow_recompute(monkeypatch)
    run, peak, probe, _ = train(references["base"], [ActivationCheckpointing(budget=budget, selective=True)])
    assert Choice.selective in probe.choices[-1]
    attention_replays = run.step_ops[-1].get(SDPA, 0)
    assert attention_replays == probe.choices[-1].count(Choice.recompute), "selective layers keep attention"
    assert_exact(references["off"], run)
    assert peak <= budget


def _slow_recompute(monkeypatch, factor: float = 100):
    """A planted measurement: recomputing a whole layer looks 100x slower than it is (``factor``), so the save rules,
    which measure no faster on this tiny model, are chosen where they fit (with a factor of 0.01, nowhere)."""
    figures = LayerReading.figures

    def recompute_is_slow(self, *args):
        found = figures(self, *args)
        return type(found)(**{**found.__dict__, "recompute_seconds": found.recompute_seconds * factor})

    monkeypatch.setattr(LayerReading, "figures", recompute_is_slow)


# the simulated device runs the engines' accelerator branch; the host path (its synchronous branch) runs in the slow
# session here, and with every target in the default one in test_offload
@pytest.mark.parametrize(
    "transfer",
    [pytest.param("host", marks=pytest.mark.slow), pytest.param("simulated", marks=pytest.mark.simulated)],
    indirect=True,
)
@pytest.mark.parametrize("target", ["hidden_states", "selective", "all"])
def test_budget_composes_with_every_offload_target(references, transfer, target, monkeypatch):
    budget = between(references, 0.5)
    offload = ActivationOffload(copy_on_host=True, min_offload_bytes=0, **{target: "cpu"})
    selective = target == "selective"
    if selective:
        _slow_recompute(monkeypatch)
    # On the simulated device "host memory" is the same memory MemTracker counts, so the selective layers' offloaded
    # saves measure over the budget and the loop may spend every correction: as many steps as the loop may take
    from lightning_ac.budget.controller import MAX_CORRECTIONS

    steps = max(STEPS, MAX_CORRECTIONS + 3)  # measuring, the first choice, the corrections, the fallback's step
    plan = [ActivationCheckpointing(budget=budget, selective=selective), offload]
    run, _, probe, _ = train(references["base"], plan, steps=steps, measure_step=steps - 1)
    assert_exact(references["off"], run)
    assert probe.budget.settled
    final = probe.choices[-1]
    # the last step moved what its choices leave to the target: recomputed layers' inputs, what the save rules keep
    # in selective layers, everything the kept layers save
    moved = offload.last_step[target]["tensors"]
    if target == "all":  # everything saved outside the recomputed layers, the output head's included
        assert moved > 0
    else:
        wanted = {"hidden_states": Choice.recompute, "selective": Choice.selective}[target]
        assert (moved > 0) == (wanted in final), (final, offload.last_step)


def test_budget_composes_with_layer_offloading():
    base = tiny_model("llama", lora=True)
    plain, off_peak, _, _ = train(base)
    _, full_peak, _, _ = train(base, [ActivationCheckpointing()])
    budget = (off_peak + full_peak) // 2
    streamer = LayerOffload(copy_on_host=True)
    run, _, probe, _ = train(base, [ActivationCheckpointing(budget=budget), streamer])
    assert_exact(plain, run)
    assert probe.budget.settled and streamer.last_step["loads"] > 0


# -- nothing outlives the run ------------------------------------------------------------------------------------


class Boom(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 2:
            raise RuntimeError("boom")


def test_the_model_is_left_as_found_after_fit_validate_test_predict_and_exceptions(references):
    module = StepLM(clone(references["base"]))
    step = lambda batch, batch_idx: module.model(input_ids=batch[0], labels=batch[0]).loss  # noqa: E731
    module.validation_step = module.test_step = module.predict_step = step
    fingerprint = model_fingerprint(module)
    callback = ActivationCheckpointing(budget=between(references, 0.5), verbose=True)
    trainer = make_trainer([callback], max_steps=3)
    trainer.fit(module, loader())
    assert model_fingerprint(module) == fingerprint and callback.plan is None
    plan = callback.budget_plan
    assert plan["line"].startswith("budget ") and len(plan["choices"]) == 4, "the run's plan, kept after it"
    trainer.validate(module, loader(), verbose=False)
    trainer.test(module, loader(), verbose=False)
    trainer.predict(module, loader())
    assert model_fingerprint(module) == fingerprint
    assert callback.budget_plan == plan, "runs without training keep the fit's plan"
    with pytest.raises(RuntimeError, match="boom"):
        make_trainer([ActivationCheckpointing(budget=between(references, 0.5)), Boom()], max_steps=4).fit(
            module, loader()
        )
    assert model_fingerprint(module) == fingerprint


def test_the_report_shows_each_layer_choice(references, caplog):
    class Report(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            cb = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
            self.rows = cb.plan.layer_rows()

    report = Report()
    train(references["base"], [ActivationCheckpointing(budget=between(references, 0.5), verbose=True), report])
    table = next(m for m in caplog.messages if "decoder layers\n" in m)
    assert "recompute (measuring)" in table, "the table at fit start: the measuring step"
    # printed again once the plan settled, with the settled choices and their figures
    settled = [m for m in caplog.messages if "decoder layers, as the budget settled\n" in m]
    assert len(settled) == 1, caplog.messages
    assert "measuring" not in settled[0] and len(re.findall(r"(keep|recompute): saves [\d.]+ [KMG]iB", settled[0])) == 4
    saves = [row.saves for row in report.rows]
    assert all(re.match(r"(keep|recompute): saves [\d.]+ [KMG]iB, recompute [\d.]+ ms", s) for s in saves), saves
    assert [row.recomputed for row in report.rows] == [not s.startswith("keep") for s in saves]


def test_activations_that_do_not_scale_per_token_are_measured_instead(caplog):
    """Eager attention saves a tokens x tokens matrix per head: twice the tokens is four times that. The re-planned
    step measures the layers again, says the figures did not scale linearly, and plans from the measured ones."""
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    data = loader(seqs=(32, 32, 128, 128, 128))
    plain, off_peak, _, _ = train(base, data=data, measure_step=4)
    _, full_peak, _, _ = train(base, [ActivationCheckpointing()], data=data, measure_step=4)
    budget = (off_peak + full_peak) // 2  # at 128 tokens a sequence
    run, peak, probe, _ = train(base, [ActivationCheckpointing(budget=budget)], data=data, measure_step=4)
    assert any("this step has 256 tokens, more than the 64 measured" in m for m in caplog.messages)
    assert any("did not scale linearly with the tokens" in m for m in caplog.messages)
    assert probe.budget.tokens == 256 and peak <= budget
    assert_exact(plain, run)


def test_the_output_heads_working_set_is_measured_with_a_real_vocabulary():
    """The CPU's twin of the CUDA budget test: with a real vocabulary the measuring step finds the head's working set
    (logits and their gradient, in float32), beside the layers' figures; with a tiny one it is folded into theirs."""
    from conftest import fit

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            cb = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
            self.head_bytes = cb.plan.budget.head_bytes

    keep = Keep()
    fit(tiny_model("llama", vocab_size=4096), [ActivationCheckpointing(budget=2**30), keep], max_steps=2)
    assert keep.head_bytes > 2 * 32 * 4096 * 4, "at least the float32 logits of the 2 x 32 tokens"
