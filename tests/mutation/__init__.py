"""The mutants of ``tests/mutants.py``: small, plausible bugs, each of which some default test must catch.

Two kinds:

- the transfer code's synchronisation points (:mod:`sync`), found in the source: each mutant removes one;
- behaviour mutants, listed by hand per part of the package (:mod:`loss`, :mod:`budget`, :mod:`measure`,
  :mod:`estimate`): each replaces one piece of text, found exactly once in its file, and names the default tests
  that must fail with it.

A mutant that no test can tell from the code (an equivalent mutant) is not listed as a mutant: it goes in its
part's ``EQUIVALENT``, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

__all__ = ["Equivalent", "Mutant"]


@dataclass(frozen=True)
class Mutant:
    """One bug, put into a copy of the package.

    Attributes:
        path: The file, relative to the repository root.
        original: Text that occurs exactly once in the file (a stale mutant, whose text moved, stops the run).
        replacement: What it becomes.
        what: The bug, in a few words (what a user would get).
        tests: The pytest node ids (or files) that must fail with it; default tests only.
    """

    path: str
    original: str
    replacement: str
    what: str
    tests: Tuple[str, ...]


@dataclass(frozen=True)
class Equivalent:
    """A change that looks like a bug but cannot change what any caller gets.

    Attributes:
        path: The file, relative to the repository root.
        original: The text it would replace.
        replacement: What it would become.
        why: Why no test can tell it from the code.
    """

    path: str
    original: str
    replacement: str
    why: str
