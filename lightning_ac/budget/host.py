"""What offloading a decoder layer's input costs the memory budget (``offload.hidden_states: auto``): the copy
rates of this device's host link, measured once at setup, the host memory the offloaded inputs may hold, and the time
an input's copies add to a step where the layer's compute does not hide them.

An offloaded layer's input goes to host memory while the forward goes on (a side stream: the layer's own forward runs
beside the copy) and comes back in backward while the layer after it runs its backward and recompute (prefetched, about
twice a forward's work). What either copy takes past the compute that hides it is added to the step; so is the
recompute the layer then runs, as for any recomputed layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from lightning_ac._logging import rank_zero_info
from lightning_ac.budget.choice import LayerFigures
from lightning_ac.offload.device import host_limit

__all__ = ["CopyRates", "PROBE_BYTES", "host_room", "measure_copy_rates", "offload_pricing", "offload_seconds"]

# The probe measuring the copy rates: large enough that a copy's fixed cost does not dominate, small enough to take
# from the device and the host at setup without notice.
PROBE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class CopyRates:
    """A host link's measured pace.

    Attributes:
        to_host: Bytes a second from the device to pinned host memory.
        to_device: Bytes a second back.
    """

    to_host: float
    to_device: float


def measure_copy_rates(device: torch.device, nbytes: int = PROBE_BYTES) -> CopyRates:
    """The best of three pinned copies of ``nbytes`` each way between ``device`` and the host. On the CPU (the
    simulated asynchronous device, where the engines' copies are host copies) a plain copy between two host buffers,
    each way."""
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        wait = lambda: torch.cuda.synchronize(device)  # noqa: E731
    else:
        host = torch.empty(nbytes, dtype=torch.uint8)
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        wait = lambda: None  # noqa: E731
    rates = []
    for dst, src in ((host, on_device), (on_device, host)):
        best = float("inf")
        for _ in range(3):
            wait()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            wait()
            best = min(best, time.perf_counter() - start)
        rates.append(nbytes / max(best, 1e-9))
    return CopyRates(to_host=rates[0], to_device=rates[1])


def offload_seconds(figures: LayerFigures, rates: CopyRates) -> float:
    """The time recomputing a layer with its input in host memory adds to a step: its recompute, and what its input's
    copies take past the compute that hides them (its forward the copy out, the next layer's backward and recompute,
    about twice a forward, the copy back)."""
    forward = figures.recompute_seconds
    out = figures.input_bytes / rates.to_host
    back = figures.input_bytes / rates.to_device
    return forward + max(0.0, out - forward) + max(0.0, back - 2 * forward)


def host_room(reserve_bytes: int) -> Optional[int]:
    """The host memory offloaded inputs may hold: ``MemAvailable`` less the offload's reserve, read at setup; ``None``
    where it cannot be read."""
    return host_limit(reserve_bytes)


def offload_pricing(runtime: Any, device: torch.device) -> Dict[str, Any]:
    """:class:`~lightning_ac.budget.settings.BudgetSettings`' ``copy_rates`` and ``host_bytes`` for
    ``offload.hidden_states: auto``, from the activation-offload runtime (``None`` where none is installed); empty
    where a layer's input in host memory frees nothing on the device (copies on the host itself: a CPU device), said
    in one line: the budget then recomputes instead."""
    engine = getattr(runtime, "engine", None)
    if engine is None or not engine.asynchronous:
        rank_zero_info(
            f"budget: offload.hidden_states: auto: on {device.type} a layer's input in host memory frees nothing on "
            "the device (host memory is the device's): the budget keeps, saves selectively or recomputes instead"
        )
        return {}
    return {"copy_rates": measure_copy_rates(device), "host_bytes": host_room(engine.host.host_reserve_bytes)}
