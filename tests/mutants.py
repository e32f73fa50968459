"""Mutation check: small, plausible bugs put into a copy of the package, one at a time; the tests must catch each.

    python tests/mutants.py                      # every part; exits 1 if any mutant survives
    python tests/mutants.py --part loss budget   # some parts (sync, loss, budget, measure, estimate, tiled)
    python tests/mutants.py --list               # the mutants (and the equivalent changes), without running them
    python tests/mutants.py --only "backward"    # the mutants whose description holds this text

The ``sync`` part removes each synchronisation point of the transfer engines and runs the ``simulated`` tests
(stopping at the first failure): every synchronisation must be needed by some test. The other parts are lists of
behaviour mutants (``tests/mutation/<part>.py``), each run against the default tests it names. A mutant the tests
do not notice survives: a test is missing or too weak. One line per mutant, then ``killed K of N``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from mutation import Equivalent, Mutant  # noqa: E402
from mutation.sync import find_mutants as find_sync_mutants  # noqa: E402

PARTS = ("sync", "loss", "budget", "measure", "estimate", "tiled")
COPIED = ("lightning_ac", "tests", "conf", "examples", "scripts", "pyproject.toml", "README.md")
TIMEOUT_S = 900  # a mutant that hangs (a wait that never returns) counts as killed after this
SIMULATED = ("-m", "simulated")
DEFAULT = ("-m", "not slow and not gpu")


@dataclass(frozen=True)
class Run:
    """One mutant as the runner applies it: the file's new text and the pytest arguments that must fail."""

    part: str
    path: str
    where: str  # path:line
    what: str
    new_text: str
    pytest_args: Tuple[str, ...]


def _line_of(text: str, original: str) -> int:
    return text[: text.index(original)].count("\n") + 1


def behaviour_mutants(part: str) -> List[Mutant]:
    """The mutants listed in ``tests/mutation/<part>.py``."""
    return list(importlib.import_module(f"mutation.{part}").MUTANTS)


def equivalents(part: str) -> List[Equivalent]:
    """The changes ``tests/mutation/<part>.py`` judges equivalent, with the reason."""
    return list(getattr(importlib.import_module(f"mutation.{part}"), "EQUIVALENT", []))


def check_mutant(mutant: Mutant, root: Path = ROOT) -> Optional[str]:
    """Why ``mutant`` cannot be applied (its text is not found exactly once, it changes nothing, it names no test),
    or None."""
    source_path = root / mutant.path
    if not source_path.exists():
        return f"{mutant.path}: no such file"
    count = source_path.read_text().count(mutant.original)
    if count != 1:
        return f"{mutant.path}: {mutant.original!r} occurs {count} times (it must occur once)"
    if mutant.original == mutant.replacement:
        return f"{mutant.path}: {mutant.original!r} is replaced by itself"
    if not mutant.tests:
        return f"{mutant.path}: {mutant.what!r} names no test"
    return None


def runs(parts: Sequence[str], only: Optional[str] = None) -> List[Run]:
    """The mutants of ``parts`` as the runner applies them; a stale behaviour mutant stops here."""
    found: List[Run] = []
    for part in parts:
        if part == "sync":
            for m in find_sync_mutants(ROOT):
                lines = (ROOT / m.path).read_text().splitlines(keepends=True)
                lines[m.line - 1] = m.replacement + "\n"
                found.append(Run(part, m.path, f"{m.path}:{m.line}", m.what, "".join(lines), SIMULATED))
            continue
        for mutant in behaviour_mutants(part):
            problem = check_mutant(mutant)
            if problem is not None:
                raise SystemExit(f"stale mutant ({part}): {problem}")
            text = (ROOT / mutant.path).read_text()
            where = f"{mutant.path}:{_line_of(text, mutant.original)}"
            new_text = text.replace(mutant.original, mutant.replacement)
            found.append(Run(part, mutant.path, where, mutant.what, new_text, (*DEFAULT, *mutant.tests)))
    if only is not None:
        found = [r for r in found if only.lower() in r.what.lower()]
    return found


def _pytest(workdir: Path, pytest_args: Sequence[str]) -> int:
    """Exit status of pytest in ``workdir`` (0 passed, 1 failed, other: a broken run)."""
    env = {**os.environ, "PYTHONPATH": str(workdir)}
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *pytest_args],
            cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return 1
    return result.returncode


def run(mutant: Run, workdir: Path) -> bool:
    """Whether the tests fail (kill) with ``mutant`` applied."""
    target = workdir / mutant.path
    target.write_text(mutant.new_text)
    try:
        status = _pytest(workdir, mutant.pytest_args)
    finally:
        shutil.copy(ROOT / mutant.path, target)
    if status not in (0, 1):  # an import error or no test collected says nothing about the mutant
        raise SystemExit(
            f"{mutant.where}: the tests did not run (pytest exit {status}): {' '.join(mutant.pytest_args)}"
        )
    return status == 1


def _baselines(chosen: List[Run]) -> List[Tuple[str, ...]]:
    """Each distinct set of pytest arguments once: the tests that must pass without any mutant."""
    seen: List[Tuple[str, ...]] = []
    for r in chosen:
        if r.pytest_args not in seen:
            seen.append(r.pytest_args)
    return seen


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", nargs="+", choices=PARTS, default=list(PARTS), help="the parts to mutate")
    parser.add_argument("--list", action="store_true", help="list the mutants without running them")
    parser.add_argument("--only", help="only the mutants whose description holds this text (case-insensitive)")
    args = parser.parse_args(argv)
    chosen = runs(args.part, args.only)
    if args.list:
        for r in chosen:
            print(f"[{r.part}] {r.where}  {r.what}  <- {' '.join(r.pytest_args[2:]) or 'the simulated tests'}")
        for part in args.part:
            for e in equivalents(part) if part != "sync" else []:
                print(f"[{part}] equivalent: {e.path}: {e.original!r} -> {e.replacement!r}: {e.why}")
        return 0
    killed = 0
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for name in COPIED:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, workdir / name, ignore=shutil.ignore_patterns("__pycache__", "outputs"))
            elif source.exists():
                shutil.copy(source, workdir / name)
        # a mutant is killed only by tests that pass without it
        for pytest_args in _baselines(chosen):
            baseline = _pytest(workdir, pytest_args)
            if baseline != 0:
                print(f"the tests fail without any mutant (pytest exit {baseline}): {' '.join(pytest_args)}")
                return 2
        for mutant in chosen:
            start = time.monotonic()
            dead = run(mutant, workdir)
            killed += dead
            status = "killed" if dead else "SURVIVED"
            print(
                f"[{mutant.part}] {mutant.where}  {mutant.what}: {status} ({time.monotonic() - start:.0f} s)",
                flush=True,
            )
    print(f"killed {killed} of {len(chosen)}")
    return 0 if killed == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
