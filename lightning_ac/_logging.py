"""The one ``lightning_ac`` logger, and the rank-zero channels every message of the suite goes through.

Information goes to :func:`rank_zero_info` (the ``lightning_ac`` logger), warnings to :func:`rank_zero_warn`
(Python's ``warnings``, with a category users can filter), as Lightning's own callbacks do. Both add the
``lightning_ac:`` prefix here, so no message writes its own.
"""

from __future__ import annotations

import logging

from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.rank_zero import rank_zero_warn as _lightning_rank_zero_warn

__all__ = ["LightningACWarning", "log", "rank_zero_info", "rank_zero_warn"]

PREFIX = "lightning_ac: "

log = logging.getLogger("lightning_ac")


class LightningACWarning(UserWarning):
    """A setting that works but costs more, or saves less, than a user would expect."""


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
def rank_zero_info(message: str) -> None:
    """Log ``message`` at INFO on global rank zero only."""
    log.info(PREFIX + message)


def rank_zero_warn(message: str, category: type[Warning] = LightningACWarning, stacklevel: int = 5) -> None:
    """Warn with ``category`` on global rank zero only (Lightning's ``rank_zero_warn``)."""
    _lightning_rank_zero_warn(PREFIX + message, stacklevel=stacklevel, category=category)
