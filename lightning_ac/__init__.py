"""lightning_ac: activation checkpointing and offloading for PyTorch Lightning, driven by one config block."""

# first: importing it checks the installed releases of torch, transformers, peft and Lightning against the tested ranges
from lightning_ac import _compat  # noqa: F401  (isort: skip)
from lightning_ac._logging import LightningACWarning
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
from lightning_ac.selective import (
    SelectiveCheckpointingWarning,
    apply_selective_checkpointing,
    register_mandatory_save,
    register_preferred_save,
)
from lightning_ac.selfcheck import IncompatibleReleaseError, SelfCheckError
from lightning_ac.selfcheck import lightning_hooks as _lightning_hooks  # noqa: F401  (registers the callbacks' check)
from lightning_ac.train_mode import EvalModeError
from lightning_ac.verify import OffloadVerificationError

__version__ = "0.1.0"

__all__ = [
    "ActivationCheckpointing",
    "ActivationCheckpointingConfig",
    "ActivationOffload",
    "ConfigError",
    "EvalModeError",
    "IncompatibleReleaseError",
    "LayerOffload",
    "LightningACWarning",
    "LegacyConfigWarning",
    "OffloadConfig",
    "OffloadVerificationError",
    "Placement",
    "SelectiveCheckpointingWarning",
    "SelectiveConfig",
    "SelfCheckError",
    "apply_selective_checkpointing",
    "register_mandatory_save",
    "register_preferred_save",
    "callbacks_from_config",
    "migrate_legacy",
    "parse_config",
]
