"""Recompute engines: transformers' own checkpointing (``hf``) and torch's checkpoint around each layer's forward.

Both take the checkpoint function to use (``torch.utils.checkpoint.checkpoint`` or a wrapper of it).
"""

from lightning_ac.checkpoint.forward import wrap_layers
from lightning_ac.checkpoint.hf import enable_hf_checkpointing
from lightning_ac.checkpoint.settings import CheckpointSettings

__all__ = ["CheckpointSettings", "enable_hf_checkpointing", "wrap_layers"]
