"""The ``lightning_ac`` logger and rank-zero helpers."""

from __future__ import annotations

import logging

from lightning.pytorch.utilities.rank_zero import rank_zero_only

log = logging.getLogger("lightning_ac")


class _WhenUnconfigured(logging.Filter):
    # Visible by default in a plain script (like Lightning's own messages); once the application configures
    # logging (Hydra does, after import), records go to its handlers only.
    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers


if not log.handlers:
    _handler = logging.StreamHandler()
    _handler.addFilter(_WhenUnconfigured())
    log.addHandler(_handler)
    log.setLevel(logging.INFO)


@rank_zero_only
def rank_zero_log(message: str, level: int = logging.INFO) -> None:
    """Log ``message`` on global rank zero only."""
    log.log(level, message)
