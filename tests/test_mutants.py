"""The mutation check's lists stay in step with the code: each behaviour mutant still applies (its text occurs once,
so a moved or renamed line stops here, not in a mutation run hours later) and names default tests that exist."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import mutants  # noqa: E402
from mutation import sync  # noqa: E402

BEHAVIOUR_PARTS = [part for part in mutants.PARTS if part != "sync"]


def _test_functions(path: Path) -> set:
    tree = ast.parse(path.read_text())
    names = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)}
    return names


@pytest.mark.parametrize("part", BEHAVIOUR_PARTS)
def test_every_mutant_applies_and_names_existing_default_tests(part: str) -> None:
    listed = mutants.behaviour_mutants(part)
    assert listed, f"the {part} part lists no mutant"
    for mutant in listed:
        assert mutants.check_mutant(mutant) is None, mutants.check_mutant(mutant)
        for node_id in mutant.tests:
            file, _, name = node_id.partition("::")
            assert (ROOT / file).is_file(), f"{mutant.what}: {file} does not exist"
            if name:
                assert name.split("[")[0] in _test_functions(ROOT / file), f"{mutant.what}: no test {node_id}"


@pytest.mark.parametrize("part", BEHAVIOUR_PARTS)
def test_equivalent_changes_say_why_and_still_apply(part: str) -> None:
    for equivalent in mutants.equivalents(part):
        assert equivalent.why.strip(), equivalent
        assert (ROOT / equivalent.path).read_text().count(equivalent.original) == 1, equivalent


def test_the_sync_part_finds_the_engines_synchronisation() -> None:
    found = mutants.runs(["sync"])
    assert len(found) >= 16  # the 16 of the offload engines when the check was written; a refactor must keep them
    assert {r.path for r in found} == set(sync.FILES)
