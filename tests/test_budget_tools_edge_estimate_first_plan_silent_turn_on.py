"""docs/budget.md, "Tools on where the budget needs them": when every layer recomputed is over "(by the measuring
step's figures, or measured), the budget turns the first tool still off on ..., says so in one line (`budget: ...:
turning chunked_loss on, and measuring the step again`)". "The first plan from an estimate": "the budget measures
that step [on fake tensors] as it measures a real one and makes its plan from it".

With budget_first_plan="estimate" the fake step finds that nothing fits and turns chunked_loss on -- silently: no
"turning chunked_loss on" line is ever logged (the run settles with the loss chunked: 16.26 MiB, where every layer
kept without it is 27.9 MiB). The first-plan line then reports a plan it never made: "keeping 0/4 decoder layers,
recomputing 4 (estimated peak 0 B; recompute n/a of full's); checked next".
With budget 12.2 MiB the log even says "turning tiled_mlp on" with no earlier word that the chunked loss is on.
"""

import logging

import lightning as L
from budget_tools_cases import VocabLM

from lightning_ac import ActivationCheckpointing

M = VocabLM


def test_turn_on_from_the_fake_step_is_said(caplog):
    cb = ActivationCheckpointing(budget="18MiB", chunked_loss="auto", budget_first_plan="estimate")
    with caplog.at_level(logging.INFO, logger="lightning_ac"):
        L.Trainer(
            accelerator="cpu",
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[cb],
        ).fit(M())
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("lightning_ac")]
    # the tool did come on: the settled peak is the chunked one (keep-all without it is ~27.9 MiB > 18 MiB)
    assert cb.budget_plan["settled"] and cb.budget_plan["measured_peak_bytes"] < 18 * 2**20
    first_plan = [line for line in lines if "the first plan" in line]
    assert any("turning chunked_loss on" in line for line in lines), lines
    assert not any("estimated peak 0 B" in line for line in first_plan), first_plan
