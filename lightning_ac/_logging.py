"""The one ``lightning_ac`` logger, and the rank-zero channels every message of the suite goes through.

Information goes to :func:`rank_zero_info` (the ``lightning_ac`` logger), warnings to :func:`rank_zero_warn`
(Python's ``warnings``, with a category users can filter), as Lightning's own callbacks do. Both add the
``lightning_ac:`` prefix here, so no message writes its own.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import warnings
from types import FrameType
from typing import Optional, Tuple

from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.rank_zero import rank_zero_warn as _lightning_rank_zero_warn

__all__ = ["LightningACWarning", "log", "rank_zero_info", "rank_zero_warn", "user_frame"]

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


# Where a warning of ours is not the user's line: these packages, and the standard library in between (contextlib,
# functools). The warning names the first frame outside them: the user's trainer.fit, LightningCLI(...) or import.
_LIBRARIES = (
    "lightning_ac",
    "lightning",
    "lightning_fabric",
    "lightning_utilities",
    "pytorch_lightning",
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "bitsandbytes",
    "jsonargparse",
    "hydra",
    "omegaconf",
)


def _library_dirs() -> Tuple[str, ...]:
    dirs = []
    for name in _LIBRARIES:
        module = sys.modules.get(name)  # a library not imported has no frame on the stack
        for path in getattr(module, "__path__", None) or ():
            dirs.append(os.path.join(os.path.realpath(path), ""))
    return tuple(dirs)


def _is_stdlib(filename: str) -> bool:
    paths = sysconfig.get_paths()
    installed = tuple(os.path.join(os.path.realpath(paths[k]), "") for k in ("purelib", "platlib"))
    return filename.startswith(os.path.join(os.path.realpath(paths["stdlib"]), "")) and not filename.startswith(
        installed
    )


def user_frame(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The first frame, from ``frame`` outwards, in neither the libraries the suite runs under nor the standard library
    (``"<frozen importlib._bootstrap>"`` frames included); the outermost frame if every one is."""
    libraries = _library_dirs()
    outermost = frame
    while frame is not None:
        filename = frame.f_code.co_filename
        real = os.path.realpath(filename)
        if not (filename.startswith("<") or real.startswith(libraries) or _is_stdlib(real)):
            return frame
        outermost, frame = frame, frame.f_back
    return outermost


@rank_zero_only
def _warn_at(message: str, category: type[Warning], frame: Optional[FrameType]) -> None:
    if frame is None:  # pragma: no cover - no Python frame above us
        warnings.warn(message, category, stacklevel=2)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module_globals.get("__name__", "<string>"),
        registry=module_globals.setdefault("__warningregistry__", {}),
        module_globals=module_globals,
    )


def rank_zero_warn(
    message: str, category: type[Warning] = LightningACWarning, stacklevel: Optional[int] = None
) -> None:
    """Warn with ``category`` on global rank zero only (as Lightning's ``rank_zero_warn``).

    Args:
        message: The message, without the ``lightning_ac:`` prefix.
        category: The warning's category, which users filter on.
        stacklevel: ``None`` (default): the warning names the user's line that led to it (:func:`user_frame`), not
            the suite's module that noticed it. A number: Lightning's ``stacklevel``, counted from its own frames.
    """
    if stacklevel is not None:
        _lightning_rank_zero_warn(PREFIX + message, stacklevel=stacklevel, category=category)
        return
    _warn_at(PREFIX + message, category, user_frame(sys._getframe(1)))
