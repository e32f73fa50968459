"""The block's ``chunked_loss``: the causal-LM loss a chunk of tokens at a time, against the same run without it.

Real transformers models from small configs, a real Trainer. One chunk holding every token runs the model's own
kernels in its order: bit-identical. More chunks sum the loss in another order: within float rounding (measured on
these models: losses equal or within 1 ulp, gradients within 4e-7 of each tensor's largest value; the tests allow
1e-6 and 1e-5)."""

from __future__ import annotations

from typing import Dict, List

import lightning.pytorch as pl
import pytest
import torch
from conftest import BATCH, LM, SEQ, VOCAB, OpCounter, clone, make_trainer, model_fingerprint, tiny_config, tiny_model

from lightning_ac import ActivationCheckpointing, ActivationOffload, ConfigError, LayerOffload, callbacks_from_config
from lightning_ac.bench.memory import StepMetrics
from lightning_ac.config import parse_config
from lightning_ac.loss.function import chunked_causal_lm_loss
from lightning_ac.loss.install import MIN_AUTO_CHUNK_TOKENS, auto_chunk_tokens

LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5
TOKENS = BATCH * SEQ


class StepsLM(LM):
    """Every step's loss and gradients (LM keeps the first step's)."""

    def __init__(self, model: torch.nn.Module, lr: float = 0.1) -> None:
        super().__init__(model, lr)
        self.step_grads: List[Dict[str, torch.Tensor]] = []
        self.logits: List[object] = []

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        output = self.model(input_ids=ids, labels=ids)
        self.logits.append(output.logits)
        self.losses.append(float(output.loss.detach()))
        return output.loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None})


class ChunksRan(pl.Callback):
    """After each step: how many training forwards the chunked loss computed so far, and its last (tokens a chunk,
    tokens). A model whose loss silently fell back to whole logits shows no chunked call."""

    def __init__(self) -> None:
        self.seen: list = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        suite = next(cb for cb in trainer.callbacks if isinstance(cb, ActivationCheckpointing))
        chunked = suite.plan.chunked_loss
        self.seen.append((chunked.chunked_calls, chunked.last_chunks) if chunked is not None else None)


def batches(steps: int = 2, vocab: int = VOCAB, seq: int = SEQ, seed: int = 1) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randint(0, vocab, (BATCH, seq), generator=g),) for _ in range(steps)]
    return torch.utils.data.DataLoader(data, batch_size=None)


def train(base, callbacks=(), steps: int = 2, module_cls=StepsLM, data=None, **kwargs) -> StepsLM:
    module = module_cls(clone(base))
    make_trainer(list(callbacks), max_steps=steps, **kwargs).fit(module, data if data is not None else batches(steps))
    return module


def assert_same(reference: StepsLM, run: StepsLM, exact: bool) -> None:
    assert len(reference.step_grads) == len(run.step_grads) > 0
    for want, got in zip(reference.losses, run.losses):
        assert want == got if exact else abs(want - got) <= LOSS_RTOL * abs(want), (want, got)
    for step, (want, got) in enumerate(zip(reference.step_grads, run.step_grads)):
        assert want.keys() == got.keys()
        for name, grad in want.items():
            if exact:
                assert torch.equal(grad, got[name]), f"step {step}: {name}"
            else:
                scale = grad.abs().max().item() or 1.0
                assert (grad - got[name]).abs().max().item() <= GRAD_RTOL * scale, f"step {step}: {name}"


# -- the field ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, tokens",
    [(True, "auto"), ("true", "auto"), ({"chunk_tokens": 8}, 8), ({"chunk_tokens": "auto"}, "auto"), ({}, "auto")],
)
def test_chunked_loss_values(value, tokens):
    assert parse_config({"chunked_loss": value}).chunked_loss.chunk_tokens == tokens
    assert ActivationCheckpointing(chunked_loss=value).config.chunked_loss.chunk_tokens == tokens


@pytest.mark.parametrize("value", [False, None, "false"])
def test_chunked_loss_off(value):
    assert parse_config({"chunked_loss": value}).chunked_loss is None


@pytest.mark.parametrize(
    "value, names",
    [
        (8, "expected true, false or a mapping"),
        ("lots", "expected true, false or a mapping"),
        ([8], "expected true, false or a mapping"),
        ({"chunk_tokens": 0}, "chunked_loss.chunk_tokens"),
        ({"chunk_tokens": 1.5}, "chunked_loss.chunk_tokens"),
        ({"chunk_tokens": True}, "chunked_loss.chunk_tokens"),
        ({"chunks": 8}, "chunks"),
    ],
)
def test_bad_chunked_loss_names_the_field_the_value_and_the_fix(value, names):
    with pytest.raises(ConfigError, match="activation_checkpointing.chunked_loss") as block:
        parse_config({"chunked_loss": value})
    assert names in str(block.value)
    with pytest.raises(ConfigError, match=r"ActivationCheckpointing\(chunked_loss=...\)"):
        ActivationCheckpointing(chunked_loss=value)


def test_the_docstring_says_what_true_means():
    """LightningCLI's --help shows it: True is chunk_tokens: auto."""
    doc = " ".join(ActivationCheckpointing.__doc__.split())
    assert "1024 tokens" not in doc
    assert (
        "``True`` (``chunk_tokens: auto``: chunks whose logits hold as many elements as the final hidden states" in doc
    )
    assert parse_config({"chunked_loss": True}).chunked_loss.chunk_tokens == "auto"


def test_enabled_false_without_chunked_loss_is_an_error():
    with pytest.raises(ConfigError, match="would do nothing. Pass chunked_loss=True"):
        ActivationCheckpointing(enabled=False)


@pytest.mark.parametrize(
    "arguments, named",
    [
        ({"budget": "2GiB"}, "budget"),
        ({"selective": True}, "selective"),
        ({"reentrant": True}, "reentrant"),
        ({"kwargs": {"preserve_rng_state": False}}, "kwargs"),
        ({"implementation": "fsdp"}, "implementation"),
        ({"layers": ["model.layers.*"]}, "layers"),
        ({"budget": "2GiB", "selective": True}, "selective, budget"),
    ],
)
@pytest.mark.parametrize("chunked_loss", [None, True])
def test_enabled_false_names_the_recompute_arguments_that_would_do_nothing(arguments, named, chunked_loss):
    with pytest.raises(ConfigError) as raised:
        ActivationCheckpointing(enabled=False, chunked_loss=chunked_loss, **arguments)
    message = str(raised.value)
    assert message.startswith("ActivationCheckpointing(enabled=False, ")
    assert f"and {named} say" in message and f"Remove {named}, or set enabled=True" in message
    assert "Pass chunked_loss=True" not in message, "no advice that leads to a second error"


def test_auto_chunk_tokens_keeps_a_chunk_of_logits_to_the_size_of_the_hidden_states_and_bounded():
    assert auto_chunk_tokens(8192, 4096, 128256) == 512  # 261.6 tokens, rounded up to a power of two
    # the hidden states' worth at 32k would be 2048 tokens (1 GiB of float32 logits): bounded at 256 MiB, at any length
    assert auto_chunk_tokens(32768, 4096, 128256) == auto_chunk_tokens(2**20, 4096, 128256) == 512
    assert auto_chunk_tokens(4096, 2048, 2048) == 4096


def test_auto_chunk_tokens_takes_no_fewer_than_the_floor_and_never_more_than_the_tokens():
    assert auto_chunk_tokens(2048, 256, 32000) == MIN_AUTO_CHUNK_TOKENS == 128  # 16.4 tokens would do
    assert auto_chunk_tokens(64, 64, 128) == 64
    assert auto_chunk_tokens(3, 4096, 128) == 3
    assert auto_chunk_tokens(0, 4096, 128) == 1


# -- the loss itself ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_items", [None, 40])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_the_loss_matches_transformers_causal_lm_loss(dtype, num_items, softcap):
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    vocab, hidden_size = 50, 16
    head = torch.nn.Linear(hidden_size, vocab, bias=False).to(dtype)
    hidden = torch.randn(BATCH, 33, hidden_size, dtype=dtype)
    labels = torch.randint(0, vocab, (BATCH, 33))
    labels[0, :5] = -100  # ignored
    items = None if num_items is None else torch.tensor(num_items)

    def reference():
        h = hidden.clone().requires_grad_()
        logits = head(h)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        loss = ForCausalLMLoss(logits, labels, vocab, num_items_in_batch=items)
        return (loss, *torch.autograd.grad(loss, [h, head.weight]))

    def chunked(tokens):
        h = hidden.clone().requires_grad_()
        loss = chunked_causal_lm_loss(h, labels, head, [head.weight], tokens, num_items_in_batch=items, softcap=softcap)
        return (loss, *torch.autograd.grad(loss, [h, head.weight]))

    want = reference()
    for got, exact in ((chunked(BATCH * 33), True), (chunked(7), False)):
        for w, g in zip(want, got):
            if exact:
                assert torch.equal(w, g)
            else:  # bf16: the weight's gradient adds up in float32 over the chunks, then rounds once
                tolerance = (LOSS_RTOL if w.dim() == 0 else GRAD_RTOL) if dtype == torch.float32 else 2**-7
                assert (w - g).abs().max() <= tolerance * w.abs().max()


# -- in a Trainer --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llama_off(llama):
    return train(llama)


def test_one_chunk_of_every_token_is_bit_identical(llama, llama_off):
    run = train(llama, [ActivationCheckpointing(chunked_loss={"chunk_tokens": TOKENS})])
    assert_same(llama_off, run, exact=True)
    assert run.logits == [None, None], "no logits are built in the training forwards"


@pytest.mark.parametrize(
    "arguments",
    [
        {},
        {"kwargs": {"every_n_layers": 2}},
        {"selective": True},
        {"budget": "1MiB"},
        {"reentrant": True},
    ],
    ids=["full", "every_2", "selective", "budget", "reentrant"],
)
def test_chunks_compose_with_the_block(llama, llama_off, arguments):
    run = train(llama, [ActivationCheckpointing(chunked_loss={"chunk_tokens": 5}, **arguments)])
    assert_same(llama_off, run, exact=False)


def test_with_enabled_false_it_recomputes_nothing(llama, llama_off, caplog):
    (callback,) = callbacks_from_config({"enabled": False, "chunked_loss": {"chunk_tokens": 5}})
    counted = {}

    class Count(pl.Callback):
        def on_before_backward(self, trainer, module, loss):
            self.counter = OpCounter().__enter__()

        def on_after_backward(self, trainer, module):
            self.counter.__exit__(None, None, None)
            counted.setdefault("mm", self.counter.counts["aten.mm"])

    plain_count = Count()
    train(llama, [plain_count], steps=1)
    plain = counted.pop("mm")
    run = train(llama, [callback, Count()])
    assert_same(llama_off, run, exact=False)
    # the head's backward matmuls ran in the forward: the layers' backward, and nothing recomputed
    assert counted["mm"] < plain
    assert any("loss chunked" in m and "nothing recomputed" in m for m in caplog.messages)


@pytest.mark.parametrize(
    "family, overrides, lora",
    [
        ("llama", {}, True),  # LoRA: the head frozen
        ("qwen3", {}, False),  # sliding-window layers, the head trains
        ("gemma3_text", {"final_logit_softcapping": 30.0}, False),  # soft-capped, the head tied to the embeddings
    ],
    ids=["llama-lora", "qwen3", "gemma3-softcap-tied"],
)
def test_models(family, overrides, lora):
    base = tiny_model(family, lora=lora, **overrides)
    plain = train(base)
    for tokens, exact in ((TOKENS, True), (5, False)):
        chunks = ChunksRan()
        run = train(base, [ActivationCheckpointing(chunked_loss={"chunk_tokens": tokens}), chunks])
        assert_same(plain, run, exact=exact)
        assert chunks.seen == [(1, (tokens, TOKENS)), (2, (tokens, TOKENS))], "every step's loss ran in chunks"
        assert run.logits == [None, None]


def _trained_head_model():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(
        tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    )


def test_the_applied_line_names_the_head_the_model_has(caplog):
    """ModernBERT-decoder's output embeddings are its ``decoder`` (its ``lm_head`` is a dense layer before them)."""
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2}
    base = tiny_model("modernbert-decoder", **ids)
    plain = train(base, steps=1)
    run = train(base, [ActivationCheckpointing(chunked_loss={"chunk_tokens": TOKENS})], steps=1)
    assert_same(plain, run, exact=True)
    assert run.logits == [None]
    assert any("through ModernBertDecoderForCausalLM.decoder " in m for m in caplog.messages), caplog.messages


def test_a_trainable_lm_head_in_peft_modules_to_save():
    model = _trained_head_model()
    plain = train(model)
    assert any("modules_to_save" in name and "lm_head" in name for name in plain.step_grads[0])
    chunks = ChunksRan()
    assert_same(plain, train(model, [ActivationCheckpointing(chunked_loss={"chunk_tokens": 5}), chunks]), exact=False)
    assert chunks.seen == [(1, (5, TOKENS)), (2, (5, TOKENS))]


@pytest.mark.parametrize(
    "arguments, measured",
    [({"budget": "1MiB"}, False), ({}, True)],
    ids=["the_budgets_measuring_step", "full_under_memtracker"],
)
def test_a_trained_head_under_module_trackers(arguments, measured):
    """PEFT's modules_to_save calls the trained head's copy as a module, inside the chunks' backward: module trackers
    (torch's ModTracker, under the budget's measuring step and under MemTracker) see nothing of it and keep working."""
    model = _trained_head_model()
    plain = train(model)
    metrics = [StepMetrics(measure_step=0, warmup_steps=0)] if measured else []
    run = train(model, [ActivationCheckpointing(chunked_loss={"chunk_tokens": 5}, **arguments), *metrics])
    assert_same(plain, run, exact=False)
    assert run.logits == [None, None], "the loss was chunked"
    if measured:
        assert metrics[0].peak is not None and metrics[0].peak.activation_bytes > 0


def test_bfloat16():
    base = tiny_model("llama").to(torch.bfloat16)
    plain = train(base)
    assert_same(plain, train(base, [ActivationCheckpointing(chunked_loss={"chunk_tokens": TOKENS})]), exact=True)


class IgnoringLM(StepsLM):
    """Labels with ignored positions and the batch's token count passed as ``num_items_in_batch``, as gradient
    accumulation does."""

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        labels = ids.clone()
        labels[:, : SEQ // 4] = -100
        items = (labels[:, 1:] != -100).sum() * 2  # as if over two micro-batches
        output = self.model(input_ids=ids, labels=labels, num_items_in_batch=items)
        self.losses.append(float(output.loss.detach()))
        return output.loss


def test_ignored_labels_and_num_items_in_batch(llama):
    plain = train(llama, module_cls=IgnoringLM)
    assert_same(plain, train(llama, [ActivationCheckpointing(chunked_loss={"chunk_tokens": TOKENS})],
                             module_cls=IgnoringLM), exact=True)  # fmt: skip
    assert_same(plain, train(llama, [ActivationCheckpointing(chunked_loss={"chunk_tokens": 5})],
                             module_cls=IgnoringLM), exact=False)  # fmt: skip


def test_a_mixture_of_experts_router_loss_is_added_as_the_model_adds_it():
    base = tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      output_router_logits=True, router_aux_loss_coef=0.5)  # fmt: skip
    plain = train(base)
    run = train(base, [ActivationCheckpointing(chunked_loss={"chunk_tokens": TOKENS})])
    assert_same(plain, run, exact=True)


@pytest.mark.parametrize("target", ["hidden_states", "all"])
def test_offload_targets(llama, llama_off, transfer, target):
    offload = ActivationOffload(copy_on_host=True, min_offload_bytes=0, **{target: "cpu"})
    run = train(llama, [ActivationCheckpointing(chunked_loss={"chunk_tokens": 5}), offload])
    assert_same(llama_off, run, exact=False)
    assert offload.last_step[target]["tensors"] > 0


def test_layer_offloading():
    base = tiny_model("llama", lora=True)
    plain = train(base)
    run = train(base, [ActivationCheckpointing(chunked_loss={"chunk_tokens": 5}), LayerOffload(copy_on_host=True)])
    assert_same(plain, run, exact=False)


# -- left as found, messages, refusals ------------------------------------------------------------------------------


def test_the_model_is_left_as_found_and_returns_logits_outside_training(llama):
    module = StepsLM(clone(llama))
    before = model_fingerprint(module)
    make_trainer([ActivationCheckpointing(chunked_loss=True)], max_steps=1).fit(module, batches(1))
    assert module.logits == [None]
    assert model_fingerprint(module) == before
    ids = batches(1).dataset[0][0]
    module.model.train()
    output = module.model(input_ids=ids, labels=ids)
    assert output.logits.shape == (BATCH, SEQ, VOCAB), "after the run: the model's own logits"


class ValidatingLM(StepsLM):
    def validation_step(self, batch, batch_idx):
        ids = batch[0]
        output = self.model(input_ids=ids, labels=ids)
        self.logits.append(output.logits)
        return output.loss


def test_validation_gets_its_logits(llama):
    module = ValidatingLM(clone(llama))
    trainer = make_trainer([ActivationCheckpointing(chunked_loss=True)], max_steps=2, val_check_interval=1,
                           limit_val_batches=1, num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(module, batches(2), batches(1))
    shapes = [None if logits is None else tuple(logits.shape) for logits in module.logits]
    assert shapes == [None, (BATCH, SEQ, VOCAB), None, (BATCH, SEQ, VOCAB)]


class NoLabelsLM(StepsLM):
    def training_step(self, batch, batch_idx):
        ids = batch[0]
        logits = self.model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        self.losses.append(float(loss.detach()))
        return loss


def test_a_training_forward_without_labels_is_said_once_and_computes_as_before(llama):
    plain = train(llama, module_cls=NoLabelsLM)
    with pytest.warns(UserWarning, match="without labels") as caught:
        run = train(llama, [ActivationCheckpointing(chunked_loss=True)], module_cls=NoLabelsLM)
    assert len([w for w in caught if "without labels" in str(w.message)]) == 1
    assert_same(plain, run, exact=True)


@pytest.mark.parametrize(
    "family, overrides, ops, exact",
    [
        ("hyperclovax", {"logits_scaling": 0.25}, [("mul", 0.25)], True),  # the scale on the head's own line
        # ... an attribute of the inner model (the loss bit-identical, the gradients within float rounding; its
        # mamba mixers run torch's reference scan on the CPU: about 30 s, so in the slow session)
        pytest.param("falcon_h1", {"lm_head_multiplier": 0.25}, [("mul", 0.25)], False, marks=pytest.mark.slow),
        ("granite", {"logits_scaling": 4.0}, [("div", 4.0)], True),  # a line of its own after the head
        ("cohere", {"logit_scale": 0.5}, [("mul", 0.5)], True),
        ("gemma3_text", {"final_logit_softcapping": 30.0}, [("div", 30.0), ("tanh", None), ("mul", 30.0)], True),
    ],
)
def test_a_logit_scale_the_forward_applies_is_applied_to_every_chunk(family, overrides, ops, exact):
    from lightning_ac.loss.source import logit_ops

    base = tiny_model(family, **overrides)
    assert logit_ops(base) == ops
    plain = train(base, steps=1)
    run = train(base, [ActivationCheckpointing(chunked_loss={"chunk_tokens": TOKENS})], steps=1)
    assert_same(plain, run, exact=exact)
    assert run.losses == plain.losses
    assert run.logits == [None], "the loss was chunked"
    chunks = ChunksRan()
    assert_same(plain, train(base, [ActivationCheckpointing(chunked_loss={"chunk_tokens": 5}), chunks], steps=1),
                exact=False)  # fmt: skip
    assert chunks.seen == [(1, (5, TOKENS))]


def test_a_layout_change_of_the_logits_is_applied_too():
    """OPT's head line ends in .contiguous() (Mamba's in .float()): values unchanged, and accepted."""
    from lightning_ac.loss.source import logit_ops

    base = tiny_model("opt", ffn_dim=128, word_embed_proj_dim=64, dropout=0.0)  # no dropout: two runs alike
    assert logit_ops(base) == [("contiguous", None)]
    plain = train(base, steps=1)
    chunks = ChunksRan()  # one chunk: OPT's key-bias gradients are float noise around 0, compared bit for bit
    run = train(base, [ActivationCheckpointing(chunked_loss={"chunk_tokens": TOKENS}), chunks], steps=1)
    assert_same(plain, run, exact=True)
    assert run.logits == [None] and chunks.seen == [(1, (TOKENS, TOKENS))]


def _scaled_inside_the_loss_block_model():
    from transformers import LlamaForCausalLM

    class ScaledInsideLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden_states = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            logits = self.lm_head(hidden_states)
            loss = None
            if labels is not None:
                logits = logits * self.temperature
                loss = self.loss_function(logits, labels, self.config.vocab_size)
            return loss

    return ScaledInsideLlama(tiny_config("llama"))


def test_a_scale_inside_the_loss_block_is_read_and_one_that_trains_is_refused():
    from lightning_ac.loss.source import logit_ops

    model = _scaled_inside_the_loss_block_model()
    model.temperature = 0.5
    assert logit_ops(model) == [("mul", 0.5)]
    model.temperature = torch.nn.Parameter(torch.tensor(0.5))  # it would never get its gradient
    with pytest.raises(ConfigError, match=r"scales its logits by self.temperature, which is Parameter and trains"):
        train(model, [ActivationCheckpointing(chunked_loss=True)], steps=1)
    del model.temperature
    with pytest.raises(ConfigError, match=r"reads self.temperature, which this model does not have"):
        train(model, [ActivationCheckpointing(chunked_loss=True)], steps=1)


def _sliced_vocabulary_model():
    from transformers import LlamaForCausalLM

    class SlicedLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden_states = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            logits = self.lm_head(hidden_states)
            logits = logits[..., : self.config.vocab_size // 2]
            loss = None
            if labels is not None:
                loss = self.loss_function(logits, labels, self.config.vocab_size // 2)
            return loss

    return SlicedLlama(tiny_config("llama"))


def test_a_model_that_changes_its_logits_otherwise_is_refused_before_training():
    with pytest.raises(ConfigError, match=r"SlicedLlama.forward cannot be .* `logits = logits\[\.\.\., :self"):
        train(_sliced_vocabulary_model(), [ActivationCheckpointing(chunked_loss=True)], steps=1)


def test_a_hook_that_changes_the_heads_output_is_caught_at_the_step():
    """What the source cannot show (a forward hook on the head) is seen in the logits that reach the loss."""
    model = tiny_model("llama")
    model.lm_head.register_forward_hook(lambda module, args, output: output * 0.25)
    with pytest.raises(RuntimeError, match=r"not what its source does .*\(nothing\).*a forward hook on lm_head"):
        train(model, [ActivationCheckpointing(chunked_loss=True)], steps=1)


class KeptLogitsLM(StepsLM):
    """Keeps the logits of the last 8 positions and passes the whole labels: the model refuses the pair."""

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        return self.model(input_ids=ids, labels=ids, logits_to_keep=8).loss


def test_labels_that_do_not_pair_with_the_kept_positions_are_refused_as_the_model_refuses_them(llama):
    with pytest.raises(ValueError) as model_says:
        train(llama, module_cls=KeptLogitsLM, steps=1)
    with pytest.raises(ValueError) as chunked_says:
        train(llama, [ActivationCheckpointing(chunked_loss=True)], module_cls=KeptLogitsLM, steps=1)
    assert "batch_size" in str(model_says.value)
    assert str(chunked_says.value) == str(model_says.value)


class AccuracyLM(StepsLM):
    """Computes the token accuracy from the logits of the training forward, as TRL's SFT trainer does."""

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        output = self.model(input_ids=ids, labels=ids)
        self.log("accuracy", (output.logits.argmax(-1)[:, :-1] == ids[:, 1:]).float().mean())
        return output.loss


def test_a_step_that_reads_the_logits_it_was_not_given_is_told_why_and_what_to_do(llama):
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'argmax'") as raised:
        with pytest.warns(UserWarning, match="this may be the chunked loss"):  # said in the log too
            train(llama, [ActivationCheckpointing(chunked_loss=True)], module_cls=AccuracyLM, steps=1)
    (note,) = raised.value.__notes__
    assert "LlamaForCausalLM's training forwards with labels return logits=None" in note
    assert "validation_step" in note and "chunked_loss: false" in note


def test_a_custom_loss_function_is_refused_before_training():
    model = tiny_model("llama")
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().mean()
    with pytest.raises(ConfigError, match="loss_function is not transformers' causal-LM loss"):
        train(model, [ActivationCheckpointing(chunked_loss=True)], steps=1)
    assert "_loss_function" in model.__dict__, "the user's loss function is still there"


def test_plain_torch_layers_are_refused():
    from test_layer_offload import Net

    with pytest.raises(ConfigError, match="has no transformers causal-LM model"):
        make_trainer([ActivationCheckpointing(layers=["blocks.*"], chunked_loss=True)]).fit(Net(), _net_batches())


def _net_batches():
    return torch.utils.data.DataLoader([(torch.randn(8, 16),)], batch_size=None)


# -- memory --------------------------------------------------------------------------------------------------------


class FloorLM(StepsLM):
    """The step without the head's activations: the logits of the last token only (the floor)."""

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], logits_to_keep=1).logits.float().mean()


def test_the_activation_peak_drops_by_the_heads_share():
    vocab = 4096  # the head's logits outweigh these layers' activations, as with a real vocabulary
    base = tiny_model("llama", lora=True, vocab_size=vocab)
    data = batches(3, vocab=vocab, seq=128)

    def peak(callbacks, module_cls=StepsLM):
        metrics = StepMetrics(measure_step=2, warmup_steps=0)
        train(base, [*callbacks, metrics], steps=3, module_cls=module_cls, data=data)
        return metrics.peak.activation_bytes

    full = peak([ActivationCheckpointing()])
    # chunks about the hidden states' size (auto without its floor: at this small a step, 128 tokens are half of it)
    chunked = peak([ActivationCheckpointing(chunked_loss={"chunk_tokens": 8})])
    floor = peak([ActivationCheckpointing()], FloorLM)
    assert chunked <= 0.3 * full, (chunked, full)
    assert chunked <= 1.3 * floor, (chunked, floor)


def test_under_a_budget_the_smaller_head_leaves_room_for_kept_layers():
    vocab = 2048
    base = tiny_model("llama", lora=True, vocab_size=vocab)
    data = batches(5, vocab=vocab, seq=64)

    def peak(callbacks):
        metrics = StepMetrics(measure_step=4, warmup_steps=0)
        train(base, [*callbacks, metrics], steps=5, data=data)
        return metrics.peak.activation_bytes

    off = peak([ActivationCheckpointing(enabled=False, chunked_loss=True)])
    full = peak([ActivationCheckpointing(chunked_loss=True)])
    budget = (off + full) // 2  # between full and off, with the loss chunked; below full without it
    chunked = ActivationCheckpointing(budget=budget, chunked_loss=True)
    assert peak([chunked]) <= budget
    assert chunked.budget_plan["choices"].count("keep") >= 1
    whole = ActivationCheckpointing(budget=budget)
    with pytest.warns(UserWarning, match="over the budget") as caught:
        peak([whole])
    advice = next(str(w.message) for w in caught if "over the budget" in str(w.message))
    assert "chunked_loss: true (the output head's logits and their gradient hold" in advice
    assert whole.budget_plan["choices"] == ["recompute"] * 4


def test_where_the_loss_runs_as_one_chunk_the_nothing_fits_advice_names_chunk_tokens():
    vocab = 2048
    base = tiny_model("llama", lora=True, vocab_size=vocab)
    one_chunk = ActivationCheckpointing(budget=1, chunked_loss=True)  # auto: 128 tokens, all of this step's
    with pytest.warns(UserWarning, match="over the budget") as caught:
        train(base, [one_chunk], steps=2, data=batches(2, vocab=vocab, seq=64))
    advice = next(str(w.message) for w in caught if "over the budget" in str(w.message))
    assert "chunked_loss.chunk_tokens below the step's 128 tokens (the loss ran as one chunk of 128 tokens" in advice
    assert "chunked_loss: true" not in advice


def test_the_budget_measures_the_chunked_heads_working_set_in_the_forward_where_it_is():
    """With the loss chunked, each chunk's logits and their gradient exist in the forward (backward only scales what
    they left): the budget's head figure is read there too, not left to a calibration taken from another plan."""
    vocab, chunk = 4096, 64

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            cb = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
            self.head_bytes = cb.plan.budget.head_bytes

    keep = Keep()
    callback = ActivationCheckpointing(budget=10**9, chunked_loss={"chunk_tokens": chunk})
    train(tiny_model("llama", lora=True, vocab_size=vocab), [callback, keep], steps=1, data=batches(1, vocab, 128))
    chunk_logits = chunk * vocab * 4  # one chunk's float32 logits
    assert chunk_logits <= keep.head_bytes <= 4 * chunk_logits, (keep.head_bytes, chunk_logits)
