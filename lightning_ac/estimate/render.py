"""The estimate as markdown: a row per mode and length, the longest sequence each mode fits, the budget's plans."""

from __future__ import annotations

from typing import Any

from lightning_ac.estimate.results import Estimate, StepEstimate

__all__ = ["describe_plan", "gib", "markdown", "progress_line"]


def gib(nbytes: int, unit: int = 2**30) -> str:
    return f"{nbytes / unit:.2f}"


def extra_compute(step: StepEstimate) -> str:
    """The recompute's FLOPs as a share of the step's other FLOPs (what ``off`` computes)."""
    base = step.total_flops - step.flops.get("recompute", 0)
    return f"+{step.flops.get('recompute', 0) / base:.0%}" if base else "—"


def _largest_part(step: StepEstimate, unit: int) -> str:
    parts = {
        "head": step.head_bytes,
        "layers' saves": sum(step.layer_saved_bytes),
        "layers' inputs": step.layer_input_bytes,
    }
    name = max(parts, key=lambda k: parts[k])
    return f"{name} {gib(parts[name], unit)}"


def _fits(step: StepEstimate) -> str:
    return "".join(" | yes" if fit else " | **no**" for fit in step.fits_on)


def markdown(estimate: Estimate) -> str:
    """The table of every step, the longest fits, and the notes."""
    devices = estimate.device_memory_bytes
    largest = max([s.device_total_bytes for s in estimate.steps] + devices)
    unit, unit_name = (2**30, "GiB") if largest >= 2**30 else (2**20, "MiB")
    lines = [
        f"{estimate.model}: {estimate.description}; {estimate.dtype}, {estimate.training}, optimizer "
        f"{estimate.optimizer}; figures for {estimate.target}{f', {estimate.ranks}' if estimate.ranks else ''} "
        f"({unit_name})",
        "",
        "| mode | seq x batch | weights | grads | optimizer | activation peak (at) | largest part | device total "
        f"| host | extra compute{''.join(f' | fits {gib(d, unit)}' for d in devices)} | fake step (s) |",
        "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(devices) + "---|",
    ]
    for s in estimate.steps:
        weights = s.parameter_bytes + s.buffer_bytes + s.streamed_weight_bytes
        lines.append(
            f"| `{s.mode}` | {s.seq} x {s.batch} | {gib(weights, unit)} | {gib(s.gradient_bytes, unit)} | "
            f"{gib(s.optimizer_bytes, unit)} | {gib(s.activation_peak_bytes, unit)} ({s.activation_peak_at}) | "
            f"{_largest_part(s, unit)} | {gib(s.device_total_bytes, unit)} | {gib(s.host_bytes, unit)} | "
            f"{extra_compute(s)}"
            f"{_fits(s)} | {s.seconds:.1f} |"
        )
    if estimate.longest:
        sizes = [d for d in devices if any(f.device_memory_bytes == d for f in estimate.longest)]
        lines += ["", f"Longest sequence that fits (batch {estimate.steps[0].batch}, {unit_name}):", ""]
        lines += ["| mode |" + "".join(f" {gib(d, unit)} |" for d in sizes), "|---|" + "---|" * len(sizes)]
        for name in dict.fromkeys(f.mode for f in estimate.longest):
            cells = []
            for d in sizes:
                fit = next(f for f in estimate.longest if f.mode == name and f.device_memory_bytes == d)
                cells.append(f">= {fit.seq}" if fit.limited else (str(fit.seq) if fit.seq else f"< {fit.step}"))
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    if estimate.budget_plans:
        lines += [
            "",
            "Memory budget: the plan for each device, from the figures of a fake measuring step (every layer "
            "recomputed, as the budget's first step), with `selective: {save: [attention]}`; layers: k keep, "
            "s save rules, r recompute; recompute: the plan's recompute time as a share of every layer's:",
            "",
            "| mode | seq x batch | device | setting | layers | recompute | activation peak | device total | fits |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [describe_plan(plan, unit) for plan in estimate.budget_plans]
    lines += [""] + [f"- {note}" for note in estimate.notes]
    return "\n".join(lines) + "\n"


def describe_plan(plan: Any, unit: int) -> str:
    """A markdown row of a :class:`~lightning_ac.estimate.budget.BudgetPlan`."""
    fits = "yes" if plan.fits else "**no** (every layer recomputed)"
    setting = f"`budget: {plan.setting}`" if plan.setting != "none" else "none: the rest does not fit"
    return (
        f"| `{plan.mode}` | {plan.seq} x {plan.batch} | {gib(plan.device_memory_bytes, unit)} | {setting} | "
        f"{plan.layers} | {plan.recompute_share:.0%} | {gib(plan.estimated_peak_bytes, unit)} | "
        f"{gib(plan.device_total_bytes, unit)} | {fits} |"
    )


def progress_line(step: StepEstimate) -> str:
    """One line per fake step, as it ends."""
    fits = f"; fits: {', '.join('yes' if fit else 'no' for fit in step.fits_on)}" if step.fits_on else ""
    activations, total = gib(step.activation_peak_bytes), gib(step.device_total_bytes)
    return (
        f"estimate: {step.mode} at {step.seq} x {step.batch} tokens: activations {activations} GiB, "
        f"device total {total} GiB{fits} ({step.seconds:.1f} s)"
    )
