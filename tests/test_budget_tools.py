"""``chunked_loss: auto`` and ``tiled_mlp: auto`` beside a memory budget: on where the budget needs them, off where it
does not. Peaks are measured with MemTracker (the benchmark's StepMetrics, apart from the budget's own measurements);
the losses and gradients are compared with an unmodified run: bit-identical where nothing is turned on, within the
chunked loss's own tolerance where it is."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import BATCH, make_trainer, tiny_model
from test_chunked_loss import ChunksRan, StepsLM, assert_same
from test_chunked_loss import batches as vocab_batches

from lightning_ac import ActivationCheckpointing, ConfigError, parse_config
from lightning_ac.bench.memory import StepMetrics

STEPS = 4
# the cpu-vocab preset's model (python -m lightning_ac.bench --preset cpu-vocab): Llama 2's vocabulary of 32,000
VOCAB_MODEL = dict(
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
)
# cpu-small's: a vocabulary of 256, where a recomputed layer's working set (the MLP's, the norms') is the step's peak
SMALL_MODEL = dict(VOCAB_MODEL, vocab_size=256)


class Budget(pl.Callback):
    """Keeps the run's budget controller (the plan lets go of it at teardown) and the tools' states; at the last
    step, what a checkpoint's plan gives a resumed run: the tools it turned on."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plan = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)).plan
        self.budget = plan.budget
        tools = [t for t in (plan.chunked_loss, plan.tiled_mlp) if t is not None]
        self.active = {t.name: t.active for t in tools}
        self.settled, self.turned_on = self.budget.settled, list(self.budget.turned_on)
        if trainer.global_step == trainer.max_steps and self.budget.settled:
            state = self.budget.state_dict()
            on = [t for t in tools if t.active and t.budget_decides]
            for tool in on:
                tool.active = False  # as a resumed run installs it
            self.budget.load_state_dict(state)
            self.resumed = state["turned_on"], [t.name for t in on if t.active]


def run(base, seq: int, vocab: int, callbacks=(), steps: int = STEPS) -> Any:
    """``steps`` steps; the StepMetrics activation peak of the last one (after the budget settled)."""
    module = StepsLM(tiny_model("llama", **base))
    metrics = StepMetrics(measure_step=steps - 1, warmup_steps=0)
    make_trainer([*callbacks, metrics], max_steps=steps).fit(module, vocab_batches(steps, vocab=vocab, seq=seq))
    return module, metrics.peak.activation_bytes


@pytest.fixture(scope="module")
def vocab_peaks():
    """The cpu-vocab model at 256 tokens: off, every layer recomputed, and every layer recomputed with the chunked
    loss (the head's float32 logits and their gradient are most of full's peak)."""
    off, off_peak = run(VOCAB_MODEL, 256, 32000)
    _, full_peak = run(VOCAB_MODEL, 256, 32000, [ActivationCheckpointing()])
    _, chunked_peak = run(VOCAB_MODEL, 256, 32000, [ActivationCheckpointing(chunked_loss=True)])
    assert chunked_peak < 0.7 * full_peak < off_peak
    return {"off": off, "off_peak": off_peak, "full_peak": full_peak, "chunked_peak": chunked_peak}


def test_chunked_loss_auto_turns_on_where_only_it_fits(vocab_peaks, caplog):
    budget = (vocab_peaks["full_peak"] + vocab_peaks["chunked_peak"]) // 2
    probe, chunks = Budget(), ChunksRan()
    callbacks = [ActivationCheckpointing(budget=budget, chunked_loss="auto"), probe, chunks]
    module, peak = run(VOCAB_MODEL, 256, 32000, callbacks)
    assert probe.settled and probe.turned_on == ["chunked_loss"], caplog.text
    assert probe.active == {"chunked_loss": True}
    assert probe.resumed == (["chunked_loss"], ["chunked_loss"]), "a resumed run starts with it on"
    assert peak <= budget, (peak, budget)
    assert chunks.seen[-1][0] > 0, "the loss was computed in chunks"
    assert "keeping chunked_loss on: only with it does a plan fit the budget" in caplog.text
    assert_same(vocab_peaks["off"], module, exact=False)


def test_a_budget_over_offs_peak_turns_nothing_on(vocab_peaks):
    probe = Budget()
    callbacks = [ActivationCheckpointing(budget=2 * vocab_peaks["off_peak"], chunked_loss="auto"), probe]
    module, _ = run(VOCAB_MODEL, 256, 32000, callbacks)
    assert probe.settled and probe.turned_on == []
    assert probe.active == {"chunked_loss": False}
    assert_same(vocab_peaks["off"], module, exact=True)


@pytest.mark.slow  # four measuring steps (MemTracker) of cpu-small's model at 1,024 tokens: about a minute
def test_tiled_mlp_auto_turns_on_where_only_tiling_fits(caplog):
    seq = 1024
    _, full_peak = run(SMALL_MODEL, seq, 256, [ActivationCheckpointing()])
    _, tiled_peak = run(SMALL_MODEL, seq, 256, [ActivationCheckpointing(tiled_mlp={"tile_tokens": 128})])
    assert tiled_peak < 0.9 * full_peak
    budget = (full_peak + tiled_peak) // 2
    probe = Budget()
    callbacks = [ActivationCheckpointing(budget=budget, tiled_mlp={"tile_tokens": 128, "budget_decides": True}), probe]
    _, peak = run(SMALL_MODEL, seq, 256, callbacks)
    assert probe.settled and probe.turned_on == ["tiled_mlp"], caplog.text
    assert peak <= budget, (peak, budget)


@pytest.mark.parametrize("field", ["chunked_loss", "tiled_mlp"])
def test_auto_without_a_budget_is_refused_naming_the_field_and_the_fix(field):
    says = (
        rf"activation_checkpointing\.{field}\.budget_decides: true \(also what {field}=auto sets\) .* budget is not set"
    )
    with pytest.raises(ConfigError, match=says) as raised:
        ActivationCheckpointing(**{field: "auto"})
    assert "budget: 20GiB" in str(raised.value) and f"budget_decides: false ({field}: true)" in str(raised.value)
    with pytest.raises(ConfigError, match=rf"{field}=auto"):
        parse_config({field: "auto"})
    assert getattr(parse_config({field: "auto", "budget": "1GiB"}), field).budget_decides


_ = (BATCH, torch)
