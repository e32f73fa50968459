"""The ``activation_checkpointing`` block and the callbacks' typed requests: one source of truth for the rules.

- :mod:`~lightning_ac.config.schema`: the block's dataclasses (Hydra structured configs too) and :class:`ConfigError`;
- :mod:`~lightning_ac.config.fields`: one parser per kind of field value, shared by the block and the callbacks;
- :mod:`~lightning_ac.config.rules`: the rules across fields (:func:`check_combination`);
- :mod:`~lightning_ac.config.block`: :func:`parse_config`, every form a user can write, validated once;
- :mod:`~lightning_ac.config.requests`: the callbacks' requests and :func:`merge_requests`, which checks the
  combination with the block's own rules.

Every message has one shape: the field as the user wrote it, what it expects, what it got, and the fix. The block's
dataclasses double as Hydra structured configs, so the fields that accept several forms (``selective``, the offload
targets) are typed ``Any`` for OmegaConf and normalised by the parsers.
"""

from lightning_ac.config.block import (
    check_block_key,
    config_to_dict,
    parse_chunked_loss,
    parse_config,
    parse_tiled_mlp,
)
from lightning_ac.config.fields import (
    parse_bool,
    parse_budget,
    parse_count,
    parse_first_plan,
    parse_layers,
    parse_placement,
    parse_size,
    parse_tolerance,
)
from lightning_ac.config.requests import (
    ActivationOffloadRequest,
    CheckpointingRequest,
    LayerOffloadRequest,
    decoder_layer_spec,
    merge_requests,
)
from lightning_ac.config.rules import check_combination, check_offload_targets
from lightning_ac.config.schema import (
    AUTO,
    CHECKPOINT_KWARGS,
    IMPLEMENTATIONS,
    OFFLOAD_TARGETS,
    ActivationCheckpointingConfig,
    ChunkedLossConfig,
    ConfigError,
    OffloadConfig,
    Placement,
    SelectiveConfig,
    TiledMLPConfig,
)

__all__ = [
    "AUTO",
    "ActivationCheckpointingConfig",
    "ActivationOffloadRequest",
    "CHECKPOINT_KWARGS",
    "CheckpointingRequest",
    "ChunkedLossConfig",
    "TiledMLPConfig",
    "ConfigError",
    "IMPLEMENTATIONS",
    "LayerOffloadRequest",
    "OFFLOAD_TARGETS",
    "OffloadConfig",
    "Placement",
    "SelectiveConfig",
    "check_block_key",
    "check_combination",
    "check_offload_targets",
    "config_to_dict",
    "decoder_layer_spec",
    "merge_requests",
    "parse_bool",
    "parse_budget",
    "parse_chunked_loss",
    "parse_tiled_mlp",
    "parse_config",
    "parse_count",
    "parse_first_plan",
    "parse_layers",
    "parse_placement",
    "parse_size",
    "parse_tolerance",
]
