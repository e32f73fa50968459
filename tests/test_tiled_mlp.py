"""The tiled MLP's engine (lightning_ac.tiled_mlp.function): a decoder layer's MLP a tile of tokens at a time trains
as the untiled MLP does, within float rounding (the CPU's matmuls block rows by their count)."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from conftest import tiny_model

from lightning_ac.tiled_mlp import TiledMLP
from lightning_ac.tiled_mlp.function import tiled_mlp


@pytest.mark.parametrize("lora", [False, True], ids=["full_finetune", "lora"])
@pytest.mark.parametrize("tile", [1, 16, 37, 74, 1000])
def test_the_tiled_mlp_trains_as_the_untiled_one(lora, tile):
    model = tiny_model("llama", lora=lora)
    mlp = (model.get_base_model() if lora else model).model.layers[0].mlp
    params = list(mlp.parameters())
    x = torch.randn(2, 37, 64, requires_grad=True, generator=torch.Generator().manual_seed(0))
    want = mlp(x)
    g = torch.randn_like(want)
    want.backward(g)
    want_x, want_p = x.grad.clone(), [p.grad.clone() if p.grad is not None else None for p in params]
    x.grad = None
    for p in params:
        p.grad = None
    got = tiled_mlp(mlp.forward, x, params, tile)
    got.backward(g)
    assert torch.allclose(got, want, rtol=0, atol=1e-7)
    assert torch.allclose(x.grad, want_x, rtol=0, atol=1e-7)
    for p, w in zip(params, want_p):
        assert (p.grad is None) == (w is None) and (w is None or torch.allclose(p.grad, w, rtol=1e-5, atol=1e-6))
    assert sum(p.requires_grad for p in params) == (6 if lora else 3)


@pytest.mark.parametrize("family, norm", [("llama", "input_layernorm"), ("gemma3_text", "pre_feedforward_layernorm")])
@pytest.mark.parametrize("tile", [1, 16, 1000])
def test_a_tiled_norm_trains_as_the_untiled_one(family, norm, tile):
    """A norm is computed per token: tiled, its output and its input's gradient are the untiled ones bit for bit;
    its weight's gradient (a full fine-tune) is a sum over tiles, within float rounding."""
    module = getattr(tiny_model(family).model.layers[0], norm)
    module.requires_grad_(True)
    x = torch.randn(2, 37, 64, requires_grad=True, generator=torch.Generator().manual_seed(1))
    want = module(x)
    g = torch.randn_like(want)
    want.backward(g)
    want_x, want_w = x.grad.clone(), module.weight.grad.clone()
    x.grad = module.weight.grad = None
    got = tiled_mlp(module.forward, x, list(module.parameters()), tile)
    got.backward(g)
    assert torch.equal(got, want) and torch.equal(x.grad, want_x)
    assert torch.allclose(module.weight.grad, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "family, per_layer",
    [
        ("llama", ["input_layernorm", "post_attention_layernorm"]),
        ("qwen3", ["input_layernorm", "post_attention_layernorm"]),  # not attention's per-head q_norm and k_norm
        (
            "gemma3_text",
            ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"],
        ),
    ],
)
def test_the_norms_tiled_are_each_layers_own_and_the_final_norm(family, per_layer):
    from lightning_ac.config import TiledMLPConfig
    from lightning_ac.layers import find_decoder_layers
    from lightning_ac.tiled_mlp.install import install_tiled_mlp

    model = tiny_model(family, lora=True)
    layers = find_decoder_layers(model)
    tiled = install_tiled_mlp(TiledMLPConfig(), layers)
    try:
        inner = model.get_base_model().model
        want = [getattr(layer, name) for layer in inner.layers for name in per_layer] + [inner.norm]
        assert [id(m) for m in tiled.norms] == [id(m) for m in want]
        assert all("forward" in m.__dict__ for m in tiled.modules)
        assert all("forward" not in m.__dict__ for layer in inner.layers for m in layer.self_attn.modules())
        assert f"and {len(want)} norms" in tiled.describe()
    finally:
        tiled.remove()
    assert not any("forward" in m.__dict__ for m in model.modules())
    from lightning_ac.tiled_mlp.install import is_norm

    assert is_norm(torch.nn.LayerNorm(8)) and is_norm(torch.nn.RMSNorm(8))
    assert not is_norm(torch.nn.LayerNorm((4, 8))), "a norm over more than the last dimension is not per token"
    only = install_tiled_mlp(TiledMLPConfig(norms=False), layers)
    assert only.norms == [] and len(only.modules) == len(inner.layers)
    only.remove()


# -- in a run ----------------------------------------------------------------------------------------------------


def _assert_close_training(reference, run, rtol=1e-5, atol=1e-6):
    """Losses and first-step gradients within float rounding (a tile's matmuls block rows by their count)."""
    assert len(reference.losses) == len(run.losses)
    for a, b in zip(reference.losses, run.losses):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (a, b)
    assert reference.grads.keys() == run.grads.keys()
    for name, grad in reference.grads.items():
        assert torch.allclose(grad, run.grads[name], rtol=rtol, atol=atol), name


@pytest.mark.parametrize(
    "family, block",
    [
        ("llama", {"tiled_mlp": {"tile_tokens": 8}}),  # with full recompute
        ("qwen3", {"tiled_mlp": {"tile_tokens": 8}, "selective": True}),
        ("gemma3_text", {"tiled_mlp": True}),  # GELU; auto tiles (hidden 64: the floor of 1024 tokens, one tile)
        ("llama", {"enabled": False, "tiled_mlp": {"tile_tokens": 8}}),  # the tiled MLP alone
        ("llama", {"tiled_mlp": {"tile_tokens": 8}, "chunked_loss": {"chunk_tokens": 16}}),
        ("llama", {"tiled_mlp": {"tile_tokens": 8, "norms": False}}),  # the MLP only
        # Falcon edits the MLP's output in place (mlp_output += attention_output): no view of the function's own
        ("falcon", {"tiled_mlp": {"tile_tokens": 8}}),
        ("falcon", {"tiled_mlp": True}),  # one tile
    ],
)
def test_a_run_with_the_tiled_mlp_trains_as_without_it_and_leaves_the_model_as_found(family, block):
    from conftest import fit, model_fingerprint

    from lightning_ac import callbacks_from_config

    base = tiny_model(family)
    reference = fit(copy.deepcopy(base), max_steps=2)
    model = copy.deepcopy(base)
    before = model_fingerprint(model)
    callbacks = callbacks_from_config(block)
    run = fit(model, callbacks, max_steps=2)
    _assert_close_training(reference, run)
    tiled = next(cb for cb in callbacks if type(cb).__name__ == "ActivationCheckpointing")
    assert model_fingerprint(model) == before, "nothing of the tiled MLP is left on the model"
    assert tiled is not None


class _BackwardFlops(pl.Callback):
    """The first step's backward FLOPs (torch's FlopCounterMode: matmuls and attention)."""

    flops = None

    def on_before_backward(self, trainer, module, loss):
        if self.flops is None:
            from torch.utils.flop_counter import FlopCounterMode

            self.mode = FlopCounterMode(display=False)
            self.mode.__enter__()

    def on_after_backward(self, trainer, module):
        if self.flops is None:
            self.mode.__exit__(None, None, None)
            self.flops = self.mode.get_total_flops()


@pytest.mark.parametrize("norms", [True, False])
def test_a_recomputed_layer_runs_no_mlp_forward_of_its_own(norms):
    """Checkpointing stops a layer's recompute at the last tensor it saved: the tiled MLP's input, saved before the
    MLP runs. The backward then runs the MLP's forward once, a tile at a time, not once in the recompute and again in
    the tiles. To the FLOP, it computes what the untiled checkpointed layer's does and one matmul more: the down
    projection's forward, whose output the untiled recompute never computes (it stops at the down projection's
    saved input) and a tile's forward must compute to backpropagate."""
    from conftest import BATCH, SEQ, fit

    from lightning_ac import ActivationCheckpointing

    base = tiny_model("llama")
    untiled, tiled = _BackwardFlops(), _BackwardFlops()
    fit(copy.deepcopy(base), [ActivationCheckpointing(), untiled])
    fit(copy.deepcopy(base), [ActivationCheckpointing(tiled_mlp={"tile_tokens": 8, "norms": norms}), tiled])
    config = base.config
    down_projection = 2 * BATCH * SEQ * config.intermediate_size * config.hidden_size
    assert untiled.flops > 0
    assert tiled.flops == untiled.flops + config.num_hidden_layers * down_projection


TILES = {"tile_tokens": 8}
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "block, kwargs",
    [
        pytest.param({"kwargs": {"every_n_layers": 2}}, {}, id="every_2", marks=SLOW),
        pytest.param({"budget": "1MiB"}, {}, id="budget", marks=SLOW),
        pytest.param({"offload": {"hidden_states": "cpu"}}, {}, id="offload_hidden"),
        pytest.param({"offload": {"all": "cpu"}}, {}, id="offload_all", marks=SLOW),
        pytest.param({"selective": True, "offload": {"selective": "cpu"}}, {}, id="offload_selective", marks=SLOW),
        pytest.param({}, {"layer_offloading": True, "copy_on_host": True}, id="layer_offloading"),
    ],
)
def test_the_tiled_mlp_composes_with_each_mode(block, kwargs):
    """Each mode with the tiled MLP (and its norms) trains as the untiled run within float rounding, its backward
    runs a tile at a time, and the model is left as found."""
    from conftest import fit, model_fingerprint

    from lightning_ac import callbacks_from_config
    from lightning_ac.tiled_mlp import function

    base = tiny_model("llama", lora=True)
    reference = fit(copy.deepcopy(base), max_steps=2)
    model = copy.deepcopy(base)
    before = model_fingerprint(model)
    backward, calls = function._TiledMLP.backward, []

    def counted(ctx, grad):
        calls.append(len(ctx.tiles))
        return backward(ctx, grad)

    function._TiledMLP.backward = staticmethod(counted)
    try:
        run = fit(model, callbacks_from_config({**block, "tiled_mlp": TILES}, **kwargs), max_steps=2)
    finally:
        function._TiledMLP.backward = staticmethod(backward)
    _assert_close_training(reference, run)
    layers = base.config.num_hidden_layers
    # per step, each layer's MLP and two norms and the final norm, in 2 x 32 / 8 tiles each; but the first layer's
    # input norm, whose input (the frozen embeddings') and weight (frozen) want no gradient: it runs untiled
    assert calls == [8] * (2 * (3 * layers + 1 - 1))
    assert model_fingerprint(model) == before


class _FirstPlan(pl.Callback):
    """The budget's figures and the plan's layer table after the first (measuring) step."""

    figures = rows = None

    def on_train_batch_end(self, trainer, pl_module, *args):
        if self.figures is None:
            plan = next(c for c in trainer.callbacks if type(c).__name__ == "ActivationCheckpointing").plan
            self.figures = [f.saved_bytes for f in plan.budget.figures]
            self.rows = plan.layer_rows()


def test_the_budget_measures_the_smaller_layer_and_the_layer_table_says_so():
    """The budget's measuring step runs the tiled MLP: each layer's measured working set is smaller by the MLP's
    and the norms' intermediates, and the budget decides on those figures."""
    from conftest import fit

    from lightning_ac import ActivationCheckpointing

    base = tiny_model("llama", lora=True)
    untiled, tiled = _FirstPlan(), _FirstPlan()
    fit(copy.deepcopy(base), [ActivationCheckpointing(budget="1GiB"), untiled])
    fit(copy.deepcopy(base), [ActivationCheckpointing(budget="1GiB", tiled_mlp=TILES), tiled])
    assert len(tiled.figures) == len(untiled.figures) == base.config.num_hidden_layers
    assert all(0 < t < u for t, u in zip(tiled.figures, untiled.figures)), (tiled.figures, untiled.figures)
    assert all("MLP and norms tiled (8 tokens a tile): their inputs only" in row.saves for row in tiled.rows)
    assert not any("tiled" in row.saves for row in untiled.rows)


@pytest.mark.parametrize("enabled", [True, pytest.param(False, marks=pytest.mark.slow)])  # False: slow session
def test_the_tiled_mlp_trains_inside_layers_compiled_one_by_one(enabled):
    """Each decoder layer compiled (torchtitan's way): the compiled layers train as the same compiled layers
    without the tiled MLP, within float rounding."""
    from conftest import fit
    from test_compile import GraphLM, GraphRecorder, compiled

    from lightning_ac import callbacks_from_config

    base = tiny_model("llama")
    reference = fit(compiled(base, GraphRecorder(False), "layer"), max_steps=2, module_cls=GraphLM)
    block = {"enabled": enabled, "tiled_mlp": TILES}
    callbacks = callbacks_from_config(block)
    run = fit(compiled(base, GraphRecorder(False), "layer"), callbacks, max_steps=2, module_cls=GraphLM)
    _assert_close_training(reference, run)


class _Block(torch.nn.Module):
    """A plain torch decoder block whose MLP is its ``ffn``."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.ffn = torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.GELU(), torch.nn.Linear(32, width))

    def forward(self, x):
        return x + self.ffn(self.norm(x))


def test_a_plain_torch_layers_mlp_is_found_by_name_or_glob():
    from lightning_ac import ConfigError
    from lightning_ac.config import parse_tiled_mlp
    from lightning_ac.tiled_mlp.install import TiledMLP, find_mlps

    blocks = torch.nn.Sequential(_Block(), _Block())
    with pytest.raises(ConfigError, match=r"_Block \(layer 0\) has no MLP to tile .*its children: norm, ffn.*"
                       r"mlp_modules: \[NAME\]"):  # fmt: skip
        TiledMLP(8, list(blocks))
    with pytest.raises(ConfigError, match=r"mlp_modules: \['feed_forward'\] matched none of its submodules"):
        find_mlps(blocks[0], 0, ["feed_forward"])
    assert find_mlps(blocks[0], 0, ["ffn"]) == [blocks[0].ffn]
    assert find_mlps(blocks[0], 0, ["f*"]) == [blocks[0].ffn], "a match inside a match is left to it"
    x = torch.randn(2, 40, 16, requires_grad=True, generator=torch.Generator().manual_seed(2))
    want = blocks(x)
    want.sum().backward()
    want_grads = [x.grad.clone(), *(p.grad.clone() for p in blocks.parameters())]
    x.grad = None
    blocks.zero_grad()
    tiled = TiledMLP(8, list(blocks), mlp_modules=parse_tiled_mlp({"mlp_modules": "ffn"}).mlp_modules)
    tiled.install()
    try:
        got = blocks(x)
        got.sum().backward()
    finally:
        tiled.remove()
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    for g, w in zip([x.grad, *(p.grad for p in blocks.parameters())], want_grads):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6)
    assert not any("forward" in m.__dict__ for m in blocks.modules())
    with pytest.raises(ConfigError, match=r"tiled_mlp.mlp_modules: expected a list of module names or globs"):
        parse_tiled_mlp({"mlp_modules": [""]})


def test_a_sparse_mixture_of_experts_and_bad_values_are_refused():
    from lightning_ac import ActivationCheckpointing, ConfigError
    from lightning_ac.tiled_mlp.install import TiledMLP

    moe = tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
    with pytest.raises(ConfigError, match=r"tiled_mlp: layer 0's mlp is a sparse mixture of experts"):
        TiledMLP("auto", moe.model.layers)
    with pytest.raises(ConfigError, match=r"tiled_mlp=\.\.\.\)\.tile_tokens: expected an integer >= 1, got 0"):
        ActivationCheckpointing(tiled_mlp={"tile_tokens": 0})
    with pytest.raises(ConfigError, match=r"unknown field\(s\) 'tiles'"):
        ActivationCheckpointing(tiled_mlp={"tiles": 8})
    with pytest.raises(ConfigError, match=r"tiled_mlp=\.\.\.\)\.norms: expected true or false, got 'no'"):
        ActivationCheckpointing(tiled_mlp={"norms": "no"})
    from lightning_ac.config import TiledMLPConfig, parse_tiled_mlp

    assert parse_tiled_mlp({"norms": False}) == TiledMLPConfig(norms=False)
    assert parse_tiled_mlp({"tile_tokens": 8, "norms": False}) == TiledMLPConfig(tile_tokens=8, norms=False)
    assert parse_tiled_mlp(True) == TiledMLPConfig() and TiledMLPConfig().norms is True


@pytest.mark.parametrize(
    "tokens, bytes_per_token, tile",
    [
        (100_000, 14336 * 2, 8192),  # Llama-3-8B's MLP in bf16: 256 MiB / 28 KiB = 9,362 tokens, down to 8,192
        (100_000, 4096 * 4, 16384),  # its norms: a float32 copy of 4,096 hidden
        (100_000, 2**19, 1024),  # an intermediate of 512 KiB a token (512 tokens fit): the floor of 1024 tokens
        (100, 14336 * 2, 100),  # never more than the tokens there are
    ],
)
def test_auto_tiles_keep_a_tiles_widest_intermediate_within_its_bytes(tokens, bytes_per_token, tile):
    from lightning_ac.tiled_mlp import auto_tile_tokens

    assert auto_tile_tokens(tokens, bytes_per_token) == tile


def test_auto_tiles_are_sized_by_each_modules_own_intermediate(monkeypatch):
    """An MLP's tiles by its widest linear output in the input's dtype (its intermediate size: 4-bit layers too), a
    norm's by a float32 copy of its input: a norm runs fewer, larger tiles than the MLP beside it."""
    import lightning_ac.tiled_mlp.install as install

    model = tiny_model("llama", intermediate_size=192, lora=True)
    layer = model.base_model.model.model.layers[0]
    assert install.widest_output(layer.mlp) == 192 and install.widest_output(layer.input_layernorm) == 0
    # the bytes of 64 tokens of the MLP's float32 intermediate (192 wide), and no floor: small tiles for a tiny model
    monkeypatch.setattr(install, "AUTO_TILE_BYTES", 64 * 192 * 4)
    monkeypatch.setattr(install, "MIN_AUTO_TILE_TOKENS", 1)
    seen = {}

    def spy(mlp, x, params, tile_tokens):
        seen[type(mlp.__self__).__name__] = tile_tokens
        return mlp(x)

    monkeypatch.setattr(install, "tiled_mlp", spy)
    tiled = install.TiledMLP("auto", [layer], norms=[layer.input_layernorm])
    tiled.install()
    try:
        x = torch.randn(1, 1000, 64, requires_grad=True)
        layer.mlp(x), layer.input_layernorm(x)
    finally:
        tiled.remove()
    assert seen == {"LlamaMLP": 64, "LlamaRMSNorm": 128}, "the norm: 64 x 192 x 4 bytes / (64 x 4) = 192 -> 128"


def test_remove_puts_back_each_mlps_forward_as_found():
    """Without the plan's journal too: an MLP without an instance forward has none again, one with its own keeps
    it."""
    from lightning_ac.tiled_mlp import TiledMLP

    model = tiny_model("llama")
    layers = model.model.layers
    own = layers[1].mlp.forward
    layers[1].mlp.forward = own  # an instance attribute of the caller's
    tiled = TiledMLP({"tile_tokens": 8}["tile_tokens"], layers)
    tiled.install()
    assert all("forward" in layer.mlp.__dict__ for layer in layers)
    tiled.remove()
    assert "forward" not in layers[0].mlp.__dict__ and layers[1].mlp.__dict__["forward"] is own


_ALIASES = {"view", "_unsafe_view", "detach", "expand", "slice", "t", "transpose", "reshape", "alias", "as_strided"}


def _work_ops(run):
    """The ops ``run`` dispatches that compute or copy (views and other aliases left out), by name."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in _ALIASES:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        run()
    return count.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tile_runs_the_mlps_own_ops_and_one_copy_and_one_sum_per_trainable_parameter(dtype):
    """What a tiled MLP runs beyond the MLP's own work, counted with a dispatch mode: per tile, its output and its
    input's gradient written into the whole sequence's (one copy each), and one in-place float32 sum per trainable
    parameter (LoRA's six adapters here), nothing allocated per tile; once a call, the six float32 sums started and
    returned in the parameters' dtype, and the two whole-sequence tensors allocated."""
    from collections import Counter

    from lightning_ac.tiled_mlp.install import TiledMLP

    model = tiny_model("llama", lora=True).to(dtype)
    layer = model.base_model.model.model.layers[0]
    x = torch.randn(1, 64, 64, dtype=dtype, requires_grad=True)
    grad = torch.randn(1, 64, 64, dtype=dtype)
    trainable = [p for p in layer.mlp.parameters() if p.requires_grad]
    assert len(trainable) == 6

    def step():
        for tensor in (x, *trainable):
            tensor.grad = None  # accumulating into a .grad left by the run before would count as a sum
        torch.autograd.backward(layer.mlp(x), grad)

    untiled = _work_ops(step)
    forward_only = _work_ops(lambda: layer.mlp(x.detach()))
    tiles = 4
    tiled = TiledMLP(64 // tiles, [layer], norms=())
    tiled.install()
    try:
        ops = _work_ops(step)
    finally:
        tiled.remove()
    mlp_own = Counter({op: tiles * (untiled[op] + forward_only[op]) for op in untiled | forward_only})
    sums = len(trainable) * (tiles - 1)
    to_float32 = 2 * len(trainable) if dtype == torch.bfloat16 else 0  # bf16: to float32 and back; float32: no copy
    expected = mlp_own + Counter({"copy_": 2 * tiles, "add_": sums, "_to_copy": to_float32, "new_empty": 1})
    expected["empty_like"] += 1
    assert ops == expected, (ops - expected, expected - ops)


def test_in_bf16_the_tiles_weight_gradients_round_as_the_untiled_ones_do():
    """Summed in bf16, 128 tiles' weight gradients rounded at each step (2.7x the untiled run's error against float64):
    summed in float32, the tiled MLP's error is the untiled MLP's, within a tenth (issue 50's item 3)."""
    model = tiny_model("llama", hidden_size=128, intermediate_size=256).to(torch.bfloat16)
    layer = model.model.layers[0]
    torch.manual_seed(0)
    x = torch.randn(1, 1024, 128, dtype=torch.bfloat16)
    grad = torch.randn(1, 1024, 128, dtype=torch.bfloat16)

    def weight_grads(mlp, dtype, tile=None):
        mlp = copy.deepcopy(mlp).to(dtype)
        if tile is not None:
            tiled = TiledMLP(tile, [torch.nn.ModuleDict({"mlp": mlp})], norms=())
            tiled.install()
        torch.autograd.backward(mlp(x.to(dtype).requires_grad_()), grad.to(dtype))
        return [p.grad.double() for p in mlp.parameters()]

    exact = weight_grads(layer.mlp, torch.float64)

    def error(grads):
        return max(((g - e).abs().max() / e.abs().max()).item() for g, e in zip(grads, exact))

    # 0.0052 both (summed in bf16, the tiled error was 0.031)
    untiled, tiled = error(weight_grads(layer.mlp, torch.bfloat16)), error(weight_grads(layer.mlp, torch.bfloat16, 8))
    assert 0 < tiled <= 1.1 * untiled, (tiled, untiled)


def test_an_mlp_called_with_more_than_its_input_is_refused_at_setup_naming_it():
    """Bloom's MLP takes the residual too (``mlp(hidden_states, residual)``): it was never tiled, while the line said
    it was. Refused before training, naming the module and its extra argument."""
    from conftest import fit, tiny_config
    from transformers import AutoModelForCausalLM

    from lightning_ac import ActivationCheckpointing, ConfigError

    config = tiny_config("bloom", n_head=4)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match=r"layer 0's mlp \(BloomMLP\) takes residual besides its input"):
        fit(model, [ActivationCheckpointing(tiled_mlp=True)])


class _MLPBlock(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.GELU(), torch.nn.Linear(32, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class _PlainLM(torch.nn.Module):
    def __init__(self, vocab: int = 128, width: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(_MLPBlock(width) for _ in range(2))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return type("Out", (), {"loss": loss})()


def test_with_enabled_false_layers_names_the_plain_torch_layers_whose_mlps_to_tile(caplog, monkeypatch):
    """``enabled=False, tiled_mlp=..., layers=[Block]``: the named layers' MLPs are tiled (``layers`` was refused,
    and without it nothing was tiled while the line said "tiled MLP (0 decoder layers"); a plain model whose layers
    are not named stops as with ``enabled=True``."""
    from conftest import fit

    from lightning_ac import ActivationCheckpointing, ConfigError

    torch.manual_seed(0)
    base = _PlainLM()
    reference = fit(copy.deepcopy(base), max_steps=2)
    tiled = []
    install = TiledMLP.install
    monkeypatch.setattr(TiledMLP, "install", lambda self: (tiled.append(len(self.mlps)), install(self)))
    callback = ActivationCheckpointing(enabled=False, tiled_mlp={"tile_tokens": 8}, layers=[_MLPBlock])
    run = fit(copy.deepcopy(base), [callback], max_steps=2)
    _assert_close_training(reference, run)
    assert tiled == [2] and "tiled MLP (2 decoder layers" in caplog.text
    with pytest.raises(ConfigError, match=r"found no decoder layers in LM.* pass layers=\[<layer class>\]"):
        fit(copy.deepcopy(base), [ActivationCheckpointing(enabled=False, tiled_mlp=True)])


def test_norms_takes_the_text_every_boolean_of_the_block_takes():
    from lightning_ac.config import parse_tiled_mlp

    assert parse_tiled_mlp({"norms": "false"}).norms is False and parse_tiled_mlp({"norms": "True"}).norms is True


def test_a_checkpoint_written_before_a_field_existed_resumes_without_a_warning():
    """A checkpoint written before the block had ``tiled_mlp`` (or ``budget``, ``chunked_loss``): those fields were off
    then, as they are by default now; only a setting that differs warns."""
    import warnings

    from lightning_ac import ActivationCheckpointing

    state = ActivationCheckpointing().state_dict()
    for field in ("tiled_mlp", "budget", "chunked_loss", "budget_first_plan"):
        del state["activation_checkpointing"][field]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ActivationCheckpointing().load_state_dict(state)
    with pytest.warns(UserWarning, match="the checkpoint was written with"):
        ActivationCheckpointing(tiled_mlp=True).load_state_dict(state)


def test_a_mixture_of_experts_not_under_mlp_is_refused_for_what_it_is():
    """GraniteMoE's ``block_sparse_moe``, DBRX's ``ffn``, Llama 4's ``feed_forward``: told first to name the MLP with
    mlp_modules, then refused as a mixture of experts; now refused as one at once."""
    from lightning_ac import ConfigError

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.block_sparse_moe = torch.nn.LayerNorm(8), Experts()

    with pytest.raises(ConfigError, match=r"layer 0's block_sparse_moe is a sparse mixture of experts \(Experts\)"):
        TiledMLP("auto", [Layer()])


def test_the_applied_line_counts_layers_and_mlp_modules_apart():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ffn_a, self.ffn_b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    tiled = TiledMLP(8, [Two(), Two()], mlp_modules=["ffn_*"])
    assert tiled.describe() == "tiled MLP (2 decoder layers: 4 MLP modules, tile_tokens: 8)"
    assert TiledMLP(8, [_MLPBlock()]).describe() == "tiled MLP (1 decoder layers, tile_tokens: 8)"


def test_auto_tiles_count_gpt2s_conv1d_and_autocasts_dtype(monkeypatch):
    """GPT-2's MLP is Conv1D (``nf``, not ``out_features``): sized by its 3,072-wide intermediate, not as a norm; under
    autocast (bf16-mixed: float32 weights and input) the intermediates are bf16."""
    import lightning_ac.tiled_mlp.install as install

    model = tiny_model("gpt2", intermediate_size=256)
    assert install.widest_output(model.transformer.h[0].mlp) == 256
    x = torch.randn(4, 4)
    assert install._compute_itemsize(x) == 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert install._compute_itemsize(x) == 2
