"""LightningCLI with the suite's errors in front: a rejected callback argument ends the command with the
:class:`~lightning_ac.ConfigError` message and exit status 2, as jsonargparse's own parse errors do.

jsonargparse builds ``trainer.callbacks`` by trying each type of its ``Union`` in turn, so a ``ConfigError`` raised by
a suite callback's ``__init__`` would reach the user as "Does not validate against any of the Union subtypes", our
message among the other subtypes' failures, under a traceback. Needs ``pip install "jsonargparse[signatures]"``.
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Any, Iterator, Optional

from lightning.pytorch.cli import LightningCLI as _LightningCLI

from lightning_ac.config import ConfigError

__all__ = ["LightningCLI", "config_error_in", "exit_on_config_error"]

# "ActivationOffload(hidden_states=...): ..." - a callback argument, as the suite's messages name one
_ARGUMENT = re.compile(r"^(ActivationCheckpointing|ActivationOffload|LayerOffload)\((\w+)=")


def config_error_in(error: BaseException) -> Optional[ConfigError]:
    """The :class:`~lightning_ac.ConfigError` that ``error`` is or was raised from (its ``__cause__`` and
    ``__context__`` chain, which jsonargparse keeps), ``None`` if there is none."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ConfigError):
            return current
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return None


def _where_in_the_config(message: str) -> str:
    """Where a callback argument the message names sits in a LightningCLI config, or ``""``."""
    match = _ARGUMENT.match(message)
    if match is None:
        return ""
    callback, argument = match.groups()
    return (
        f"\n(In a LightningCLI config, {callback}({argument}=...) is init_args.{argument} of the trainer.callbacks "
        f"entry with class_path: lightning_ac.{callback}; on the command line --trainer.callbacks.{argument}=...)"
    )


@contextlib.contextmanager
def exit_on_config_error() -> Iterator[None]:
    """Turn a :class:`~lightning_ac.ConfigError` raised inside the block (directly, or wrapped by jsonargparse or
    anything else that chains exceptions) into its message on stderr and ``SystemExit(2)``: a bad value is the
    user's to fix, and a traceback would bury what to fix. Other exceptions pass through unchanged.

    Example::

        with exit_on_config_error():
            MyLightningCLI(MyModel, MyData)
    """
    try:
        yield
    except Exception as error:
        found = config_error_in(error)
        if found is None:
            raise
        print(f"error: {found}{_where_in_the_config(str(found))}", file=sys.stderr)
        raise SystemExit(2) from None


class LightningCLI(_LightningCLI):
    """Lightning's :class:`~lightning.pytorch.cli.LightningCLI`, taking the same arguments, where a
    :class:`~lightning_ac.ConfigError` (a suite callback's argument rejected when the callbacks are built, or a
    combination rejected in ``setup``) ends the command with its message and exit status 2 instead of a traceback
    (see :func:`exit_on_config_error`). Subclass it as you would Lightning's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with exit_on_config_error():
            super().__init__(*args, **kwargs)
