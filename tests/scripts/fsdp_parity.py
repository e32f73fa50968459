"""Run under `python -m torch.distributed.run --nproc_per_node 2`: FSDP2 (ModelParallelStrategy) on CPU with gloo,
the model sharded with fully_shard in configure_model; `implementation: fsdp` against no checkpointing.

Writes one JSON line per rank to the path in argv[1].
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import LM, batches, clone, tiny_model  # noqa: E402

from lightning_ac import ActivationCheckpointing  # noqa: E402


class ShardedLM(LM):
    def configure_model(self):
        if getattr(self, "_sharded", False):
            return
        self._sharded = True
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def on_after_backward(self):
        if self.grads is None:
            self.grads = {n: p.grad.full_tensor().clone() for n, p in self.named_parameters() if p.grad is not None}


def train(base, callbacks):
    module = ShardedLM(clone(base))
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, batches(n=4))
    return module, trainer


MODES = {
    "fsdp": lambda: ActivationCheckpointing(implementation="fsdp", kwargs={"every_n_layers": 1}),
    "hf_selective": lambda: ActivationCheckpointing(selective=True),
}
base = tiny_model("llama")
plain, _ = train(base, [])
for name, make in MODES.items():
    suite, trainer = train(base, [make()])
    same = plain.losses == suite.losses and all(torch.equal(g, suite.grads[n]) for n, g in plain.grads.items())
    layer = suite.model.model.layers[0]
    left_behind = "forward" in layer.__dict__ or layer.gradient_checkpointing
    row = {"rank": trainer.global_rank, "mode": name, "same": same, "left_behind": left_behind}
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps(row) + "\n")
