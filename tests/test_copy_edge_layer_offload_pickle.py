"""docs/index.md: "A copy or a pickle taken during the run (... `torch.save(model)` or of one layer, EMA code) is of
the model as found, in its own wrapper (a PEFT model, ...), without the suite's wrappers and hooks ...: it computes
with its own weights, and a layer's pickle holds that layer only."

With LayerOffload (copy_on_host=True, as the docs run it on a CPU) a pickle of the model, or of one decoder layer,
taken in a callback during fit fails:
- pickle.dumps: AttributeError: Can't pickle local object 'LayerWeightStreamer._make_pre_hook.<locals>.pre_hook'
- torch.save: RuntimeError('Cannot save multiple tensors or storages that view the same data as different types')
Both because every streamed submodule (each frozen Linear, each norm) carries an instance `_apply`, the suite's
ConversionGuard `_ApplyGuard`, holding the live streamer (its hook closures, the layer's host buffer): the journal
hides the suite's hooks and wrappers from pickles but not this attribute. (Popping `_apply` before torch.save makes
the same save succeed; copy.deepcopy works because _ApplyGuard has its own __deepcopy__.)
(copy.deepcopy of the same model works.)
"""

import io
import pickle
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Trainer
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from lightning_ac import ActivationCheckpointing, LayerOffload

warnings.filterwarnings("ignore")


def tiny_lora():
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        )
    )
    return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).train()


class LM(pl.LightningModule):
    def __init__(self, m):
        super().__init__()
        self.model = m

    def training_step(self, batch, i):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randint(0, 128, (4, 16)), batch_size=2)


class Save(pl.Callback):
    def __init__(self, what, how):
        self.what, self.how, self.error, self.saved = what, how, None, None

    def on_train_batch_end(self, trainer, pl_module, *args):
        if self.saved is None and self.error is None:
            obj = pl_module.model if self.what == "model" else pl_module.model.base_model.model.model.layers[0]
            buf = io.BytesIO()
            try:
                if self.how == "torch.save":
                    torch.save(obj, buf)
                else:
                    buf.write(pickle.dumps(obj))
                self.saved = buf.getvalue()
            except Exception as e:  # noqa: BLE001
                self.error = e


@pytest.mark.parametrize("how", ["torch.save", "pickle.dumps"])
@pytest.mark.parametrize("what", ["model", "layer"])
def test_pickle_during_fit_with_layer_offload(what, how):
    save = Save(what, how)
    Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ActivationCheckpointing(), LayerOffload(copy_on_host=True), save],
    ).fit(LM(tiny_lora()))
    assert save.error is None, f"{how}({what}) during fit with LayerOffload failed: {save.error!r}"
    loaded = torch.load(io.BytesIO(save.saved), weights_only=False) if how == "torch.save" else pickle.loads(save.saved)
    leftovers = [n for n, m in loaded.named_modules() if "_apply" in m.__dict__]
    assert not leftovers, f"the pickle carries the suite's _apply on {leftovers[:3]}"
