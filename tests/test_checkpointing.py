"""ActivationCheckpointing in a real Trainer: gradient parity, counted recompute, and a model left as found."""

from __future__ import annotations

import inspect
import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from conftest import LM, VOCAB, batches, clone, fit, make_trainer, model_fingerprint, tiny_model
from torch import nn

from lightning_ac import (
    ActivationCheckpointing,
    ActivationOffload,
    ConfigError,
    LayerOffload,
    LightningACWarning,
    callbacks_from_config,
)

MM = "aten.mm"
ADDMM = "aten.addmm"
SDPA = "aten._scaled_dot_product_flash_attention_for_cpu"


def assert_same_training(reference: LM, run: LM, exact: bool = True) -> None:
    assert (
        reference.losses == run.losses
        if exact
        else torch.allclose(torch.tensor(reference.losses), torch.tensor(run.losses))
    )
    assert reference.grads.keys() == run.grads.keys() and reference.grads
    for name, grad in reference.grads.items():
        if exact:
            assert torch.equal(grad, run.grads[name]), name
        else:
            torch.testing.assert_close(run.grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "family, lora, callback_kwargs, mm_replays",
    [
        # Tiny Llama: 58 mm in backward without recompute; full recompute replays q, k, v, o, gate, up per
        # layer (6 x 4 = 24); down_proj is never replayed (early stop: its output only feeds the residual add).
        ("llama", False, {}, 24),
        ("llama", False, {"kwargs": {"every_n_layers": 2}}, 12),
        ("llama", False, {"kwargs": {"preserve_rng_state": False}}, 24),
        ("llama", False, {"kwargs": {"early_stop": False}}, 28),
        # Reentrant recompute runs the whole layer again, down_proj included.
        ("llama", False, {"reentrant": True}, 28),
        # LoRA: each adapted projection adds lora_A and lora_B matmuls to the replay.
        ("llama", True, {}, None),
        ("llama", True, {"reentrant": True}, None),
        ("qwen3", False, {}, 24),
        # Gemma3 normalises down_proj's output (post_feedforward_layernorm), so down_proj is replayed too.
        ("gemma3_text", False, {}, 28),
    ],
)
def test_gradients_match_and_recompute_is_counted(family, lora, callback_kwargs, mm_replays):
    base = tiny_model(family, lora=lora)
    reference = fit(clone(base))
    run = fit(clone(base), [ActivationCheckpointing(**callback_kwargs)])
    assert_same_training(reference, run)
    replays = run.backward_ops[MM] - reference.backward_ops[MM]
    if mm_replays is not None:
        assert replays == mm_replays
    else:
        assert replays > 0
    layers = 4 // callback_kwargs.get("kwargs", {}).get("every_n_layers", 1)
    assert run.backward_ops[SDPA] - reference.backward_ops.get(SDPA, 0) == layers, "attention replays once per layer"
    assert reference.backward_ops.get(SDPA, 0) == 0


def test_reference_counts_match_design_notes():
    reference = fit(tiny_model("llama"))
    assert reference.backward_ops[MM] == 58


def test_frozen_base_lora_reentrant_keeps_adapter_gradients():
    base = tiny_model("llama", lora=True)
    run = fit(clone(base), [ActivationCheckpointing(reentrant=True)])
    lora_grads = {n: g for n, g in run.grads.items() if "lora_" in n}
    assert len(lora_grads) == 4 * 7 * 2
    # lora_B starts at zero, so lora_A's first gradient is zero by construction; lora_B's must not be.
    assert all(g.abs().sum() > 0 for n, g in lora_grads.items() if "lora_B" in n)


def test_dropout_masks_replay_exactly():
    base = tiny_model("llama", lora=True, attention_dropout=0.3, lora_dropout=0.2)
    pl.seed_everything(7)
    reference = fit(clone(base))
    pl.seed_everything(7)
    run = fit(clone(base), [ActivationCheckpointing()])
    assert_same_training(reference, run)
    pl.seed_everything(8)
    other_seed = fit(clone(base), [ActivationCheckpointing()])
    assert other_seed.losses != reference.losses, "dropout must be active for this test to mean anything"


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)
        self.calls_with_cache = 0

    def forward(self, x: torch.Tensor, *, use_cache: bool = False) -> torch.Tensor:
        self.calls_with_cache += int(use_cache)
        return x + self.drop(self.down(torch.relu(self.up(self.norm(x)))))


class TinyTorchLM(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, use_cache=True)
        logits = self.head(x)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return type("Out", (), {"loss": loss})()


@pytest.mark.parametrize("layers", [[Block], ["model.blocks.*"]])
@pytest.mark.parametrize("reentrant", [False, True])
def test_plain_torch_layers(layers, reentrant):
    torch.manual_seed(0)
    base = TinyTorchLM()
    pl.seed_everything(3)
    reference = fit(clone(base))
    before = model_fingerprint(reference)
    pl.seed_everything(3)
    model = clone(base)
    module = LM(model)
    fingerprint = model_fingerprint(module)
    make_trainer([ActivationCheckpointing(layers=layers, reentrant=reentrant)]).fit(module, batches())
    assert_same_training(reference, module)
    assert module.backward_ops[ADDMM] == reference.backward_ops[ADDMM] + 3 * 2, "up and down replayed per block"
    assert all(b.calls_with_cache == 0 for b in model.blocks), "use_cache is forced off in checkpointed layers"
    assert model_fingerprint(module) == fingerprint
    assert before.keys() == fingerprint.keys()


def test_frozen_plain_torch_reentrant_keeps_trainable_gradients():
    torch.manual_seed(0)
    base = TinyTorchLM()
    base.embed.requires_grad_(False)
    for block in base.blocks:
        block.norm.requires_grad_(False)
        block.down.requires_grad_(False)
    pl.seed_everything(3)
    reference = fit(clone(base))
    pl.seed_everything(3)
    run = fit(clone(base), [ActivationCheckpointing(layers=[Block], reentrant=True)])
    assert_same_training(reference, run)
    assert all(f"model.blocks.{i}.up.weight" in run.grads for i in range(3))


def test_model_left_as_found_after_fit_validate_and_second_fit(llama):
    module = LM(llama)
    module.validation_step = lambda batch, batch_idx: module.model(input_ids=batch[0], labels=batch[0]).loss
    fingerprint = model_fingerprint(module)
    callback = ActivationCheckpointing()
    trainer = make_trainer([callback], max_steps=1)
    trainer.fit(module, batches())
    assert model_fingerprint(module) == fingerprint
    assert callback.plan is None
    # validate and a second fit with the same callback object
    trainer.validate(module, batches(), verbose=False)
    assert model_fingerprint(module) == fingerprint
    trainer2 = make_trainer([callback], max_steps=2)
    module.backward_ops = module.grads = None
    trainer2.fit(module, batches())
    assert module.backward_ops[MM] == 58 + 24, "second fit checkpoints again"
    assert model_fingerprint(module) == fingerprint


def test_hf_flags_and_hooks_exist_only_during_fit(llama):
    seen = {}

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            layers = pl_module.model.model.layers
            seen["flags"] = [layer.gradient_checkpointing for layer in layers]
            seen["hooks"] = len(pl_module.model.model.embed_tokens._forward_hooks)

    module = LM(llama)
    fingerprint = model_fingerprint(module)
    make_trainer([Probe(), ActivationCheckpointing(kwargs={"every_n_layers": 2})]).fit(module, batches())
    assert seen["flags"] == [True, False, True, False]
    assert seen["hooks"] == 0, "transformers' input-require-grads hook is for reentrant recompute only"
    assert model_fingerprint(module) == fingerprint
    assert not any(layer.gradient_checkpointing for layer in llama.model.layers)


@pytest.mark.parametrize(
    "reentrant, users_hook, required", [(False, False, False), (True, False, True), (False, True, True)]
)
def test_the_input_require_grads_hook_only_where_recompute_needs_it(reentrant, users_hook, required):
    # transformers' checkpointing hooks the input embeddings so that their output requires grad: reentrant recompute
    # over a frozen embedding needs it; non-reentrant does not, and with it backward computed the embedding output's
    # gradient (a hidden state) for nothing. A hook the user set (peft's prepare_model_for_kbit_training) stays.
    base = tiny_model("llama", lora=True)
    if users_hook:
        base.enable_input_require_grads()
    embeddings = base.get_input_embeddings()
    before = len(embeddings._forward_hooks)
    seen = []

    class Probe(pl.Callback):  # whether the (frozen) embeddings' output requires grad in the training step
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.handle = embeddings.register_forward_hook(lambda m, i, out: seen.append(out.requires_grad))

        def on_train_batch_end(self, *args):
            self.handle.remove()

    reference = fit(clone(base))
    run = fit(base, [Probe(), ActivationCheckpointing(reentrant=reentrant)])
    assert seen == [required]
    assert_same_training(reference, run)
    assert len(embeddings._forward_hooks) == before, "left as found"


class Boom(pl.Callback):
    def on_train_batch_end(self, *args, **kwargs):
        raise RuntimeError("boom")


@pytest.mark.parametrize("layers", [None, ["model.model.layers.*"]])
def test_removed_after_exception(llama, layers):
    module = LM(llama)
    fingerprint = model_fingerprint(module)
    with pytest.raises(RuntimeError, match="boom"):
        make_trainer([ActivationCheckpointing(layers=layers), Boom()]).fit(module, batches())
    assert model_fingerprint(module) == fingerprint


def test_state_dict_keys_unchanged_during_fit(llama):
    keys = {}

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            keys["during"] = list(pl_module.state_dict().keys())

    module = LM(llama)
    before = list(module.state_dict().keys())
    make_trainer([ActivationCheckpointing(layers=["model.model.layers.*"]), Probe()]).fit(module, batches())
    assert keys["during"] == before


def test_save_and_resume_lightning_checkpoint(tmp_path, llama):
    module = LM(clone(llama))
    trainer = make_trainer(
        [ActivationCheckpointing()], max_steps=2, default_root_dir=tmp_path, enable_checkpointing=True
    )
    trainer.fit(module, batches())
    ckpt = next(tmp_path.rglob("*.ckpt"))
    state = torch.load(ckpt, weights_only=False)
    assert set(state["state_dict"]) == set(LM(clone(llama)).state_dict())
    assert state["callbacks"]["ActivationCheckpointing"]["activation_checkpointing"]["enabled"] is True

    resumed = LM(clone(llama))
    trainer = make_trainer([ActivationCheckpointing()], max_steps=4, default_root_dir=tmp_path)
    trainer.fit(resumed, batches(), ckpt_path=ckpt)
    assert trainer.global_step == 4
    # Resuming with checkpointing continues exactly as resuming the same checkpoint without it.
    plain = LM(clone(llama))
    make_trainer([], max_steps=4, default_root_dir=tmp_path).fit(plain, batches(), ckpt_path=ckpt)
    for (name, a), b in zip(plain.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_order_independent_and_applied_once(llama):
    from lightning_ac.callbacks import SuiteCallback

    class Counting(pl.Callback):
        pass

    module = LM(llama)
    callback = ActivationCheckpointing()
    make_trainer([Counting(), callback]).fit(module, batches())
    assert module.backward_ops[MM] == 82
    # Lightning's own state_key check or ours, whichever runs first.
    with pytest.raises((ConfigError, RuntimeError), match="more than one.*ActivationCheckpointing"):
        make_trainer([ActivationCheckpointing(), ActivationCheckpointing()]).fit(LM(tiny_model()), batches())
    assert isinstance(callback, SuiteCallback)


def test_one_log_line_says_what_was_applied(llama, caplog):
    with caplog.at_level(logging.INFO, logger="lightning_ac"):
        fit(llama, [ActivationCheckpointing(kwargs={"every_n_layers": 2})])
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_ac"]
    assert lines == ["lightning_ac: checkpointing 2/4 decoder layers (hf, non-reentrant, every 2 layers)"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning_ac"):
        fit(tiny_model(), [ActivationCheckpointing(reentrant=True)])
    assert [r.getMessage() for r in caplog.records if r.name == "lightning_ac"] == [
        "lightning_ac: checkpointing 4/4 decoder layers (hf, reentrant)"
    ]


class ConfiguredLM(LM):
    """Builds its transformers model in configure_model, after Callback.setup."""

    def __init__(self, factory) -> None:
        super().__init__(nn.Identity())
        self.factory = factory

    def configure_model(self) -> None:
        if isinstance(self.model, nn.Identity):
            self.model = self.factory()


def test_layers_created_in_configure_model():
    reference = fit(tiny_model())
    module = ConfiguredLM(lambda: tiny_model())
    make_trainer([ActivationCheckpointing()]).fit(module, batches())
    assert_same_training(reference, module)
    assert module.backward_ops[MM] == 82
    assert "configure_model" not in module.__dict__
    assert not any(layer.gradient_checkpointing for layer in module.model.model.layers)


def test_no_layers_found_is_a_config_error():
    module = LM(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ConfigError, match="found no decoder layers.*layers="):
        make_trainer([ActivationCheckpointing()]).fit(module, batches())


def test_fsdp_implementation_needs_an_fsdp_strategy(llama):
    module = LM(llama)
    fingerprint = model_fingerprint(module)
    with pytest.raises(ConfigError, match="fsdp needs an FSDP strategy.*SingleDeviceStrategy"):
        make_trainer([ActivationCheckpointing(implementation="fsdp")]).fit(module, batches())
    assert model_fingerprint(module) == fingerprint


def _wrap_with_torch_checkpoint(model, selective=False):
    """The wrapper behind ``implementation: fsdp`` (and plain torch layers), applied directly."""
    from lightning_ac.checkpoint.forward import wrap_layers
    from lightning_ac.config import parse_config
    from lightning_ac.layers import find_decoder_layers
    from lightning_ac.selective.apply import build_policy

    config = parse_config({"selective": True} if selective else True)
    layers = find_decoder_layers(model)
    context_fn = None
    if selective:
        policy = build_policy(config.selective, model, layers, [True] * len(layers), None)
        policy.install()
        context_fn = policy.context_fn
    wrap_layers([m for _, m in layers.layers], config, context_fn)


def _gpt2():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gpt2", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("selective", [False, True])
def test_layer_wrapper_keeps_the_kv_cache_out_of_the_recompute(family, selective, caplog):
    """With the model's cache on (the default for a forward without ``use_cache=False``), the recompute must not
    write the cache a second time, and nothing in the cache may hold the layers' keys and values until backward.
    Llama passes the cache by keyword, GPT-2 positionally."""
    base = tiny_model("llama") if family == "llama" else _gpt2()
    ids = batches().dataset.tensors[0][:2]
    reference = clone(base).train()
    reference(input_ids=ids, labels=ids).loss.backward()
    model = clone(base).train()
    _wrap_with_torch_checkpoint(model, selective)
    out = model(input_ids=ids, labels=ids)
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 0
    out.loss.backward()
    assert out.past_key_values.get_seq_length() == 0
    for (name, p), (_, q) in zip(reference.named_parameters(), model.named_parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_layer_wrapper_refuses_a_cache_that_holds_tokens():
    from transformers import DynamicCache

    model = tiny_model("llama").train()
    _wrap_with_torch_checkpoint(model)
    ids = batches().dataset.tensors[0][:2]
    # transformers 5.24 renamed past_key_values to cache (the old name still works, with a warning)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = {name: DynamicCache(config=model.config)}
    with torch.no_grad():
        model(input_ids=ids[:, :4], use_cache=True, **cache)  # 4 tokens, as prefix tuning would hold
    with pytest.raises(RuntimeError, match=f"KV cache \\({name}\\) that already holds 4 tokens.*prefix tuning"):
        model(input_ids=ids, labels=ids, **cache)


def test_layer_wrapper_keeps_cache_named_inputs_of_plain_torch_layers():
    from lightning_ac.checkpoint.forward import wrap_layers
    from lightning_ac.config import parse_config

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x, cache=None):
            return self.linear(x) + (cache if cache is not None else 0)

    block = Block()
    x, memory = torch.randn(2, 8, requires_grad=True), torch.randn(2, 8)
    expected = block(x, cache=memory)
    wrap_layers([block], parse_config(True))
    assert torch.equal(block(x, cache=memory), expected), "here `cache` is an input, not a KV cache"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"implementation": "deepspeed"}, "implementation"),
        ({"kwargs": {"use_cache": False}}, "use_cache"),
        ({"layers": "model.layers.*"}, "layers"),
        ({"layers": [3]}, "layers"),
        ({"selective": True, "reentrant": True}, "non-reentrant"),
    ],
)
def test_argument_checks_in_init(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ActivationCheckpointing(**kwargs)


def test_callbacks_from_config():
    assert callbacks_from_config(None) == []
    assert callbacks_from_config(False) == []
    assert callbacks_from_config({"enabled": False}) == []
    (callback,) = callbacks_from_config({"reentrant": True, "kwargs": {"every_n_layers": 2}})
    assert isinstance(callback, ActivationCheckpointing)
    assert callback.config.use_reentrant and callback.config.every_n_layers == 2
    checkpointing, offload = callbacks_from_config({"offload": {"hidden_states": "cpu"}}, copy_on_host=True)
    assert isinstance(offload, ActivationOffload) and offload.copy_on_host
    assert offload.targets == ["hidden_states"]
    (offload,) = callbacks_from_config({"enabled": False, "offload": {"all": True}})
    assert isinstance(offload, ActivationOffload) and offload.targets == ["all"]
    with pytest.raises(ConfigError, match="layer_offloading"):
        callbacks_from_config(True, layer_offloading="yes")


def test_hooks_added_by_others_after_setup_survive_removal(llama):
    """Only what we installed is removed: a hook the user adds in LightningModule.setup stays."""
    calls = []

    class UserSetup(LM):
        def setup(self, stage):
            if not getattr(self, "_hooked", False):
                self._hooked = True
                self.model.model.norm.register_forward_hook(lambda *a: calls.append(1))

    module = UserSetup(llama)
    make_trainer([ActivationCheckpointing()]).fit(module, batches())
    assert calls, "the user's hook ran during fit"
    assert len(module.model.model.norm._forward_hooks) == 1, "and is still there after it"
    assert not any(layer.gradient_checkpointing for layer in module.model.model.layers)


class SetupBuiltLM(LM):
    """Builds its model in LightningModule.setup, which Lightning runs after Callback.setup."""

    def __init__(self) -> None:
        super().__init__(nn.Identity())

    def setup(self, stage):
        if isinstance(self.model, nn.Identity):
            self.model = tiny_model()


def test_layers_created_in_lightning_module_setup():
    module = SetupBuiltLM()
    make_trainer([ActivationCheckpointing()]).fit(module, batches())
    assert module.backward_ops[MM] == 82
    assert "configure_model" not in module.__dict__


def test_layers_that_match_nothing_are_echoed_with_the_module_names():
    module = LM(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(
        ConfigError, match=r"ActivationCheckpointing\(layers=\['blocks\.\*'\]\) matched no module.*: model"
    ):
        make_trainer([ActivationCheckpointing(layers=["blocks.*"])]).fit(module, batches())


def test_layers_given_to_layer_offload_are_named_as_its_own_argument():
    module = LM(nn.Sequential(nn.Linear(2, 2)))
    callbacks = [ActivationCheckpointing(), LayerOffload(layers=["blocks.*"], copy_on_host=True)]
    with pytest.raises(ConfigError) as info:
        make_trainer(callbacks).fit(module, batches())
    message = str(info.value)
    assert message.startswith("LayerOffload(layers=['blocks.*']) matched no module in LM"), message
    assert "ActivationCheckpointing(layers" not in message, "an argument the user never gave"


LLAMA_LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"


@pytest.mark.parametrize(
    "given, expected",
    [
        ([LLAMA_LAYER], "class"),
        (["model.model.layers.*"], "glob"),  # a glob character: a glob
        (["model.layers"], "glob"),  # a module name: no module named "model" to import
        ([LLAMA_LAYER + "s"], "glob"),  # not in that module: a glob, which the no-match error explains
        (["torch.nn.functional.relu"], "glob"),  # imports, but not an nn.Module subclass
        (["torch.nn"], "glob"),  # a module, not a class
        (["model.layers.0"], "glob"),  # not a path of identifiers
    ],
)
def test_a_dotted_class_path_in_layers_names_the_class(given, expected):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    layers = ActivationCheckpointing(layers=given).layers
    assert layers == ([LlamaDecoderLayer] if expected == "class" else given)
    assert LayerOffload(layers=given).layers == layers


def test_layers_as_a_class_path_checkpoint_the_layers_of_that_class(llama):
    module = LM(clone(llama))
    make_trainer([ActivationCheckpointing(layers=[LLAMA_LAYER])]).fit(module, batches())
    assert module.backward_ops[MM] == 82, "the 4 decoder layers recomputed"


def test_a_transformers_model_without_checkpointable_layers_is_named():
    from transformers import AlbertConfig, AlbertForMaskedLM

    config = AlbertConfig(vocab_size=128, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=64)  # fmt: skip
    module = LM(AlbertForMaskedLM(config))
    with pytest.raises(ConfigError, match="contains the transformers model.*AlbertForMaskedLM.*cannot checkpoint"):
        make_trainer([ActivationCheckpointing()]).fit(module, batches())


def test_an_encoder_decoder_model_counts_encoder_and_decoder_layers(caplog):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=128, d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2,
                      decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    fit(T5ForConditionalGeneration(config), [ActivationCheckpointing()])
    assert "checkpointing 4/4 encoder and decoder layers (hf, non-reentrant)" in caplog.text


def test_validate_says_nothing_is_recomputed(llama, caplog):
    module = LM(llama)
    module.validation_step = lambda batch, batch_idx: module.model(input_ids=batch[0], labels=batch[0]).loss
    make_trainer([ActivationCheckpointing()]).validate(module, batches(), verbose=False)
    assert "validate: no backward, so nothing is recomputed and no activation is offloaded" in caplog.text
    assert "checkpointing 4/4" not in caplog.text


class CacheLM(LM):
    """Records whether its training forward built a KV cache, and what its config said then."""

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch[0], labels=batch[0])
        self.seen = (out.past_key_values, self.model.config.use_cache)
        return out.loss


def test_the_kv_cache_is_off_in_a_checkpointed_training_forward_and_the_config_untouched(llama, caplog):
    """transformers turns the cache off under checkpointing anyway, with a warning per run; each training forward is
    called with use_cache=False instead (no cache built, no warning), and the config is never touched: a copy, a
    pickle or a save_pretrained during the run has it as found."""
    assert llama.config.use_cache is True
    module = fit(llama, [ActivationCheckpointing()], module_cls=CacheLM)
    assert module.seen == (None, True), "no cache built in the training forward; the config as found"
    assert "use_cache=True` is incompatible" not in caplog.text and "Caching is incompatible" not in caplog.text
    assert llama.config.use_cache is True
    llama.eval()
    assert llama(input_ids=torch.randint(0, 100, (1, 4))).past_key_values is not None, "evaluation keeps its cache"


class PackedLM(LM):
    """Two documents packed in each sequence: position ids restart at the boundary, and no attention mask."""

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        half = ids.shape[1] // 2
        positions = torch.cat([torch.arange(half), torch.arange(ids.shape[1] - half)]).expand(ids.shape[0], -1)
        loss = self.model(input_ids=ids, labels=ids, position_ids=positions).loss
        self.losses.append(float(loss.detach()))
        return loss


@pytest.mark.parametrize("arguments", [{}, {"budget": 10**9}], ids=["hf", "budget"])
def test_packed_batches_say_once_that_they_train_otherwise_without_the_cache(arguments):
    """Without a KV cache (checkpointing turns it off, transformers' own too) transformers masks packed documents
    apart; the same model with its default use_cache=True attends across them. Every loss differed from the run
    without the suite, silently; now one warning names use_cache and the way to train the same either way, which
    trains bit for bit as without the suite."""
    base = tiny_model("llama")
    with pytest.warns(LightningACWarning, match="packed sequences") as caught:
        fit(clone(base), [ActivationCheckpointing(**arguments)], module_cls=PackedLM, max_steps=2)
    ours = [str(w.message) for w in caught if "packed sequences" in str(w.message)]
    assert len(ours) == 1 and "use_cache=False" in ours[0] and "model.config.use_cache = False" in ours[0]
    assert base.config.use_cache is True
    base.config.use_cache = False  # the way out the warning gives
    plain = fit(clone(base), module_cls=PackedLM)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LightningACWarning)
        run = fit(clone(base), [ActivationCheckpointing(**arguments)], module_cls=PackedLM)
    assert_same_training(plain, run)


def test_packed_batches_with_layers_named_keep_the_models_cache_and_attention():
    """Layers named by glob run under torch's checkpoint around their forward: the model keeps its cache (each
    checkpointed call drops it), so packed documents are attended to as without the suite."""
    base = tiny_model("llama")
    plain = fit(clone(base), module_cls=PackedLM)
    run = fit(clone(base), [ActivationCheckpointing(layers=["model.model.layers.*"])], module_cls=PackedLM)
    assert_same_training(plain, run)


def test_unpacked_batches_with_position_ids_say_nothing(llama):
    class PositionsLM(LM):
        def training_step(self, batch, batch_idx):
            ids = batch[0]
            positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
            return self.model(input_ids=ids, labels=ids, position_ids=positions).loss

    with warnings.catch_warnings():
        warnings.simplefilter("error", LightningACWarning)
        fit(llama, [ActivationCheckpointing()], module_cls=PositionsLM, max_steps=2)
