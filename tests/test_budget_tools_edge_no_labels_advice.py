"""docs/budget.md, "Nothing fits": "one warning gives the measured peak and only what lowers it further in this
configuration"; docs/chunked-loss.md: "its nothing-fits advice names `chunked_loss: true` where the head holds over
a quarter of the peak (and `chunk_tokens` where the loss ran as one chunk)".

A training_step that computes the loss itself from logits (no labels=) with chunked_loss: auto. The budget turns the
chunked loss on, which cannot act (no labels), spends a second measuring step on it, and ends with the nothing-fits
warning (23.77 MiB against 18 MiB). The output head still holds about half the peak, and the one change that lowers it
in this configuration -- passing labels= so the loss can be chunked -- is not in the advice: it names only "a smaller
batch or shorter sequences". (Without chunked_loss in the block, the same run's advice does name the head.)
"""

import warnings

import lightning as L
import torch.nn.functional as F
from budget_tools_cases import VocabLM

from lightning_ac import ActivationCheckpointing


class M(VocabLM):
    def training_step(self, b, i):
        logits = self.model(input_ids=b).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), b[:, 1:].reshape(-1))


def test_nothing_fits_advice_names_the_head_when_the_loss_could_not_be_chunked():
    cb = ActivationCheckpointing(budget="18MiB", chunked_loss="auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(
            accelerator="cpu",
            max_steps=5,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[cb],
        ).fit(M())
    over = [str(w.message) for w in caught if "over the budget; training goes on" in str(w.message)]
    assert over, [str(w.message) for w in caught]
    assert "labels" in over[0] or "head" in over[0], over[0]
