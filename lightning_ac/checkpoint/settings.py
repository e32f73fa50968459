"""What the recompute engines take of the block: the checkpoint function's arguments and which layers recompute."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

__all__ = ["CheckpointSettings"]


@dataclass(frozen=True)
class CheckpointSettings:
    """The recompute engines' part of the block (an ``ActivationCheckpointingConfig`` has the same two attributes,
    and serves where these are asked for).

    Attributes:
        checkpoint_kwargs: The keyword arguments for ``torch.utils.checkpoint.checkpoint``, ``use_reentrant``
            included.
        every_n_layers: Checkpoint every n-th decoder layer.
    """

    checkpoint_kwargs: Dict[str, Any] = field(default_factory=lambda: {"use_reentrant": False})
    every_n_layers: int = 1
