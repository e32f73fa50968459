"""docs/checkpointing.md: "The applied line (`checkpointing 2/6 decoder layers`) does not count the layers of a model
with no parameter to train, in it or in a wrapper of it ...: a step recomputes them only where it runs them with
gradients into an input that requires them."  (brief: the applied line now counts what a step recomputes)

(Found trying it as a user would; the sentence's letter only excluded whole models with nothing to train): a model whose
decoder layers have nothing to train and whose inputs need no gradient -- a head-only fine-tune (everything frozen but
lm_head), or LoRA on the last layer only (PEFT's layers_to_transform=[1]) -- is announced as "checkpointing 2/2 decoder
layers" while a step recomputes no layer (head-only) or one of two (LoRA on the last layer): the log says checkpointing
for layers that, exactly like a frozen teacher's, are run with no gradient into them and never recomputed.
"""

import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Trainer
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

from lightning_ac import ActivationCheckpointing

warnings.filterwarnings("ignore")


def tiny():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        )
    ).train()


class LM(pl.LightningModule):
    def __init__(self, m):
        super().__init__()
        self.model = m

    def training_step(self, batch, i):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randint(0, 128, (2, 16)), batch_size=2)


class CountAttention(TorchDispatchMode):
    """Counts attention forwards run in backward: one per recomputed layer."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func) and "backward" not in str(func):
            self.n += 1
        return func(*args, **(kwargs or {}))


class Backward(pl.Callback):
    recomputed = None

    def on_before_backward(self, trainer, pl_module, loss):
        self.mode = CountAttention()
        self.mode.__enter__()

    def on_after_backward(self, trainer, pl_module):
        self.mode.__exit__(None, None, None)
        self.recomputed = self.mode.n


def model_for(case):
    m = tiny()
    if case == "head_only":
        m.requires_grad_(False)
        m.lm_head.requires_grad_(True)
        return m
    return get_peft_model(m, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], layers_to_transform=[1])).train()


@pytest.mark.parametrize("case", ["head_only", "lora_last_layer_only"])
def test_applied_line_counts_what_a_step_recomputes(case, caplog):
    counter = Backward()
    with caplog.at_level(logging.INFO, logger="lightning_ac"):
        Trainer(
            accelerator="cpu",
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ActivationCheckpointing(), counter],
        ).fit(LM(model_for(case)))
    line = next(r.getMessage() for r in caplog.records if "checkpointing" in r.getMessage())
    announced = int(line.split("checkpointing ")[1].split("/")[0])
    assert announced == counter.recomputed, (
        f"{case}: the applied line says {line!r} ({announced} layers) but the step recomputed {counter.recomputed}"
    )
