"""The causal-LM loss computed a chunk of tokens at a time (the block's ``chunked_loss``): for a real vocabulary the
output head's logits, their float32 upcast and their gradient hold most of a step's activation memory."""

from lightning_ac.loss.function import chunked_causal_lm_loss
from lightning_ac.loss.install import ChunkedLoss

__all__ = ["ChunkedLoss", "chunked_causal_lm_loss"]
