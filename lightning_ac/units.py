"""Sizes in bytes: the units the suite reads and prints, and its one default that is a size."""

from __future__ import annotations

import re
from typing import Dict, Optional

__all__ = ["DEFAULT_HOST_RESERVE_BYTES", "GiB", "KiB", "MiB", "SIZE_UNITS", "format_bytes", "size_from_text"]

KiB, MiB, GiB = 2**10, 2**20, 2**30

# What a size written as text may end with: decimal and binary units, matched in any case.
SIZE_UNITS: Dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")

# Host memory the offload engines leave to the rest of the machine (ActivationOffload's and LayerOffload's
# host_reserve_bytes)
DEFAULT_HOST_RESERVE_BYTES = 2 * GiB


def format_bytes(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps the number at 1 or more (``512 B``, ``1.5 MiB``)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


def size_from_text(text: str) -> Optional[int]:
    """The bytes ``text`` names (``"24GiB"``, ``"300 MB"``; a number and one of :data:`SIZE_UNITS`), rounded down to a
    whole byte; ``None`` when it is not a number with a known unit. The config's ``parse_size`` says what is wrong."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in SIZE_UNITS:
        return None
    return int(float(match.group(1)) * SIZE_UNITS[unit])
