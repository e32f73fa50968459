"""What a Trainer the suite runs for itself (the Lightning hook check's one-step fit, the estimator's fake step)
needs: the user's ``PL_TRAINER_*`` variables set aside, and Lightning's own lines about it kept out of the user's
log."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

__all__ = ["lightning_quiet", "without_trainer_environment"]


@contextlib.contextmanager
def without_trainer_environment() -> Iterator[None]:
    """The user's ``PL_TRAINER_*`` variables set aside: Lightning reads them as the defaults of every Trainer's
    arguments, and the probe's must be its own (``PL_TRAINER_LIMIT_TRAIN_BATCHES=0.5`` makes its one-batch fit raise).
    They are put back as they were, whatever happens."""
    saved = {name: value for name, value in os.environ.items() if name.startswith("PL_TRAINER_")}
    for name in saved:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def lightning_quiet() -> Iterator[None]:
    """Lightning's own lines about the probe's Trainer (its devices, barebones mode) are not the user's run's."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
