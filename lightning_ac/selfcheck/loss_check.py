"""The chunked loss's self-check: the toy's training step with its loss in chunks, as the plan installs it.

The chunked loss relies on transformers behaviour that is not an API: a causal LM's ``forward`` computes its logits
with ``self.lm_head(...)``, passes them on to ``self.loss_function(...)`` (which the chunks stand in for), and
``ForCausalLMLoss`` shifts the labels, upcasts to float32 and takes the mean over the tokens not ignored (which the
chunks reproduce). On a release that changed any of it the chunks would compute another loss, or none.
"""

from __future__ import annotations

import copy
import inspect
from typing import FrozenSet

from lightning_ac.config import ConfigError
from lightning_ac.selfcheck.toy import same_as, toy, train_step
from lightning_ac.selfcheck.verdict import SelfCheckFailed

__all__ = ["check_chunked_loss"]

# what the chunks take from the calls of transformers' causal-LM loss
_LOSS_ARGUMENTS = ("logits", "labels", "vocab_size", "num_items_in_batch", "ignore_index", "shift_labels")


def check_chunked_loss(others: FrozenSet[str]) -> None:
    """One chunk of every token trains the toy bit for bit as its own loss does, through the model's
    ``loss_function``, and returns no logits; transformers' causal-LM loss takes the arguments the chunks read."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lightning_ac.loss import ChunkedLoss

    what = "the chunked loss"
    found = tuple(inspect.signature(ForCausalLMLoss).parameters)
    missing = [name for name in _LOSS_ARGUMENTS if name not in found]
    if missing:
        raise SelfCheckFailed(
            f"transformers' ForCausalLMLoss no longer takes {', '.join(missing)} (it takes {', '.join(found)}): "
            f"{what} reads them from the model's call"
        )
    model, ids = toy()
    reference = train_step(copy.deepcopy(model), ids)
    try:
        loss = ChunkedLoss(ids.numel(), [model])
    except ConfigError as error:  # the model's forward no longer goes from its head to its loss_function
        raise SelfCheckFailed(f"{what} refused transformers' own LlamaForCausalLM: {error}") from None
    loss.install()
    logits = []
    handle = model.register_forward_hook(lambda module, args, output: logits.append(output.logits))
    try:
        step = train_step(model, ids)
    finally:
        handle.remove()
        loss.remove()
    if loss.chunked_calls != 1 or logits != [None]:
        raise SelfCheckFailed(
            f"{what} computed {loss.chunked_calls} losses in one training forward and the model returned "
            f"{'no logits' if logits == [None] else 'logits'}: the model no longer calls self.loss_function with what "
            "its output head computed"
        )
    same_as(reference, step, what)
