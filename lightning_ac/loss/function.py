"""The causal-LM loss a chunk of tokens at a time: the output head's logits never exist whole.

For each chunk of the final hidden states, the head's logits are computed (and, for Gemma-family models, soft-capped
as the model does), upcast to float32 as transformers' ``ForCausalLMLoss`` does, and their cross-entropy summed; the
gradients of that chunk (for the hidden states and for each trainable parameter of the head) are computed at once,
in the forward, and the chunk's logits freed before the next. What backward receives is the loss's gradient, a
scalar: it scales the gradients the forward computed. No matmul runs twice: recomputing each chunk's logits in
backward instead would run the head's largest matmul once more (one of its three with a trainable head, one of two
with a frozen one).

With one chunk holding every token, the forward and each gradient run the same kernels in the same order as the
model's own loss, and the results are bit-identical when the loss's gradient is 1 (a loss divided by the
accumulation steps scales the gradients once more, in another order: within float rounding). With more chunks,
the chunks' sums add in another order: the loss is equal within float rounding.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F

from lightning_ac.loss.source import LogitOp, apply_logit_ops

__all__ = ["chunked_causal_lm_loss", "shift_labels"]


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def shift_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """As transformers' ``ForCausalLMLoss``: tokens ``< n`` predict ``n``; the last position predicts nothing."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


# The module-level registries nn.Module's call reads for global hooks (torch.nn.modules.module)
_GLOBAL_MODULE_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


@contextlib.contextmanager
def _no_global_module_hooks() -> Iterator[None]:
    """Module calls inside see no global module hook (the registries are put back as they were, same objects, so
    the trackers' handles stay valid)."""
    from torch.nn.modules import module

    saved = {name: getattr(module, name) for name in _GLOBAL_MODULE_HOOKS if hasattr(module, name)}
    try:
        for name in saved:
            setattr(module, name, collections.OrderedDict())
        yield
    finally:
        for name, registry in saved.items():
            setattr(module, name, registry)


class _ChunkedHeadLoss(torch.autograd.Function):
    """``loss = sum over chunks of cross_entropy(head(hidden[chunk]), labels[chunk], reduction="sum") / denominator``,
    with the gradients computed chunk by chunk in the forward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        denominator: torch.Tensor,
        chunk_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        chunk_tokens: int,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        wants_hidden = ctx.needs_input_grad[0]
        wanted = [p for p, needs in zip(params, ctx.needs_input_grad[5:]) if needs]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        grad_params: List[Optional[torch.Tensor]] = [None] * len(wanted)
        # d(loss)/d(chunk sum): as the model's own mean (or sum / num_items_in_batch) gives its cross-entropy
        scale = torch.ones((), dtype=torch.float32, device=denominator.device) / denominator
        total: Optional[torch.Tensor] = None
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, hidden.shape[0])
            # What the chunk's graph saves is freed with it, within this call: no saved-tensor hooks of the run
            # (offloading, the budget's counting) see it.
            # Nor do global module hooks: a module tracker (torch's ModTracker, under MemTracker and the memory
            # budget's measuring step) that sees a module called inside the chunk (a trained head: PEFT's
            # modules_to_save wrapper calls its copy as a module) hooks its tensors for backward, and this backward,
            # run inside the model's forward, breaks its bookkeeping (it raises, or resets what it tracks).
            with (
                torch.enable_grad(),
                torch.autograd.graph.saved_tensors_hooks(_plain, _plain),
                _no_global_module_hooks(),
            ):
                piece = hidden[start:end].detach().requires_grad_(wants_hidden)
                loss = chunk_loss(piece, labels[start:end])
                inputs = ([piece] if wants_hidden else []) + wanted
                grads = torch.autograd.grad(loss, inputs, grad_outputs=scale, allow_unused=True) if inputs else ()
            loss = loss.detach()
            total = loss if total is None else total + loss
            if wants_hidden:
                assert grad_hidden is not None
                grad_hidden[start:end] = grads[0] if grads[0] is not None else 0
                grads = grads[1:]
            for index, grad in enumerate(grads):
                if grad is None:
                    continue
                if grad_params[index] is None:
                    # a low-precision weight's gradient adds up in float32 over the chunks, as the one matmul of
                    # the whole logits would accumulate it
                    several = end < hidden.shape[0]
                    grad_params[index] = grad.float() if several and grad.element_size() < 4 else grad
                else:
                    grad_params[index].add_(grad)  # type: ignore[union-attr]
        assert total is not None
        grad_params = [g.to(p.dtype) if g is not None else None for g, p in zip(grad_params, wanted)]
        # Saved for backward, so that what the run does with saved tensors (offloading them, counting them) sees
        # what this loss holds from the forward to the backward.
        computed = [index for index, grad in enumerate(grad_params) if grad is not None]
        ctx.save_for_backward(*([grad_hidden] if grad_hidden is not None else []), *(grad_params[i] for i in computed))
        ctx.has_hidden = grad_hidden is not None
        # where each saved parameter gradient goes among the parameters
        positions = [k for k, needs in enumerate(ctx.needs_input_grad[5:]) if needs]
        ctx.param_positions = [positions[i] for i in computed]
        ctx.param_count = len(params)
        return total / denominator

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> Any:  # type: ignore[override]
        saved = list(ctx.saved_tensors)
        grad_hidden = saved.pop(0).mul(grad_loss) if ctx.has_hidden else None
        grad_params: List[Optional[torch.Tensor]] = [None] * ctx.param_count
        for position, grad in zip(ctx.param_positions, saved):
            grad_params[position] = grad.mul(grad_loss)
        return (grad_hidden, None, None, None, None, *grad_params)


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    params: Sequence[torch.Tensor],
    chunk_tokens: int,
    *,
    ignore_index: int = -100,
    num_items_in_batch: Any = None,
    shifted_labels: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    logit_ops: Sequence[LogitOp] = (),
) -> torch.Tensor:
    """The causal-LM loss of ``head(hidden)`` against ``labels``, as transformers' ``ForCausalLMLoss`` computes it,
    without the whole logits.

    Args:
        hidden: The final hidden states, ``(..., hidden_size)``.
        labels: The labels, ``hidden.shape[:-1]``; shifted here unless ``shifted_labels`` is given.
        head: Computes a chunk's logits from a chunk of hidden states (the model's ``lm_head``).
        params: The head's parameters that train (their gradients are computed here).
        chunk_tokens: Tokens per chunk.
        ignore_index: Labels that count for nothing.
        num_items_in_batch: When given (gradient accumulation), the loss is the sum over the tokens divided by it;
            else the mean over the tokens not ignored.
        shifted_labels: Already shifted labels (transformers' ``shift_labels``).
        softcap: The model's ``final_logit_softcapping``: ``logits = tanh(logits / softcap) * softcap``.
        logit_ops: What the model's forward does to its head's output before its loss, in order
            (:func:`~lightning_ac.loss.source.logit_ops`): ``("mul", s)``, ``("div", s)``, ``("tanh", None)``.

    Returns:
        The loss, a float32 scalar whose backward gives ``hidden`` and ``params`` their gradients.
    """
    targets = shifted_labels if shifted_labels is not None else shift_labels(labels, ignore_index)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(flat_hidden.device)
    if num_items_in_batch is None:
        denominator = (targets != ignore_index).sum().to(torch.float32)
    elif torch.is_tensor(num_items_in_batch):
        denominator = num_items_in_batch.to(flat_hidden.device)
    else:
        denominator = torch.tensor(num_items_in_batch, device=flat_hidden.device)

    ops = list(logit_ops)
    if softcap is not None:  # as Gemma's forward does, in the logits' dtype
        ops += [("div", softcap), ("tanh", None), ("mul", softcap)]

    def chunk_loss(piece: torch.Tensor, piece_targets: torch.Tensor) -> torch.Tensor:
        logits = apply_logit_ops(head(piece), ops)
        return F.cross_entropy(logits.float(), piece_targets, ignore_index=ignore_index, reduction="sum")

    return _ChunkedHeadLoss.apply(flat_hidden, targets, denominator, chunk_loss, int(chunk_tokens), *params)
