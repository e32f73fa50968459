"""What a self-check's outcome says: the errors it raises, and their messages (the release broke the feature, or the
check could not run here, for a reason that is not the release's)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from lightning_ac._compat import TESTED, tested_range, untested_release

__all__ = [
    "IncompatibleReleaseError",
    "SelfCheckError",
    "SelfCheckFailed",
    "could_not_run",
    "environment_trouble",
    "failure",
]


class IncompatibleReleaseError(RuntimeError):
    """A feature's self-check failed on a release of torch, transformers or Lightning that lightning_ac was not tested
    with: the feature would not do what it says there."""


class SelfCheckError(RuntimeError):
    """A feature's self-check could not run on this machine (host memory, the file system...): it says nothing about
    the release, and the feature is not known to work on it."""


class SelfCheckFailed(Exception):
    """What a check found wrong, in one sentence."""


def environment_trouble(error: BaseException) -> Optional[Tuple[str, str]]:
    """What ``error``, raised inside a check, says about the machine, and what to do about it (``None``: nothing, so
    it is the release's doing).

    The toy needs a few KiB of host memory (offloaded with no reserve kept) and no files: running short of memory, or
    the operating system refusing a request, is the machine's state, which a release does not change.
    """
    from lightning_ac.offload.device import HostMemoryError

    if isinstance(error, (HostMemoryError, MemoryError)) or "can't allocate memory" in str(error):
        return "the host has no memory left for a toy model of a few KiB", "Free host memory and run again"
    if isinstance(error, OSError):
        return "the operating system refused a request", "Fix what it names and run again"
    return None


def _on(releases: Dict[str, str]) -> str:
    return ", ".join(f"{p} {r}" for p, r in releases.items())


def failure(
    feature: str, packages: Tuple[str, ...], turn_off: Optional[str], method: str, releases: Dict[str, str], found: str
) -> str:
    """The message of :class:`IncompatibleReleaseError`: ``feature``'s check (which ``method`` says) found ``found`` on
    ``releases``."""
    newer = [p for p in releases if untested_release(p, releases) is not None]
    tested = "; ".join(tested_range(p) for p in (newer or releases))
    status = "newer than the releases lightning_ac was tested with" if newer else "tested"
    off = f"turn {feature} off ({turn_off})" if turn_off else ""
    if newer:
        pins = " ".join(f"'{p}<={TESTED[p][1]}'" for p in newer)
        fix = f"Install a tested release (pip install {pins})" + (f", or {off}." if off else ".")
    else:  # only by hand (python -m lightning_ac.selfcheck, tests): a tested release that fails is our bug
        fix = "This is a bug of lightning_ac on a tested release: please report it with this message" + (
            f"; meanwhile {off}." if off else "."
        )
    return (
        f"lightning_ac: {feature} does not work with {_on(releases)} ({status}: {tested}). Its self-check "
        f"{method.format(feature=feature)}, and {found}. {feature} relies on behaviour of "
        f"{' and '.join(packages)} that is not part of {'its' if len(packages) == 1 else 'their'} public "
        f"API, so training with it would not do what it says. {fix}"
    )


def could_not_run(feature: str, releases: Dict[str, str], trouble: Tuple[str, str], found: str) -> str:
    """The message of :class:`SelfCheckError`: ``feature``'s check stopped on ``found``, which says ``trouble`` (what
    went wrong, and the fix) about the machine."""
    what, fix = trouble
    return (
        f"lightning_ac: the self-check of {feature} could not run on this machine: {what} ({found}). This is not "
        f"{_on(releases)} breaking {feature}: the check stopped before it could tell whether {feature} works there. "
        f"{fix} (python -m lightning_ac.selfcheck {feature} runs the check alone)."
    )
