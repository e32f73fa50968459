"""The train-mode guard at its edges: compiled models are checked too (once, before the first compiled step), and
only what a training step would lose is refused: not a frozen teacher's forward that records no graph, not a
callback's own gradient probe outside the step. Its message names modules by their paths at the time it is raised."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from conftest import LM, OpCounter, batches, clone, make_trainer, model_fingerprint, tiny_model

from lightning_ac import ActivationCheckpointing, EvalModeError


def _compile_model(model):
    model.compile(backend="eager")


def _compile_layers(model):
    for layer in model.model.layers:
        layer.compile(backend="eager")


@pytest.mark.parametrize("compile_", [_compile_model, _compile_layers], ids=["model.compile", "layer.compile"])
def test_a_compiled_model_in_eval_mode_stops_before_its_first_step(compile_):
    torch._dynamo.reset()
    model = tiny_model("llama").eval()
    compile_(model)
    module = LM(model)
    with pytest.raises(EvalModeError, match=r"reached model(\.model\.layers\.0)? in eval mode") as raised:
        make_trainer([ActivationCheckpointing(chunked_loss=True)]).fit(module, batches())
    assert "model.train()" in str(raised.value)
    assert module.losses == [], "refused before the first compiled step ran"
    torch._dynamo.reset()


def test_a_compiled_model_in_training_mode_trains():
    torch._dynamo.reset()
    model = tiny_model("llama")
    _compile_layers(model)
    module = LM(model)
    make_trainer([ActivationCheckpointing()]).fit(module, batches())
    assert module.losses
    torch._dynamo.reset()


class FrozenTeacher(LM):
    """Distillation: a frozen teacher in eval mode, called without no_grad and without labels (its forward records no
    graph: its parameters are frozen and its input needs no gradient)."""

    def __init__(self, model):
        super().__init__(model)
        self.teacher = clone(model).eval().requires_grad_(False)

    def training_step(self, batch, batch_idx):
        teacher_logits = self.teacher(input_ids=batch[0]).logits
        assert not teacher_logits.requires_grad
        return super().training_step(batch, batch_idx) + 0.0 * teacher_logits.float().mean()


def test_a_frozen_teacher_in_eval_mode_without_no_grad_is_left_alone():
    module = FrozenTeacher(tiny_model("llama"))
    make_trainer([ActivationCheckpointing()]).fit(module, batches())
    assert module.losses


class GradientProbe(pl.Callback):
    """A callback's own forward and backward in eval mode, after the training step (a gradient-norm probe)."""

    def __init__(self) -> None:
        self.norms = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        module.model.eval()
        try:
            loss = module.model(input_ids=batch[0], labels=batch[0]).loss
            grads = torch.autograd.grad(loss, [p for p in module.model.parameters() if p.requires_grad])
            self.norms.append(float(sum(g.norm() ** 2 for g in grads)))
        finally:
            module.model.train()


def test_a_gradient_probe_in_eval_mode_after_the_step_is_left_alone():
    probe = GradientProbe()
    make_trainer([ActivationCheckpointing(), probe], max_steps=2).fit(LM(tiny_model("llama")), batches())
    assert len(probe.norms) == 2


class WrapsInPeftAtFitStart(LM):
    """Wraps its model with PEFT after the plan applied (``on_fit_start``), in eval mode."""

    def on_fit_start(self):
        from peft import LoraConfig, get_peft_model

        self.model = get_peft_model(self.model.eval(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_the_error_names_modules_by_their_paths_when_it_is_raised():
    model = tiny_model("llama")
    with pytest.raises(EvalModeError) as raised:
        make_trainer([ActivationCheckpointing()]).fit(WrapsInPeftAtFitStart(model), batches())
    message = str(raised.value)
    assert "reached model.base_model.model.model.layers.0 in eval mode" in message, message
    assert "of model.base_model.model (" in message, message


def test_a_student_in_eval_mode_beside_a_frozen_teacher_is_still_refused():
    """What the check still refuses beside the teacher: the student's layers record a graph."""
    module = FrozenTeacher(tiny_model("llama"))
    module.model.eval()
    found = model_fingerprint(module.model)
    with pytest.raises(EvalModeError, match=r"reached model\.model\.layers\.0"):
        make_trainer([ActivationCheckpointing()]).fit(module, batches())
    assert model_fingerprint(module.model) == found


def test_the_backward_of_a_compiled_model_recomputes():
    """With the check in place a compiled model in training mode is recomputed (the compiled layers' backward runs
    their forward's matmuls again)."""
    torch._dynamo.reset()
    counts = {}
    for name, callbacks in (("plain", []), ("checkpointed", [ActivationCheckpointing()])):
        model = tiny_model("llama")
        _compile_layers(model)
        module = LM(model)
        make_trainer(callbacks).fit(module, batches())
        counts[name] = module.backward_ops["aten.mm"]
        torch._dynamo.reset()
    assert counts["checkpointed"] > counts["plain"], counts


_ = OpCounter  # the counter the LM's backward_ops come from
