"""Run under `python -m torch.distributed.run --nproc_per_node 2`: FSDP2 (ModelParallelStrategy) on CPU with gloo,
the model sharded with fully_shard in configure_model; `implementation: fsdp` (alone, with selective checkpointing,
and with selective + hidden_states offload), `hf` + selective, `hf` + the chunked loss (one chunk) and `hf` + the tiled
MLP (one tile), each against no checkpointing (bit for bit; the tiled MLP within float rounding).

Writes one JSON line per rank to the path in argv[1].
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import LM, batches, clone, shard_once, tiny_model  # noqa: E402

from lightning_ac import ActivationCheckpointing, ActivationOffload  # noqa: E402


class ShardedLM(LM):
    def configure_model(self):
        shard_once(self)

    def on_after_backward(self):
        if self.grads is None:  # gather the sharded gradients; the parent then only stops the op counter
            self.grads = {n: p.grad.full_tensor().clone() for n, p in self.named_parameters() if p.grad is not None}
        super().on_after_backward()


def train(base, callbacks):
    module = ShardedLM(clone(base))
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, batches(n=4))
    return module, trainer


SDPA = "aten._scaled_dot_product_flash_attention_for_cpu"
MODES = {
    "fsdp": lambda: [ActivationCheckpointing(implementation="fsdp", kwargs={"every_n_layers": 1})],
    "fsdp_selective": lambda: [ActivationCheckpointing(implementation="fsdp", selective=True)],
    "fsdp_selective_offload": lambda: [
        ActivationCheckpointing(implementation="fsdp", selective=True),
        ActivationOffload(hidden_states="cpu", selective="cpu", copy_on_host=True),
    ],
    "hf_selective": lambda: [ActivationCheckpointing(selective=True)],
    # the output head sharded with the rest: its gradient, computed in the chunked loss's forward, reaches FSDP's
    "hf_chunked": lambda: [ActivationCheckpointing(chunked_loss={"chunk_tokens": 4096})],
    # the tiled MLP and norms (one tile): the unsharded parameters' gradients it returns reach FSDP's
    "hf_tiled": lambda: [ActivationCheckpointing(tiled_mlp={"tile_tokens": 4096})],
}
base = tiny_model("llama")
plain, _ = train(base, [])
for name, make in MODES.items():
    callbacks = make()
    suite, trainer = train(base, callbacks)
    # the tiled run's gradients reach each layer's input along another path: equal within float rounding
    equal = torch.equal if name != "hf_tiled" else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    same = plain.losses == suite.losses and all(equal(g, suite.grads[n]) for n, g in plain.grads.items())
    layer = suite.model.model.layers[0]
    left_behind = "forward" in layer.__dict__ or layer.gradient_checkpointing
    offload = next((cb.last_step for cb in callbacks if isinstance(cb, ActivationOffload)), None)
    row = {
        "rank": trainer.global_rank,
        "mode": name,
        "same": same,
        "left_behind": left_behind,
        "attention_replayed": suite.backward_ops.get(SDPA, 0),
        "offloaded": {k: v["tensors"] for k, v in offload.items()} if offload else None,
    }
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps(row) + "\n")

# Tear the process group down before the interpreter does: left to interpreter shutdown, gloo's threads have
# (rarely) aborted the process with "terminate called without an active exception" after the work was done.
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
