"""The ``lightning_ac`` logger, set up the way Lightning sets up its own, and rank-zero helpers."""

from __future__ import annotations

import logging

from lightning.pytorch.utilities.rank_zero import rank_zero_only

log = logging.getLogger("lightning_ac")
if not logging.getLogger().hasHandlers() and not log.handlers:
    # Like lightning.pytorch: visible by default in a plain script, left to the application when it
    # configures logging itself (Hydra does).
    log.setLevel(logging.INFO)
    log.addHandler(logging.StreamHandler())
    log.propagate = False


@rank_zero_only
def rank_zero_log(message: str, level: int = logging.INFO) -> None:
    """Log ``message`` on global rank zero only."""
    log.log(level, message)
