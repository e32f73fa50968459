"""bitsandbytes imported only by a run that uses it (a 4-bit base, its 8-bit AdamW), and then without its import's
log lines on the terminal.

PEFT imports bitsandbytes wherever it is installed: on ``import peft`` (``peft.helpers``, for a helper the estimate
never calls) and when LoRA adapts a layer (to look for bitsandbytes' layer classes). bitsandbytes' import loads its
CPU kernels: about 2 s, and, with transformers' ``kernels`` package beside it, a warning ("Failed to load CPU
gemm_4bit_forward from kernels-community: ...") that reads like a failure of the run. The estimate runs none of
bitsandbytes' kernels (its 4-bit layers run on fake tensors), so PEFT runs :func:`without_bitsandbytes` until a run
needs it, and :func:`import_bitsandbytes` logs what its import says at DEBUG, on the ``lightning_ac.estimate`` logger.
"""

from __future__ import annotations

import logging
import sys
import warnings
from contextlib import contextmanager
from types import ModuleType
from typing import Iterator, List

__all__ = ["import_bitsandbytes", "without_bitsandbytes"]

log = logging.getLogger("lightning_ac.estimate")

BNB = "bitsandbytes"


@contextmanager
def without_bitsandbytes() -> Iterator[None]:
    """Inside, bitsandbytes looks not installed, unless it is imported already: PEFT imports and applies LoRA without
    it. While bitsandbytes is not imported no module can be one of its layers, so the LoRA is the same. On the way
    out PEFT's cached answers to "is bitsandbytes installed?" are forgotten: a 4-bit run later in the process finds
    it."""
    if BNB in sys.modules:  # a 4-bit run's (or the caller's): the model may hold its layers, and PEFT must see them
        yield
        return
    sys.modules[BNB] = None  # Python's way to block an import: it raises ImportError, and find_spec finds nothing
    try:
        yield
    finally:
        if BNB in sys.modules and sys.modules[BNB] is None:
            del sys.modules[BNB]
        _forget_peft_answers()


def _forget_peft_answers() -> None:
    utils = sys.modules.get("peft.import_utils")
    for name in ("is_bnb_available", "is_bnb_4bit_available"):
        cache_clear = getattr(getattr(utils, name, None), "cache_clear", None)  # functools.lru_cache's
        if cache_clear is not None:
            cache_clear()


class _Held(logging.Handler):
    """The log records of bitsandbytes' import, held to be logged again at DEBUG."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname.lower()}: {record.getMessage()}")


def import_bitsandbytes() -> ModuleType:
    """bitsandbytes, for a run that uses it. What its import logs or warns (its CPU kernels failing to load, say) is
    about kernels the estimate does not run: it is logged at DEBUG, not shown.

    Raises:
        ImportError: bitsandbytes is not installed (the caller names the flag that needs it).
    """
    if sys.modules.get(BNB) is not None:
        return sys.modules[BNB]
    held, logger = _Held(), logging.getLogger(BNB)
    propagate = logger.propagate
    logger.addHandler(held)
    logger.propagate = False  # its records reach our handler only, not the root's (nor logging's last resort)
    try:
        with warnings.catch_warnings(record=True) as warned:
            import bitsandbytes
    finally:
        logger.removeHandler(held)
        logger.propagate = propagate
    for line in held.lines + [f"{w.category.__name__}: {w.message}" for w in warned]:
        log.debug("bitsandbytes, on import (about its own kernels, which the estimate does not run): %s", line)
    helpers = sys.modules.get("peft.helpers")
    if helpers is not None and getattr(helpers, "bnb", False) is None:
        helpers.bnb = bitsandbytes  # what PEFT's import would have set, had it not run without_bitsandbytes
    return bitsandbytes
