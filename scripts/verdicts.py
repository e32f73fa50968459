"""The GPU goals (issues 52 and 58) against what one GPU check measured: for each goal the measured figure, the
target and pass or fail, as a Markdown table; a goal whose figure is missing says "not measured" and counts as not
passed.

    python scripts/verdicts.py RESULTS_DIR [-o verdicts.md]

``RESULTS_DIR`` is what ``scripts/gpu_check.sh`` writes (any file may be missing: a step that timed out or failed):

- ``bench/goals.json``: the benchmark's own verdicts, of which the ``auto`` rows' (issue 58: each at most 1.05x the
  step of the fastest fixed mode that fits its budget).
- ``bench/results.json``, ``bench.log``: the gpu-8k benchmark (``python -m lightning_ac.bench``). A mode's step
  time is its row's ``step_time_s``; where the table was never written (a step killed at its limit), the median of
  the log's ``rep N MODE step X s`` lines. An offload row's copy floor (the bus time of the bytes it moves each way
  per step at the measured copy bandwidth) is read from its ``copy_floor_s`` field where the benchmark writes one.
- ``bench_compiled/results.json``, ``bench_compiled.log``: the compiled rows, the same way.
- ``longctx.log``: ``LONGCTX {...}`` lines of ``scripts/longctx.py`` (the 8B cases).
- ``estimate.json``: ``python -m lightning_ac.estimate --json`` for the same cases.
- ``gpu_tests.log``: pytest's output for ``-m gpu tests/test_gpu.py tests/test_offload_residency.py`` (its last
  summary line is counted).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

GIB = 2**30
# The gradient tolerance of the tests for bf16: the largest difference at most 2**-7 (bf16's machine epsilon) times
# the reference's largest gradient (tests/test_chunked_loss.py); a relative bound, so a row needs the reference's
# magnitude beside its absolute difference
BF16_GRAD_RTOL = 2**-7
# a bench row's relative difference, or the reference magnitude to make one of max_grad_diff
GRAD_REL_FIELD = "max_grad_rel_diff"
GRAD_SCALE_FIELD = "max_grad_ref_abs"
COPY_FLOOR_FIELD = "copy_floor_s"
LONGCTX_SEQ = 32768
TILED = "offload_hidden+chunked_loss+tiled_mlp"
UNTILED = "offload_hidden+chunked_loss"
ESTIMATE_RANGE = (0.99, 1.05)
AUTO_MODES = ("auto_25", "auto_50", "auto_75")
_REP_LINE = re.compile(r"^rep \d+ (\S+)\s+step ([0-9.]+) s")
# "30/41 tests collected (11 deselected)" with -m: 30 selected of 41
_PYTEST_COUNT = re.compile(
    r"(?<![/\d])(\d+)(?:/\d+)? (passed|failed|errors?|skipped|xfailed|xpassed|deselected|tests? collected)"
)

__all__ = [
    "Figures",
    "Verdict",
    "evaluate",
    "read_bench_goals",
    "read_bench_json",
    "read_bench_log",
    "read_estimates",
    "read_figures",
    "read_longctx",
    "read_pytest_counts",
    "render",
]


@dataclass
class Figures:
    """What one GPU check measured, by source.

    Attributes:
        steps: mode -> step time (s), the benchmark's eager and compiled rows.
        copy_floors: offload mode -> its copy floor (s): the step's bytes each way at the measured copy bandwidth.
        grads: mode -> (largest absolute gradient difference, the same relative to the reference's largest
            gradient or None where the row lacks the reference's magnitude).
        longctx: the 8B cases' ``LONGCTX`` records.
        estimates: (mode, tokens, qlora) -> the estimator's device total (bytes).
        tests: the gpu tests' counts by outcome (``passed``, ``failed``, ``errors``, ``skipped``, ``collected``);
            None where no summary line was found.
        bench_goals: The benchmark's ``goals.json`` verdicts.
    """

    steps: Dict[str, float] = field(default_factory=dict)
    copy_floors: Dict[str, float] = field(default_factory=dict)
    grads: Dict[str, Tuple[float, Optional[float]]] = field(default_factory=dict)
    longctx: List[dict] = field(default_factory=list)
    estimates: Dict[Tuple[str, int, bool], int] = field(default_factory=dict)
    tests: Optional[Dict[str, int]] = None
    bench_goals: List[dict] = field(default_factory=list)

    def add_bench_rows(self, rows: Iterable[dict]) -> None:
        """A benchmark ``results.json``'s rows; a mode already known keeps its figures."""
        for row in rows:
            mode = row["mode"]
            if row.get("status", "ok") != "ok":
                continue
            if row.get("step_time_s") is not None:
                self.steps.setdefault(mode, row["step_time_s"])
            if row.get(COPY_FLOOR_FIELD) is not None:
                self.copy_floors.setdefault(mode, row[COPY_FLOOR_FIELD])
            if row.get("max_grad_diff") is not None:
                self.grads.setdefault(mode, (row["max_grad_diff"], _relative_grad(row)))

    def add_bench_steps(self, steps: Dict[str, float]) -> None:
        """Step times from a benchmark's log, for the modes no ``results.json`` gave."""
        for mode, seconds in steps.items():
            self.steps.setdefault(mode, seconds)


@dataclass
class Verdict:
    """One goal's line: ``passed`` is None where the figure is missing (not measured: not passed)."""

    goal: str
    target: str
    measured: Optional[str] = None
    passed: Optional[bool] = None

    @property
    def text(self) -> str:
        return "not measured" if self.passed is None else "pass" if self.passed else "FAIL"


def _relative_grad(row: dict) -> Optional[float]:
    if row.get(GRAD_REL_FIELD) is not None:
        return row[GRAD_REL_FIELD]
    scale = row.get(GRAD_SCALE_FIELD)
    return row["max_grad_diff"] / scale if scale else None


def read_bench_json(path: Path) -> List[dict]:
    """The rows of a benchmark ``results.json``; none where the file is missing."""
    return json.loads(path.read_text()) if path.is_file() else []


def read_bench_goals(path: Path) -> List[dict]:
    """The verdicts of a benchmark ``goals.json``; none where the file is missing."""
    return json.loads(path.read_text()) if path.is_file() else []


def read_bench_log(path: Path) -> Dict[str, float]:
    """mode -> the median of its ``rep N MODE step X s`` lines (each a repetition's median step) in a benchmark's
    log: the step times of a run killed before its table."""
    times: Dict[str, List[float]] = {}
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            match = _REP_LINE.match(line)
            if match:
                times.setdefault(match[1], []).append(float(match[2]))
    return {mode: statistics.median(values) for mode, values in times.items()}


def read_longctx(path: Path) -> List[dict]:
    """The ``LONGCTX {...}`` records of ``scripts/longctx.py`` in a log."""
    if not path.is_file():
        return []
    prefix = "LONGCTX "
    return [json.loads(line[len(prefix) :]) for line in path.read_text().splitlines() if line.startswith(prefix)]


def read_estimates(path: Path) -> Dict[Tuple[str, int, bool], int]:
    """(mode, tokens, qlora) -> the device total of each step in a ``python -m lightning_ac.estimate --json`` file
    (batch 1: tokens are the sequence length)."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    qlora = "qlora" in data.get("training", "")
    return {(s["mode"], s["seq"] * s.get("batch", 1), qlora): s["device_total_bytes"] for s in data["steps"]}


def read_pytest_counts(path: Path) -> Optional[Dict[str, int]]:
    """The counts of pytest's last summary line (``5 failed, 25 passed, 36 warnings in 56.44s``, or with
    ``--collect-only``: ``30 tests collected in 2.1s``); None where there is none."""
    if not path.is_file():
        return None
    for line in reversed(path.read_text(errors="replace").splitlines()):
        if re.search(r"\bin [0-9.]+s\b", line) or "no tests ran" in line:
            counts = {}
            for number, what in _PYTEST_COUNT.findall(line):
                key = "collected" if "collected" in what else "errors" if what.startswith("error") else what
                counts[key] = int(number)
            if counts or "no tests ran" in line:
                return counts
    return None


def read_figures(results: Path) -> Figures:
    """Every figure a GPU check left in ``results`` (the layout of ``scripts/gpu_check.sh``)."""
    figures = Figures()
    for name in ("bench", "bench_compiled"):
        figures.add_bench_rows(read_bench_json(results / name / "results.json"))
        figures.add_bench_steps(read_bench_log(results / f"{name}.log"))
    figures.bench_goals = read_bench_goals(results / "bench" / "goals.json")
    figures.longctx = read_longctx(results / "longctx.log")
    figures.estimates = read_estimates(results / "estimate.json")
    figures.tests = read_pytest_counts(results / "gpu_tests.log")
    return figures


def _ratio_goal(figures: Figures, mode: str, against: str, limit: float, goal: str) -> Verdict:
    verdict = Verdict(goal, f"<= {limit:.2f}x")
    step, reference = figures.steps.get(mode), figures.steps.get(against)
    if step is not None and reference:
        ratio = step / reference
        verdict.measured = f"{step:.3f} s / {reference:.3f} s = {ratio:.3f}x"
        verdict.passed = ratio <= limit
    return verdict


def _auto_goals(figures: Figures) -> List[Verdict]:
    """Each ``auto`` row against the fastest fixed mode that fits its budget, as the benchmark judged it."""
    verdicts = []
    for mode in AUTO_MODES:
        verdict = Verdict(f"`{mode}` vs the fastest fixed mode that fits its budget (gpu-8k)", "<= 1.05x")
        found = next((g for g in figures.bench_goals if g["goal"]["mode"] == mode), None)
        if found is not None and found.get("ratio") is not None:
            verdict.measured = (
                f"{found['value']:.3f} s / {found['base']:.3f} s = {found['ratio']:.3f}x (`{found['goal']['against']}`"
                + (f"; {found['noise']}" if found.get("noise") else "")
                + ")"
            )
            verdict.passed = bool(found["met"])
        verdicts.append(verdict)
    return verdicts


def _longctx_case(figures: Figures, mode: str, seq: int, qlora: bool = False) -> Optional[dict]:
    for record in figures.longctx:
        if record["mode"] == mode and record["seq"] == seq and bool(record.get("qlora")) == qlora:
            return record
    return None


def _longctx_step(record: Optional[dict]) -> Optional[float]:
    return statistics.median(record["step_times"]) if record and record.get("step_times") else None


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"  # MiB: the dry run's two-layer cases


def _case_name(record: dict) -> str:
    return f"`{record['mode']}` at {record['seq']:,} tokens{', 4-bit base' if record.get('qlora') else ''}"


def _offload_only_goals(figures: Figures) -> List[Verdict]:
    step, floor = figures.steps.get("offload_only"), figures.copy_floors.get("offload_only")
    against_floor = Verdict("`offload_only` step vs its copy floor (gpu-8k)", "<= 1.30x")
    if step is not None and floor:
        against_floor.measured = f"{step:.3f} s / {floor:.3f} s = {step / floor:.2f}x"
        against_floor.passed = step / floor <= 1.3
    elif step is not None:
        against_floor.measured = f"step {step:.3f} s; no `{COPY_FLOOR_FIELD}` in the benchmark's results"
    absolute = Verdict("`offload_only` step (gpu-8k)", "<= 0.800 s")
    if step is not None:
        absolute.measured, absolute.passed = f"{step:.3f} s", step <= 0.8
    return [against_floor, absolute]


def _estimate_goals(figures: Figures) -> List[Verdict]:
    low, high = ESTIMATE_RANGE
    target = f"{low:.2f}x to {high:.2f}x"
    verdicts = []
    for record in figures.longctx:
        verdict = Verdict(f"8B estimate vs the allocator's peak: {_case_name(record)}", target)
        measured = record.get("measured_total")
        estimated = figures.estimates.get((record["mode"], record["seq"], bool(record.get("qlora"))))
        if measured and estimated is not None:
            ratio = estimated / measured
            verdict.measured = f"{_size(estimated)} / {_size(measured)} = {ratio:.3f}x"
            verdict.passed = low <= ratio <= high
        elif measured:
            verdict.measured = f"allocator {_size(measured)}; no estimate of this case"
        verdicts.append(verdict)
    return verdicts or [Verdict("8B estimates vs the allocator's peak (no 8B case ran)", target)]


def _gradient_goal(figures: Figures) -> Verdict:
    verdict = Verdict(
        "every gradient difference (bench rows)", f"<= {BF16_GRAD_RTOL:.2g} x the largest reference gradient"
    )
    if not figures.grads:
        return verdict
    worst_abs = max(figures.grads, key=lambda m: figures.grads[m][0])
    relative = {mode: rel for mode, (_, rel) in figures.grads.items() if rel is not None}
    if len(relative) < len(figures.grads):
        verdict.measured = (
            f"largest absolute difference {figures.grads[worst_abs][0]:.1e} (`{worst_abs}`); "
            f"the rows lack `{GRAD_SCALE_FIELD}` to make it relative"
        )
        return verdict
    worst = max(relative, key=relative.get)
    verdict.measured = f"{relative[worst]:.1e} (`{worst}`), {len(relative)} rows"
    verdict.passed = relative[worst] <= BF16_GRAD_RTOL
    return verdict


def evaluate(figures: Figures) -> List[Verdict]:
    """Every goal of issue 52 against ``figures``, in the issue's order, then issue 58's."""
    verdicts = _offload_only_goals(figures)
    verdicts.append(_ratio_goal(figures, "selective_attn", "torch_sac", 1.05, "`selective_attn` vs `torch_sac`"))
    verdicts.append(
        _ratio_goal(
            figures, "selective_attn_compiled", "full_compiled", 1.0, "`selective_attn_compiled` vs `full_compiled`"
        )
    )
    for mode in ("offload_hidden", "offload_all"):
        verdicts.append(_ratio_goal(figures, mode, "full", 1.02, f"`{mode}` vs `full`"))
    verdicts.append(_ratio_goal(figures, "layer_offload", "lora_full", 1.10, "`layer_offload` vs `lora_full`"))
    tiled = Verdict(f"8B tiled vs untiled step (`{TILED}` vs `{UNTILED}`, {LONGCTX_SEQ:,} tokens)", "<= 1.05x")
    step, reference = (_longctx_step(_longctx_case(figures, m, LONGCTX_SEQ)) for m in (TILED, UNTILED))
    if step is not None and reference:
        tiled.measured = f"{step:.2f} s / {reference:.2f} s = {step / reference:.3f}x"
        tiled.passed = step / reference <= 1.05
    verdicts.append(tiled)
    verdicts += _estimate_goals(figures)
    verdicts.append(_gradient_goal(figures))
    verdicts += _auto_goals(figures)
    return verdicts


def _tests_line(counts: Optional[Dict[str, int]]) -> str:
    if counts is None:
        return "gpu tests: not run (no pytest summary in gpu_tests.log)"
    ran = [f"{counts[k]} {k}" for k in ("passed", "failed", "errors", "skipped", "xfailed", "xpassed") if k in counts]
    if ran:
        return "gpu tests: " + ", ".join(ran)
    if "collected" in counts:
        return f"gpu tests: {counts['collected']} collected, none run (collect only)"
    return "gpu tests: none ran"


def render(verdicts: Sequence[Verdict], tests: Optional[Dict[str, int]], source: str = "") -> str:
    """The Markdown page: the goals' table, how many passed, and the gpu tests' counts."""
    lines = ["# GPU goals (issues 52 and 58)", ""]
    if source:
        lines += [f"Figures from `{source}`.", ""]
    lines += ["| goal | measured | target | verdict |", "|---|---|---|---|"]
    lines += [f"| {v.goal} | {v.measured or 'not measured'} | {v.target} | {v.text} |" for v in verdicts]
    passed = sum(v.passed is True for v in verdicts)
    missing = sum(v.passed is None for v in verdicts)
    lines += [
        "",
        f"{passed} of {len(verdicts)} goals passed ({missing} not measured, counted as not passed).",
        "",
        _tests_line(tests),
    ]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="the GPU check's results folder")
    parser.add_argument("-o", "--out", type=Path, default=None, help="write the page here too")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        parser.error(f"{args.results}: not a folder; give the folder scripts/gpu_check.sh wrote its results to")
    figures = read_figures(args.results)
    page = render(evaluate(figures), figures.tests, str(args.results))
    print(page, end="")
    if args.out is not None:
        args.out.write_text(page)
    return page


if __name__ == "__main__":
    main()
