"""Run under `python -m torch.distributed.run --nproc_per_node 2`: the memory budget under DDP and under FSDP2
(ModelParallelStrategy, fully_shard in configure_model), on CPU with gloo, each against an unmodified run.

Each rank measures its own figures, and a planted skew makes them disagree: rank 0 measures the early layers slower,
rank 1 the late ones, so each on its own would keep other layers. ``ddp_estimate``: the same under DDP with
``budget_first_plan: estimate``, where the ranks agree on the fake step's figures (a training step that reads no
tensor's value). Writes one JSON line per rank and mode to argv[1].
"""

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import LM, batches, clone, shard_once, tiny_model  # noqa: E402

from lightning_ac import ActivationCheckpointing  # noqa: E402
from lightning_ac.bench.memory import StepMetrics  # noqa: E402
from lightning_ac.budget.measure import LayerMeter  # noqa: E402

RANK = int(os.environ["RANK"])
STEPS = 5


class StepLM(LM):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_grads = getattr(self, "step_grads", [])
        self.step_grads.append({n: _full(p.grad).clone() for n, p in self.named_parameters() if p.grad is not None})


class FakeableLM(StepLM):
    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"].detach()))
        super().on_train_batch_end(outputs, batch, batch_idx)


class ShardedLM(StepLM):
    def configure_model(self):
        shard_once(self)


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()


def train(base, callbacks, fsdp, lm=StepLM):
    module = (ShardedLM if fsdp else lm)(clone(base))
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if fsdp else "ddp"
    metrics = StepMetrics(measure_step=STEPS - 1, warmup_steps=0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, callbacks=[*callbacks, metrics],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, batches(n=4))
    return module, metrics.peak.activation_bytes


stop = LayerMeter.stop


def skewed(self):  # what each rank measures: on rank 0 the early layers are slower, on rank 1 the late ones
    readings = stop(self)
    for index, reading in enumerate(readings):
        reading.forward_seconds *= 10 * ((4 - index) if RANK == 0 else (index + 1))
    return readings


base = tiny_model("llama")
for mode, fsdp, implementation in (("ddp", False, "hf"), ("fsdp", True, "fsdp"), ("ddp_estimate", False, "hf")):
    lm = FakeableLM if mode == "ddp_estimate" else StepLM
    plain, off_peak = train(base, [], fsdp, lm)
    _, full_peak = train(base, [ActivationCheckpointing(implementation=implementation)], fsdp, lm)
    budget = int(full_peak + 0.5 * (off_peak - full_peak))
    LayerMeter.stop = skewed
    first_plan = "estimate" if mode == "ddp_estimate" else "measure"
    callback = ActivationCheckpointing(implementation=implementation, budget=budget, budget_first_plan=first_plan)
    run, peak = train(base, [callback], fsdp, lm)
    LayerMeter.stop = stop
    same = plain.losses == run.losses and all(
        torch.equal(grad, after[name])
        for before, after in zip(plain.step_grads, run.step_grads)
        for name, grad in before.items()
    )
    row = {
        "rank": RANK, "mode": mode, "same": same, "choices": callback.budget_plan["choices"], "peak": peak,
        "budget": budget, "settled": callback.budget_plan["settled"],
    }  # fmt: skip
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps(row) + "\n")

if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
