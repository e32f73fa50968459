"""docs/budget.md, "What you see": "The settled plan is saved in checkpoints, so a resumed run starts from it instead
of measuring again ... the resumed run's first step is measured and checks the plan like any choice".
And "How it decides": only "A batch of as many tokens whose shape of work is new (an attention mask appears for padding
or packed documents, another precision)" makes a step recompute every layer to measure it.

Resume a run whose budget turned chunked_loss on and settled (keeping 4/4 layers). The resumed run's first step checks
the plan and settles; its SECOND step, on a batch of exactly the same shape, no mask, same precision, logs
"this step's batch has another shape of work than the steps measured ... recomputing every layer in it to measure it"
and recomputes every layer -- i.e. it measures again, and the run ends unsettled with a correction counted.
(The checked step settles without recording its shape of work: the calibration per shape is empty after a resume.)
"""

import logging
import os
import shutil
import tempfile

import lightning as L
from budget_tools_cases import VocabLM
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_ac import ActivationCheckpointing

M = VocabLM


class Choices(Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ac = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
        self.rows.append((trainer.global_step, [c.value for c in ac._plan.budget.choices]))


def test_resumed_settled_plan_is_not_measured_again(caplog):
    d = tempfile.mkdtemp()
    try:
        cb = ActivationCheckpointing(budget="18MiB", chunked_loss="auto")
        L.Trainer(
            accelerator="cpu",
            max_steps=5,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[cb, ModelCheckpoint(dirpath=d, save_last=True)],
        ).fit(M())
        assert cb.budget_plan["settled"] and cb.budget_plan["choices"] == ["keep"] * 4
        spy, cb2 = Choices(), ActivationCheckpointing(budget="18MiB", chunked_loss="auto")
        with caplog.at_level(logging.INFO, logger="lightning_ac"):
            L.Trainer(
                accelerator="cpu",
                max_steps=9,
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=False,
                callbacks=[cb2, spy],
            ).fit(M(), ckpt_path=os.path.join(d, "last.ckpt"))
        text = caplog.text
        assert "resuming with the checkpoint's plan" in text
        assert "another shape of work" not in text, [r for r in text.splitlines() if "shape of work" in r]
        assert all(ch == ["keep"] * 4 for _, ch in spy.rows), spy.rows
        assert cb2.budget_plan["settled"] and cb2.budget_plan["corrections"] == 0, cb2.budget_plan
    finally:
        shutil.rmtree(d, ignore_errors=True)
