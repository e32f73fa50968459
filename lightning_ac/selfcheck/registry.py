"""Which features check themselves, on which packages' releases, how each is turned off, and its check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Optional, Tuple

from lightning_ac.selfcheck.budget_check import check_budget
from lightning_ac.selfcheck.checks import (
    check_activation_checkpointing,
    check_layer_offloading,
    check_offload_all,
    check_offload_hidden_states,
    check_offload_selective,
    check_selective,
)
from lightning_ac.selfcheck.loss_check import check_chunked_loss

__all__ = ["CHECKS", "FEATURES", "Check", "register"]


@dataclass(frozen=True)
class Check:
    """One feature's self-check.

    Attributes:
        packages: The packages whose private behaviour the feature relies on: the check runs when any of them is
            newer than its newest tested release.
        turn_off: How to turn the feature off, in the block's words (``None``: it cannot be, every run uses it).
        run: Called with the other features the plan applies; raises :class:`SelfCheckFailed` (or anything else) when
            the feature does not work on this release.
        method: What the check did, for the error message.
        context: The other features that change what the check checks (it runs again for each combination).
    """

    packages: Tuple[str, ...]
    turn_off: Optional[str]
    run: Callable[[FrozenSet[str]], None]
    method: str = "trained a two-layer toy model one step with {feature} and without it"
    context: FrozenSet[str] = frozenset()


# "callbacks" (the Lightning hooks the suite callbacks implement) is registered by lightning_ac.callbacks, which knows
# them: register()
CHECKS: Dict[str, Check] = {
    "activation_checkpointing": Check(
        ("torch", "transformers"), "activation_checkpointing: false", check_activation_checkpointing
    ),
    "selective": Check(
        ("torch", "transformers"),
        "remove activation_checkpointing.selective",
        check_selective,
        context=frozenset({"offload.hidden_states", "offload.all"}),
    ),
    # transformers too: its layers must call the checkpoint function offload.hidden_states puts in place of torch's
    "offload.hidden_states": Check(
        ("torch", "transformers"), "activation_checkpointing.offload.hidden_states: none", check_offload_hidden_states
    ),
    "offload.selective": Check(("torch",), "activation_checkpointing.offload.selective: none", check_offload_selective),
    "offload.all": Check(("torch",), "activation_checkpointing.offload.all: none", check_offload_all),
    "layer_offloading": Check(("torch",), "layer_offloading: false", check_layer_offloading),
    # transformers too: its layers must call the checkpoint function the budget gives each of them
    "budget": Check(
        ("torch", "transformers"),
        "remove activation_checkpointing.budget",
        check_budget,
        "ran the memory budget's measuring step on a two-layer toy model and trained it one step without the budget",
    ),
    # transformers only: its causal LMs' forward and loss are what the chunks stand in for
    "chunked_loss": Check(
        ("transformers",),
        "activation_checkpointing.chunked_loss: false",
        check_chunked_loss,
        "trained a two-layer toy model one step with its loss in one chunk and without it",
    ),
}

FEATURES: Tuple[str, ...] = ("callbacks", *CHECKS)
"""The features that check themselves, in the block's words."""


def register(
    feature: str,
    packages: Tuple[str, ...],
    turn_off: Optional[str],
    run: Callable[[FrozenSet[str]], None],
    method: str,
) -> None:
    """Add the self-check of ``feature``, which relies on private behaviour of ``packages``.

    Args:
        feature: A name from :data:`FEATURES`.
        packages: The packages whose release decides whether the check runs.
        turn_off: How to turn the feature off, in the block's words (``None``: every run uses it).
        run: Called with the other features in force; raises when the feature does not work on the installed
            releases (:class:`SelfCheckFailed` with one sentence of what was found).
        method: What the check does, as the error says it ("ran ...").
    """
    if feature not in FEATURES:
        raise ValueError(f"{feature!r} is not a self-checked feature ({', '.join(FEATURES)})")
    CHECKS[feature] = Check(packages, turn_off, run, method)
