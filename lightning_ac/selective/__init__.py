"""Selective activation checkpointing: policy, save rules, plugin registry and diagnostics."""

from lightning_ac.selective.apply import apply_selective_checkpointing
from lightning_ac.selective.policy import SelectiveCheckpointingWarning, SelectivePolicy
from lightning_ac.selective.registry import RegisteredSave, register_mandatory_save, register_preferred_save

__all__ = [
    "RegisteredSave",
    "SelectiveCheckpointingWarning",
    "SelectivePolicy",
    "apply_selective_checkpointing",
    "register_mandatory_save",
    "register_preferred_save",
]
