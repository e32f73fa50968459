"""Whether a step fits a device, with a stated margin, and the longest sequence each mode fits.

The estimate counts the bytes the step's tensors hold (what ``torch.cuda.max_memory_allocated`` reports, with each
allocation rounded to the allocator's 512-byte blocks), and, with a CUDA target, cuBLAS's workspaces, which its
first matmuls allocate through the allocator and keep (:mod:`~lightning_ac.estimate.workspaces`). A device needs more
than that: the CUDA context and the libraries' handles live outside the allocator, and the caching allocator reserves
more than it allocates (fragmentation: blocks split and cached between steps). Until a GPU measures it, the margin is
an assumption (:data:`MARGIN_NOTE`): :data:`CONTEXT_BYTES` plus :data:`FRAGMENTATION` of the allocated peak.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from lightning_ac.estimate.results import LongestFit, StepEstimate

__all__ = ["CONTEXT_BYTES", "FRAGMENTATION", "MARGIN_NOTE", "fits", "longest_fit", "margin_bytes"]

CONTEXT_BYTES = 1 * 2**30  # the CUDA context and the libraries' handles: outside the allocator
FRAGMENTATION = 0.05  # reserved beyond allocated, as a share of the allocated peak
MARGIN_NOTE = (
    f"fits: the device total plus an assumed margin of {CONTEXT_BYTES / 2**30:.0f} GiB (CUDA context and the "
    f"libraries' handles, outside the allocator; cuBLAS's workspaces are in the device total) and {FRAGMENTATION:.0%} "
    "of the device total (the caching allocator reserves more than it allocates); an assumption until a GPU measures "
    "reserved minus allocated"
)


def margin_bytes(device_total: int) -> int:
    """The margin assumed beyond ``device_total`` allocated bytes."""
    return CONTEXT_BYTES + int(FRAGMENTATION * device_total)


def fits(step: StepEstimate, device_memory: int) -> bool:
    """Whether ``step``'s device total and its margin fit ``device_memory`` bytes."""
    return step.device_total_bytes + margin_bytes(step.device_total_bytes) <= device_memory


def longest_fit(
    mode: str,
    known: List[StepEstimate],
    run: Callable[[int], StepEstimate],
    device_memory: int,
    step: int = 512,
    upper: int = 2**20,
) -> LongestFit:
    """The longest multiple of ``step`` tokens at which ``mode`` fits ``device_memory``, found with fake steps.

    The device total grows about linearly with the length (flash attention keeps no S x S matrix), so the next
    length tried is where the line through the two lengths nearest the boundary reaches the device (a secant),
    rounded down to ``step``; once a guess lands, its neighbour one ``step`` away settles it (as it does when the line
    puts the boundary within a step of a length already tried). Every length is judged by a fake step of its own
    (``run``), never by the line.

    Args:
        mode: The mode's name.
        known: Steps of this mode already estimated (at the lengths asked for).
        run: A fake step of this mode at a length.
        device_memory: The device's size in bytes.
        step: The granularity of the answer.
        upper: The longest length searched (``limited`` when the mode fits it).
    """
    seen = {s.seq: s for s in known}

    def ok(seq: int) -> bool:
        if seq not in seen:
            seen[seq] = run(seq)
        return fits(seen[seq], device_memory)

    multiples = sorted(s for s in seen if s % step == 0)
    lo = max((s for s in multiples if ok(s)), default=0)  # the longest length known to fit (0: none yet)
    hi = min((s for s in multiples if s > lo and not ok(s)), default=None)  # the shortest known not to
    if lo == 0 and (hi is None or hi > step):
        if not ok(step):
            return LongestFit(mode, device_memory, 0, step)
        lo = step
    neighbour: Optional[int] = None  # the length that settles a guess that just landed
    while hi is None or hi - lo > step:
        if lo >= upper:
            return LongestFit(mode, device_memory, lo, step, limited=True)
        settling, guess = neighbour is not None, neighbour or _secant(seen, lo, hi, device_memory, step)
        if hi is None:
            guess = min(guess if guess > lo else 2 * lo, upper)
        elif not lo < guess < hi:  # the line puts the boundary within a step of one end: try that end's neighbour
            settling, guess = True, lo + step if guess <= lo else hi - step
        fitted = ok(guess)
        lo, hi = (guess, hi) if fitted else (lo, guess)
        # a guess of the line's is settled by its neighbour; a neighbour that did not settle it leaves the line to
        # guess again, from the nearer points
        neighbour = None if settling else guess + step if fitted else guess - step if guess - step > lo else None
    return LongestFit(mode, device_memory, lo, step)


def _secant(seen: Dict[int, StepEstimate], lo: int, hi: Optional[int], device_memory: int, step: int) -> int:
    """Where the line through the two lengths nearest the boundary reaches the device, as a multiple of ``step``
    (``2 * lo`` when no line can be drawn)."""
    points = sorted((s, e.device_total_bytes + margin_bytes(e.device_total_bytes)) for s, e in seen.items())
    below = [p for p in points if p[0] <= lo]
    above = [p for p in points if hi is not None and p[0] >= hi]
    pair = [below[-1], above[0]] if above and below else below[-2:]
    if len(pair) < 2 or pair[1][0] == pair[0][0] or pair[1][1] <= pair[0][1]:
        return 2 * lo
    (s0, t0), (s1, t1) = pair
    guess = s0 + (device_memory - t0) * (s1 - s0) / (t1 - t0)
    return int(guess // step * step)
