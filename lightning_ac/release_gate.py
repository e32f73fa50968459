"""The release gate: on a release of torch, transformers or Lightning newer than the tested ones, each feature that
relies on their private behaviour checks itself, once per process, before it acts.

The gate knows the features, which packages each relies on, and when its check must run. The checks themselves
(:mod:`lightning_ac.selfcheck`, which trains a toy model with the engines) sit above the engines and register here
when ``lightning_ac`` is imported; an engine asks the gate (:func:`ensure`) before it acts and imports nothing of the
checks, so the layering runs one way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

from lightning_ac._compat import untested_release
from lightning_ac._logging import rank_zero_info

__all__ = ["FEATURES", "Check", "CHECKS", "ensure", "features_of", "register", "run_check", "set_runner"]

FEATURES: Tuple[str, ...] = (
    "callbacks",
    "activation_checkpointing",
    "selective",
    "offload.hidden_states",
    "offload.selective",
    "offload.all",
    "layer_offloading",
    "budget",
    "chunked_loss",
)
"""The features that check themselves, in the block's words, in the order their checks run."""

DEFAULT_METHOD = "trained a two-layer toy model one step with {feature} and without it"


@dataclass(frozen=True)
class Check:
    """One feature's self-check.

    Attributes:
        packages: The packages whose private behaviour the feature relies on: the check runs when any of them is
            newer than its newest tested release.
        turn_off: How to turn the feature off, in the block's words (``None``: it cannot be, every run uses it).
        run: Called with the other features the plan applies; raises ``SelfCheckFailed`` (or anything else) when
            the feature does not work on this release.
        method: What the check did, for the error message.
        context: The other features that change what the check checks (it runs again for each combination).
    """

    packages: Tuple[str, ...]
    turn_off: Optional[str]
    run: Callable[[FrozenSet[str]], None]
    method: str = DEFAULT_METHOD
    context: FrozenSet[str] = frozenset()


CHECKS: Dict[str, Check] = {}
"""The registered check of each feature (:func:`register`)."""

# Runs one feature's check and returns its seconds (lightning_ac.selfcheck's run_check, set when it is imported).
Runner = Callable[[str, Optional[Dict[str, str]], Optional[Iterable[str]]], float]
_runner: Optional[Runner] = None
# (feature, the other features that changed what it checked) -> seconds the check took, in this process
_passed: Dict[Tuple[str, FrozenSet[str]], float] = {}


def register(
    feature: str,
    packages: Tuple[str, ...],
    turn_off: Optional[str],
    run: Callable[[FrozenSet[str]], None],
    method: str = DEFAULT_METHOD,
    context: FrozenSet[str] = frozenset(),
) -> None:
    """Add the self-check of ``feature``, which relies on private behaviour of ``packages``.

    Args:
        feature: A name from :data:`FEATURES`.
        packages: The packages whose release decides whether the check runs.
        turn_off: How to turn the feature off, in the block's words (``None``: every run uses it).
        run: Called with the other features in force; raises when the feature does not work on the installed
            releases (``SelfCheckFailed`` with one sentence of what was found).
        method: What the check does, as the error says it ("ran ...").
        context: The other features that change what the check checks.
    """
    if feature not in FEATURES:
        raise ValueError(f"{feature!r} is not a self-checked feature ({', '.join(FEATURES)})")
    CHECKS[feature] = Check(packages, turn_off, run, method, context)


def set_runner(runner: Runner) -> None:
    """Set what runs one check (:func:`lightning_ac.selfcheck.run_check`: isolated, its outcome a verdict)."""
    global _runner
    _runner = runner


def run_check(feature: str, releases: Optional[Dict[str, str]] = None, others: Optional[Iterable[str]] = None) -> float:
    """Run ``feature``'s check with the registered runner; the seconds it took."""
    if _runner is None:
        raise RuntimeError("no self-check runner is registered: import lightning_ac, whose package registers it")
    return _runner(feature, releases, others)


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
        check = CHECKS[feature]
        newer = {p: r for p in check.packages if (r := untested_release(p, installed)) is not None}
        others = features & check.context
        if not newer or (feature, others) in _passed:
            continue
        _passed[feature, others] = seconds = run_check(feature, newer, others)
        on = ", ".join(f"{p} {r}" for p, r in newer.items())
        rank_zero_info(f"self-check of {feature} on {on} (newer than the tested releases): passed in {seconds:.2f} s")
