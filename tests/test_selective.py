"""Selective activation checkpointing: what is saved, what is replayed, and gradients that never change."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from conftest import LM, batches, clone, fit, make_trainer, model_fingerprint, tiny_model
from torch import nn

from lightning_ac import (
    ActivationCheckpointing,
    ConfigError,
    SelectiveCheckpointingWarning,
    apply_selective_checkpointing,
    register_mandatory_save,
    register_preferred_save,
)
from lightning_ac.selective.ops import is_attention, matmul_k

MM = "aten.mm"
SDPA = "aten._scaled_dot_product_flash_attention_for_cpu"
LAYERS = 4


def assert_same_grads(reference: LM, run: LM) -> None:
    assert reference.losses == run.losses
    assert reference.grads.keys() == run.grads.keys()
    for name, grad in reference.grads.items():
        assert torch.equal(grad, run.grads[name]), name


def run_selective(base, selective, **kwargs):
    callback = ActivationCheckpointing(selective=selective, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = fit(clone(base), [callback])
    problems = [str(w.message) for w in caught if issubclass(w.category, SelectiveCheckpointingWarning)]
    return module, problems


@pytest.fixture(scope="module")
def llama_runs():
    base = tiny_model("llama")
    return base, fit(clone(base)), fit(clone(base), [ActivationCheckpointing()])


@pytest.mark.parametrize(
    "selective, mm_replays, attention_replays",
    [
        # full recompute replays 24 matmuls and 4 attention calls (see test_checkpointing)
        (True, 24, 0),
        ({"save": ["attention"]}, 24, 0),
        ({"save": ["attention", "aten::mm"]}, 0, 0),
        ({"save": [], "save_matmul_min_k": 1}, 0, 4),
        (
            {"save": [], "save_matmul_min_k": 128},
            20,
            4,
        ),  # only down_proj (K = intermediate 128) qualifies... and it is never replayed
        ({"save": [], "save_matmul_min_k": 64}, 0, 4),  # every projection has K >= 64
        ({"save": [], "save_modules": ["o_proj"]}, 20, 4),  # exactly one replayed matmul fewer per layer
        ({"save": [], "save_modules": ["self_attn.o_proj"]}, 20, 4),
        ({"save": [], "save_modules": ["model.layers.*.mlp.*_proj"]}, 16, 4),  # gate, up (down is not replayed)
        ({"save": [], "save_modules": ["model.layers.0.self_attn.o_proj"]}, 23, 4),
        ({"save": []}, 24, 4),
        ({"save": ["attention"], "save_modules": ["o_proj", "gate_proj", "up_proj"]}, 12, 0),
    ],
)
def test_saved_ops_are_not_replayed(llama_runs, selective, mm_replays, attention_replays):
    base, reference, full = llama_runs
    assert full.backward_ops[MM] - reference.backward_ops[MM] == 24
    run, _ = run_selective(base, selective)
    assert_same_grads(reference, run)
    if selective == {"save": [], "save_matmul_min_k": 128}:
        mm_replays = 24  # down_proj's output is saved but was never replayed anyway
    assert run.backward_ops[MM] - reference.backward_ops[MM] == mm_replays
    assert run.backward_ops.get(SDPA, 0) == attention_replays


def test_every_n_layers_and_dropout_with_selective():
    # LoRA dropout inside the recomputed layers: masks must replay exactly. (Attention dropout on CPU
    # takes SDPA's math path, which dispatches no attention kernel to save.)
    base = tiny_model("llama", lora=True, lora_dropout=0.3)
    pl.seed_everything(5)
    reference = fit(clone(base))
    pl.seed_everything(5)
    run, problems = run_selective(base, {"save": ["attention"]}, kwargs={"every_n_layers": 2})
    assert_same_grads(reference, run)
    assert run.backward_ops.get(SDPA, 0) == 0
    assert problems == []
    pl.seed_everything(6)
    other = fit(clone(base))
    assert any(not torch.equal(g, other.grads[n]) for n, g in reference.grads.items()), "dropout is active"


def test_sliding_window_layers_recompute_attention_by_default():
    base = tiny_model("qwen3")  # layer_types: full, full, sliding, sliding
    assert base.config.layer_types == ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    reference = fit(clone(base))
    run, _ = run_selective(base, {"save": ["attention"]})
    assert_same_grads(reference, run)
    assert run.backward_ops[SDPA] == 2, "the two sliding layers replay attention"
    saved = run_report(base, {"save": ["attention"]})
    assert {layer: "aten::_scaled_dot_product_flash_attention_for_cpu" in ops for layer, ops in saved.items()} == {
        0: True,
        1: True,
        2: False,
        3: False,
    }
    run, _ = run_selective(base, {"save": ["attention"], "save_sliding_window": True})
    assert_same_grads(reference, run)
    assert run.backward_ops.get(SDPA, 0) == 0
    run, _ = run_selective(base, {"save": ["attention"], "recompute_layer_types": []})
    assert run.backward_ops.get(SDPA, 0) == 0
    run, _ = run_selective(base, {"save": ["attention"], "recompute_layer_types": ["full_attention"]})
    assert run.backward_ops[SDPA] == 2


def run_report(base, selective):
    reports = {}

    class Grab(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            reports.update(callback.plan.selective.report())

    callback = ActivationCheckpointing(selective=selective)
    fit(clone(base), [callback, Grab()])
    return reports


def test_gemma3_all_sliding_but_one():
    base = tiny_model("gemma3_text")
    types = base.config.layer_types
    reference = fit(clone(base))
    run, _ = run_selective(base, {"save": ["attention"]})
    assert_same_grads(reference, run)
    assert run.backward_ops.get(SDPA, 0) == types.count("sliding_attention")


def test_peft_save_modules_resolves_to_base_layer():
    base = tiny_model("llama", lora=True)
    reference = fit(clone(base))
    full = fit(clone(base), [ActivationCheckpointing()])
    run, problems = run_selective(base, {"save": [], "save_modules": ["o_proj"]})
    assert_same_grads(reference, run)
    assert problems == []
    # Only the frozen base matmul is saved: lora_A and lora_B of o_proj are still replayed.
    assert full.backward_ops[MM] - run.backward_ops[MM] == LAYERS
    report = run_report(base, {"save": [], "save_modules": ["o_proj"]})
    assert all(ops == {"aten::mm": 1} for ops in report.values())
    # names are the base model's: PEFT's own prefix does not match
    _, problems = run_selective(
        base, {"save": [], "save_modules": ["base_model.model.model.layers.0.self_attn.o_proj"]}
    )
    assert any("matched no module" in p for p in problems)


def test_lm_head_and_embeddings_are_never_in_scope(llama_runs):
    base, reference, full = llama_runs
    run, problems = run_selective(base, {"save": [], "save_modules": ["lm_head", "embed_tokens"]})
    assert run.backward_ops[MM] == full.backward_ops[MM]
    assert len([p for p in problems if "matched no module" in p]) == 2


class Router(nn.Module):
    """A toy mixture-of-experts block whose router normalises its top-k weights in place."""

    def __init__(self, dim: int = 16, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x).softmax(-1)
        weights, chosen = torch.topk(scores, self.k, dim=-1)
        weights /= weights.sum(-1, keepdim=True)  # in place, as real routers do
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            weight = (weights * (chosen == index)).sum(-1, keepdim=True)
            out = out + weight * expert(x)
        return x + out


class RouterLM(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Router(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return type("Out", (), {"loss": loss})()


def test_mandatory_save_clone_protects_in_place_edit():
    torch.manual_seed(0)
    base = RouterLM()
    reference = fit(clone(base))
    handle = register_mandatory_save("aten::topk")
    try:
        run, _ = run_selective(base, {"save": []}, layers=[Router])
    finally:
        handle.remove()
    assert_same_grads(reference, run)
    assert run.backward_ops.get("aten.topk", 0) == 0, "topk is saved, not replayed"
    # A preferred save hands the forward the cached tensor itself: the in-place edit corrupts it, which
    # torch detects. The clone is what makes the mandatory save safe.
    handle = register_preferred_save(torch.ops.aten.topk)
    try:
        with pytest.raises(RuntimeError):
            run_selective(base, {"save": []}, layers=[Router])
    finally:
        handle.remove()


def test_registered_saves_apply_ahead_of_the_save_list(llama_runs):
    base, reference, _ = llama_runs
    handle = register_preferred_save("aten::mm")
    try:
        run, _ = run_selective(base, {"save": []})
    finally:
        handle.remove()
    assert_same_grads(reference, run)
    assert run.backward_ops[MM] == reference.backward_ops[MM]


@pytest.mark.parametrize(
    "selective, fragment",
    [
        ({"save": ["aten::does_not_exist"]}, "'aten::does_not_exist' matched no op"),
        ({"save": [], "save_modules": ["q_projection"]}, "'q_projection' matched no module"),
        ({"save": [], "save_modules": ["down_proj"]}, "no recompute replayed"),
        ({"save": [], "save_matmul_min_k": 100000}, "no matmul reached K >= 100000 (largest K seen: 128)"),
    ],
)
def test_diagnostics_name_the_rule(llama_runs, selective, fragment):
    base, reference, _ = llama_runs
    run, problems = run_selective(base, selective)
    assert_same_grads(reference, run)
    assert any(fragment in p for p in problems), problems


def test_diagnostics_quiet_for_healthy_rules(llama_runs):
    base, _, _ = llama_runs
    _, problems = run_selective(
        base, {"save": ["attention"], "save_modules": ["o_proj", "up_proj"], "save_matmul_min_k": 64}
    )
    assert problems == []


def test_eager_attention_is_not_matched_and_says_so():
    base = tiny_model("llama")
    base.config._attn_implementation = "eager"
    reference = fit(clone(base))
    run, problems = run_selective(base, {"save": ["attention"]})
    assert_same_grads(reference, run)
    assert any("'attention' matched no op" in p and "eager attention" in p for p in problems)


def test_plain_torch_layers_with_selective():
    torch.manual_seed(0)
    base = RouterLM()
    reference = fit(clone(base))
    run, _ = run_selective(base, {"save": [], "save_modules": ["gate"]}, layers=["model.blocks.*"])
    assert_same_grads(reference, run)


def test_model_left_as_found_after_selective(llama):
    module = LM(llama)
    fingerprint = model_fingerprint(module)
    make_trainer([ActivationCheckpointing(selective={"save": ["attention"], "save_modules": ["o_proj"]})]).fit(
        module, batches()
    )
    assert model_fingerprint(module) == fingerprint


class TwoBackwards(LM):
    """Backpropagates the same loss twice (``retain_graph=True``), as a user computing two gradients might."""

    def __init__(self, model):
        super().__init__(model)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        loss = self.model(input_ids=ids, labels=ids).loss
        self.manual_backward(loss, retain_graph=True)
        self.manual_backward(loss)


@pytest.mark.parametrize("offload", [False, True])
def test_second_backward_through_a_selective_region_says_why(llama, offload, transfer):
    from lightning_ac import ActivationOffload

    module = TwoBackwards(llama)
    fingerprint = model_fingerprint(module)
    callbacks = [ActivationCheckpointing(selective=True)]
    if offload:
        callbacks.append(ActivationOffload(selective="cpu", copy_on_host=True))
    # torch's own rule for selective checkpointing, in torch's words (not an error from inside contextlib)
    with pytest.raises(RuntimeError, match="only allowed to backward once on any region computed under selective"):
        make_trainer(callbacks).fit(module, batches())
    assert model_fingerprint(module) == fingerprint


# selective under torch.compile (per layer and whole model): tests/test_compile.py


def test_apply_selective_checkpointing_on_transformers_checkpointing():
    base = tiny_model("llama")
    reference = fit(clone(base))
    model = clone(base)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    original = model.model.layers[0]._gradient_checkpointing_func
    handle = apply_selective_checkpointing(model, save=["attention"])
    run = fit(model)
    assert_same_grads(reference, run)
    assert run.backward_ops.get(SDPA, 0) == 0
    assert handle.report() and all(
        "aten::_scaled_dot_product_flash_attention_for_cpu" in v for v in handle.report().values()
    )
    handle.remove()
    assert model.model.layers[0]._gradient_checkpointing_func is original
    again = fit(model)
    assert again.backward_ops[SDPA] == LAYERS


def test_apply_selective_checkpointing_diagnoses_after_one_backward_of_the_checkpointed_layers():
    model = tiny_model("llama")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=2)
    handle = apply_selective_checkpointing(model, save=["attention"])
    assert handle.diagnose_after == LAYERS // 2, "two of the four layers are recomputed in a backward"
    fit(model)
    assert handle.diagnosed, "after the first backward"
    handle.remove()


def test_apply_selective_checkpointing_registered_only():
    base = tiny_model("llama")
    model = clone(base)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    entry = register_preferred_save("aten::_scaled_dot_product_flash_attention")
    try:
        handle = apply_selective_checkpointing(model, save=[])
        run = fit(model)
    finally:
        entry.remove()
    handle.remove()
    assert run.backward_ops.get(SDPA, 0) == 0


def test_apply_selective_checkpointing_errors():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="no checkpointed decoder layers"):
        apply_selective_checkpointing(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ConfigError, match="non-reentrant"):
        apply_selective_checkpointing(model)
    with pytest.raises(ConfigError, match="save_matmul_min_k"):
        apply_selective_checkpointing(model, save_matmul_min_k=0)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("aten::_scaled_dot_product_flash_attention_for_cpu", True),
        ("aten::_scaled_dot_product_flash_attention", True),
        ("aten::_scaled_dot_product_efficient_attention", True),
        ("aten::_efficient_attention_forward", True),
        ("aten::_scaled_dot_product_cudnn_attention", True),
        ("aten::_cudnn_attention_forward", True),
        ("aten::_scaled_dot_product_fused_attention_overrideable", True),
        ("aten::_scaled_dot_product_attention_math_for_mps", True),
        ("flash_attn::_flash_attn_forward", True),
        ("flash_attn_3::fwd", True),
        ("kernels_flash_attn_abc::_flash_attn_varlen_forward", True),
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", False),
        ("flash_attn::_flash_attn_backward", False),
        ("aten::bmm", False),
        ("aten::_softmax", False),
        ("aten::_safe_softmax", False),  # SDPA's math backend: its output bmm is saved instead
    ],
)
def test_attention_names(name, expected):
    assert is_attention(name) is expected


def test_matmul_k():
    a, b = torch.ones(3, 5), torch.ones(5, 7)
    assert matmul_k("aten::mm", (a, b)) == 5
    assert matmul_k("aten::addmm", (torch.ones(7), a, b)) == 5


def test_the_policy_decides_once_per_op_kind_and_adds_no_dispatch_mode_once_it_has_diagnosed(monkeypatch):
    """SAC's own cost: torch's selective checkpointing is a dispatch mode that asks a policy about each op; ours added
    per op a decision worked out again for each call and a dispatch mode of its own in the forward and the recompute
    (1.22x torch's step on a tiny Llama on the CPU). Now an op's kind decides (only attention is asked per call: a
    sliding window, SDPA's math backend), torch hands the policy the op's output (what was saved is recorded there),
    and the replay is watched for the first backward's diagnostics only: after the first step no mode of ours runs."""
    from lightning_ac.selective.modes import ForwardMode, RecomputeMode
    from lightning_ac.selective.rules import OpRules

    calls = {"decided": [], "forward mode": [], "recompute mode": []}
    step = [0]

    def counting(name, method):
        def spy(*args, **kwargs):
            calls[name].append(step[0])
            return method(*args, **kwargs)

        return spy

    monkeypatch.setattr(OpRules, "_decide", counting("decided", OpRules._decide))
    for name, mode in (("forward mode", ForwardMode), ("recompute mode", RecomputeMode)):
        monkeypatch.setattr(mode, "__torch_dispatch__", counting(name, mode.__torch_dispatch__))

    class Steps(pl.Callback):
        def on_train_batch_end(self, *args):
            step[0] += 1

    base = tiny_model("llama")
    reference = fit(clone(base), max_steps=3)
    callback = ActivationCheckpointing(selective={"save": ["attention"]})
    run = fit(clone(base), [callback, Steps()], max_steps=3)
    assert reference.losses == run.losses
    later = [s for s in calls["decided"] if s > 0]
    assert len(later) == 2 * 4, "steps 1 and 2 asked again about one op per layer: attention (4 layers)"
    # 19 here: 15 kinds of op and the 4 attention calls, of about 40 ops in each of the 4 layers' forwards
    assert 0 < calls["decided"].count(0) < 30, "the first step decided each kind of op once"
    assert calls["forward mode"] == [] and [s for s in calls["recompute mode"] if s > 0] == []
    assert calls["recompute mode"], "the first backward's replay was watched (the diagnostics)"


def test_the_sac_cost_benchmark_steps_ours_beside_torchs_own(capsys):
    """``python -m lightning_ac.bench.sac_cost`` runs the three steps (its figure is a timing: judged by a person or
    the GPU check, never here)."""
    from lightning_ac.bench.sac_cost import main

    seconds = main(["--steps", "1", "--reps", "1"])
    assert set(seconds) == {"torch_full", "torch_sac", "ours"} and all(s > 0 for s in seconds.values())
    assert "ours / torch_sac = " in capsys.readouterr().out
