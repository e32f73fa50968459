"""docs/index.md: "A frozen reference model or teacher in eval mode beside the trained one (DPO, distillation) is
left alone, under `torch.no_grad()` or not: its forward records no graph".

A distillation step that calls a frozen teacher (every parameter requires_grad=False, eval mode) with labels, to
read its loss, without torch.no_grad(), under chunked_loss=True: the step stops with EvalModeError naming the
teacher ("the chunked loss would not run for teacher"), although the teacher's forward records no graph.
(With torch.no_grad() around the teacher, or without chunked_loss, the same step trains.)
"""

import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch import Trainer
from transformers import AutoModelForCausalLM, LlamaConfig

from lightning_ac import ActivationCheckpointing, EvalModeError

warnings.filterwarnings("ignore")


def tiny(seed):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        )
    )


class Distill(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny(0).train()
        self.teacher = tiny(1).eval()
        self.teacher.requires_grad_(False)

    def training_step(self, batch, i):
        teacher_loss = self.teacher(input_ids=batch, labels=batch).loss  # frozen: records no graph
        assert not teacher_loss.requires_grad
        self.log("teacher_loss", teacher_loss)
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randint(0, 128, (4, 16)), batch_size=2)


def test_frozen_teacher_with_labels_is_left_alone_under_chunked_loss():
    trainer = Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ActivationCheckpointing(chunked_loss=True)],
    )
    try:
        trainer.fit(Distill())
    except EvalModeError as e:
        raise AssertionError(f"a frozen teacher in eval mode (no parameter to train, no graph) was refused: {e}") from e
    assert trainer.global_step == 2
