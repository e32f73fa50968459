"""Behaviour mutants of the chunked loss (loss/function.py, loss/install.py): see :mod:`tests.mutation`."""

from __future__ import annotations

from typing import List

from mutation import Equivalent, Mutant

FUNCTION = "lightning_ac/loss/function.py"
INSTALL = "lightning_ac/loss/install.py"
X = "tests/test_loss_exact.py::"
C = "tests/test_chunked_loss.py::"

MUTANTS: List[Mutant] = [
    Mutant(
        FUNCTION,
        "grad_hidden = saved.pop(0).mul(grad_loss) if ctx.has_hidden else None",
        "grad_hidden = saved.pop(0) if ctx.has_hidden else None",
        "backward ignores the incoming gradient for the hidden states: a scaled loss (accumulation) trains too fast",
        (X + "test_backward_scales_the_gradients_by_the_incoming_gradient",),
    ),
    Mutant(
        FUNCTION,
        "grad_params[position] = grad.mul(grad_loss)",
        "grad_params[position] = grad",
        "backward ignores the incoming gradient for the head's parameters",
        (X + "test_backward_scales_the_gradients_by_the_incoming_gradient",),
    ),
    Mutant(
        FUNCTION,
        "scale = torch.ones((), dtype=torch.float32, device=denominator.device) / denominator",
        "scale = torch.ones((), dtype=torch.float32, device=denominator.device)",
        "the gradients are the summed loss's, not the mean's: as many times too large as there are tokens",
        (X + "test_backward_scales_the_gradients_by_the_incoming_gradient",),
    ),
    Mutant(
        FUNCTION,
        "targets = shifted_labels if shifted_labels is not None else shift_labels(labels, ignore_index)",
        "targets = shift_labels(labels, ignore_index)",
        "labels the caller shifted (shift_labels) are shifted again: every token is trained on the wrong target",
        (X + "test_labels_shifted_by_the_caller_are_taken_as_they_are",),
    ),
    Mutant(
        FUNCTION,
        "denominator = torch.tensor(num_items_in_batch, device=flat_hidden.device)",
        "denominator = (targets != ignore_index).sum().to(torch.float32)",
        "an integer num_items_in_batch is ignored: the loss is the micro-batch's mean, not the accumulated one's",
        (X + "test_an_integer_num_items_in_batch_divides_the_sum",),
    ),
    Mutant(
        FUNCTION,
        'F.cross_entropy(logits.float(), piece_targets, ignore_index=ignore_index, reduction="sum")',
        'F.cross_entropy(logits.float(), piece_targets, reduction="sum")',
        "another ignore_index is not ignored by the chunks",
        (X + "test_another_ignore_index_is_ignored_and_pads_the_shift",),
    ),
    Mutant(
        FUNCTION,
        "return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()",
        "return F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()",
        "the shift pads each row's last position with -100 whatever the ignore_index",
        (X + "test_another_ignore_index_is_ignored_and_pads_the_shift",),
    ),
    Mutant(
        FUNCTION,
        "for start in range(0, hidden.shape[0], chunk_tokens):",
        "for start in range(0, hidden.shape[0] - 1, chunk_tokens):",
        "a last chunk of one token is dropped: its loss and its hidden state's gradient are lost",
        (X + "test_a_last_chunk_of_one_token_counts",),
    ),
    Mutant(
        FUNCTION,
        "ctx.param_positions = [positions[i] for i in computed]",
        "ctx.param_positions = computed",
        "a trained bias beside a frozen weight gets its gradient at the weight's place",
        (X + "test_a_frozen_weight_beside_a_trained_bias_gets_no_gradient_and_the_bias_its_own",),
    ),
    Mutant(
        FUNCTION,
        'ops += [("div", softcap), ("tanh", None), ("mul", softcap)]',
        'ops += [("tanh", None), ("mul", softcap)]',
        "Gemma's soft-capping loses its division: the capped logits are wrong",
        (C + "test_the_loss_matches_transformers_causal_lm_loss",),
    ),
    Mutant(
        INSTALL,
        "wanted = max(1, -(-tokens * hidden_size // vocab_size))",
        "wanted = max(1, tokens * hidden_size // vocab_size)",
        "chunk_tokens: auto rounds the hidden states' worth of logits down: chunks half as large past a power of two",
        (X + "test_auto_chunk_tokens_at_the_edges_of_its_rounding",),
    ),
    Mutant(
        INSTALL,
        "max(MIN_AUTO_CHUNK_TOKENS, 1 << (wanted - 1).bit_length())",
        "max(MIN_AUTO_CHUNK_TOKENS, 1 << wanted.bit_length())",
        "chunk_tokens: auto doubles a chunk that is exactly a power of two",
        (X + "test_auto_chunk_tokens_at_the_edges_of_its_rounding",),
    ),
    Mutant(
        INSTALL,
        "chunk = min(chunk, max(MIN_AUTO_CHUNK_TOKENS, 1 << (bounded.bit_length() - 1)))",
        "chunk = min(chunk, max(MIN_AUTO_CHUNK_TOKENS, 1 << bounded.bit_length()))",
        "chunk_tokens: auto rounds its bound up: chunks past the fixed size of float32 logits",
        (X + "test_auto_chunk_tokens_at_the_edges_of_its_rounding",),
    ),
    Mutant(
        INSTALL,
        "chunk = min(chunk, max(MIN_AUTO_CHUNK_TOKENS, 1 << (bounded.bit_length() - 1)))",
        "chunk = min(chunk, 1 << (bounded.bit_length() - 1))",
        "chunk_tokens: auto goes below its floor for a vast vocabulary (matmuls too small to run at speed)",
        (X + "test_auto_chunk_tokens_at_the_edges_of_its_rounding",),
    ),
    Mutant(
        INSTALL,
        "bounded = MAX_AUTO_CHUNK_LOGIT_BYTES // (4 * vocab_size)",
        "bounded = MAX_AUTO_CHUNK_LOGIT_BYTES // (2 * vocab_size)",
        "chunk_tokens: auto bounds two-byte logits, but the loss upcasts them to float32: chunks twice the size",
        (X + "test_auto_chunk_tokens_at_the_edges_of_its_rounding",),
    ),
    Mutant(
        INSTALL,
        "tokens = auto_chunk_tokens(hidden.shape[:-1].numel(), hidden.shape[-1], vocab_size)",
        "tokens = auto_chunk_tokens(hidden.shape[:-1].numel(), vocab_size, hidden.shape[-1])",
        "chunk_tokens: auto sizes chunks from the vocabulary over the hidden size: whole logits for a real vocabulary",
        (X + "test_auto_chunks_are_sized_from_the_models_tokens_hidden_size_and_vocabulary",),
    ),
    Mutant(
        INSTALL,
        'shifted_labels=kwargs.get("shift_labels"),',
        "shifted_labels=None,",
        "shift_labels passed to the model is dropped: the labels are shifted again",
        (X + "test_the_models_loss_arguments_reach_the_chunks",),
    ),
    Mutant(
        INSTALL,
        'ignore_index=kwargs.get("ignore_index", -100),',
        "ignore_index=-100,",
        "an ignore_index passed to the model is dropped",
        (X + "test_the_models_loss_arguments_reach_the_chunks",),
    ),
    Mutant(
        INSTALL,
        'num_items_in_batch=kwargs.get("num_items_in_batch"),',
        "num_items_in_batch=None,",
        "num_items_in_batch passed to the model is dropped: gradient accumulation's loss is the micro-batch's mean",
        (X + "test_the_models_loss_arguments_reach_the_chunks",),
    ),
    Mutant(
        INSTALL,
        "if call is None or call.hidden is not None or args or kwargs:",
        "if True:",
        "the chunked loss silently never applies: the model builds its whole logits, as without the suite",
        (C + "test_models",),
    ),
]

EQUIVALENT: List[Equivalent] = []
