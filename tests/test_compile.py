"""torch.compile: the block's recompute and selective modes inside compiled graphs, per decoder layer and whole model.

Compiled graphs bypass dispatch modes, so recompute and saves are counted in the graphs themselves: a recording
``aot_autograd`` backend keeps every forward and backward graph AOT autograd builds (``aot_eager``: the graphs run
as traced, so gradients compare bit for bit with the same compiled model without the suite).
"""

from __future__ import annotations

import re
from typing import List, Tuple

import lightning.pytorch as pl
import pytest
import torch
import torch._functorch.config
from conftest import LM, batches, clone, fit, make_trainer, model_fingerprint, tiny_model
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.custom_graph_pass import CustomGraphPass

from lightning_ac import (
    ActivationCheckpointing,
    ActivationOffload,
    ConfigError,
    LayerOffload,
    register_mandatory_save,
    register_preferred_save,
)
from lightning_ac._compat import CHECKPOINT_SIDE_EFFECTS_SETTING, DYNAMO_SKIPS_CHECKPOINT_SIDE_EFFECTS
from lightning_ac.plan.recompute import trace_side_effects_in_checkpoints

MM, SDPA = "aten.mm", "aten._scaled_dot_product_flash_attention_for_cpu"


class GraphRecorder:
    """A backend that keeps every forward and backward graph AOT autograd builds, apart, and runs it: as traced
    (``aot_eager``), or compiled by inductor, which hands its graphs after its own passes to the recorder (its
    caches off, so that every graph is built and seen).

    Args:
        inductor: Compile with inductor rather than running the graphs as traced.
    """

    def __init__(self, inductor: bool = False) -> None:
        self.graphs: List[Tuple[str, List[str]]] = []  # (forward or backward, the ops each call_function node calls)
        if inductor:
            self.options = {
                "backend": "inductor",
                "options": {"post_grad_custom_post_pass": _InductorPass(self.graphs), "fx_graph_cache": False},
            }
        else:
            recording = aot_autograd(fw_compiler=self._keep("forward"), bw_compiler=self._keep("backward"))
            self.options = {"backend": recording}

    def _keep(self, kind: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs):
            self.graphs.append((kind, _calls(gm.graph)))
            return make_boxed_func(gm.forward)

        return compiler

    def compile(self, module: torch.nn.Module) -> torch.nn.Module:
        """``torch.compile(module)`` with this backend."""
        return torch.compile(module, **self.options)

    def compile_in_place(self, module: torch.nn.Module) -> None:
        """``module.compile()`` with this backend."""
        module.compile(**self.options)

    def ops(self, kind: str, prefix: str, since: int = 0) -> List[int]:
        """Per graph of ``kind`` (from the ``since``-th graph kept on), how many of its calls are ops whose name
        starts with ``prefix``."""
        return [sum(op.startswith(prefix) for op in calls) for k, calls in self.graphs[since:] if k == kind]


def _calls(graph: torch.fx.Graph) -> List[str]:
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


class _InductorPass(CustomGraphPass):
    """Keeps each graph inductor is about to lower; a backward graph is the one that takes the tangents."""

    def __init__(self, graphs: List[Tuple[str, List[str]]]) -> None:
        self.graphs = graphs

    def __call__(self, graph: torch.fx.Graph) -> None:
        backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
        self.graphs.append(("backward" if backward else "forward", _calls(graph)))

    def uuid(self) -> str:
        return "lightning_ac-tests-recorder"


class GraphLM(LM):
    """The tests' LM without its backward dispatch mode (compiled graphs bypass it, and it cannot pass their
    higher-order ops): the first step's gradients only."""

    def on_before_backward(self, loss):
        pass

    def on_after_backward(self):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None}


def compiled(base: torch.nn.Module, recorder: GraphRecorder, where: str) -> torch.nn.Module:
    """A copy of ``base`` compiled with ``recorder``: each decoder layer (torchtitan's way), or the whole model."""
    torch._dynamo.reset()
    model = clone(base)
    if where == "model":
        return recorder.compile(model)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = recorder.compile(layer)
    return model


def train(base, where: str, callbacks=(), inductor: bool = False) -> Tuple[GraphLM, GraphRecorder]:
    recorder = GraphRecorder(inductor)
    return fit(compiled(base, recorder, where), callbacks, max_steps=2, module_cls=GraphLM), recorder


# aot_eager in the default run; inductor, which compiles each graph (seconds each on CPU), in the slow session
BACKENDS = [pytest.param(False, id="aot_eager"), pytest.param(True, id="inductor", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", autouse=True)
def _forget_the_graphs():
    """Dynamo's caches hold the module's graphs and their fake tensors: let them go with the module. AOT autograd's
    cache stays off here: a graph it serves is never handed to inductor's passes, where the recorder sees it."""
    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama")


class Plain(dict):
    """The same compiled models without the suite, trained when first asked for: ``plain[where]`` with
    ``aot_eager``, ``plain[where, inductor]``; the reference and its backward matmuls."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base = base

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key, False)
        if key not in self:
            self[key] = train(self.base, *key[:1], inductor=key[1])
        return super().__getitem__(key)


@pytest.fixture(scope="module")
def plain(base):
    return Plain(base)


def assert_same_grads(reference: GraphLM, run: GraphLM, where: str = "layer", inductor: bool = False) -> None:
    """Gradients bit for bit against the same compiled model without the suite: with aot_eager (per layer at every
    length, whole model at the tests' 32 tokens a sequence: see test_gradients_at_more_than_one_length),
    and with inductor per layer, the graphs agree on every sum. Inductor compiles a whole model's backward as one
    graph, where the recompute changes what it fuses, so sums round differently (full checkpointing: 38 of 39
    gradients differ, by at most 4.2e-7 of their largest value): there, float32 rounding apart."""
    grads = {name.replace("._orig_mod", ""): grad for name, grad in run.grads.items()}  # in place: no wrapper
    assert grads.keys() == {name.replace("._orig_mod", "") for name in reference.grads}
    for name, grad in reference.grads.items():
        if inductor and where == "model":
            torch.testing.assert_close(grads[name.replace("._orig_mod", "")], grad, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(grad, grads[name.replace("._orig_mod", "")]), name


# backward matmuls of one layer's graph (per-layer compile: one graph serves all four layers) or the model's graph
PLAIN_MM = {"layer": 14, "model": 58}
FULL_MM = {"layer": 20, "model": 83}  # + the 6 recomputed projections of each layer (the output head is not)
PER_GRAPH = {"layer": 1, "model": 4}  # decoder layers a graph holds


SAVE_RULES = [
    (None, FULL_MM),
    ({"save": ["aten::mm"]}, PLAIN_MM),  # every matmul saved: none recomputed
    ({"save": [], "save_matmul_min_k": 64}, PLAIN_MM),  # every projection contracts over >= 64
    ({"save": ["attention"]}, FULL_MM),  # the partitioner never recomputes attention: the rule adds nothing
]


@pytest.mark.parametrize(
    "selective, backward_mm, where",
    [  # the whole model's cases of the last two rules run in the slow session (per layer in the default one)
        pytest.param(rule, mm, where, marks=[pytest.mark.slow] if where == "model" and i >= 2 else [])
        for i, (rule, mm) in enumerate(SAVE_RULES)
        for where in ("layer", "model")
    ],
)
@pytest.mark.parametrize("inductor", BACKENDS)
def test_save_rules_apply_inside_compiled_graphs(base, plain, where, selective, backward_mm, inductor):
    reference, reference_graphs = plain[where, inductor]
    assert set(reference_graphs.ops("backward", MM)) == {PLAIN_MM[where]}
    run, graphs = train(base, where, [ActivationCheckpointing(selective=selective)], inductor=inductor)
    assert set(graphs.ops("backward", MM)) == {backward_mm[where]}
    # one SDPA call per layer in backward: its backward kernel; a recomputed attention would add its forward
    assert set(graphs.ops("backward", SDPA)) == set(reference_graphs.ops("backward", SDPA)) == {PER_GRAPH[where]}
    assert run.losses == reference.losses
    assert_same_grads(reference, run, where, inductor)


@pytest.mark.parametrize("where, backward_mm", [("layer", {14, 20}), ("model", {72})])
@pytest.mark.parametrize("inductor", BACKENDS)
def test_every_n_layers_recomputes_every_second_layer_inside_the_graphs(base, plain, where, backward_mm, inductor):
    reference, _ = plain[where, inductor]
    run, graphs = train(base, where, [ActivationCheckpointing(kwargs={"every_n_layers": 2})], inductor=inductor)
    assert set(graphs.ops("backward", MM)) == backward_mm  # per layer: a graph for each kind of layer
    assert run.losses == reference.losses
    assert_same_grads(reference, run, where, inductor)


# the whole model's cases of these three run in the slow session (the save rules run both in the default one)
WHOLE_IN_SLOW = ["layer", pytest.param("model", marks=pytest.mark.slow)]


@pytest.mark.parametrize("where, backward_mm", [("layer", 14), pytest.param("model", 58, marks=pytest.mark.slow)])
def test_compiled_in_place_too(base, where, backward_mm):
    # module.compile() compiles in place (no OptimizedModule wrapper): found and handled as torch.compile(module)
    torch._dynamo.reset()
    recorder, model = GraphRecorder(), clone(base)
    for module in model.model.layers if where == "layer" else [model]:
        recorder.compile_in_place(module)
    fit(model, [ActivationCheckpointing(selective={"save": ["aten::mm"]})], max_steps=1, module_cls=GraphLM)
    assert set(recorder.ops("backward", MM)) == {backward_mm}


@pytest.mark.parametrize("register", [register_mandatory_save, register_preferred_save])
def test_registered_saves_apply_inside_compiled_graphs(base, plain, register):
    reference, _ = plain["layer"]
    handle = register("aten::mm")
    try:
        run, graphs = train(base, "layer", [ActivationCheckpointing(selective={"save": []})])
    finally:
        handle.remove()
    assert set(graphs.ops("backward", MM)) == {PLAIN_MM["layer"]}, "a preferred save is a save under compile too"
    assert run.losses == reference.losses
    assert_same_grads(reference, run)


def test_the_applied_line_and_the_report_say_the_rules_apply_when_traced(base, caplog):
    described = []

    class Report(pl.Callback):  # what the per-layer table shows in its SAC column, read while the plan is applied
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not described:
                policy = checkpointing.plan.selective
                described.extend(policy.describe_layer(i, recomputed=True) for i in range(4))

    checkpointing = ActivationCheckpointing(selective=True)
    train(base, "layer", [checkpointing, Report()])
    applied = next(m for m in caplog.messages if "checkpointing 4/4" in m)
    assert "selective: save attention" in applied
    # one compiled part (it said "compiled:" twice): what compiling changes, then what it does to the save rules
    assert applied.count("compiled:") == 1, applied
    inside = "compiled: recomputed inside the graphs, where the partitioner keeps attention's outputs"
    assert f"{inside}; the save rules apply when the graphs are traced" in applied
    assert described == ["attention, compiled: decided when traced"] * 4


UNKNOWN_OP = {"save": ["aten::mm", "aten::no_such_op"]}
UNKNOWN_SAID = ["'aten::no_such_op' matched no op in the traced graphs"]


@pytest.mark.parametrize(
    "where, rules, backward_mm, said",
    [
        ("layer", UNKNOWN_OP, 14, UNKNOWN_SAID),
        ("model", UNKNOWN_OP, 30, UNKNOWN_SAID),
        ("layer", {"save": [], "save_matmul_min_k": 64}, 14, []),
        ("layer", {"save": [], "save_matmul_min_k": 4096}, 20, ["no matmul reached K >= 4096 (largest K seen: 128)"]),
    ],
)
def test_the_diagnostics_count_the_rules_when_traced(small, where, rules, backward_mm, said):
    # before, working rules (save: [aten::mm], save_matmul_min_k: 64: 20 -> 14 backward matmuls a layer) "matched no
    # op in 0 checkpointed regions" or "saved nothing": nothing was counted under compile. Tracing tells which rules
    # match an op, not which saves a recompute replays: no rule is said never replayed there.
    problems = []

    class Problems(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            problems.extend(checkpointing.plan.selective.problems())

    checkpointing = ActivationCheckpointing(selective=rules)
    recorder = GraphRecorder()
    fit(compiled(small, recorder, where), [checkpointing, Problems()], max_steps=1, module_cls=GraphLM)
    assert set(recorder.ops("backward", MM)) == {backward_mm}
    assert len(problems) == len(said), problems
    for problem, expected in zip(problems, said):
        assert expected in problem


@pytest.mark.parametrize("where", ["layer", "model"])
def test_the_model_is_left_as_found(base, where):
    recorder = GraphRecorder()
    model = compiled(base, recorder, where)
    module = GraphLM(model)
    fingerprint = model_fingerprint(module)
    make_trainer([ActivationCheckpointing(selective={"save": ["aten::mm"]})], max_steps=1).fit(module, batches())
    assert model_fingerprint(module) == fingerprint


class _Active:
    """A module-level variable, as the ``kernels`` package keeps the kernels in force for each attention's call."""

    funcs = None


_ACTIVE = _Active()
needs_side_effects_setting = pytest.mark.skipif(
    not DYNAMO_SKIPS_CHECKPOINT_SIDE_EFFECTS,
    reason=f"this torch has no {CHECKPOINT_SIDE_EFFECTS_SETTING}: a side effect inside a checkpoint breaks the graph",
)


@needs_side_effects_setting
@pytest.mark.parametrize("where", ["layer", "model"])
def test_a_forward_with_side_effects_is_recomputed_inside_the_graphs(base, plain, where, monkeypatch):
    # transformers >= 5.25 installs the kernels package, whose wrapper around each attention's forward sets a
    # module-level variable and puts it back: dynamo broke the graph at every checkpoint there (a side effect inside
    # its higher-order op), and the decoder layers ran eagerly, uncompiled (no backward graph held a matmul)
    from transformers.models.llama.modeling_llama import LlamaAttention

    forward = LlamaAttention.forward

    def with_kernels_in_force(self, *args, **kwargs):
        previous, _ACTIVE.funcs = _ACTIVE.funcs, {"rotary": self}
        try:
            return forward(self, *args, **kwargs)
        finally:
            _ACTIVE.funcs = previous

    reference, _ = plain[where]
    monkeypatch.setattr(LlamaAttention, "forward", with_kernels_in_force)
    run, graphs = train(base, where, [ActivationCheckpointing()])
    assert set(graphs.ops("backward", MM)) == {FULL_MM[where]}, "the layers ran compiled"
    assert run.losses == reference.losses
    assert_same_grads(reference, run, where)
    assert getattr(torch._dynamo.config, CHECKPOINT_SIDE_EFFECTS_SETTING) is False, "the setting is put back"


@needs_side_effects_setting
def test_a_side_effects_setting_the_user_turned_on_stays_on():
    # the config's own patch: monkeypatch's undo would delete the setting, which hides it from getattr afterwards
    with torch._dynamo.config.patch(CHECKPOINT_SIDE_EFFECTS_SETTING, True):
        assert trace_side_effects_in_checkpoints() is None
        assert getattr(torch._dynamo.config, CHECKPOINT_SIDE_EFFECTS_SETTING) is True
    assert getattr(torch._dynamo.config, CHECKPOINT_SIDE_EFFECTS_SETTING) is False


@pytest.mark.parametrize("where", ["layer", "model"])
@pytest.mark.parametrize("inductor", BACKENDS)
def test_offload_all_moves_what_the_compiled_graphs_save(base, plain, where, inductor):
    # torch runs saved-tensor hooks on a compiled graph's saves after its forward, all at once (no overlap with it)
    offload = ActivationOffload(all="cpu", min_offload_bytes=0, copy_on_host=True)
    run, graphs = train(base, where, [ActivationCheckpointing(), offload], inductor=inductor)
    assert set(graphs.ops("backward", MM)) == {FULL_MM[where]}, "the layers ran compiled"
    assert offload.last_step["all"]["tensors"] > 0
    reference, _ = plain[where, inductor]
    assert run.losses == reference.losses
    assert_same_grads(reference, run, where, inductor)


def compiled_calls(model: torch.nn.Module) -> List[object]:
    """What eager code calls to run each decoder layer's compiled graph (offload.hidden_states wraps it)."""
    return [layer.__dict__.get("forward", layer.__dict__.get("_compiled_call_impl")) for layer in model.model.layers]


@pytest.mark.parametrize(
    "how, inductor",
    [
        ("wrapper", False),
        ("in_place", False),
        ("wrapper_named", False),
        pytest.param("wrapper", True, marks=pytest.mark.slow, id="wrapper-inductor"),
    ],
)
def test_offload_hidden_states_moves_each_compiled_layers_inputs(base, plain, how, inductor, caplog):
    # hooks around each layer's compiled call, in eager, take its inputs from what the graph saves after its
    # forward; by name the layer is the wrapper itself, and the hooks around its checkpoint call are eager already
    torch._dynamo.reset()
    recorder, model = GraphRecorder(inductor), clone(base)
    for i, layer in enumerate(model.model.layers):
        if how == "in_place":
            recorder.compile_in_place(layer)
        else:
            model.model.layers[i] = recorder.compile(layer)
    calls = compiled_calls(model)
    offload = ActivationOffload(hidden_states="cpu", copy_on_host=True)
    layers = ["model.model.layers.?"] if how == "wrapper_named" else None
    run = fit(model, [ActivationCheckpointing(layers=layers), offload], max_steps=2, module_cls=GraphLM)
    # by name, the checkpoint wraps the compiled call: its recompute runs the compiled forward again, from outside
    recomputed_in_graph = FULL_MM["layer"] if how != "wrapper_named" else PLAIN_MM["layer"]
    assert set(recorder.ops("backward", MM)) == {recomputed_in_graph}, "the layers ran compiled"
    # the 4 layers' hidden states, (batch x sequence, hidden) float32, as in eager: the positional inputs (the graph
    # saves the rotary cos and sin too, keyword inputs, which stay, as eager's checkpoint keeps them)
    assert offload.last_step["hidden_states"] == {"tensors": 4, "bytes": 4 * 64 * 64 * 4}
    if how == "wrapper_named":
        assert any("compiled: each checkpoint wraps a compiled layer" in m for m in caplog.messages)
    else:
        applied = next(m for m in caplog.messages if "checkpointing 4/4" in m)
        assert "compiled: recomputed inside the graphs, where the partitioner keeps attention's outputs" in applied
        assert "(compiled decoder layers: 4, their inputs moved after each compiled forward" in applied
    assert offload.last_step["all"]["tensors"] == 0
    reference, _ = plain["layer", inductor]
    assert run.losses == reference.losses
    assert_same_grads(reference, run, inductor=inductor)
    assert all(a is b for a, b in zip(compiled_calls(model), calls)), "the compiled calls are the ones found"


def test_offload_hidden_states_leaves_uncheckpointed_compiled_layers_alone(base, plain):
    recorder = GraphRecorder()
    offload = ActivationOffload(hidden_states="cpu", copy_on_host=True)
    callbacks = [ActivationCheckpointing(kwargs={"every_n_layers": 2}), offload]
    run = fit(compiled(base, recorder, "layer"), callbacks, max_steps=1, module_cls=GraphLM)
    assert set(recorder.ops("backward", MM)) == {14, 20}
    assert offload.last_step["hidden_states"] == {"tensors": 2, "bytes": 2 * 64 * 64 * 4}
    reference, _ = plain["layer"]
    assert run.losses[:1] == reference.losses[:1]


def test_offload_hidden_states_with_some_layers_compiled_and_some_eager(base):
    # eager layers: the hooks around their checkpoint call; compiled ones: around their compiled call
    def half_compiled(recorder: GraphRecorder) -> torch.nn.Module:
        torch._dynamo.reset()
        model = clone(base)
        for i in (0, 2):
            model.model.layers[i] = recorder.compile(model.model.layers[i])
        return model

    recorder = GraphRecorder()
    offload = ActivationOffload(hidden_states="cpu", copy_on_host=True)
    run = fit(half_compiled(recorder), [ActivationCheckpointing(), offload], max_steps=1, module_cls=GraphLM)
    assert set(recorder.ops("backward", MM)) == {FULL_MM["layer"]}, "the compiled layers ran compiled"
    assert offload.last_step["hidden_states"] == {"tensors": 4, "bytes": 4 * 64 * 64 * 4}
    reference = fit(half_compiled(GraphRecorder()), [ActivationCheckpointing()], max_steps=1, module_cls=GraphLM)
    assert run.losses == reference.losses
    assert_same_grads(reference, run)


class CompiledInConfigureModel(GraphLM):
    """Builds the model and compiles it in ``configure_model`` (the suite applies right after it)."""

    def __init__(self, base: torch.nn.Module, recorder: GraphRecorder, where: str) -> None:
        super().__init__(None)
        self._build = lambda: compiled(base, recorder, where)

    def configure_model(self):
        if self.model is None:
            self.model = self._build()


@pytest.mark.parametrize("where", WHOLE_IN_SLOW)
def test_a_model_compiled_in_configure_model(base, plain, where):
    recorder = GraphRecorder()
    module = CompiledInConfigureModel(base, recorder, where)
    make_trainer([ActivationCheckpointing(selective={"save": ["aten::mm"]})], max_steps=2).fit(module, batches())
    assert set(recorder.ops("backward", MM)) == {PLAIN_MM[where]}
    reference, _ = plain[where]
    assert module.losses == reference.losses
    assert_same_grads(reference, module, where)


@pytest.mark.parametrize("where", WHOLE_IN_SLOW)
def test_a_later_fit_runs_graphs_traced_for_it_not_stale_ones(base, where):
    # dynamo's guards see the checkpoint flags and the policy change: each fit traces the graphs it runs
    recorder = GraphRecorder()
    module = GraphLM(compiled(base, recorder, where))
    backward_mm = []
    for callbacks in ([ActivationCheckpointing(selective={"save": ["aten::mm"]})], [], [ActivationCheckpointing()]):
        before = len(recorder.graphs)
        make_trainer(callbacks, max_steps=1).fit(module, batches())
        backward_mm.append(set(recorder.ops("backward", MM, since=before)))  # empty: no graph traced for this fit
    assert backward_mm == [{PLAIN_MM[where]}, {PLAIN_MM[where]}, {FULL_MM[where]}]


@pytest.mark.parametrize(
    "callbacks, field",
    [
        ([ActivationCheckpointing(selective={"save": [], "save_modules": ["o_proj"]})], "selective.save_modules"),
        (
            [ActivationCheckpointing(selective=True), ActivationOffload(selective="cpu", copy_on_host=True)],
            "offload.selective",
        ),
        ([ActivationCheckpointing(budget="1MiB")], "budget"),  # its measurements made dynamo run the layers eagerly
    ],
)
@pytest.mark.parametrize("where", ["layer", "model"])
def test_what_cannot_work_under_compile_is_refused_before_training(base, callbacks, field, where):
    recorder = GraphRecorder()
    module = GraphLM(compiled(base, recorder, where))
    with pytest.raises(ConfigError, match=rf"activation_checkpointing\.{field}: .*compiled with torch\.compile"):
        make_trainer(callbacks).fit(module, batches())
    assert not recorder.graphs, "nothing was traced"


def test_offload_hidden_states_under_a_compiled_model_is_refused_before_training(base):
    # no eager code runs between the layers of a compiled model: hooks around a layer's call would be inside the
    # graph, where dynamo would run the layers eagerly, uncompiled, without a word
    recorder = GraphRecorder()
    module = GraphLM(compiled(base, recorder, "model"))
    callbacks = [ActivationCheckpointing(), ActivationOffload(hidden_states="cpu", copy_on_host=True)]
    field = "offload.hidden_states"
    with pytest.raises(ConfigError, match=rf"activation_checkpointing\.{field}: .*compiled with torch\.compile"):
        make_trainer(callbacks).fit(module, batches())
    assert not recorder.graphs, "nothing was traced"


# -- every route into a compiled region: Lightning's, a compiled forward, a compiled class forward ----------------

LIGHTNING_ROUTE = "fit(torch.compile(module))"  # Lightning's documented way: it compiles the step methods in place
# the plain routes, and the backward matmuls of one graph of the 2-layer model without recompute / fully recomputed
ROUTES = {LIGHTNING_ROUTE: (30, 43), "model.forward": (30, 43), "layer.forward": (14, 20)}


@pytest.fixture(scope="module")
def small():
    return tiny_model("llama", num_hidden_layers=2)


def compiled_by(route: str, base: torch.nn.Module, recorder: GraphRecorder) -> Tuple[object, GraphLM]:
    """A copy of ``base`` compiled by ``route`` with ``recorder``: what to hand ``trainer.fit``, and its
    LightningModule."""
    torch._dynamo.reset()
    model = clone(base)
    if route == "layer.forward":  # transformers' docs' pattern, per layer
        for layer in model.model.layers:
            layer.forward = recorder.compile(layer.forward)
    elif route == "model.forward":
        model.forward = recorder.compile(model.forward)
    elif route == "class forward":  # a layer class whose forward is compiled
        compiled_forward = torch.compile(type(model.model.layers[0]).forward, **recorder.options)
        cls = type("CompiledForwardLayer", (type(model.model.layers[0]),), {"forward": compiled_forward})
        for layer in model.model.layers:
            layer.__class__ = cls
    module = GraphLM(model)
    return (recorder.compile(module) if route == LIGHTNING_ROUTE else module), module


def fit_route(route, base, callbacks, max_steps=2) -> Tuple[GraphLM, GraphRecorder]:
    recorder = GraphRecorder()
    given, module = compiled_by(route, base, recorder)
    make_trainer(callbacks, max_steps=max_steps).fit(given, batches())
    return module, recorder


@pytest.fixture(scope="module")
def plain_route(small):
    """The 2-layer model compiled by each route without the suite, trained (two steps) when first asked for."""
    trained = {}

    def get(route):
        if route not in trained:
            trained[route] = fit_route(route, small, [])
        return trained[route]

    return get


# how the refusals name each route
SAID = {
    LIGHTNING_ROUTE: "trainer.fit(torch.compile(lightning_module))",
    "model.forward": "model.forward = torch.compile(model.forward)",
    "layer.forward": "layer.forward = torch.compile(layer.forward)",
    "class forward": "a compiled forward in class CompiledForwardLayer",
}
REFUSED = {
    "activation_checkpointing.budget": lambda: [ActivationCheckpointing(budget="1MiB")],
    "layer_offloading": lambda: [LayerOffload(copy_on_host=True)],
    # under a compiled model, and where transformers' checkpoint wraps a forward compiled in the layer class (it
    # checkpoints inside that forward too); it works around the compiled call of a layer compiled by itself (below)
    "activation_checkpointing.offload.hidden_states": lambda: [
        ActivationCheckpointing(),
        ActivationOffload(hidden_states="cpu", copy_on_host=True),
    ],
}


@pytest.mark.parametrize(
    "route, field",
    [
        (route, field)
        for route in SAID
        for field in REFUSED
        if not (field.endswith("hidden_states") and route == "layer.forward")
    ],
)
def test_every_compile_route_is_seen_and_gets_the_compile_rules(small, route, field):
    # before, these ran the layers eagerly, uncompiled, without a word (budget, offload.hidden_states) or crashed in
    # the compiler (layer offloading)
    recorder = GraphRecorder()
    given, module = compiled_by(route, small, recorder)
    for name, parameter in module.named_parameters():
        parameter.requires_grad_("self_attn" in name)  # frozen weights for layer offloading to stream
    match = rf"{re.escape(field)}: .*compiled with torch\.compile \({re.escape(SAID[route])}"
    with pytest.raises(ConfigError, match=match):
        make_trainer(REFUSED[field]()).fit(given, batches())
    assert not recorder.graphs, "nothing was traced"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "selective", [None, pytest.param({"save": ["aten::mm"]}, marks=pytest.mark.slow)], ids=["full", "save_mm"]
)  # save_mm: slow session
def test_every_compile_route_recomputes_inside_the_graphs(small, plain_route, route, selective):
    # before, selective crashed inside dynamo on these routes (the eager policy inside the compiled region)
    reference, reference_graphs = plain_route(route)
    plain_mm, full_mm = ROUTES[route]
    assert set(reference_graphs.ops("backward", MM)) == {plain_mm}
    run, graphs = fit_route(route, small, [ActivationCheckpointing(selective=selective)])
    assert set(graphs.ops("backward", MM)) == {full_mm if selective is None else plain_mm}
    assert run.losses == reference.losses
    assert_same_grads(reference, run)


def test_offload_hidden_states_moves_the_inputs_around_each_compiled_layer_forward(small, plain_route, caplog):
    # layer.forward = torch.compile(layer.forward) holds transformers' checkpoint: the inputs move around that call
    reference, _ = plain_route("layer.forward")
    offload = ActivationOffload(hidden_states="cpu", copy_on_host=True)
    graphs = GraphRecorder()
    run = compiled_by("layer.forward", small, graphs)[1]
    calls = [layer.forward for layer in run.model.model.layers]
    make_trainer([ActivationCheckpointing(), offload], max_steps=2).fit(run, batches())
    assert [layer.forward for layer in run.model.model.layers] == calls, "the compiled forwards are put back"
    assert set(graphs.ops("backward", MM)) == {ROUTES["layer.forward"][1]}, "the layers ran compiled"
    assert offload.last_step["hidden_states"] == {"tensors": 2, "bytes": 2 * 64 * 64 * 4}
    assert any("(compiled decoder layers: 2, their inputs moved" in m for m in caplog.messages)
    assert run.losses == reference.losses
    assert_same_grads(reference, run)


@pytest.mark.parametrize("route", ["torch.compile(layer), selected by name", "layer.forward, torch engine"])
def test_selective_is_refused_where_the_checkpoint_wraps_a_compiled_call_from_outside(small, route):
    # the policy, a dispatch mode around the compiled call, made dynamo run the layers eagerly (a compiled forward
    # under the torch engine) or failed in backward (the torchtitan wrapper selected by name)
    recorder = GraphRecorder()
    if route.startswith("layer.forward"):
        module = compiled_by("layer.forward", small, recorder)[1]
    else:
        torch._dynamo.reset()
        module = GraphLM(clone(small))
        for i, layer in enumerate(module.model.model.layers):
            module.model.model.layers[i] = recorder.compile(layer)
    callbacks = [ActivationCheckpointing(layers=["model.model.layers.?"], selective={"save": ["aten::mm"]})]
    match = r"activation_checkpointing\.selective: .*wraps their compiled call from outside"
    with pytest.raises(ConfigError, match=match):
        make_trainer(callbacks).fit(module, batches())
    assert not recorder.graphs, "nothing was traced"


# -- gradients at more than one length -----------------------------------------------------------------------------

# The most a gradient of the whole compiled model with checkpoint regions differs from the same compiled model without
# them, as a fraction of that gradient's largest value. Measured (aot_eager, 2 and 4 layers, full and selective, 48 to
# 256 tokens a sequence): at most 4.0e-7, about 3 float32 ulps (1.2e-7); 1e-6 leaves 2.5 times that.
WHOLE_MODEL_RTOL = 1e-6


def fit_at(base, where: str, seq: int, callbacks=(), own_checkpointing: bool = False) -> GraphLM:
    """One step of ``base`` compiled ``where`` (aot_eager) on sequences of ``seq`` tokens; ``own_checkpointing``:
    with transformers' own checkpointing turned on before compiling, and no suite."""
    model = clone(base)
    if own_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    module = GraphLM(compiled(model, GraphRecorder(), where))
    make_trainer(callbacks, max_steps=1).fit(module, batches(seq=seq))
    return module


@pytest.mark.parametrize(
    "where, seq", [("layer", 64), ("model", 32), pytest.param("model", 64, marks=pytest.mark.slow)]
)
def test_gradients_at_more_than_one_length(small, where, seq):
    # Per layer, bit for bit at every length measured (8 to 256 tokens). Whole model, bit for bit up to 32 tokens a
    # sequence; from 48 on, 13 of the 21 gradients differ: those backward reaches after the last layer's attention (its
    # k and v projections, and all before). The difference is the checkpoint regions', not the suite's: transformers'
    # own checkpointing under the same compile gives the suite's bits exactly, and the losses are the same.
    reference = fit_at(small, where, seq)
    run = fit_at(small, where, seq, [ActivationCheckpointing()])
    assert run.losses == reference.losses
    if where == "layer" or seq <= 32:
        assert_same_grads(reference, run)
        return
    own = fit_at(small, where, seq, own_checkpointing=True)
    assert own.losses == run.losses
    assert_same_grads(own, run)
    for name, grad in reference.grads.items():
        difference = (run.grads[name] - grad).abs().max()
        assert difference <= WHOLE_MODEL_RTOL * grad.abs().max(), name


# torch's note that MemTracker's global module hooks fire for the compiled wrapper too (the head is measured eagerly)
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_a_compiled_output_head_compiles_once_the_budget_stops_measuring(small):
    # the decoder layers stay eager (a compiled layer is refused with a budget); the output head is compiled. On a
    # CPU trainer the budget measures its steps with MemTracker, a dispatch mode, under which dynamo skipped the
    # head's frame for good: it never compiled. It runs eagerly while measured and compiles after.
    torch._dynamo.reset()
    recorder, model = GraphRecorder(), clone(small)
    model.lm_head = recorder.compile(model.lm_head)  # (a Linear compiled in place never compiles here, suite or not)
    checkpointing = ActivationCheckpointing(budget="1MiB")
    fit(model, [checkpointing], max_steps=4, module_cls=GraphLM)
    assert checkpointing.budget_plan is not None and checkpointing.budget_plan["settled"]
    assert (recorder.ops("forward", MM), recorder.ops("backward", MM)) == ([1], [2]), "the head compiled, once"


class ChunkedGraphLM(GraphLM):
    """GraphLM that keeps what each training forward returned as logits."""

    def training_step(self, batch, batch_idx):
        output = self.model(input_ids=batch[0], labels=batch[0])
        self.logits = getattr(self, "logits", []) + [output.logits]
        self.losses.append(float(output.loss.detach()))
        return output.loss


class ChunkedCalls(pl.Callback):
    """How many training forwards the chunked loss computed, read at each step's end (the run uninstalls it)."""

    calls = 0

    def on_train_batch_end(self, trainer, pl_module, *args):
        block = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
        self.calls = block.plan.chunked_loss.chunked_calls


@pytest.mark.parametrize("where", ["layer", pytest.param("model", marks=pytest.mark.slow)])
def test_the_chunked_loss_under_a_compiled_model(base, where):
    # per layer, the head and the loss stay eager; whole model, dynamo breaks its graph at the head, whose chunks run
    # eagerly (their logits never exist whole): the same losses and gradients as the same chunks uncompiled
    chunked = {"chunk_tokens": 16}  # 64 tokens a step: 4 chunks
    eager = fit(clone(base), [ActivationCheckpointing(chunked_loss=chunked)], max_steps=2, module_cls=ChunkedGraphLM)
    recorder, counted = GraphRecorder(), ChunkedCalls()
    run = fit(
        compiled(base, recorder, where),
        [ActivationCheckpointing(chunked_loss=chunked), counted],
        max_steps=2,
        module_cls=ChunkedGraphLM,
    )
    assert recorder.graphs, "compiled"
    assert counted.calls == 2 and run.logits == [None, None]
    assert run.losses == eager.losses
    assert_same_grads(eager, run)
