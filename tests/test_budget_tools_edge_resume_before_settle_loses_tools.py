"""docs/budget.md, "Tools on where the budget needs them": the budget turns the chunked loss on "When even every
layer recomputed is over the budget"; "The settled plan is saved in checkpoints, so a resumed run starts from it".
The feature's promise (brief): "The budget's checkpoint state (callback state_dict) records the tools turned on so a
resumed run starts with them on."

A checkpoint written after the budget turned chunked_loss on, but before the plan settled (the step right after the
turn-on measures again), records nothing: the resumed run starts with the tool off, and its first step runs every
layer recomputed WITHOUT the chunked loss -- the configuration this very budget already measured over (23.9 MiB
against 18 MiB). On a GPU that is the step that runs out of memory on resume.
"""

import os
import shutil
import tempfile

import lightning as L
import torch
from budget_tools_cases import VocabLM
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_ac import ActivationCheckpointing

BUDGET = "18MiB"  # every layer recomputed: 23.9 MiB without the chunked loss, 12.2 MiB with it


M = VocabLM


class Spy(Callback):
    def __init__(self):
        self.active_at_start = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        ac = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
        self.active_at_start.append((trainer.global_step, ac._plan.chunked_loss.active))


def trainer(steps, d, spy, every=None):
    cbs = [ActivationCheckpointing(budget=BUDGET, chunked_loss="auto"), spy]
    if every:
        cbs.append(ModelCheckpoint(dirpath=d, every_n_train_steps=every, save_top_k=-1))
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(every),
        callbacks=cbs,
    )


def test_tools_turned_on_survive_a_checkpoint_taken_before_the_plan_settled():
    d = tempfile.mkdtemp()
    try:
        first = Spy()
        trainer(2, d, first, every=2).fit(M())
        # the budget turned the chunked loss on after step 1: step 2 ran with it
        assert first.active_at_start == [(0, False), (1, True)]
        ckpt = os.path.join(d, "epoch=0-step=2.ckpt")
        state = torch.load(ckpt, weights_only=False)["callbacks"]["ActivationCheckpointing"]
        resumed = Spy()
        trainer(4, d, resumed).fit(M(), ckpt_path=ckpt)
        assert resumed.active_at_start[0] == (2, True), (
            f"resumed run started with chunked_loss off; the checkpoint's state has {sorted(state)}"
        )
    finally:
        shutil.rmtree(d, ignore_errors=True)
