"""Benchmark every mode side by side with what a user would use instead.

python -m lightning_ac.bench --out bench_out            # cpu-small on CPU
python -m lightning_ac.bench --preset gpu-8k --out bench_out
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

import torch

from lightning_ac.bench.goals import check_goals
from lightning_ac.bench.modes import ALL_COMPILED, MODES, UNPLANNED, default_modes, why_not_planned
from lightning_ac.bench.plot import plot
from lightning_ac.bench.presets import PRESETS
from lightning_ac.bench.run import Row, quiet, run_benchmark
from lightning_ac.bench.tables import auto_goals, results_markdown

__all__ = ["main"]


MIN_PLAN_SEQ = 32


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, preset: str) -> None:
    """Refuse values the benchmark cannot measure with (exit status 2, naming the flag), before any training."""
    for flag in ("seq", "batch", "reps", "steps", "plan_seq"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} {value}: expected an integer >= 1")
    if args.plan_seq is not None and args.budget_gib is None:
        parser.error(
            f"--plan-seq {args.plan_seq}: it is the sequence length the budget planner plans for, and there is no "
            "--budget-gib to plan with; add --budget-gib, or leave --plan-seq out"
        )
    compiled = [m for m in args.modes or [] if m in ALL_COMPILED]
    if args.no_compiled and compiled:
        parser.error(
            f"--no-compiled leaves out the compiled rows, and --modes asks for {' '.join(compiled)}: drop "
            "--no-compiled, or those modes"
        )
    if args.budget_gib is not None and args.modes and all(m in UNPLANNED for m in args.modes):
        parser.error(
            f"--modes {' '.join(args.modes)} --budget-gib {args.budget_gib:g}: the planner compares the activation "
            "modes of one fixed choice (off, full, every_2, the selective and offload modes), and none of these is "
            f"one ({why_not_planned(args.modes)}). Add such modes, or leave --budget-gib out"
        )
    if args.budget_gib is not None:
        if not args.budget_gib > 0:
            parser.error(f"--budget-gib {args.budget_gib}: expected a budget > 0 GiB")
        seq = args.seq or PRESETS[preset]["seq"]
        if seq < MIN_PLAN_SEQ:
            parser.error(
                f"--seq {seq}: the budget planner measures every mode at the sequence length and at half of it and "
                f"extrapolates per token, which needs --seq >= {MIN_PLAN_SEQ} (fixed costs swamp shorter ones)"
            )


def write_rows(out: Path, preset: str, rows: List[Row], table: str, partial: bool = False) -> None:
    """``results.json`` and ``results.md`` in ``out``; ``partial``: the rows as they stand while the run goes on."""
    note = "(partial: written as each mode ends; the run had not finished)\n\n" if partial else ""
    (out / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    (out / "results.md").write_text(f"preset: {preset}\n{note}\n{table}")


def main(argv: Optional[List[str]] = None) -> List[Row]:
    parser = argparse.ArgumentParser(prog="python -m lightning_ac.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="default: cpu-small on CPU, gpu-8k on CUDA"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=None,
        help=f"default: the preset's own rows where it has them (cpu-vocab: each mode with and without chunked_loss), "
        f"else all that run here ({', '.join(MODES)}, ...)",
    )
    parser.add_argument(
        "--model", default=None, help="a transformers model type with the preset's sizes (qwen3), or a JSON config"
    )
    parser.add_argument(
        "--no-compiled",
        action="store_true",
        help="leave out the torch.compile rows (they compile afresh in every repetition: seconds on cpu-small, "
        "minutes on a large model)",
    )
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the preset's)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    parser.add_argument(
        "--reps", type=int, default=None, help="alternating repetitions per mode (default: the preset's)"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps per repetition (default: the preset's)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench_out"),
        help="where results.json, results.md, memory_time.png go (default: bench_out)",
    )
    parser.add_argument(
        "--budget-gib", type=float, default=None, help="print the fastest mode whose activation peak fits this budget"
    )
    parser.add_argument(
        "--plan-seq", type=int, default=None, help="sequence length to plan for (default: the measured one)"
    )
    args = parser.parse_args(argv)
    preset = args.preset or ("gpu-8k" if torch.cuda.is_available() else "cpu-small")
    _check_arguments(parser, args, preset)
    quiet()
    modes = args.modes
    if modes is None and args.no_compiled:
        defaults = PRESETS[preset].get("modes") or default_modes(torch.cuda.is_available())
        modes = [m for m in defaults if m not in ALL_COMPILED]
    args.out.mkdir(parents=True, exist_ok=True)

    def write_so_far(rows_so_far: List[Row]) -> None:
        # after each mode: a run cut short (killed for host memory, out of time) still leaves its table
        write_rows(args.out, preset, rows_so_far, results_markdown(rows_so_far, []), partial=True)

    measured = (args.seq, args.batch, args.dtype, args.reps, args.steps)
    rows = run_benchmark(preset, modes, *measured, model=args.model, on_progress=write_so_far)
    verdicts = check_goals(rows, [*PRESETS[preset].get("goals", ()), *auto_goals(rows)])
    table = results_markdown(rows, verdicts)
    print(table)
    written = ["results.md", "results.json", "memory_time.png"] + (["goals.json"] if verdicts else [])
    print(f"results: {', '.join(str(args.out / name) for name in written)}")
    advice = None
    if args.budget_gib is not None:
        from lightning_ac.bench.planner import explain, plan_mode, scaling_errors

        seq = args.seq or PRESETS[preset]["seq"]
        batch = args.batch or PRESETS[preset]["batch"]
        # the scaling check: measure every mode's peak at half the sequence too (activation modes: the layer
        # offloading modes train another model, LoRA, and save weights, not activations)
        planned_rows = [r for r in rows if r.mode not in UNPLANNED]
        unplanned = [r.mode for r in rows if r not in planned_rows]
        modes = [r.mode for r in planned_rows if r.status == "ok"]
        half = run_benchmark(preset, modes, seq // 2, batch, args.dtype, reps=1, steps=1, model=args.model)
        errors = scaling_errors(planned_rows, half, ratio=seq / (seq // 2))
        planned = (args.plan_seq or seq) * batch
        budget = int(args.budget_gib * 2**30)
        advice = explain(plan_mode(planned_rows, budget, seq * batch, planned, errors), budget, planned, seq * batch)
        if unplanned:
            advice += f"\nNot planned: {', '.join(unplanned)} ({why_not_planned(unplanned)})."
        print(advice)
    if args.out:  # always set (default bench_out)
        if advice is not None:
            (args.out / "plan.txt").write_text(advice + "\n")
        write_rows(args.out, preset, rows, table)
        if verdicts:
            goals = [{**asdict(v), "verdict": v.text} for v in verdicts]
            (args.out / "goals.json").write_text(json.dumps(goals, indent=2) + "\n")
        plot(rows, args.out / "memory_time.png")
    return rows
