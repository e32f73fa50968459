"""A model in eval mode (as ``from_pretrained`` returns it) gets what the block asks for, or the run stops before its
first step with the cause and the fix: never a run that trains without it while the log says it applied."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from conftest import LM, OpCounter, batches, clone, make_trainer, model_fingerprint, tiny_model

from lightning_ac import ActivationCheckpointing, ActivationOffload, EvalModeError


def pretrained(tmp_path, lora: bool = False) -> torch.nn.Module:
    """A tiny Llama as users load one: saved, then ``from_pretrained`` (which returns it in eval mode)."""
    from transformers import AutoModelForCausalLM

    tiny_model("llama").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not model.training, "from_pretrained returns the model in eval mode"
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    return model


class BackwardMM(pl.Callback):
    """Counts the matmuls of the first backward (a recomputed layer runs its forward's matmuls again there)."""

    def __init__(self) -> None:
        self.counts = []

    def on_before_backward(self, trainer, module, loss):
        self.counter = OpCounter().__enter__()

    def on_after_backward(self, trainer, module):
        self.counter.__exit__(None, None, None)
        self.counts.append(self.counter.counts["aten.mm"])


@pytest.mark.parametrize(
    "arguments, says",
    [
        (
            {},
            r"reached model\.base_model\.model\.model\.layers\.0 in eval mode with gradients enabled, so 4 of the "
            r"recomputed decoder layers of model\.base_model\.model \(0, 1, 2, 3\) would not be recomputed",
        ),
        ({"budget": "1MiB"}, "would not be recomputed"),
        (
            {"enabled": False, "chunked_loss": True},
            r"the chunked loss would not run for model\.base_model\.model \(LlamaForCausalLM\)",
        ),
    ],
    ids=["full", "budget", "chunked_loss"],
)
def test_a_model_from_pretrained_in_eval_mode_stops_before_its_first_step(tmp_path, arguments, says):
    model = pretrained(tmp_path, lora=True)
    found = model_fingerprint(model)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    module = LM(model)
    with pytest.raises(EvalModeError, match=says) as raised:
        make_trainer([ActivationCheckpointing(**arguments)]).fit(module, batches())
    assert "model.train()" in str(raised.value), "the fix is named"
    assert module.losses == [], "the step stopped before the model ran"
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters()), "nothing trained"
    assert model_fingerprint(model) == found, "nothing of ours is left"


def test_the_same_model_put_in_training_mode_is_recomputed(tmp_path):
    base = pretrained(tmp_path, lora=True)
    plain, checkpointed = BackwardMM(), BackwardMM()
    make_trainer([plain]).fit(LM(clone(base).train()), batches())
    make_trainer([ActivationCheckpointing(), checkpointed]).fit(LM(clone(base).train()), batches())
    # every layer's q, k, v, o, gate and up run again in backward (down_proj: early stop), and q's and v's
    # LoRA A and B
    assert checkpointed.counts[0] - plain.counts[0] == 4 * (6 + 4)


def test_dropout_modules_in_eval_mode_leave_the_block_applied(tmp_path):
    """Turning off dropout by putting only its modules in eval mode is a way to train the check leaves alone."""
    model = tiny_model("llama", attention_dropout=0.1)
    for submodule in model.modules():
        if isinstance(submodule, torch.nn.Dropout):
            submodule.eval()
    counted = BackwardMM()
    make_trainer([ActivationCheckpointing(), counted]).fit(LM(model), batches())
    assert counted.counts


def test_offload_all_alone_applies_in_eval_mode(transfer):
    """Saved-tensor hooks move what the step saves whatever the modules' mode: nothing to refuse."""
    model = tiny_model("llama").eval()
    callback = ActivationOffload(all="cpu", min_offload_bytes=0, copy_on_host=True)
    make_trainer([callback]).fit(LM(model), batches())
    assert callback.last_step["all"]["tensors"] > 0


class PolicyAndReference(LM):
    """A policy in training mode beside a frozen copy in eval mode, called under no_grad (DPO, distillation, RLHF):
    both share a class, so the plan finds both models' layers."""

    def __init__(self, model):
        super().__init__(model)
        self.reference = clone(model).eval().requires_grad_(False)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.reference(input_ids=batch[0])
        return super().training_step(batch, batch_idx)


class TrainsItself(LM):
    """Calls .train() on its model in its own training step, after the batch's start."""

    def training_step(self, batch, batch_idx):
        self.model.train()
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("module_cls", [PolicyAndReference, TrainsItself], ids=["reference_under_no_grad", "train"])
def test_what_the_step_does_not_reach_in_eval_mode_with_gradients_is_left_alone(module_cls):
    """Refused before in every mode: the check read the modes at the batch's start, of every layer found. Now it is
    what the step reaches with gradients enabled: the policy's layers (in training mode) are recomputed."""
    base = tiny_model("llama")
    plain, checkpointed = BackwardMM(), BackwardMM()
    model = clone(base).eval() if module_cls is TrainsItself else clone(base)
    make_trainer([plain]).fit(module_cls(clone(base)), batches())
    make_trainer([ActivationCheckpointing(), checkpointed]).fit(module_cls(model), batches())
    assert checkpointed.counts[0] - plain.counts[0] == 4 * 6, "every layer's q, k, v, o, gate and up again"


class ValidatesWithGradients(LM):
    """A validation step that enables gradients (a gradient probe) on a model that Lightning put in eval mode."""

    def validation_step(self, batch, batch_idx):
        with torch.enable_grad():
            return self.model(input_ids=batch[0], labels=batch[0]).loss


def test_a_validation_step_with_gradients_enabled_is_left_alone():
    module = ValidatesWithGradients(tiny_model("llama"))
    trainer = make_trainer([ActivationCheckpointing()], limit_val_batches=1, val_check_interval=1, inference_mode=False)
    trainer.fit(module, batches(), batches())
    assert module.losses, "trained, and validated in eval mode with gradients on"
