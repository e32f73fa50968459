"""The budget weighs the tools it decides (``chunked_loss: auto``, ``tiled_mlp: auto``): after its measuring step, where
the plan recomputes anything, it turns the next tool on, measures a step with it, and keeps it only where its plan fits
and is faster, or where only its plan fits (docs/budget.md, "Tools on where the budget needs them").

The model is :class:`budget_tools_cases.VocabLM` (four layers, a vocabulary of 8,000: the head holds most of a step's
activations). Whether a tool steps faster is a timing, which the benchmark measures (``auto`` rows); here, the parts
that do not depend on the clock: a tool that only lets a plan fit stays on, a tool that costs far more than it could
save is turned off again and the run goes on as without it, and a budget that keeps every layer weighs nothing.
"""

from __future__ import annotations

import lightning as L
import torch
from budget_tools_cases import VocabLM
from lightning.pytorch.callbacks import Callback

from lightning_ac import ActivationCheckpointing


class Spy(Callback):
    """Which tools are on at each step's start, and the budget's choices at its end."""

    def __init__(self):
        self.on = []
        self.choices = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        plan = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))._plan
        self.on.append({t.name for t in (plan.chunked_loss, plan.tiled_mlp) if t is not None and t.active})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plan = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))._plan
        self.choices.append([c.value for c in plan.budget.choices])


def fit(callback, steps=8, module=None):
    spy = Spy()
    module = module or VocabLM()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, spy],
    )
    trainer.fit(module)
    return module, spy


def test_a_tool_only_whose_plan_fits_is_weighed_and_kept(caplog):
    callback = ActivationCheckpointing(budget="18MiB", chunked_loss="auto")
    _, spy = fit(callback)
    assert "budget: weighing chunked_loss: measuring the next step with it on" in caplog.text
    assert "budget: keeping chunked_loss on: only with it does a plan fit the budget" in caplog.text
    assert spy.on[0] == set() and all(on == {"chunked_loss"} for on in spy.on[1:]), spy.on
    assert callback.budget_plan["settled"] and callback.budget_plan["measured_peak_bytes"] <= 18 * 2**20


def test_a_tool_that_costs_more_than_it_saves_is_turned_off_again(caplog):
    """The tiled MLP a token at a time: hundreds of Python-level tiles for each MLP, where the budget keeps most
    layers anyway. It is weighed in step 3 (step 2 measures again: the first is cold), turned off again, and every
    later step runs without it, on the plan the
    first step's figures chose (measured: 15 ms of recompute without it, against none and 2.2 s of its own with it)."""
    budget = "26MiB"  # over every layer recomputed (about 24 MiB here), under keeping them all (27.9 MiB)
    callback = ActivationCheckpointing(budget=budget, tiled_mlp={"tile_tokens": 1, "budget_decides": True})
    _, spy = fit(callback)
    assert "budget: weighing tiled_mlp" in caplog.text
    assert "budget: turning tiled_mlp off again: the plan with it is not predicted faster" in caplog.text
    assert spy.on[:3] == [set(), set(), {"tiled_mlp"}] and all(on == set() for on in spy.on[3:]), spy.on
    plain = ActivationCheckpointing(budget=budget)
    _, plain_spy = fit(plain)
    # as many layers kept as without the tool (which of the alike layers is the clock's choice)
    assert sorted(spy.choices[-1]) == sorted(plain_spy.choices[-1]), (spy.choices, plain_spy.choices)
    assert callback.budget_plan["settled"]


def test_a_budget_that_keeps_every_layer_weighs_nothing_and_trains_as_a_plain_run(caplog):
    reference, _ = fit(ActivationCheckpointing(budget="1GiB"), steps=4)
    module, spy = fit(ActivationCheckpointing(budget="1GiB", chunked_loss="auto", tiled_mlp="auto"), steps=4)
    assert "weighing" not in caplog.text and all(on == set() for on in spy.on)
    for (name, a), b in zip(reference.named_parameters(), module.parameters()):
        assert torch.equal(a, b), name
