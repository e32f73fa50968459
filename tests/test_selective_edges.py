"""Selective checkpointing at its edges (issue 57, items 8-12): saves registered during a run, a frozen teacher beside
the student, rules that overlap, sliding windows without ``layer_types``, and a policy the user installed."""

from __future__ import annotations

import warnings
from typing import List

import lightning.pytorch as pl
import pytest
import torch
import torch._functorch.config
from conftest import LM, batches, clone, fit, make_trainer, tiny_model
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_ac import (
    ActivationCheckpointing,
    SelectiveCheckpointingWarning,
    apply_selective_checkpointing,
    register_mandatory_save,
    register_preferred_save,
)

MM, BMM = "aten.mm", "aten.bmm"
SDPA = "aten._scaled_dot_product_flash_attention_for_cpu"


def selective_problems(caught) -> List[str]:
    return [str(w.message) for w in caught if issubclass(w.category, SelectiveCheckpointingWarning)]


def run_selective(base, selective, module_cls=LM, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = fit(clone(base), [ActivationCheckpointing(selective=selective, **kwargs)], module_cls=module_cls)
    return module, selective_problems(caught)


def assert_same_grads(reference: LM, run: LM) -> None:
    assert reference.losses == run.losses
    assert reference.grads.keys() == run.grads.keys()
    for name, grad in reference.grads.items():
        assert torch.equal(grad, run.grads[name]), name


# -- item 8: a save registered after the first step reaches the graphs traced later ---------------------------------


class GraphLM(LM):
    """No backward dispatch mode: compiled graphs bypass it."""

    def on_before_backward(self, loss):
        pass

    def on_after_backward(self):
        pass


def lengths(*seqs: int) -> torch.utils.data.DataLoader:
    """One batch per length: a new length makes dynamo trace the layers' graphs again."""
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader([(torch.randint(0, 128, (2, s), generator=g),) for s in seqs], batch_size=None)


class RegisterAfterFirstStep(pl.Callback):
    def __init__(self, register) -> None:
        self.register, self.handle = register, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            self.handle = self.register("aten::mm")


@pytest.mark.parametrize("register", [register_preferred_save, register_mandatory_save])
def test_a_save_registered_after_the_first_step_applies_to_graphs_traced_later(register):
    backward_mm: List[int] = []

    def keep_backward(gm, example_inputs):
        backward_mm.append(sum(str(n.target).startswith(MM) for n in gm.graph.nodes if n.op == "call_function"))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=keep_backward)
    torch._dynamo.reset()
    model = tiny_model("llama", num_hidden_layers=2)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer, backend=backend)
    registering = RegisterAfterFirstStep(register)
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            make_trainer([ActivationCheckpointing(selective={"save": []}), registering], max_steps=2).fit(
                GraphLM(model), lengths(32, 48)
            )
    finally:
        if registering.handle is not None:
            registering.handle.remove()
        torch._dynamo.reset()
    # a layer's backward graph: 14 matmuls, and the 6 recomputed projections while nothing saves them
    assert backward_mm[0] == 20 and len(backward_mm) > 1
    assert set(backward_mm[1:]) == {14}, "the graphs traced at the second length save every matmul"


# -- item 9: a registered save's rule is its own, not one of an earlier save at the same address -------------------


class Router(torch.nn.Module):
    """A mixture-of-experts block whose router normalises its top-k weights in place (as in test_selective)."""

    def __init__(self, dim: int = 16, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(dim, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(experts))
        self.k = k

    def forward(self, x):
        weights, chosen = torch.topk(self.gate(x).softmax(-1), self.k, dim=-1)
        weights /= weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            out = out + (weights * (chosen == index)).sum(-1, keepdim=True) * expert(x)
        return x + out


class RouterLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(128, 16)
        self.blocks = torch.nn.ModuleList(Router() for _ in range(2))
        self.head = torch.nn.Linear(16, 128)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        loss = torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
        return type("Out", (), {"loss": loss})()


class SwapSaves(pl.Callback):
    """After the first step: remove the preferred save, drop it, and register a mandatory one (the issue's order)."""

    def __init__(self, callback: ActivationCheckpointing) -> None:
        self.callback = callback
        self.preferred = register_preferred_save("aten::mm")
        self.mandatory = None
        self.topk_rules: List[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx != 0:
            rules = self.callback.plan.selective.registered_rules.values()
            self.topk_rules = [rule.mandatory for rule in rules if "aten::topk" in rule.label]
            return
        self.preferred.remove()
        self.preferred = None  # freed here: the next object of its size (the mandatory save) may take its address
        self.mandatory = register_mandatory_save("aten::topk")


def test_a_mandatory_save_registered_where_a_removed_preferred_one_was_keeps_its_clone():
    torch.manual_seed(0)
    base = RouterLM()
    reference = fit(clone(base), max_steps=2)
    callback = ActivationCheckpointing(selective={"save": []}, layers=[Router])
    swap = SwapSaves(callback)
    try:
        # before, the mandatory save took the preferred one's rule when it got its address: no clone for the
        # forward, and the router's in-place edit ended backward ("...has been mutated")
        run = fit(clone(base), [callback, swap], max_steps=2)
    finally:
        for handle in (swap.preferred, swap.mandatory):
            if handle is not None:
                handle.remove()
    assert run.losses == reference.losses
    assert swap.topk_rules == [True], "the second step's topk saves were counted by a mandatory rule of their own"


# -- item 10: the diagnostics and the applied line count what the step recomputes ----------------------------------


class Distill(LM):
    """A student trained beside a frozen teacher that runs under ``no_grad`` (never recomputed)."""

    def __init__(self, student, teacher) -> None:
        super().__init__(student)
        self.teacher = teacher.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        with torch.no_grad():
            target = self.teacher(input_ids=ids).logits.softmax(-1)
        out = self.model(input_ids=ids, labels=ids)
        loss = out.loss + torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten(0, 1))
        self.losses.append(float(loss.detach()))
        return loss


THREE_PROBLEMS = {"save": ["aten::no_such_op"], "save_modules": ["q_projection"], "save_matmul_min_k": 100000}


def test_the_diagnostics_come_after_the_first_backward_beside_a_frozen_teacher(caplog):
    student, teacher = tiny_model("llama", num_hidden_layers=2), tiny_model("llama", seed=1)
    callback = ActivationCheckpointing(selective=THREE_PROBLEMS)
    seen = {}

    class AfterEachStep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen[batch_idx] = (callback.plan.selective.diagnosed, len(selective_problems(caught)))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([callback, AfterEachStep()], max_steps=3).fit(Distill(student, teacher), batches())
    # one "matched no module" at install, then the other two rules' problems after the first backward
    assert seen[0] == (True, 3), seen
    assert seen[2][1] == 3, "said once"
    applied = next(m for m in caplog.messages if "checkpointing " in m and "decoder layers" in m)
    assert "checkpointing 2/6 decoder layers" in applied, applied
    assert "teacher" in applied, applied


# -- item 11: the threshold's advice counts the matmuls an earlier rule saved -----------------------------------------


@pytest.mark.parametrize(
    "selective",
    [
        {"save": [], "save_modules": ["down_proj"], "save_matmul_min_k": 128},
        {"save": ["aten::mm"], "save_matmul_min_k": 128},
    ],
    ids=["save_modules", "save"],
)
def test_a_threshold_whose_matmuls_an_earlier_rule_saved_is_not_told_to_go_lower(selective):
    base = tiny_model("llama", num_hidden_layers=2)
    reference = fit(clone(base))
    run, problems = run_selective(base, selective)
    assert_same_grads(reference, run)
    threshold = [p for p in problems if "selective.save_matmul_min_k" in p]
    # down_proj's K=128 matmul ran in every layer, taken by the rule ahead of the threshold: no "lower it" advice,
    # which would save every projection
    assert threshold and all("Lower it" not in p and "no matmul reached" not in p for p in threshold), threshold
    assert "largest K seen: 128" in threshold[0] and "ahead of it" in threshold[0], threshold


# -- item 12: sliding windows without layer_types; a policy the user installed on a second model ---------------------


def mistral(**overrides):
    # every layer slides (sliding_window set, no layer_types), as in Mistral 7B v0.1, Mixtral, Phi-3, Starcoder2
    return tiny_model("mistral", num_hidden_layers=2, sliding_window=16, **overrides)


def test_mistral_sliding_window_attention_is_recomputed_under_sdpa():
    base = mistral()
    assert getattr(base.config, "layer_types", None) is None
    reference = fit(clone(base))
    run, _ = run_selective(base, {"save": ["attention"]})
    assert_same_grads(reference, run)
    assert run.backward_ops[SDPA] == 2, "both sliding layers replay attention"
    run, _ = run_selective(base, {"save": ["attention"], "save_sliding_window": True})
    assert_same_grads(reference, run)
    assert run.backward_ops.get(SDPA, 0) == 0


def test_mistral_sliding_window_attention_is_recomputed_under_sdpa_math():
    base = mistral()
    with sdpa_kernel(SDPBackend.MATH):
        full = fit(clone(base), [ActivationCheckpointing()])
        recomputed, _ = run_selective(base, {"save": ["attention"]})
        saved, _ = run_selective(base, {"save": ["attention"], "save_sliding_window": True})
    assert recomputed.backward_ops[BMM] == full.backward_ops[BMM], "attention's output bmm is replayed"
    assert saved.backward_ops[BMM] == full.backward_ops[BMM] - 2, "one bmm (attention's output) saved a layer"


class TwoModels(LM):
    """A LightningModule training its model and a second one whose checkpointing the user set up."""

    def __init__(self, model, other) -> None:
        super().__init__(model)
        self.other = other

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        loss = self.model(input_ids=ids, labels=ids).loss + self.other(input_ids=ids, labels=ids).loss
        self.losses.append(float(loss.detach()))
        return loss


def test_a_policy_the_user_installed_on_a_second_model_is_kept(caplog):
    base, other_base = tiny_model("llama", num_hidden_layers=2), tiny_model("llama", seed=1, num_hidden_layers=2)
    reference = fit(clone(base), module_cls=lambda m: TwoModels(m, clone(other_base)))
    other = clone(other_base)
    other.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    handle = apply_selective_checkpointing(other, save=["aten::mm"])
    installed = other.model.layers[0]._gradient_checkpointing_func
    try:
        run = fit(
            clone(base), [ActivationCheckpointing(selective={"save": []})], module_cls=lambda m: TwoModels(m, other)
        )
        assert handle.report(), "the user's policy ran on its model's layers"
        assert other.model.layers[0]._gradient_checkpointing_func is installed, "and is there after the run"
    finally:
        handle.remove()
    assert_same_grads(reference, run)
    # the callback's model: 6 projections replayed a layer; the other model's: every matmul saved by the user's policy
    assert run.backward_ops[MM] - reference.backward_ops[MM] == 2 * 6
    assert any("keep the policy apply_selective_checkpointing installed" in m for m in caplog.messages)
