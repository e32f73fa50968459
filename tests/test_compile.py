"""torch.compile: the block's recompute and selective modes inside compiled graphs, per decoder layer and whole model.

Compiled graphs bypass dispatch modes, so recompute and saves are counted in the graphs themselves: a recording
``aot_autograd`` backend keeps every forward and backward graph AOT autograd builds (``aot_eager``: the graphs run
as traced, so gradients compare bit for bit with the same compiled model without the suite).
"""

from __future__ import annotations

from typing import List, Tuple

import lightning.pytorch as pl
import pytest
import torch
from conftest import LM, batches, clone, fit, make_trainer, model_fingerprint, tiny_model
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from lightning_ac import (
    ActivationCheckpointing,
    ActivationOffload,
    ConfigError,
    register_mandatory_save,
    register_preferred_save,
)

MM, SDPA = "aten.mm", "aten._scaled_dot_product_flash_attention_for_cpu"


class GraphRecorder:
    """An ``aot_autograd`` backend that runs each graph as traced and keeps it, forward and backward apart."""

    def __init__(self) -> None:
        self.graphs: List[Tuple[str, torch.fx.GraphModule]] = []
        self.backend = aot_autograd(fw_compiler=self._keep("forward"), bw_compiler=self._keep("backward"))

    def _keep(self, kind: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs):
            self.graphs.append((kind, gm))
            return make_boxed_func(gm.forward)

        return compiler

    def ops(self, kind: str, prefix: str, since: int = 0) -> List[int]:
        """Per graph of ``kind`` (from the ``since``-th graph kept on), how many of its calls are ops whose name
        starts with ``prefix``."""
        return [
            sum(n.op == "call_function" and str(n.target).startswith(prefix) for n in gm.graph.nodes)
            for k, gm in self.graphs[since:]
            if k == kind
        ]


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
        return torch.compile(model, backend=recorder.backend)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer, backend=recorder.backend)
    return model


def train(base, where: str, callbacks=()) -> Tuple[GraphLM, GraphRecorder]:
    recorder = GraphRecorder()
    return fit(compiled(base, recorder, where), callbacks, max_steps=2, module_cls=GraphLM), recorder


@pytest.fixture(scope="module", autouse=True)
def _forget_the_graphs():
    """Dynamo's caches hold the module's graphs and their fake tensors: let them go with the module."""
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def plain(base):
    """The same compiled models without the suite, per layer and whole: the reference and its backward matmuls."""
    return {where: train(base, where) for where in ("layer", "model")}


# backward matmuls of one layer's graph (per-layer compile: one graph serves all four layers) or the model's graph
PLAIN_MM = {"layer": 14, "model": 58}
FULL_MM = {"layer": 20, "model": 83}  # + the 6 recomputed projections of each layer (the output head is not)
PER_GRAPH = {"layer": 1, "model": 4}  # decoder layers a graph holds


@pytest.mark.parametrize("where", ["layer", "model"])
@pytest.mark.parametrize(
    "selective, backward_mm",
    [
        (None, FULL_MM),
        ({"save": ["aten::mm"]}, PLAIN_MM),  # every matmul saved: none recomputed
        ({"save": [], "save_matmul_min_k": 64}, PLAIN_MM),  # every projection contracts over >= 64
        ({"save": ["attention"]}, FULL_MM),  # the partitioner never recomputes attention: the rule adds nothing
    ],
)
def test_save_rules_apply_inside_compiled_graphs(base, plain, where, selective, backward_mm):
    reference, reference_graphs = plain[where]
    assert set(reference_graphs.ops("backward", MM)) == {PLAIN_MM[where]}
    run, graphs = train(base, where, [ActivationCheckpointing(selective=selective)])
    assert set(graphs.ops("backward", MM)) == {backward_mm[where]}
    # one SDPA call per layer in backward: its backward kernel; a recomputed attention would add its forward
    assert set(graphs.ops("backward", SDPA)) == set(reference_graphs.ops("backward", SDPA)) == {PER_GRAPH[where]}
    assert run.losses == reference.losses
    for name, grad in reference.grads.items():
        assert torch.equal(grad, run.grads[name]), name


@pytest.mark.parametrize("where, backward_mm", [("layer", {14, 20}), ("model", {72})])
def test_every_n_layers_recomputes_every_second_layer_inside_the_graphs(base, plain, where, backward_mm):
    reference, _ = plain[where]
    run, graphs = train(base, where, [ActivationCheckpointing(kwargs={"every_n_layers": 2})])
    assert set(graphs.ops("backward", MM)) == backward_mm  # per layer: a graph for each kind of layer
    assert run.losses == reference.losses
    for name, grad in reference.grads.items():
        assert torch.equal(grad, run.grads[name]), name


# the whole model's cases of these three run in the slow session (the save rules run both in the default one)
WHOLE_IN_SLOW = ["layer", pytest.param("model", marks=pytest.mark.slow)]


@pytest.mark.parametrize("where, backward_mm", [("layer", 14), pytest.param("model", 58, marks=pytest.mark.slow)])
def test_compiled_in_place_too(base, where, backward_mm):
    # module.compile() compiles in place (no OptimizedModule wrapper): found and handled as torch.compile(module)
    torch._dynamo.reset()
    recorder, model = GraphRecorder(), clone(base)
    for module in model.model.layers if where == "layer" else [model]:
        module.compile(backend=recorder.backend)
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
    for name, grad in reference.grads.items():
        assert torch.equal(grad, run.grads[name]), name


def test_the_applied_line_and_the_report_say_the_rules_apply_when_traced(base, caplog):
    described = []

    class Report(pl.Callback):  # what the per-layer table shows in its SAC column, read while the plan is applied
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not described:
                policy = checkpointing.plan.selective
                described.extend(policy.describe_layer(i, recomputed=True) for i in range(4))

    checkpointing = ActivationCheckpointing(selective=True)
    train(base, "layer", [checkpointing, Report()])
    assert any("selective: save attention" in m and "compiled: the save rules apply when" in m for m in caplog.messages)
    assert described == ["attention, compiled: decided when traced"] * 4


@pytest.mark.parametrize("where", ["layer", "model"])
def test_the_model_is_left_as_found(base, where):
    recorder = GraphRecorder()
    model = compiled(base, recorder, where)
    module = GraphLM(model)
    fingerprint = model_fingerprint(module)
    make_trainer([ActivationCheckpointing(selective={"save": ["aten::mm"]})], max_steps=1).fit(module, batches())
    assert model_fingerprint(module) == fingerprint


@pytest.mark.parametrize("where", ["layer", "model"])
def test_offload_all_moves_what_the_compiled_graphs_save(base, plain, where):
    # torch runs saved-tensor hooks on a compiled graph's saves after its forward, all at once (no overlap with it)
    offload = ActivationOffload(all="cpu", min_offload_bytes=0, copy_on_host=True)
    run, graphs = train(base, where, [ActivationCheckpointing(), offload])
    assert set(graphs.ops("backward", MM)) == {FULL_MM[where]}, "the layers ran compiled"
    assert offload.last_step["all"]["tensors"] > 0
    reference, _ = plain[where]
    assert run.losses == reference.losses
    for name, grad in reference.grads.items():
        assert torch.equal(grad, run.grads[name]), name


def compiled_calls(model: torch.nn.Module) -> List[object]:
    """What eager code calls to run each decoder layer's compiled graph (offload.hidden_states wraps it)."""
    return [layer.__dict__.get("forward", layer.__dict__.get("_compiled_call_impl")) for layer in model.model.layers]


@pytest.mark.parametrize("how", ["wrapper", "in_place", "wrapper_named"])
def test_offload_hidden_states_moves_each_compiled_layers_inputs(base, plain, how):
    # hooks around each layer's compiled call, in eager, take its inputs from what the graph saves after its
    # forward; by name the layer is the wrapper itself, and the hooks around its checkpoint call are eager already
    torch._dynamo.reset()
    recorder, model = GraphRecorder(), clone(base)
    for i, layer in enumerate(model.model.layers):
        if how == "in_place":
            layer.compile(backend=recorder.backend)
        else:
            model.model.layers[i] = torch.compile(layer, backend=recorder.backend)
    calls = compiled_calls(model)
    offload = ActivationOffload(hidden_states="cpu", copy_on_host=True)
    layers = ["model.model.layers.?"] if how == "wrapper_named" else None
    run = fit(model, [ActivationCheckpointing(layers=layers), offload], max_steps=2, module_cls=GraphLM)
    # by name, the checkpoint wraps the compiled call: its recompute runs the compiled forward again, from outside
    recomputed_in_graph = FULL_MM["layer"] if how != "wrapper_named" else PLAIN_MM["layer"]
    assert set(recorder.ops("backward", MM)) == {recomputed_in_graph}, "the layers ran compiled"
    hidden_states = 4 * 64 * 64 * 4  # 4 layers' (batch x sequence, hidden) float32 inputs
    if how == "wrapper_named":  # checkpoint's own saves outside its region: the hidden states, as in eager
        assert offload.last_step["hidden_states"] == {"tensors": 4, "bytes": hidden_states}
    else:  # the graph saves its inputs: the hidden states, and the rotary cos and sin all layers share (moved once)
        assert offload.last_step["hidden_states"] == {"tensors": 6, "bytes": hidden_states + 2 * 32 * 16 * 4}
    assert offload.last_step["all"]["tensors"] == 0
    reference, _ = plain["layer"]
    assert run.losses == reference.losses
    grads = {name.replace("._orig_mod", ""): grad for name, grad in run.grads.items()}  # in place: no wrapper
    for name, grad in reference.grads.items():
        assert torch.equal(grad, grads[name.replace("._orig_mod", "")]), name
    assert all(a is b for a, b in zip(compiled_calls(model), calls)), "the compiled calls are the ones found"


def test_offload_hidden_states_leaves_uncheckpointed_compiled_layers_alone(base, plain):
    recorder = GraphRecorder()
    offload = ActivationOffload(hidden_states="cpu", copy_on_host=True)
    callbacks = [ActivationCheckpointing(kwargs={"every_n_layers": 2}), offload]
    run = fit(compiled(base, recorder, "layer"), callbacks, max_steps=1, module_cls=GraphLM)
    assert set(recorder.ops("backward", MM)) == {14, 20}
    assert offload.last_step["hidden_states"] == {"tensors": 4, "bytes": 2 * 64 * 64 * 4 + 2 * 32 * 16 * 4}
    reference, _ = plain["layer"]
    assert run.losses[:1] == reference.losses[:1]


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
    for name, grad in reference.grads.items():
        assert torch.equal(grad, module.grads[name]), name


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
