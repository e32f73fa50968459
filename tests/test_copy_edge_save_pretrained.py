"""docs/index.md: "A copy or a pickle taken during the run (`copy.deepcopy`: a best-model snapshot, ...) is of the
model as found ... with the config as found (the run's `use_cache=False` is not in it)".

(Found trying it as a user would; save_pretrained is neither copy.deepcopy nor pickle, but it is how a transformers user
takes a best-model snapshot): `model.save_pretrained(dir)` from a callback during fit writes config.json with
"use_cache": false, the run's setting, so the snapshot reloaded for generation runs without a KV cache; a deepcopy taken
at the same moment says use_cache=True.
"""

import copy
import json
import os
import tempfile
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch import Trainer
from transformers import AutoModelForCausalLM, LlamaConfig

from lightning_ac import ActivationCheckpointing

warnings.filterwarnings("ignore")


class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(
            LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=128,
            )
        ).train()

    def training_step(self, batch, i):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randint(0, 128, (4, 16)), batch_size=2)


class BestSnapshot(pl.Callback):
    def __init__(self, path):
        self.path, self.copy = path, None

    def on_train_batch_end(self, trainer, pl_module, *args):
        if self.copy is None:
            pl_module.model.save_pretrained(self.path)
            self.copy = copy.deepcopy(pl_module.model)


def test_save_pretrained_during_fit_writes_config_as_found():
    lm = LM()
    assert lm.model.config.use_cache is True
    with tempfile.TemporaryDirectory() as d:
        snap = BestSnapshot(os.path.join(d, "best"))
        Trainer(
            accelerator="cpu",
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ActivationCheckpointing(), snap],
        ).fit(lm)
        saved = json.load(open(os.path.join(d, "best", "config.json")))
    assert snap.copy.config.use_cache is True  # the deepcopy at the same moment is as found
    assert saved.get("use_cache") is True, (
        f"save_pretrained during fit wrote use_cache={saved.get('use_cache')!r} to config.json (the run's setting); "
        "a deepcopy taken at the same moment says True"
    )
