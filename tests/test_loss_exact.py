"""The chunked loss against torch's own cross-entropy on whole logits, for what the Trainer tests never vary: the loss
scaled before backward, labels shifted by the caller, an integer ``num_items_in_batch``, another ``ignore_index``, a
last chunk of one token, a head whose weight is frozen and whose bias trains, and ``chunk_tokens: auto`` at the
edges of its rounding. The oracle is written here: ``F.cross_entropy`` over the whole float32 logits, summed and
divided as transformers' ``ForCausalLMLoss`` divides."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from lightning_ac.loss.function import chunked_causal_lm_loss
from lightning_ac.loss.install import ChunkedLoss, auto_chunk_tokens

VOCAB, HIDDEN, BATCH, SEQ = 50, 16, 2, 33  # 66 tokens: chunks of 5 leave a last chunk of one token
RTOL = 1e-5


def _head(bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(HIDDEN, VOCAB, bias=bias)


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return hidden, labels


def _oracle(hidden, targets, head, ignore_index: int = -100, denominator: Optional[float] = None, scale: float = 1.0):
    """The loss and the gradients of ``scale * loss`` for hidden and each trainable head parameter, on whole
    logits; ``targets`` already shifted."""
    h = hidden.clone().requires_grad_()
    logits = head(h).float().reshape(-1, VOCAB)
    flat = targets.reshape(-1)
    total = F.cross_entropy(logits, flat, ignore_index=ignore_index, reduction="sum")
    loss = total / (denominator if denominator is not None else (flat != ignore_index).sum())
    params = [p for p in head.parameters() if p.requires_grad]
    grads = torch.autograd.grad(scale * loss, [h, *params])
    return loss.detach(), grads


def _chunked(hidden, labels, head, tokens: int, scale: float = 1.0, **kwargs):
    h = hidden.clone().requires_grad_()
    params = [p for p in head.parameters() if p.requires_grad]
    loss = chunked_causal_lm_loss(h, labels, head, params, tokens, **kwargs)
    grads = torch.autograd.grad(scale * loss, [h, *params])
    return loss.detach(), grads


def _shifted(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    return torch.cat([labels[:, 1:], torch.full((BATCH, 1), ignore_index)], dim=1)


def _assert_close(want, got) -> None:
    (want_loss, want_grads), (got_loss, got_grads) = want, got
    assert abs(want_loss - got_loss) <= RTOL * abs(want_loss), (want_loss, got_loss)
    assert len(want_grads) == len(got_grads)
    for w, g in zip(want_grads, got_grads):
        assert (w - g).abs().max() <= RTOL * w.abs().max(), (w - g).abs().max()


@pytest.mark.parametrize("scale", [0.5, 1 / 3])
@pytest.mark.parametrize("bias", [False, True])
def test_backward_scales_the_gradients_by_the_incoming_gradient(scale, bias):
    """A loss divided by the accumulation steps (or any ``0.5 * loss``) gives gradients scaled as much."""
    head, (hidden, labels) = _head(bias), _inputs()
    want = _oracle(hidden, _shifted(labels), head, scale=scale)
    _assert_close(want, _chunked(hidden, labels, head, 5, scale=scale))
    unscaled = _oracle(hidden, _shifted(labels), head)[1]
    assert not torch.allclose(want[1][0], unscaled[0]), "the scale shows in the gradients"


def test_labels_shifted_by_the_caller_are_taken_as_they_are():
    """transformers' ``shift_labels``: every position predicts the label given for it, the last one too."""
    head, (hidden, labels) = _head(), _inputs()
    given = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    want = _oracle(hidden, given, head)
    _assert_close(want, _chunked(hidden, labels, head, 5, shifted_labels=given))
    assert not torch.allclose(want[0], _oracle(hidden, _shifted(labels), head)[0])


def test_an_integer_num_items_in_batch_divides_the_sum():
    head, (hidden, labels) = _head(), _inputs()
    want = _oracle(hidden, _shifted(labels), head, denominator=40.0)
    _assert_close(want, _chunked(hidden, labels, head, 5, num_items_in_batch=40))
    _assert_close(want, _chunked(hidden, labels, head, 5, num_items_in_batch=torch.tensor(40)))


def test_another_ignore_index_is_ignored_and_pads_the_shift():
    head, (hidden, labels) = _head(), _inputs()
    labels[0, :9] = -1
    want = _oracle(hidden, _shifted(labels, ignore_index=-1), head, ignore_index=-1)
    _assert_close(want, _chunked(hidden, labels, head, 5, ignore_index=-1))
    counted = int((_shifted(labels, -1) != -1).sum())
    assert counted == BATCH * SEQ - 8 - BATCH, "8 ignored labels shifted in, and each row's last position"


def test_a_last_chunk_of_one_token_counts():
    """66 tokens in chunks of 5: the last chunk holds one token, whose label (given, not padded) counts."""
    head, (hidden, labels) = _head(), _inputs()
    given = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    assert (BATCH * SEQ) % 5 == 1
    want = _oracle(hidden, given, head)
    got = _chunked(hidden, labels, head, 5, shifted_labels=given)
    _assert_close(want, got)
    assert got[1][0][-1, -1].abs().sum() > 0, "the last token's hidden state has its gradient"


def test_a_frozen_weight_beside_a_trained_bias_gets_no_gradient_and_the_bias_its_own():
    head, (hidden, labels) = _head(bias=True), _inputs()
    head.weight.requires_grad_(False)
    h = hidden.clone().requires_grad_()
    loss = chunked_causal_lm_loss(h, labels, head, [head.weight, head.bias], 5)
    loss.backward()
    want = _oracle(hidden, _shifted(labels), head)
    assert head.weight.grad is None
    assert (head.bias.grad - want[1][1]).abs().max() <= RTOL * want[1][1].abs().max()


@pytest.mark.parametrize(
    "tokens, hidden_size, vocab, chunk",
    [
        (8192, 4096, 65536, 512),  # exactly 512 tokens of logits: a power of two, kept
        (8192 + 16, 4096, 65536, 1024),  # 513 tokens' worth: the next power of two
        (8191, 4096, 65536, 512),  # 511.94 tokens, rounded up to 512
        (8193, 4096, 65536, 1024),  # 512.06 tokens: rounded up, past the power of two
        (16384, 4096, 65536, 1024),  # exactly 1024
        (1000, 64, 1000, 128),  # 64 tokens' worth: the floor of 128
        (100, 64, 1000, 100),  # the floor, but no more than the tokens there are
        # bounded: no more tokens than make 256 MiB of float32 logits, rounded down to a power of two
        (8192, 4096, 128256, 512),  # Llama-3 at 8k: 262 tokens' worth -> 512, under the bound (523 tokens)
        (65536, 4096, 128256, 512),  # at 64k the hidden states' worth is 4096 tokens (2 GiB of logits): bounded
        (2**20, 4096, 131072, 512),  # the bound is exactly 512 tokens: kept
        (2**20, 4096, 131073, 256),  # 511.99 tokens: rounded down
        (2**20, 4096, 2**20, 128),  # a bound of 64 tokens: the floor of 128 wins
    ],
)
def test_auto_chunk_tokens_at_the_edges_of_its_rounding(tokens, hidden_size, vocab, chunk):
    assert auto_chunk_tokens(tokens, hidden_size, vocab) == chunk


# -- on a real model ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama")
    model.train()
    return model


def _model_loss(model, ids, chunk_tokens, **kwargs):
    """The model's loss and its gradients with the chunked loss installed (chunk_tokens) or not (None)."""
    chunked = ChunkedLoss(chunk_tokens, [model]) if chunk_tokens is not None else None
    if chunked is not None:
        chunked.install()
    try:
        model.zero_grad(set_to_none=True)
        output = model(input_ids=ids, labels=ids, **kwargs)
        output.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return output, grads, chunked
    finally:
        if chunked is not None:
            chunked.remove()


def _ids(seq: int = 37):
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(5))
    ids[:, ::5] = 3  # the ignore_index case below: labels it ignores
    return ids


@pytest.mark.parametrize(
    "kwargs",
    [
        {"shift_labels": torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(9))},
        {"ignore_index": 3},
        {"num_items_in_batch": 50},
    ],
    ids=["shift_labels", "ignore_index", "int-num_items"],
)
def test_the_models_loss_arguments_reach_the_chunks(llama, kwargs):
    """What a caller passes the model for its loss (TRL passes shift_labels; Trainer an int num_items_in_batch)."""
    ids = _ids()
    plain, plain_grads, _ = _model_loss(llama, ids, None, **kwargs)
    run, grads, chunked = _model_loss(llama, ids, 5, **kwargs)
    assert run.logits is None and chunked.chunked_calls == 1 and chunked.last_chunks == (5, 74)
    assert abs(plain.loss - run.loss) <= RTOL * abs(plain.loss)
    for name, grad in plain_grads.items():
        assert (grad - grads[name]).abs().max() <= RTOL * grad.abs().max(), name


def test_auto_chunks_are_sized_from_the_models_tokens_hidden_size_and_vocabulary(llama):
    """37 x 2 tokens, hidden 64, vocabulary 128: 37 tokens' worth of logits, at least 128 tokens, at most 74."""
    ids = _ids()
    _, _, chunked = _model_loss(llama, ids, "auto")
    assert chunked.last_chunks == (auto_chunk_tokens(74, 64, 128), 74) == (74, 74)
    long_ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(5))
    _, _, chunked = _model_loss(llama, long_ids, "auto")
    assert chunked.last_chunks == (512, 600)  # 300 tokens' worth, rounded up to a power of two
