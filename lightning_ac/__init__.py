"""lightning_ac: activation checkpointing and offloading for PyTorch Lightning, driven by one config block."""

from lightning_ac.callbacks import ActivationCheckpointing, ActivationOffload, LayerOffload, callbacks_from_config
from lightning_ac.config import (
    ActivationCheckpointingConfig,
    ConfigError,
    OffloadConfig,
    Placement,
    SelectiveConfig,
    parse_config,
)
from lightning_ac.legacy import LegacyConfigWarning, migrate_legacy

__version__ = "0.1.0"

__all__ = [
    "ActivationCheckpointing",
    "ActivationCheckpointingConfig",
    "ActivationOffload",
    "ConfigError",
    "LayerOffload",
    "LegacyConfigWarning",
    "OffloadConfig",
    "Placement",
    "SelectiveConfig",
    "callbacks_from_config",
    "migrate_legacy",
    "parse_config",
]
