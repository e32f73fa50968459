"""Which mode to use under an activation-memory budget, from measured benchmark rows.

Activation memory of these modes is a sum of per-token terms (with flash/SDPA attention nothing grows with
the square of the sequence), so the estimate for another length scales the measured peak by the number of
tokens. The rule is checked, not assumed: the benchmark also measures every mode at half the sequence,
predicts the full-size peak from it, and reports how far the prediction was from the measurement. The
planner widens each mode's estimate by that error before comparing it with the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from lightning_ac.offload.device import format_bytes

__all__ = ["Choice", "plan_mode", "scaling_errors"]


@dataclass
class Choice:
    """A mode's estimate at the planned size."""

    mode: str
    kind: str
    estimate_bytes: int
    margin: float  # relative error of the scaling rule measured for this mode
    step_time_s: Optional[float]
    fits: bool


def scaling_errors(full: Sequence, half: Sequence, ratio: float = 2.0) -> Dict[str, float]:
    """Relative error of predicting each mode's full-size peak from its half-size peak, scaled by ``ratio``: the
    tokens of the full size over those measured at half (2 for an even sequence, 33 / 16 for ``--seq 33``)."""
    halves = {r.mode: r.peak_activation_bytes for r in half if r.peak_activation_bytes}
    errors = {}
    for row in full:
        if row.peak_activation_bytes and row.mode in halves:
            errors[row.mode] = (ratio * halves[row.mode] - row.peak_activation_bytes) / row.peak_activation_bytes
    return errors


def plan_mode(
    rows: Sequence,
    budget_bytes: int,
    measured_tokens: int,
    planned_tokens: int,
    errors: Optional[Dict[str, float]] = None,
) -> List[Choice]:
    """Every measured mode's estimate at ``planned_tokens``, fastest first; ``fits`` against the budget."""
    errors = errors or {}
    choices = []
    for row in rows:
        if row.peak_activation_bytes is None or row.step_time_s is None or row.status != "ok":
            continue
        margin = abs(errors.get(row.mode, 0.0))
        estimate = int(row.peak_activation_bytes * planned_tokens / measured_tokens)
        fits = estimate * (1 + margin) <= budget_bytes
        choices.append(Choice(row.mode, row.kind, estimate, margin, row.step_time_s, fits))
    return sorted(choices, key=lambda c: c.step_time_s or float("inf"))


def _size(nbytes: int, decimals: int = 2) -> str:
    """GiB with ``decimals`` decimals, or a smaller unit where that would show zero (a budget of 0.001 GiB)."""
    if nbytes >= 0.5 * 10**-decimals * 2**30:
        return f"{nbytes / 2**30:.{decimals}f} GiB"
    return format_bytes(nbytes)


def _setting(nbytes: int) -> str:
    """A size as the ``budget`` field takes it: ``24GiB``, ``1.27KiB``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g}{unit}"
    return f"{nbytes}B"


def explain(choices: List[Choice], budget_bytes: int, planned_tokens: int, measured_tokens: int) -> str:
    """The planner's answer and its reasons, as printed by ``python -m lightning_ac.bench --budget-gib``."""
    suite = [c for c in choices if c.kind == "suite"]
    best = next((c for c in suite if c.fits), None)
    lines = [
        f"Activation budget {_size(budget_bytes)} at {planned_tokens} tokens per step "
        f"(measured at {measured_tokens}; estimates scale with tokens, widened by the error the scaling rule "
        "showed for each mode between half and full size):"
    ]
    for c in choices:
        if c.fits:
            verdict = "fits"
        elif c.estimate_bytes <= budget_bytes:
            verdict = "over budget with the margin"  # the estimate fits; the scaling error widens it past
        else:
            verdict = "over budget"
        lines.append(
            f"  {c.mode:26s} {c.kind:6s} est {_size(c.estimate_bytes, 3):>11s} (+/-{100 * c.margin:4.1f}%)  "
            f"step {c.step_time_s:.3f} s  {verdict}"
        )
    unsure = [c.mode for c in choices if c.margin > 0.5]
    if unsure:
        lines.append(
            f"The scaling rule is off by more than 50% for {', '.join(unsure)} at this size: fixed costs, not "
            "per-token activations, dominate what was measured. Measure at a longer --seq before trusting these."
        )
    if best is None:
        lines.append(
            "No mode fits: even the smallest estimate is over budget. Lower the batch or sequence, or offload "
            "(offload.hidden_states on an accelerator)."
        )
    else:
        faster = [c.mode for c in suite if (c.step_time_s or 0) < (best.step_time_s or 0) and not c.fits]
        why = f"; faster modes over budget: {', '.join(faster)}" if faster else "; it is the fastest mode measured"
        lines.append(f"Use: {best.mode} (fastest mode that fits{why}).")
    size = _setting(budget_bytes)
    lines.append(
        f"Or let the suite choose per decoder layer what to keep and what to recompute under this budget, measured on "
        f"your model in the first step: budget: {size} in the activation_checkpointing block "
        f'(ActivationCheckpointing(budget="{size}"); Hydra: activation_checkpointing=budget '
        f"activation_checkpointing.budget={size}). It keeps what fits at full speed, which a mode of one fixed choice "
        "cannot."
    )
    return "\n".join(lines)
