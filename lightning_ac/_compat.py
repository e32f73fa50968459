"""What depends on the release of torch, transformers, peft or Lightning, in one place.

:data:`TESTED` holds, for each package, the lowest release the default test run passed with (``nox -s oldest``) and
the newest (``nox -s newest``). Below the lowest, importing lightning_ac fails, naming the range: those releases are
known to fail. Above the newest, importing warns once (a :class:`~lightning_ac.LightningACWarning`, rank zero) and
each feature that relies on private behaviour of that package checks itself the first time it is applied
(:mod:`lightning_ac.selfcheck`), so that a release that broke it fails before the first step, naming the feature,
instead of training wrong. ``pyproject.toml`` caps only at the next major release, so that installing lightning_ac
never replaces a user's newer torch.

The branches inside the tested ranges:

- torch >= 2.14: a SAC region's caching mode has ``respect_saved_tensors_hooks`` (``checkpoint``'s argument of
  that name sets it, but only on a ``context_fn``'s own mode, and ours wraps it): whether what selective
  checkpointing saves goes through the saved-tensor hooks in force. We set ``False``, today's behaviour and the one
  offload.selective, offload.hidden_states/all and layer offloading are built on: SAC's saves are moved by
  offload.selective's own storage, never a second time by a hook. Older releases always bypass the hooks.
- SAC's storage (which offload.selective replaces with a host-resident one): torch >= 2.13 keys each op's saves by
  invocation index (``storage[op][i] = entry``, with markers for recomputed and consumed entries) and no longer
  consults the policy in the recompute; older releases keep a queue per op (``storage[op].append(entry)``, popped
  from the front in the recompute, where the policy is asked again with ``ctx.is_recompute`` set).
  :data:`SAC_STORAGE_INDEXED` tells them apart.
- ``_CachedTorchDispatchMode`` (the recompute side of SAC's storage) takes ``allow_cache_entry_mutation``
  explicitly: the argument exists in every supported release, its default does not; and the policy, which releases
  before 2.13 call.
- dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint`` (added after torch 2.9.0): with it on, dynamo traces a
  checkpoint inside a compiled graph whose forward has Python side effects (transformers >= 5.25's ``kernels``
  wrapper around each attention's forward has one), applying them once, in the forward; without it, it breaks the
  graph at the checkpoint. The plan turns it on for a run that recomputes inside compiled graphs
  (:func:`lightning_ac.plan.recompute.trace_side_effects_in_checkpoints`); :data:`DYNAMO_SKIPS_CHECKPOINT_SIDE_EFFECTS`
  says whether this torch has it.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Any, Dict, Optional, Tuple

import torch
import torch._dynamo.config
from packaging.version import Version

__all__ = [
    "CHECKPOINT_SIDE_EFFECTS_SETTING",
    "CHECKPOINT_TAKES_RESPECT_HOOKS",
    "DYNAMO_SKIPS_CHECKPOINT_SIDE_EFFECTS",
    "SAC_STORAGE_INDEXED",
    "SAC_POLICY_SEES_OUTPUT",
    "SELF_CHECKED",
    "TESTED",
    "cached_dispatch_mode",
    "check_versions",
    "installed_release",
    "sac_saves_bypass_saved_tensor_hooks",
    "tested_range",
    "untested_release",
]

# package -> (lowest release tested, newest release tested): the ends of what the default test run passed with.
TESTED: Dict[str, Tuple[str, str]] = {
    "torch": ("2.9.1", "2.15.0"),
    "transformers": ("5.23.0", "5.25.0"),
    "peft": ("0.18.0", "0.21.2"),
    "lightning": ("2.6.0", "2.6.6"),
}

# The packages whose behaviour outside their public API some feature relies on: those features check themselves on a
# newer release (lightning_ac.selfcheck). Of peft only public API is used (its tuner layer classes).
SELF_CHECKED = ("torch", "transformers", "lightning")

CHECKPOINT_TAKES_RESPECT_HOOKS = (
    "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
)

# torch >= 2.13: storage[op] maps invocation index -> entry; before: a FIFO list of the saved entries
SAC_STORAGE_INDEXED = hasattr(torch.utils.checkpoint, "_sac_storage_key")

# torch >= 2.13: SAC asks the policy about an op after running it, and hands it the output (what the policy saves is
# known there, without a dispatch mode of ours); before: the policy is asked first, without the output
SAC_POLICY_SEES_OUTPUT = "op_output" in inspect.signature(torch.utils.checkpoint.SelectiveCheckpointContext).parameters

# torch after 2.9.0: dynamo's setting that traces a checkpoint whose forward has Python side effects, applying them
# once, in the forward; before, dynamo breaks the graph at such a checkpoint
CHECKPOINT_SIDE_EFFECTS_SETTING = "skip_fwd_side_effects_in_bwd_under_checkpoint"
DYNAMO_SKIPS_CHECKPOINT_SIDE_EFFECTS = hasattr(torch._dynamo.config, CHECKPOINT_SIDE_EFFECTS_SETTING)


def installed_release(package: str) -> Optional[str]:
    """The installed release of ``package`` (``2.15.0+cu130``), or ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(package: str, installed: Optional[Dict[str, Optional[str]]]) -> Optional[str]:
    return installed.get(package) if installed is not None else installed_release(package)


def tested_range(package: str) -> str:
    """The tested releases of ``package``, as messages name them: ``torch 2.9.1 to 2.15.0``."""
    low, high = TESTED[package]
    return f"{package} {low} to {high}"


def _newer_than_tested(package: str, found: str) -> bool:
    version, newest = Version(found), Version(TESTED[package][1])
    release = Version(version.base_version)  # 2.15.0+cu130 -> 2.15.0, 2.16.0.dev20261201 -> 2.16.0
    # a pre-release or nightly of the newest tested release is not that release
    return release > newest or (release == newest and (version.is_prerelease or version.is_devrelease))


def untested_release(package: str, installed: Optional[Dict[str, Optional[str]]] = None) -> Optional[str]:
    """The installed release of ``package`` if it is newer than the newest tested one, else ``None``.

    Args:
        package: A key of :data:`TESTED`.
        installed: ``package -> version`` to judge instead of what is installed (tests).
    """
    found = _release(package, installed)
    return found if found is not None and _newer_than_tested(package, found) else None


def check_versions(installed: Optional[Dict[str, Optional[str]]] = None) -> Dict[str, str]:
    """Fail for a release below the tested ones; warn (rank zero) for each release newer than the tested ones.

    Args:
        installed: ``package -> version`` to check instead of what is installed (tests).

    Returns:
        ``package -> release`` for each package newer than the newest tested release.

    Raises:
        ImportError: If an installed release is older than the oldest tested one, naming the tested range.
    """
    newer: Dict[str, str] = {}
    for package, (low, _) in TESTED.items():
        found = _release(package, installed)
        if found is None:
            continue  # not installed: pip's dependency resolution reports it, not us
        if Version(Version(found).base_version) < Version(low):
            raise ImportError(
                f"lightning_ac needs {package}>={low}, but {package} {found} is installed; older releases are known "
                f"to fail its tests (tested: {tested_range(package)}). Upgrade: pip install '{package}>={low}'."
            )
        if _newer_than_tested(package, found):
            newer[package] = found
    for package, found in newer.items():
        from lightning_ac._logging import rank_zero_warn  # imports Lightning, whose release is checked above

        guard = (
            "Each feature that relies on its private behaviour checks itself on a toy model the first time it is "
            "applied, and raises IncompatibleReleaseError before the first step if it is broken."
            if package in SELF_CHECKED
            else "lightning_ac uses only its public API; please report what fails."
        )
        rank_zero_warn(
            f"{package} {found} is newer than the releases lightning_ac was tested with ({tested_range(package)}). "
            f"{guard} To silence this warning, install a tested one: pip install '{package}<={TESTED[package][1]}'.",
            # the user's import line: past Lightning's rank_zero_warn (3 frames), ours, this function, this module's
            # import and lightning_ac/__init__'s (warnings skips importlib's frames)
            stacklevel=8,
        )
    return newer


def sac_saves_bypass_saved_tensor_hooks(forward_mode: Any) -> None:
    """Tell a SAC region's caching mode that what it saves bypasses the saved-tensor hooks in force (torch >= 2.14
    asks, and would otherwise warn and, in a later release, route the saves through the hooks)."""
    if CHECKPOINT_TAKES_RESPECT_HOOKS and hasattr(forward_mode, "respect_saved_tensors_hooks"):
        forward_mode.respect_saved_tensors_hooks = False


def cached_dispatch_mode(policy_fn: Any, storage: Any) -> Any:
    """SAC's recompute-side dispatch mode over ``storage`` (``policy_fn`` is the region's policy: releases before
    2.13 ask it again in the recompute)."""
    from torch.utils.checkpoint import _CachedTorchDispatchMode

    return _CachedTorchDispatchMode(policy_fn, storage, False)


check_versions()  # at import: an older release fails here, naming the range; a newer one warns (once: import runs once)
