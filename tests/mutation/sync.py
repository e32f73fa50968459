"""The transfer engines' synchronisation mutants: each removes one synchronisation point from
``lightning_ac/offload/engine.py`` or layer offloading's host buffers and residency (an event record, an event or
stream wait, a record_stream, the stash hold, a release-event wait, an end-of-step synchronize). Every one must be
needed by some ``simulated`` test: a survivor is a missing test or a synchronisation nothing needs."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

FILES = (
    "lightning_ac/offload/engine.py",
    "lightning_ac/offload/weights/host.py",
    "lightning_ac/offload/weights/residency.py",
)
SYNC_CALLS = {"wait_stream", "wait_event", "record_event", "record_stream", "synchronize"}


@dataclass(frozen=True)
class LineMutant:
    """A mutant that replaces one whole line."""

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
    if "_stash_push(" in text:
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


def find_mutants(root: Path) -> List[LineMutant]:
    """Every synchronisation mutant of :data:`FILES` under ``root``, in file and line order."""
    mutants = []
    for path in FILES:
        source = (root / path).read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.Expr, ast.Assign)) or node.lineno != node.end_lineno:
                continue
            found = _mutation(node, source, lines[node.lineno - 1])
            if found is not None:
                mutants.append(LineMutant(path, node.lineno, lines[node.lineno - 1], *found))
    return sorted(mutants, key=lambda m: (m.path, m.line))
