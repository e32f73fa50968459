"""Which mode to use under an activation-memory budget, from measured benchmark rows.

Activation memory of these modes is a sum of per-token terms (with flash/SDPA attention nothing grows with
the square of the sequence), so the estimate for another length scales the measured peak by the number of
tokens. The rule is checked, not assumed: the benchmark also measures every mode at half the sequence,
predicts the full-size peak from it, and reports how far the prediction was from the measurement. The
planner widens each mode's estimate by that error before comparing it with the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from lightning_ac.config import parse_size
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


def _setting(nbytes: int, round_up: bool = False) -> str:
    """A size as the ``budget`` field takes it, to three significant digits: ``24GiB``, ``1.27KiB``, ``1000MiB``;
    with ``round_up``, never below ``nbytes``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            value = nbytes / size
            scale = 10.0 ** (2 - math.floor(math.log10(value)))
            digits = math.ceil(value * scale * (1 - 1e-12)) if round_up else round(value * scale)
            return f"{digits / scale:g}{unit}"
    return f"{nbytes}B"


def _needs(choice: Choice) -> int:
    """The least budget ``choice`` fits: its estimate widened by its margin, as ``fits`` compares it."""
    return math.ceil(choice.estimate_bytes * (1 + choice.margin))


def _tokens_that_fit(choice: Choice, budget_bytes: int, planned_tokens: int) -> int:
    """How many tokens per step ``choice``'s widened estimate fits into the budget (estimates scale with tokens)."""
    return int(budget_bytes * planned_tokens // _needs(choice)) if _needs(choice) else planned_tokens


def explain(choices: List[Choice], budget_bytes: int, planned_tokens: int, measured_tokens: int) -> str:
    """The planner's answer and its reasons, as printed by ``python -m lightning_ac.bench --budget-gib``."""
    suite = [c for c in choices if c.kind == "suite"]
    best = next((c for c in suite if c.fits), None)
    least = min(suite, key=_needs, default=None)  # the mode with the least activation memory
    # the memory budget recomputes every decoder layer at the least, as full does: it cannot hold less than full
    floor = next((c for c in suite if c.mode == "full"), least)
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
        lines.append(_what_fits_instead(least, budget_bytes, planned_tokens))
    else:
        faster = [c.mode for c in suite if (c.step_time_s or 0) < (best.step_time_s or 0) and not c.fits]
        why = f"; faster modes over budget: {', '.join(faster)}" if faster else "; it is the fastest mode measured"
        lines.append(f"Use: {best.mode} (fastest mode that fits{why}).")
    if floor is None or budget_bytes >= _needs(floor):
        size = _setting(budget_bytes)
        if floor is not None and parse_size(size, "budget") < _needs(floor):  # rounded to below what full needs
            size = _setting(_needs(floor), round_up=True)
        lines.append(
            "Or let the suite choose per decoder layer what to keep and what to recompute under this budget, measured "
            f"on your model in the first step: {_budget_setting(size)}. It keeps what fits at full speed, which a mode "
            "of one fixed choice cannot."
        )
    else:  # a budget below full's own estimate would only be overrun: name the least one that holds instead
        tokens = _tokens_that_fit(floor, budget_bytes, planned_tokens)
        lines.append(
            f"The memory budget (the suite choosing per decoder layer what to keep) cannot hold {_size(budget_bytes)} "
            f"either: it recomputes every layer at the least, as {floor.mode} does. At {planned_tokens} tokens per "
            f"step the least budget it holds is {_budget_setting(_setting(_needs(floor), round_up=True))}"
            + (f"; under {_size(budget_bytes)} it holds up to {tokens} tokens per step." if tokens else ".")
        )
    return "\n".join(lines)


def _budget_setting(size: str) -> str:
    """Where the ``budget`` field goes, with ``size``."""
    return (
        f'budget: {size} in the activation_checkpointing block (ActivationCheckpointing(budget="{size}"); Hydra: '
        f"activation_checkpointing=budget activation_checkpointing.budget={size})"
    )


def _what_fits_instead(least: Optional[Choice], budget_bytes: int, planned_tokens: int) -> str:
    """No mode fits: the least-memory mode's figures, and what would fit."""
    if least is None:
        return "No mode fits: no mode of the suite was measured."
    tokens = _tokens_that_fit(least, budget_bytes, planned_tokens)
    instead = [f"a budget of {_setting(_needs(least), round_up=True)} or more"]
    if tokens:
        instead.insert(0, f"{least.mode} at up to {tokens} tokens per step (lower the batch or sequence)")
    if "offload" not in least.mode:
        instead.append("offloading (offload.hidden_states, on an accelerator)")
    return (
        f"No mode fits: the least activation memory of any mode is {least.mode}'s, est "
        f"{_size(least.estimate_bytes, 3)} (+/-{100 * least.margin:.1f}%) at {planned_tokens} tokens per step. "
        f"What would fit instead: {'; or '.join(instead)}."
    )
