"""After a training step fails between forward and backward, ``all`` offloading keeps its pinned host memory for good.

What the user did: ``ActivationOffload(all="cpu", min_offload_bytes=0)`` on a small Llama, on the simulated
asynchronous device (``copy_on_host=True``). The training step raised after the model's forward (a NaN check, a bad
batch), the user caught the error, and ran ``fit`` again with the same callback (as in a notebook), which succeeded.

Doc lines relied on (README: "after `fit`, `validate`, `test` or an error the model is as they found it";
docs/offloading.md, "What offloading holds": "Each copy lives in host memory as long as autograd keeps a save that
uses it", "an arena no step has used for 3 steps is freed").

What happened: a successful fit ends with 0 pinned bytes alive (``sim.host.pinned_bytes``), and so does the same
failure under ``ActivationCheckpointing() + ActivationOffload(hidden_states="cpu")`` or an error raised during
backward. With ``all``, the failed step's graph is gone (nothing references its loss) but 1 MiB of pinned memory
stays alive after the failed fit, after the trainer and module are deleted, and after a second, successful fit of
3 steps with the same callback.
"""

import gc

import lightning.pytorch as pl
import torch
from conftest import tiny_model
from lightning.pytorch import Trainer

from lightning_ac import ActivationOffload
from lightning_ac.testing.simulated import SimulatedDevice


class Boom(Exception):
    pass


class LM(pl.LightningModule):
    def __init__(self, fail_at):
        super().__init__()
        self.model = tiny_model("llama", max_position_embeddings=1024).train()
        self.fail_at = fail_at

    def training_step(self, ids, idx):
        loss = self.model(input_ids=ids, labels=ids).loss
        if self.global_step == self.fail_at:
            raise Boom("bad batch")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(callback, fail_at):
    g = torch.Generator().manual_seed(1)
    dl = torch.utils.data.DataLoader([torch.randint(0, 128, (16,), generator=g) for _ in range(8)], batch_size=2)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    try:
        trainer.fit(LM(fail_at), dl)
    except Boom:
        pass


def test_failed_step_then_refit_frees_pinned_memory():
    callback = ActivationOffload(all="cpu", min_offload_bytes=0, copy_on_host=True)
    sim = SimulatedDevice()
    with sim:
        _fit(callback, fail_at=1)
        gc.collect()
        after_failure = sim.host.pinned_bytes
        _fit(callback, fail_at=None)  # the retry succeeds
        gc.collect()
    assert sim.host.pinned_bytes == 0, (
        f"pinned bytes alive after the failed fit: {after_failure}; after a successful retry: {sim.host.pinned_bytes}"
    )
