"""A copy of the model taken during a run (``copy.deepcopy``: a best-model snapshot, a teacher made in
``on_fit_start``) is a copy of the model as found: none of the suite's wrappers and hooks, so it computes with its own
weights, during the run and after it, and ``torch.save`` takes it."""

from __future__ import annotations

import copy
import io

import lightning.pytorch as pl
import pytest
import torch
from conftest import batches, fit, model_fingerprint, tiny_model

from lightning_ac import ActivationCheckpointing, ActivationOffload

# every wrapper and hook a plan installs on a Hugging Face model: the layers' checkpointed forward, the selective
# policy's and the train-mode guard's hooks, the chunked head and loss, the tiled MLPs and norms, offload's hooks
_EVERYTHING = dict(selective={"save": ["attention"]}, chunked_loss={"chunk_tokens": 8}, tiled_mlp={"tile_tokens": 8})


class _Snapshot(pl.Callback):
    """Deep-copies the model being trained at ``hook`` (``on_fit_start``, or after the first training batch)."""

    def __init__(self, hook: str) -> None:
        self.hook, self.copies = hook, []

    def on_fit_start(self, trainer, module):
        if self.hook == "on_fit_start":
            self.copies.append(copy.deepcopy(module.model))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.hook == "after_a_step" and batch_idx == 0:
            self.copies.append(copy.deepcopy(module.model))
            self.copies.append(copy.deepcopy(module).model)  # the LightningModule's copy (Lightning: without trainer)


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("hook", ["on_fit_start", "after_a_step"])
@pytest.mark.parametrize("offload", [False, True], ids=["recompute", "recompute+offload"])
def test_a_copy_taken_during_fit_computes_with_its_own_weights_and_saves(hook, offload):
    base = tiny_model("llama")
    before = model_fingerprint(base)
    snapshot = _Snapshot(hook)
    callbacks = [ActivationCheckpointing(**_EVERYTHING), snapshot]
    if offload:
        callbacks.append(ActivationOffload(hidden_states="cpu"))
    fit(base, callbacks, max_steps=3)
    assert model_fingerprint(base) == before
    assert snapshot.copies
    ids = next(iter(batches()))[0]
    for copied in snapshot.copies:
        assert model_fingerprint(copied) == before, "the copy carries none of the suite's wrappers or hooks"
        # the same weights in a model built afresh: the copy must compute exactly as it does
        fresh = tiny_model("llama")
        fresh.load_state_dict(copied.state_dict())
        assert not all(torch.equal(a, b) for a, b in zip(copied.parameters(), base.parameters())), (
            "the live model trained on after the copy (else the test could not tell whose weights it computes with)"
        )
        loss, grads = _loss_and_grads(copied, ids)
        fresh_loss, fresh_grads = _loss_and_grads(fresh, ids)
        assert torch.equal(loss, fresh_loss)
        assert grads.keys() == fresh_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, fresh_grads[name]), name
        torch.save(copied, io.BytesIO())


def test_a_copy_keeps_what_the_user_installed_and_the_live_model_keeps_ours():
    """Only what the suite installed is left out of a copy: the user's own hooks stay on it; and the live model keeps
    the suite's wrappers after the copy (the copy is not made by removing them)."""
    base = tiny_model("llama")
    calls = _USER_CALLS
    calls.clear()
    base.model.layers[0].register_forward_pre_hook(_user_hook)
    before, seen = model_fingerprint(base), {}

    class _Check(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 0:
                copied = copy.deepcopy(module.model)
                seen["copy"], seen["live"] = model_fingerprint(copied), model_fingerprint(module.model)
                seen["copy calls"] = len(calls), copied(input_ids=batch[0]) is not None, len(calls)

    fit(base, [ActivationCheckpointing(**_EVERYTHING), _Check()], max_steps=2)
    assert seen["copy"] == before, "the copy: as found, the user's hook with it"
    count, _, after = seen["copy calls"]
    assert after == count + 1, "the user's hook runs on the copy"
    assert seen["live"] != before, "the live model keeps the suite's wrappers after the copy"
    assert model_fingerprint(base) == before


_USER_CALLS: list = []


def _user_hook(module, args):
    """A forward pre-hook of the user's own (a module-level function: picklable, and shared by a copy)."""
    _USER_CALLS.append(type(module).__name__)
