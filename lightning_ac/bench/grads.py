"""Each mode's gradients against its reference's, compared as soon as the mode has run.

A mode's float32 gradients are as large as the model (4.4 GB for the ``gpu-8k`` preset's 1B Llama). Kept for a
comparison at the end, 28 modes of them filled the H200 machine's 125 GiB of host memory and the kernel killed the
benchmark before it wrote its table. Here only the references' gradients are kept (``off``'s, and ``lora_full``'s for
the layer-offloading rows); every other mode's are reduced to one figure, the largest difference, and dropped.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

__all__ = ["GradientDiffs", "REFERENCES"]

# The reference of each mode: the layer-offloading rows (LoRA) are compared with lora_full, the others with off
REFERENCES = ("off", "lora_full")


class GradientDiffs:
    """The largest gradient difference of each mode against its reference, computed when the mode's gradients come.

    Args:
        reference_of: The reference mode's name for a mode (``off`` or ``lora_full``), ``None`` for a mode compared
            with nothing (the floor, which trains another loss).
    """

    def __init__(self, reference_of: Callable[[str], Optional[str]]) -> None:
        self.reference_of = reference_of
        self.diffs: Dict[str, Optional[float]] = {}
        self._references: Dict[str, Dict[str, torch.Tensor]] = {}
        self._scales: Dict[str, float] = {}  # each reference's largest gradient, which a difference is relative to

    def add(self, mode: str, grads: Optional[Dict[str, torch.Tensor]]) -> None:
        """Take ``mode``'s gradients: a reference's are kept (its own difference is 0); any other mode's are compared
        with its reference's at once and not kept. A mode whose reference has not run (or failed) gets no figure."""
        if grads is None:
            return
        if mode in REFERENCES:
            self._references[mode] = grads
            self._scales[mode] = max(float(g.abs().max()) for g in grads.values())
            self.diffs[mode] = 0.0
            return
        reference = self._references.get(self.reference_of(mode) or "")
        self.diffs[mode] = None if reference is None else _max_diff(grads, reference)

    def diff(self, mode: str) -> Optional[float]:
        """``mode``'s largest gradient difference, ``None`` when it has none."""
        return self.diffs.get(mode)

    def scale(self, mode: str) -> Optional[float]:
        """The largest gradient of ``mode``'s reference (a bf16 tolerance is relative to it), ``None`` without one."""
        return self._scales.get(self.reference_of(mode) or "") if self.diffs.get(mode) is not None else None

    @property
    def held_bytes(self) -> int:
        """What the comparison holds in host memory: the references' gradients only."""
        return sum(g.numel() * g.element_size() for grads in self._references.values() for g in grads.values())


def _max_diff(grads: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> float:
    return max(float((grads[name] - g).abs().max()) for name, g in reference.items())
