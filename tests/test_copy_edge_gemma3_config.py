"""docs/index.md: "A copy or a pickle taken during the run (`copy.deepcopy`: a best-model snapshot ...;
`torch.save(model)` ...) is of the model as found, ... with the config as found (the run's `use_cache=False` is not
in it)".

A multimodal Gemma3 (Gemma3ForConditionalGeneration: a text_config beside a vision_config) copied during fit: the
copy's top-level config still says text_config.use_cache=False (the run's setting), and the copy's language model
no longer shares its config with the top-level config.text_config (as found, they are the same object).
"""

import copy
import io
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Trainer
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig

from lightning_ac import ActivationCheckpointing

warnings.filterwarnings("ignore")


def tiny_gemma3():
    text = Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        head_dim=16,
    )
    cfg = Gemma3Config(
        text_config=text,
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        image_token_index=127,
        boi_token_index=125,
        eoi_token_index=126,
    )
    torch.manual_seed(0)
    return Gemma3ForConditionalGeneration(cfg).train()


class LM(pl.LightningModule):
    def __init__(self, m):
        super().__init__()
        self.model = m

    def training_step(self, batch, i):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randint(0, 120, (4, 16)), batch_size=2)


class Snapshot(pl.Callback):
    copies = None

    def on_train_batch_end(self, trainer, pl_module, *args):
        if self.copies is None:
            buf = io.BytesIO()
            torch.save(pl_module.model, buf)
            self.copies = {
                "deepcopy": copy.deepcopy(pl_module.model),
                "torch.save": torch.load(io.BytesIO(buf.getvalue()), weights_only=False),
            }


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_gemma3_multimodal_copy_has_config_as_found(how):
    model = tiny_gemma3()
    assert model.config.text_config.use_cache is True
    assert model.model.language_model.config is model.config.text_config
    snap = Snapshot()
    Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ActivationCheckpointing(), snap],
    ).fit(LM(model))
    c = snap.copies[how]
    assert c.config.text_config.use_cache is True, (
        f"{how} taken during fit: copy.config.text_config.use_cache is {c.config.text_config.use_cache} "
        "(the run's setting), not True as found"
    )
    assert c.model.language_model.config is c.config.text_config, (
        f"{how} taken during fit: the copy's language_model.config is no longer its config.text_config"
    )
