"""Copies and pickles taken during fit, of a model inside the wrappers users train it in (PEFT, a LightningModule,
``torch.compile``): each is the model as found, in its own wrapper, with the config as found; ``torch.save`` takes the
model and any one layer, and a layer's pickle holds that layer only."""

from __future__ import annotations

import copy
import io
import pickle

import lightning.pytorch as pl
import torch
from conftest import fit, model_fingerprint, tiny_model

from lightning_ac import ActivationCheckpointing, ActivationOffload

# every wrapper and hook a plan installs: the layers' checkpointed forward, the selective policy's and the train-mode
# guard's hooks, the chunked head and loss, the tiled MLPs, offload's hooks
_EVERYTHING = dict(selective=True, chunked_loss={"chunk_tokens": 8}, tiled_mlp={"tile_tokens": 8})


class _During(pl.Callback):
    """Runs ``take(module)`` after the first training batch and keeps what it returns."""

    def __init__(self, take) -> None:
        self.take, self.taken = take, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 0:
            self.taken = self.take(module)


def _fit_with(take, offload: bool = True):
    model = tiny_model("llama", lora=True)
    found = model_fingerprint(model)
    during = _During(take)
    callbacks = [ActivationCheckpointing(**_EVERYTHING), during]
    if offload:
        callbacks.append(ActivationOffload(hidden_states="cpu", copy_on_host=True))
    fit(model, callbacks, max_steps=2)
    return model, found, during.taken


def test_copies_of_the_wrappers_are_the_wrappers_as_found():
    def take(module):
        peft = module.model
        return {
            "peft": (peft, copy.deepcopy(peft)),
            "lora": (peft.base_model, copy.deepcopy(peft.base_model)),
            "lightning": (peft, copy.deepcopy(module).model),
            "compiled": (peft, copy.deepcopy(torch.compile(peft))._orig_mod),
        }

    model, found, taken = _fit_with(take)
    for what, (live, copied) in taken.items():
        assert type(copied) is type(live), f"{what}: a {type(copied).__name__}, not a {type(live).__name__}"
        assert model_fingerprint(copied) == model_fingerprint(live) == found or what == "lora", what
        assert copied.state_dict().keys() == live.state_dict().keys(), what
        live.load_state_dict(copied.state_dict())  # the copy's keys load into the model it copied


def test_a_copy_and_a_pickle_get_the_config_as_found():
    def take(module):
        live = module.model.base_model.model
        buffer = io.BytesIO()
        torch.save(live, buffer)
        buffer.seek(0)
        return copy.deepcopy(live), torch.load(buffer, weights_only=False)

    model, _, (copied, loaded) = _fit_with(take)
    for what, one in (("copy", copied), ("pickle", loaded)):
        assert one.config.use_cache is True, f"{what}: the config as found, not the run's use_cache=False"
        assert one.model.config is one.config, f"{what}: its modules still share one config"
        assert one.model.layers[0].self_attn.config is one.config, what
    assert model.base_model.model.config.use_cache is True, "and the live model's, after the run"


def test_the_model_and_one_layer_pickle_during_fit_as_found():
    sizes = {}

    def layer_of(model):
        return model.base_model.model.model.layers[1]

    before = tiny_model("llama", lora=True)
    sizes["before"] = len(pickle.dumps(layer_of(before)))

    def take(module):
        buffer = io.BytesIO()
        torch.save(module.model, buffer)
        sizes["layer"] = len(pickle.dumps(layer_of(module.model)))
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    model, found, loaded = _fit_with(take)
    assert model_fingerprint(loaded) == found, "a pickled module is the module as found"
    assert sizes["layer"] < 1.1 * sizes["before"], f"one layer's pickle holds that layer only: {sizes}"
    ids = torch.randint(0, 128, (2, 16))
    loaded.train()
    loaded(input_ids=ids, labels=ids).loss.backward()  # computes on its own, without the run
