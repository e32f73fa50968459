"""A forward in training mode whose graph is dropped without backward leaks offloaded copies, step after step.

What the user did: ``ActivationOffload(all="cpu", min_offload_bytes=0)`` on a small Llama, run on the simulated
asynchronous device (``copy_on_host=True``); the training step makes one extra model call in training mode whose
result is thrown away (a graph freed without backward: e.g. a scoring pass for logging), then returns the loss of a
second call.

Doc lines relied on (docs/offloading.md, "What offloading holds"):
- "Each copy lives in host memory as long as autograd keeps a save that uses it ..." -- autograd keeps nothing of
  the dropped graph.
- "a step of the same shapes as the last lands in the same slices and allocates nothing" and "At the end of backward
  at most that one copy is on the device."

What happens: over six steps of the same shapes, pinned_allocations go 2, 3, 4, 5, 6, 6 (pinned_bytes 2 MiB ->
6.25 MiB), and the device bytes of reloaded copies still referenced after each backward grow by 8 KiB a step
(8192, 16384, ..., 49152): the dropped graph's copies are never given back, and reloaded copies pile up. Without
the dropped forward the same run stays at one arena (1 MiB) and 0 reloaded bytes; under
ActivationCheckpointing() + ActivationOffload(hidden_states="cpu") the dropped forward leaks nothing. Gradients
still match a run without offloading.
"""

import lightning.pytorch as pl
import torch
from conftest import tiny_model
from lightning.pytorch import Trainer

from lightning_ac import ActivationOffload
from lightning_ac.testing.simulated import SimulatedDevice


def _model():
    return tiny_model("llama", max_position_embeddings=1024).train()


class LM(pl.LightningModule):
    def __init__(self, sim):
        super().__init__()
        self.model = _model()
        self.sim = sim
        self.rows = []

    def training_step(self, ids, idx):
        _ = self.model(input_ids=ids.flip(1), labels=ids).loss  # a training-mode forward, dropped without backward
        return self.model(input_ids=ids, labels=ids).loss

    def on_after_backward(self):
        self.rows.append(
            (
                self.sim.live_bytes("reloaded activation bytes"),
                self.sim.host.pinned_allocations,
                self.sim.host.pinned_bytes,
            )
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_dropped_forward_does_not_accumulate_copies():
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 128, (16,), generator=g) for _ in range(12)]
    dl = torch.utils.data.DataLoader(data, batch_size=2)
    sim = SimulatedDevice()
    lm = LM(sim)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ActivationOffload(all="cpu", min_offload_bytes=0, copy_on_host=True)],
    )
    with sim:
        trainer.fit(lm, dl)
    reloaded = [r[0] for r in lm.rows]
    allocations = [r[1] for r in lm.rows]
    pinned = [r[2] for r in lm.rows]
    # steady steps of the same shapes allocate no pinned memory, and the pool does not grow
    assert allocations[-1] == allocations[2], (
        f"pinned allocations per step: {allocations}, pinned bytes {pinned}, reloaded bytes after backward {reloaded}"
    )
    # at the end of backward at most one reloaded copy is on the device: it must not grow step after step
    assert reloaded[-1] <= reloaded[1], f"reloaded bytes still referenced after each backward: {reloaded}"
