"""Run under `python -m torch.distributed.run --nproc_per_node 2`: DDP on CPU (gloo), with and without the suite.

Writes one JSON line per rank to the path in argv[1]: whether the final parameters of each suite run (SAC +
hidden_states offload; checkpointing + layer offloading, whose rank 1 starts from other frozen weights, which
the broadcast at setup must replace; checkpointing + the chunked loss, one chunk of every token) are bit-identical
to the plain run's.
"""

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import LM, batches, clone, tiny_model  # noqa: E402

from lightning_ac import ActivationCheckpointing, ActivationOffload, LayerOffload  # noqa: E402


def train(base, callbacks, perturb_frozen=False):
    model = clone(base)
    if perturb_frozen and int(os.environ["RANK"]) == 1:
        # DDP broadcasts rank 0's state at setup: with layer offloading, the streamed weights' share of it is ours
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad:
                    p.add_(1.0)
    module = LM(model)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=2, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, batches(n=4))
    return module, trainer


base = tiny_model("llama", lora=True)
plain, _ = train(base, [])
suite, trainer = train(
    base,
    # verify mode too: its reference pass runs under no_sync and is compared with DDP's all-reduced gradients
    [
        ActivationCheckpointing(selective=True),
        ActivationOffload(hidden_states="cpu", copy_on_host=True, verify_steps=2),
    ],
)
streamed, _ = train(
    base, [ActivationCheckpointing(), LayerOffload(copy_on_host=True, verify_steps=1)], perturb_frozen=True
)
chunked, _ = train(base, [ActivationCheckpointing(chunked_loss={"chunk_tokens": 4096})])
same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), suite.parameters()))
same_chunked = all(torch.equal(a, b) for a, b in zip(plain.parameters(), chunked.parameters()))
same_streamed = all(torch.equal(a, b) for a, b in zip(plain.parameters(), streamed.parameters()))
row = {"rank": trainer.global_rank, "same": same, "same_streamed": same_streamed, "same_chunked": same_chunked,
       # the verified steps ran training_step twice: LM records a loss per call, the reference's first
       "losses": [plain.losses, suite.losses[1::2][:2] + suite.losses[4:], streamed.losses[1:],
                  chunked.losses]}  # fmt: skip
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(row) + "\n")

# Tear the process group down before the interpreter does: left to interpreter shutdown, gloo's threads have
# (rarely) aborted the process with "terminate called without an active exception" after the work was done.
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
