"""Self-checks: on a release of torch, transformers or Lightning newer than the ones lightning_ac was tested with,
each feature that relies on their private behaviour proves itself on a toy model before the user's first step.

``pyproject.toml`` admits every release up to the next major one, so that installing lightning_ac never replaces a
user's torch; a few features are built on behaviour that torch, transformers and Lightning do not promise to keep
(SAC's caching and cached dispatch modes and their storage layout, whether SAC's saves reach saved-tensor hooks,
which tensors a checkpoint saves outside its region, the checkpoint function transformers' layers call, the saved-
tensor hooks in force and MemTracker's records that the memory budget measures with, the Lightning hooks the
callbacks implement). On a tested release the test suite covers them and nothing runs here. On a newer one, the
first time the plan applies a feature, its check trains a two-layer Llama (hidden size 16, built from a config, on
the CPU: a few milliseconds) one step with the feature and without it, compares the loss and every gradient bit for
bit, and checks that the feature did what it is for (layers recomputed through the checkpoint function the suite
gives them, attention kept, tensors moved to the host and back, weights streamed, each layer measured). A failure
raises :class:`IncompatibleReleaseError`, naming the feature, the release and what to do, before anything trains; a
check that could not run on the machine (out of host memory) raises :class:`SelfCheckError`, which says so instead.

The checks run in isolation: the caller's random state, default device and dtype are left as they were, and the
toy is thrown away. Run every check by hand with ``python -m lightning_ac.selfcheck``.

The modules: :mod:`~lightning_ac.selfcheck.verdict` (the errors and their messages),
:mod:`~lightning_ac.selfcheck.toy` (the toy model and what is measured on it), :mod:`~lightning_ac.selfcheck.checks`
and :mod:`~lightning_ac.selfcheck.budget_check` (the checks), :mod:`~lightning_ac.selfcheck.registry` (which
feature has which check), :mod:`~lightning_ac.selfcheck.runner` (running one), :mod:`~lightning_ac.selfcheck.cli`
(``python -m``); here, when they run.
"""

from __future__ import annotations

from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

from lightning_ac._compat import untested_release
from lightning_ac._logging import rank_zero_info
from lightning_ac.selfcheck.cli import main
from lightning_ac.selfcheck.registry import CHECKS as _CHECKS
from lightning_ac.selfcheck.registry import FEATURES, register
from lightning_ac.selfcheck.runner import run_check
from lightning_ac.selfcheck.verdict import IncompatibleReleaseError, SelfCheckError, SelfCheckFailed

__all__ = [
    "FEATURES",
    "IncompatibleReleaseError",
    "SelfCheckError",
    "SelfCheckFailed",
    "ensure",
    "features_of",
    "main",
    "register",
    "run_check",
]

# (feature, the other features that changed what it checked) -> seconds the check took, in this process
_passed: Dict[Tuple[str, FrozenSet[str]], float] = {}


def features_of(
    enabled: bool,
    selective: bool,
    offload_targets: Sequence[str],
    layer_offloading: bool,
    budget: bool = False,
    chunked_loss: bool = False,
) -> List[str]:
    """The self-checked features a plan applies.

    Args:
        enabled: Whether decoder layers are recomputed.
        selective: Whether a selective policy decides what they save.
        offload_targets: The activation-offload targets in force (``hidden_states``, ``selective``, ``all``).
        layer_offloading: Whether frozen layer weights are streamed.
        budget: Whether a memory budget chooses what each layer does.
        chunked_loss: Whether the loss is computed in chunks.
    """
    found = ["callbacks"]
    found += ["activation_checkpointing"] if enabled else []
    found += ["selective"] if enabled and selective else []
    found += [f"offload.{target}" for target in offload_targets]
    found += ["layer_offloading"] if layer_offloading else []
    found += ["budget"] if enabled and budget else []
    found += ["chunked_loss"] if chunked_loss else []
    return found


def ensure(features: Iterable[str], installed: Optional[Dict[str, Optional[str]]] = None) -> None:
    """Run the self-check of each feature that relies on a release newer than the tested ones, once per process.

    Args:
        features: Names from :data:`FEATURES` (:func:`features_of`).
        installed: ``package -> version`` to judge instead of what is installed (tests).

    Raises:
        IncompatibleReleaseError: If a feature's check fails on such a release.
        SelfCheckError: If a check could not run on this machine (it runs again next time).
    """
    features = frozenset(features)
    for feature in sorted(features, key=FEATURES.index):
        check = _CHECKS[feature]
        newer = {p: r for p in check.packages if (r := untested_release(p, installed)) is not None}
        others = features & check.context
        if not newer or (feature, others) in _passed:
            continue
        _passed[feature, others] = seconds = run_check(feature, newer, others)
        on = ", ".join(f"{p} {r}" for p, r in newer.items())
        rank_zero_info(f"self-check of {feature} on {on} (newer than the tested releases): passed in {seconds:.2f} s")
