"""What depends on the release of torch, transformers, peft or Lightning, in one place.

The supported ranges are the ones the default test run passed with (``nox -s oldest``, ``nox -s newest``); a release
outside them fails at import with a message that names the range, instead of failing (or hanging) in step 1.
Inside them, the branches:

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
"""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Any, Dict, Optional, Tuple

import torch
from packaging.version import Version

__all__ = [
    "CHECKPOINT_TAKES_RESPECT_HOOKS",
    "SAC_STORAGE_INDEXED",
    "SUPPORTED",
    "cached_dispatch_mode",
    "check_versions",
    "sac_saves_bypass_saved_tensor_hooks",
]

# package -> (lowest supported, first unsupported or None): what the test runs passed with. The upper bound of torch
# is the newest release tested, since selective checkpointing's storage and policy are private torch APIs.
SUPPORTED: Dict[str, Tuple[str, Optional[str]]] = {
    "torch": ("2.9.1", "2.15"),
    "transformers": ("5.23.0", "6"),
    "peft": ("0.18.0", None),
    "lightning": ("2.6.0", "2.7"),
}

CHECKPOINT_TAKES_RESPECT_HOOKS = (
    "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
)

# torch >= 2.13: storage[op] maps invocation index -> entry; before: a FIFO list of the saved entries
SAC_STORAGE_INDEXED = hasattr(torch.utils.checkpoint, "_sac_storage_key")


def _installed(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _range(package: str) -> str:
    low, high = SUPPORTED[package]
    return f">={low}" + (f",<{high}" if high else "")


def check_versions(installed: Optional[Dict[str, Optional[str]]] = None) -> None:
    """Raise ``ImportError`` naming the supported range when an installed release is outside it.

    Args:
        installed: ``package -> version`` to check instead of what is installed (tests).
    """
    for package, (low, high) in SUPPORTED.items():
        found = installed[package] if installed is not None else _installed(package)
        if found is None:
            continue  # not installed: pip's dependency resolution reports it, not us
        release = Version(Version(found).base_version)  # 2.13.0+cpu -> 2.13.0
        if release < Version(low) or (high is not None and release >= Version(high)):
            supported = f"{package}{_range(package)}"
            raise ImportError(
                f"lightning_ac supports {supported} (the releases its tests pass with), but {package} {found} is "
                f"installed. Install a supported release: pip install '{supported}'."
            )


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


check_versions()  # at import: a release outside the tested ranges fails here, naming the range
