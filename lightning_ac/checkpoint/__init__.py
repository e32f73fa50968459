"""Recompute engines: transformers' own checkpointing (``hf``) and a torch checkpoint wrapper for plain layers."""

from lightning_ac.checkpoint.hf import enable_hf_checkpointing
from lightning_ac.checkpoint.torch_layers import wrap_layers

__all__ = ["enable_hf_checkpointing", "wrap_layers"]
