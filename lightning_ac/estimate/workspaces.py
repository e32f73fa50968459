"""The device memory a CUDA training step's libraries allocate once, on first use, and keep: cuBLAS's workspaces.

No tensor of the step holds them, so the fake step does not see them, but the caching allocator does: torch allocates
each cuBLAS workspace through it (``torch.cuda.max_memory_allocated`` counts them) and keeps it for good, one per
handle and stream. torch keeps a handle per thread, and a training step's matmuls run on two: the forward's on the
caller's thread, the backward's on autograd's thread for the device. The H200 read both in a tiny model's first step
(68,039,168 bytes: two of 32 MiB and the step's own 930,304). They are like the parameters: in the device total, not in
the activations a memory budget bounds (:func:`lightning_ac.memory.warm_up_libraries` allocates them before a step
is measured).
"""

from __future__ import annotations

import os
import re
from typing import Optional

__all__ = ["DEFAULT_WORKSPACE_BYTES", "WORKSPACE_THREADS", "cublas_workspace_bytes", "workspace_bytes"]

# torch's default cuBLAS workspace on Hopper and Blackwell (``:4096:8``, KiB x count); older GPUs take 8 MiB and
# 128 KiB (``:4096:2:16:8``): the estimate, which does not know the GPU, takes the larger
DEFAULT_WORKSPACE_BYTES = 4096 * 1024 * 8
# the threads a step's matmuls run on: the forward's (the caller's) and the backward's (autograd's for the device)
WORKSPACE_THREADS = 2
_ALLOCATOR_BLOCK = 512  # the caching allocator rounds each allocation up to a multiple of this


def cublas_workspace_bytes(config: Optional[str] = None) -> int:
    """One cuBLAS workspace's bytes, as torch sizes it: ``config`` (default: the ``CUBLAS_WORKSPACE_CONFIG``
    environment variable) is ``:SIZE:COUNT`` pairs, SIZE in KiB, summed; unset or without a pair (torch warns and
    takes its default), :data:`DEFAULT_WORKSPACE_BYTES`."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG") if config is None else config
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if not pairs:
        return DEFAULT_WORKSPACE_BYTES
    total = sum(int(size) * 1024 * int(count) for size, count in pairs)
    return -(-total // _ALLOCATOR_BLOCK) * _ALLOCATOR_BLOCK


def workspace_bytes(target: str) -> int:
    """What a step on ``target`` (``cuda`` or ``cpu``) holds in library workspaces: a cuBLAS workspace per thread its
    matmuls run on, on CUDA; nothing on the CPU."""
    return WORKSPACE_THREADS * cublas_workspace_bytes() if target == "cuda" else 0
