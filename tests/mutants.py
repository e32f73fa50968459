"""Mutation check of the transfer code's synchronisation: every sync point must be needed by some test.

    python tests/mutants.py            # every mutant; exits 1 if any survives
    python tests/mutants.py --list     # the mutants, without running them

Each mutant removes one synchronisation point from lightning_ac/offload/engine.py or lightning_ac/offload/weights.py
(an event record, an event or stream wait, a record_stream, the stash hold, a release-event wait, an end-of-step
synchronize), in a copy of the package, and runs the ``simulated`` tests against it (stopping at the first
failure). A mutant the tests do not notice survives: either a test is missing or the synchronisation is not
needed. One line per mutant, then ``killed K of N``.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
FILES = ("lightning_ac/offload/engine.py", "lightning_ac/offload/weights.py")
SYNC_CALLS = {"wait_stream", "wait_event", "record_event", "record_stream", "synchronize"}


@dataclass
class Mutant:
    path: str
    line: int  # 1-based
    original: str
    replacement: str
    what: str


def _call_names(node: ast.AST) -> List[str]:
    return [n.func.attr for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]


def _mutation(statement: ast.stmt, source: str, source_line: str) -> Optional[tuple]:
    """How to remove the synchronisation in one statement: (replacement line, description), or None."""
    indent = source_line[: len(source_line) - len(source_line.lstrip())]
    names = _call_names(statement)
    text = ast.get_source_segment(source, statement) or source_line.strip()  # without a trailing comment
    if "_stash.append" in text:
        return indent + "pass", "stash hold (device bytes kept until their copy finishes)"
    if not SYNC_CALLS & set(names):
        return None
    if isinstance(statement, ast.Assign) and "record_event" in names:
        target = text.split("=", 1)[0].strip()
        return f"{indent}{target} = None", f"event record ({text})"
    if text.endswith(".popleft().synchronize()"):
        return indent + text[: -len(".synchronize()")], f"release-event wait ({text})"
    if "record_stream" in names:
        return indent + "pass", f"record_stream ({text})"
    if "wait_event" in names or "wait_stream" in names:
        return indent + "pass", f"stream wait ({text})"
    if "record_event" in names:
        return indent + "pass", f"event record ({text})"
    return indent + "pass", f"synchronize ({text})"


def find_mutants() -> List[Mutant]:
    mutants = []
    for path in FILES:
        source = (ROOT / path).read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.Expr, ast.Assign)) or node.lineno != node.end_lineno:
                continue
            found = _mutation(node, source, lines[node.lineno - 1])
            if found is not None:
                mutants.append(Mutant(path, node.lineno, lines[node.lineno - 1], *found))
    return sorted(mutants, key=lambda m: (m.path, m.line))


TIMEOUT_S = 900  # a mutant that hangs (a wait that never returns) counts as killed after this


def _pytest(workdir: Path, pytest_args: List[str]) -> int:
    """Exit status of the simulated tests in ``workdir`` (pytest's: 0 passed, 1 failed, other: broken run)."""
    env = {**os.environ, "PYTHONPATH": str(workdir)}
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-m", "simulated", "-x", "-q", "-p", "no:cacheprovider", *pytest_args],
            cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return 1
    return result.returncode


def run(mutant: Mutant, workdir: Path, pytest_args: List[str]) -> bool:
    """Whether the simulated tests fail (kill) with ``mutant`` applied."""
    target = workdir / mutant.path
    lines = (ROOT / mutant.path).read_text().splitlines(keepends=True)
    lines[mutant.line - 1] = mutant.replacement + "\n"
    target.write_text("".join(lines))
    try:
        status = _pytest(workdir, pytest_args)
    finally:
        shutil.copy(ROOT / mutant.path, target)
    if status not in (0, 1):  # an import error or no test collected says nothing about the mutant
        raise SystemExit(f"{mutant.path}:{mutant.line}: the simulated tests did not run (pytest exit {status})")
    return status == 1


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants without running them")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. a test file)")
    args = parser.parse_args(argv)
    mutants = find_mutants()
    if args.list:
        for m in mutants:
            print(f"{m.path}:{m.line}  {m.what}")
        return 0
    killed = 0
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        shutil.copytree(ROOT / "lightning_ac", workdir / "lightning_ac")
        shutil.copytree(ROOT / "tests", workdir / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", workdir / "pyproject.toml")
        baseline = _pytest(workdir, args.pytest_args)
        if baseline != 0:  # a mutant is killed only by tests that pass without it
            print(f"the simulated tests fail without any mutant (pytest exit {baseline}): fix them first")
            return 2
        for mutant in mutants:
            start = time.monotonic()
            dead = run(mutant, workdir, args.pytest_args)
            killed += dead
            status = "killed" if dead else "SURVIVED"
            print(
                f"{mutant.path}:{mutant.line}  {mutant.what}: {status} ({time.monotonic() - start:.0f} s)", flush=True
            )
    print(f"killed {killed} of {len(mutants)}")
    return 0 if killed == len(mutants) else 1


if __name__ == "__main__":
    sys.exit(main())
