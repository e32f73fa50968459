"""docs/chunked-loss.md: "A step that reads the missing logits (token accuracy, as TRL's SFT computes it) fails with a
note on its error that says why and what to do." docs/budget.md: `chunked_loss: auto` "install[s] the tool off: each
model computes as it does" until the budget turns it on.

With `chunked_loss: auto`, step 1 reads `out.logits` fine; the budget turns the chunked loss on; step 2 crashes with
AttributeError. The note's "why" omits the actual cause -- the memory budget turned it on mid-run (the user never
wrote `chunked_loss: true`) -- and its fix "set chunked_loss: false" points at a setting the user does not have;
nothing says that `chunked_loss: auto` + a step that reads logits means the run dies the moment the budget needs
the tool.
"""

import lightning as L
import pytest
from budget_tools_cases import VocabLM

from lightning_ac import ActivationCheckpointing


class M(VocabLM):
    def training_step(self, b, i):
        out = self.model(input_ids=b, labels=b)
        acc = (out.logits.argmax(-1)[:, :-1] == b[:, 1:]).float().mean()
        self.log("acc", acc)
        return out.loss


def test_note_says_the_budget_turned_it_on():
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ActivationCheckpointing(budget="18MiB", chunked_loss="auto")],
    )
    with pytest.raises(AttributeError) as info:
        trainer.fit(M())
    assert trainer.global_step == 1  # step 1 ran with logits; the budget then turned the tool on
    note = " ".join(getattr(info.value, "__notes__", []))
    assert "lightning_ac" in note, note
    assert "budget" in note and "auto" in note, note
