"""Where the memory budget's figures come from beyond one process: the ranks' agreement (every rank must recompute
the same layers) and ``budget: auto``'s reading of the device."""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from lightning_ac._logging import rank_zero_info
from lightning_ac.units import format_bytes

__all__ = ["AUTO_MARGIN", "agree", "auto_budget"]

# budget: auto leaves this fraction of the device's memory free (fragmentation, the allocator's rounding, other
# processes' growth)
AUTO_MARGIN = 0.10


def auto_budget(device: torch.device) -> int:
    """The memory free on ``device`` now, plus what the allocator holds unused, less :data:`AUTO_MARGIN` of the
    total."""
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    budget = int(free + cached - AUTO_MARGIN * total)
    rank_zero_info(
        f"budget auto: {format_bytes(budget)} (free {format_bytes(free + cached)} of {format_bytes(total)}, less "
        f"{AUTO_MARGIN:.0%} of it)"
    )
    return max(budget, 1)


def agree(values: List[float], device: torch.device) -> List[float]:
    """``values`` as every rank sees them: the largest of each across the ranks (as they are without any)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return values
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    on = device if dist.get_backend() != "gloo" else torch.device("cpu")
    with unset_fake_temporarily():  # in the fake step too, the ranks agree on real numbers
        tensor = torch.tensor(values, dtype=torch.float64, device=on)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()
