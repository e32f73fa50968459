"""Run under `python -m torch.distributed.run --nproc_per_node 2`: what each rank holds in a real step under FSDP2
and DDP on CPU with gloo: the estimator's reference for `--strategy fsdp` and `--strategy ddp`.

The estimate's training step (its module, optimizer and loss) on the tests' tiny Llama, every parameter trained; three
steps of a real Trainer, the third measured (DDP rebuilds its gradient buckets in the second step's forward, in the
order the first step's gradients arrived: a new set of buckets, allocated once):

- FSDP2: Lightning's ModelParallelStrategy, the model sharded as the estimate shards it (`fully_shard` on each decoder
  layer and the root, in `configure_model`), measured by torch's own FSDPMemTracker (its peak total: under
  Lightning's closure, which runs the forward and backward inside `optimizer.step`, its split by kind is not usable);
- DDP: Lightning's DDPStrategy, the activation peak measured by the benchmark's StepMetrics (measure_step), and the
  gradient buckets as DDP's reducer holds them.

FSDP2 in float32 and in bf16-mixed (Lightning's plugin: autocast over the float32 shards). Writes one JSON line per
rank, strategy, precision and mode to the path in argv[1].
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import tiny_config  # noqa: E402

from lightning_ac.bench.memory import StepMetrics  # noqa: E402
from lightning_ac.estimate.models import Training, build_model  # noqa: E402
from lightning_ac.estimate.modes import resolve_modes  # noqa: E402
from lightning_ac.estimate.optimizers import optimizer_choice  # noqa: E402
from lightning_ac.estimate.step import _StepModule, mode_callbacks  # noqa: E402

SEQ, BATCH = 64, 2
# (strategy, precision, modes)
RUNS = [
    ("fsdp", "32-true", ["off", "full", "full+chunked_loss"]),
    ("fsdp", "bf16-mixed", ["selective_attn"]),  # Lightning's plugin: autocast over float32 shards, gathered in float32
    ("ddp", "32-true", ["full"]),
]


def nbytes(tensors):
    """The bytes of the storages holding ``tensors`` on this rank, each storage once (FSDP2's sharded gradients are
    views of one reduce-scatter output per layer)."""
    storages = {}
    for t in tensors:
        storage = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


class Plain(_StepModule):
    def on_train_start(self):
        pass  # the first real step makes the gradients and the optimizer state


class Sharded(Plain):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class FSDPMeasure(pl.Callback):
    """torch's FSDPMemTracker around the third training step (as DDP's): its peak total."""

    def __init__(self):
        self.tracker, self.peak = None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            self.tracker = FSDPMemTracker(pl_module.model, trainer.optimizers[0])
            self.tracker.__enter__()

    def on_train_batch_end(self, trainer, pl_module, *args):
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.peak = next(iter(self.tracker.get_tracker_snapshot("peak").values()))["Total"]
            self.tracker = None


class Buckets(pl.Callback):
    """The bytes of DDP's gradient buckets, as its reducer holds them (read after the measured step, while the Trainer
    has DDP wrapped: reading them allocates a copy)."""

    nbytes = None

    def on_train_end(self, trainer, pl_module):
        buckets = trainer.strategy.model.reducer._get_zeros_like_grad_buckets()
        self.nbytes = sum(b.buffer().nbytes for b in buckets)


config = tiny_config("llama")
training = Training(None, None)  # a full fine-tune: every parameter sharded and trained
for strategy, precision, modes in RUNS:
    for mode in resolve_modes(modes, True):
        torch.manual_seed(0)
        model = build_model(config, torch.float32, training, "cpu")
        if strategy == "fsdp":
            measure, module = FSDPMeasure(), Sharded(model, optimizer_choice("adamw", "cpu"))
            chosen, extra = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), []
        else:
            # the third step: DDP rebuilds its buckets in the order the gradients arrived in the second step's forward
            measure = StepMetrics(measure_step=2, warmup_steps=0)
            module = Plain(model, optimizer_choice("adamw", "cpu"))
            chosen, buckets = DDPStrategy(), Buckets()
            extra = [buckets]
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=chosen, precision=precision, max_steps=3, logger=False,
            use_distributed_sampler=False,
            callbacks=[*mode_callbacks(mode, config.num_hidden_layers), measure, *extra], enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        trainer.fit(module, torch.utils.data.DataLoader([ids] * 3, batch_size=None))
        state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        row = {
            "rank": trainer.global_rank,
            "strategy": strategy,
            "precision": precision,
            "mode": mode.name,
            "parameter_bytes": nbytes(module.parameters()),
            "gradient_bytes": nbytes(p.grad for p in module.parameters()),
            "optimizer_bytes": nbytes(state),
        }
        if strategy == "fsdp":
            row["peak_bytes"] = measure.peak
        else:
            row["activation_peak_bytes"] = measure.peak.activation_bytes
            row["bucket_bytes"] = buckets.nbytes
        with open(sys.argv[1], "a") as f:
            f.write(json.dumps(row) + "\n")

if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
