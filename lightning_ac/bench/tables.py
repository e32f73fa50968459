"""The benchmark's tables (markdown): every mode against ``off`` and the anchor, the memory budget's claims, the
compiled rows against eager ``full`` and the layer-offloading rows against the same LoRA run; step-time ratios that
noise decided are marked."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from lightning_ac.bench.goals import Goal, Verdict
from lightning_ac.bench.modes import (
    ALL_BUDGET_MODES,
    ALL_COMPILED,
    AUTO_MODES,
    CHUNKED_BUDGET_MODES,
    LAYER_OFFLOAD_MODES,
)
from lightning_ac.bench.run import Row

__all__ = ["AUTO_STEP_GOAL", "auto_goals", "fastest_fixed_mode", "goals_markdown", "results_markdown"]


def _ratio(value: Optional[float], base: Optional[float]) -> str:
    return f"{value / base:.2f}x" if value is not None and base else "—"


def _time_ratio(row: Row, base: Optional[Row]) -> str:
    """A step-time ratio, marked ``~`` when the repetitions of either row spread by more than the difference
    the ratio reports (noise decided it), and ``¹`` when either row ran one repetition (no spread to tell)."""
    text = _ratio(row.step_time_s, base and base.step_time_s)
    if base is None or row is base or row.step_time_s is None or not base.step_time_s:
        return text
    if row.step_time_spread is None or base.step_time_spread is None:  # one repetition: no spread was measured
        return f"{text}{ONE_REPETITION}"
    difference = abs(row.step_time_s / base.step_time_s - 1)
    spread = max(row.step_time_spread or 0.0, base.step_time_spread or 0.0)
    return f"{text}~" if spread > difference else text


NOISE_NOTE = (
    "~: within noise: the repetitions' median steps of this mode or of the mode it is compared with spread by more "
    "than the difference the ratio shows (rerun on a quieter machine, or with more --reps)."
)
ONE_REPETITION = "¹"
ONE_REPETITION_NOTE = (
    f"{ONE_REPETITION}: one repetition: this mode or the mode it is compared with ran once, so no spread tells whether "
    "noise decided the ratio (rerun with --reps 2 or more)."
)


def results_markdown(rows: List[Row], verdicts: Sequence[Verdict] = ()) -> str:
    """A table with ratios to ``off`` and to ``hf_native_full``, then the budget, compiled and layer-offloading rows'
    own tables and the preset's goals (``verdicts``), each where it has rows."""
    by = {r.mode: r for r in rows}
    off, hf = by.get("off"), by.get("hf_native_full")
    offloaded = [r for r in rows if r.mode in LAYER_OFFLOAD_MODES]
    compiled = [r for r in rows if r.mode in ALL_COMPILED]
    rows = [r for r in rows if r.mode not in LAYER_OFFLOAD_MODES and r.mode not in ALL_COMPILED]
    lines = [
        "| mode | kind | activation peak (MiB) | vs off | vs hf_native_full "
        "| step (s) | vs off | vs hf_native_full | max grad diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if not rows:  # only layer-offloading or compiled modes ran: their own tables, no empty one above them
        lines = []
    for r in rows:
        mib = f"{r.peak_activation_bytes / 2**20:.1f}" if r.peak_activation_bytes is not None else "—"
        step, diff = _step_and_diff(r)
        lines.append(
            f"| `{r.mode}` | {r.kind} | {mib} | {_ratio(r.peak_activation_bytes, off and off.peak_activation_bytes)} | "
            f"{_ratio(r.peak_activation_bytes, hf and hf.peak_activation_bytes)} | {step} | "
            f"{_time_ratio(r, off)} | {_time_ratio(r, hf)} | {diff} |"
        )
    budgets = [r for r in rows if r.mode in ALL_BUDGET_MODES]
    text = ("\n".join(lines) + "\n" if lines else "") + (_budget_markdown(budgets, rows) if budgets else "")
    text += _compiled_markdown(compiled, by.get("full")) if compiled else ""
    text += _layer_offload_markdown(offloaded) if offloaded else ""
    moving = [r for r in rows if r.moved_bytes]
    text += _copy_floor_markdown(moving) if moving else ""
    text += goals_markdown(verdicts) if verdicts else ""
    text = text.removeprefix("\n")  # a table that follows none starts the text
    notes = [note for mark, note in (("~", NOISE_NOTE), (ONE_REPETITION, ONE_REPETITION_NOTE)) if f"x{mark} |" in text]
    return text + "".join(f"\n{note}\n" for note in notes)


def _copy_floor_markdown(rows: Sequence[Row]) -> str:
    """The offload rows' traffic: the bytes a step moves each way, the time they take on the bus at its measured
    bandwidth (the copy floor; on a device only), and the step against it."""
    lines = [
        "",
        "What the offload rows move (each way, a step) and the bus time it needs (a pinned 1 GiB copy measured first):",
        "",
        "| mode | moved each way (MiB) | copy floor (s) | step (s) | step vs floor |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        floor = f"{r.copy_floor_s:.3f}" if r.copy_floor_s is not None else "—"
        step = f"{r.step_time_s:.3f}" if r.step_time_s is not None else "—"
        against = f"{r.step_time_s / r.copy_floor_s:.2f}x" if r.copy_floor_s and r.step_time_s is not None else "—"
        lines.append(f"| `{r.mode}` | {r.moved_bytes / 2**20:.1f} | {floor} | {step} | {against} |")
    return "\n".join(lines) + "\n"


_AUTO_ROWS = (
    "; the `auto` rows also leave `chunked_loss`, `tiled_mlp` and `offload.hidden_states` to the budget (each weighed, "
    "on where it fits the budget or steps faster)"
)
# issue 58: each auto row (the one knob) steps within this multiple of the fastest fixed mode that fits its budget
AUTO_STEP_GOAL = 1.05


def auto_goals(rows: Sequence[Row]) -> List[Goal]:
    """A step-time goal for each auto row that ran: at most :data:`AUTO_STEP_GOAL` times the fastest fixed mode
    whose measured activation peak fits its budget (that it fits the budget is the budget table's column)."""
    goals = []
    for r in rows:
        fixed = fastest_fixed_mode(rows, r.budget_bytes) if r.mode in AUTO_MODES and r.budget_bytes else None
        if fixed is not None:
            goals.append(Goal(r.mode, "step", fixed.mode, AUTO_STEP_GOAL))
    return goals


def fastest_fixed_mode(rows: Sequence[Row], budget_bytes: int) -> Optional[Row]:
    """The fastest suite mode of one fixed choice (not a budget) whose measured activation peak fits the budget."""
    fitting = [
        r
        for r in rows
        if r.kind == "suite"
        and r.mode not in ALL_BUDGET_MODES
        and r.mode not in LAYER_OFFLOAD_MODES
        and r.status == "ok"
        and r.peak_activation_bytes is not None
        and r.step_time_s is not None
        and r.peak_activation_bytes <= budget_bytes
    ]
    return min(fitting, key=lambda r: r.step_time_s or float("inf"), default=None)


def _budget_markdown(budgets: List[Row], rows: List[Row]) -> str:
    """The budget rows' three claims: under the budget, no slower than the fastest fixed mode that fits it, exact."""
    chunked = _CHUNKED_BUDGETS if any(r.mode in CHUNKED_BUDGET_MODES for r in budgets) else ""
    lines = [
        "",
        "Memory budget (placed 1/4, 1/2 and 3/4 of the way from full's activation peak to off's, with "
        f"`selective: {{save: [attention]}}`{chunked}{_AUTO_ROWS if any(r.mode in AUTO_MODES for r in budgets) else ''}"
        "; each layer's choice: k keep, s selective, r recompute, o recompute with the input in host memory):",
        "",
        "| mode | budget (MiB) | peak (MiB) | under budget | layers | fastest fixed mode that fits | step vs it "
        "| max grad diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in budgets:
        budget = r.budget_bytes
        peak = r.peak_activation_bytes
        fixed = fastest_fixed_mode(rows, budget) if budget is not None else None
        under = "yes" if peak is not None and budget is not None and peak <= budget else "no"
        layers = "".join(c[0] for c in r.budget_choices) if r.budget_choices else "—"
        _, diff = _step_and_diff(r)
        lines.append(
            f"| `{r.mode}` | {_mib(budget)} | {_mib(peak)} | {under} | {layers} | "
            f"{'`' + fixed.mode + '`' if fixed else '—'} | {_time_ratio(r, fixed) if fixed else '—'} | {diff} |"
        )
    return "\n".join(lines) + "\n"


_CHUNKED_BUDGETS = "; the `_chunked` rows with `chunked_loss: true`, from full_chunked's peak to off_chunked's"


def goals_markdown(verdicts: Sequence[Verdict]) -> str:
    """The preset's goals, each checked on the rows of this run."""
    lines = ["", "Goals (checked on the rows of this run):", "", "| goal | measured | verdict |", "|---|---|---|"]
    for v in verdicts:
        if v.ratio is None:
            measured = "—"
        elif v.goal.figure == "peak":
            measured = f"{v.ratio:.2f}x ({_mib(v.value)} / {_mib(v.base)} MiB)"  # type: ignore[arg-type]
        else:
            measured = f"{v.ratio:.2f}x ({v.value:.3f} / {v.base:.3f} s)"
        lines.append(f"| {v.goal.describe()} | {measured} | {v.text} |")
    return "\n".join(lines) + "\n"


def _mib(value: Optional[int]) -> str:
    return f"{value / 2**20:.1f}" if value is not None else "—"


def _step_and_diff(row: Row) -> Tuple[str, str]:
    """A row's step-time cell (its status when it did not run) and max-grad-diff cell."""
    if row.status != "ok":
        step = row.status
    else:
        step = f"{row.step_time_s:.3f}" if row.step_time_s is not None else "—"
    return step, f"{row.max_grad_diff:.1e}" if row.max_grad_diff is not None else "—"


def _compiled_markdown(rows: List[Row], full: Optional[Row]) -> str:
    """The compiled modes against eager ``full``: step time, compile time apart, and (on CUDA) the peak."""
    lines = [
        "",
        "torch.compile (each decoder layer compiled by itself with inductor; the warm-up steps' excess over the "
        "median step is the compile time, caches off; max grad diff against eager `off`; activation peak on CUDA "
        "only, as MemTracker cannot see inside compiled graphs):",
        "",
        "| mode | kind | activation peak (MiB) | vs full | step (s) | vs full | compile (s) | max grad diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        step, diff = _step_and_diff(r)
        compile_time = f"{r.compile_time_s:.1f}" if r.compile_time_s is not None else "—"
        lines.append(
            f"| `{r.mode}` | {r.kind} | {_mib(r.peak_activation_bytes)} | "
            f"{_ratio(r.peak_activation_bytes, full and full.peak_activation_bytes)} | {step} | "
            f"{_time_ratio(r, full)} | {compile_time} | {diff} |"
        )
    return "\n".join(lines) + "\n"


def _layer_offload_markdown(rows: List[Row]) -> str:
    """The layer-offloading modes against ``lora_full``: whole device peak and step time."""
    base = next((r for r in rows if r.mode == "lora_full"), None)
    lines = [
        "",
        "Layer offloading (LoRA r=8 on the frozen base, full checkpointing; device peak from the CUDA allocator):",
        "",
        "| mode | resident layers | device peak (MiB) | vs lora_full | step (s) | vs lora_full | max grad diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = f"{r.peak_device_bytes / 2**20:.1f}" if r.peak_device_bytes is not None else "—"
        step, diff = _step_and_diff(r)
        resident = LAYER_OFFLOAD_MODES[r.mode] or "—"
        lines.append(
            f"| `{r.mode}` | {resident} | {peak} | {_ratio(r.peak_device_bytes, base and base.peak_device_bytes)} | "
            f"{step} | {_time_ratio(r, base)} | {diff} |"
        )
    return "\n".join(lines) + "\n"
