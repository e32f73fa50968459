"""Over growing sequence lengths the pinned pool stays well above 1.25x the largest step, and peaks at their sum.

What the user did: ``ActivationCheckpointing() + ActivationOffload(hidden_states="cpu")`` on a small Llama, on the
simulated asynchronous device (``copy_on_host=True``), with batches of 10 rows whose length grows (300, 500, then
700 tokens for six steps: varying lengths as an SFT or curriculum run has), watching ``sim.host.pinned_bytes`` against
the step's bytes in ``callback.last_step``.

Doc line relied on (docs/offloading.md, "What offloading holds", host memory): "a longer step adds an arena of at
least a quarter of the pool, so the pool ends within about 1.25x what the largest step moves (not the sum of every
length seen); an arena no step has used for 3 steps is freed."

What happened: a 10 x 700-token step moves 7,168,000 bytes. A run that starts at 700 tokens pins exactly that (1.00x).
After 300 and 500 tokens first, the pool reaches 20,882,812 bytes (2.91x, the sum of the three lengths' pools),
and after six steady steps at 700 tokens -- past the 3-step release -- it still holds 12,329,212 bytes (1.72x),
for good.
"""

import lightning.pytorch as pl
import torch
from conftest import tiny_model
from lightning.pytorch import Trainer

from lightning_ac import ActivationCheckpointing, ActivationOffload
from lightning_ac.testing.simulated import SimulatedDevice


class LM(pl.LightningModule):
    def __init__(self, sim, offload):
        super().__init__()
        self.model = tiny_model("llama", max_position_embeddings=1024).train()
        self.sim, self.offload, self.rows = sim, offload, []

    def training_step(self, ids, idx):
        return self.model(input_ids=ids, labels=ids).loss

    def on_train_batch_end(self, outputs, batch, idx):
        moved = sum(v["bytes"] for v in self.offload.last_step.values())
        self.rows.append((batch.shape[1], moved, self.sim.host.pinned_bytes))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _run(lengths):
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 128, (10, n), generator=g) for n in lengths]  # 10 rows of n tokens a batch
    offload = ActivationOffload(hidden_states="cpu", copy_on_host=True)
    sim = SimulatedDevice()
    lm = LM(sim, offload)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=len(lengths),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ActivationCheckpointing(), offload],
    )
    with sim:
        trainer.fit(lm, torch.utils.data.DataLoader(data, batch_size=None))
    return lm.rows


def test_pool_ends_near_largest_step_over_growing_lengths():
    rows = _run([300, 500] + [700] * 6)
    largest = max(moved for _, moved, _ in rows)
    final_pool = rows[-1][2]
    assert final_pool <= 1.3 * largest, (
        f"pool {final_pool} B after 6 steady steps = {final_pool / largest:.2f}x the largest step's {largest} B; "
        f"per step (tokens, moved, pinned): {rows}"
    )
