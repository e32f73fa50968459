"""Every Python and YAML example of the README and of docs/ runs, so that no example drifts from the code.

The Python blocks of a page run in order in one namespace (a later block may use what an earlier one made), in a
fresh directory. A YAML block is what a user would give the suite: an ``activation_checkpointing`` block (and
``layer_offloading``) goes through ``callbacks_from_config``; ``trainer.callbacks`` entries (LightningCLI) are built
from their ``class_path`` and ``init_args``. An HTML comment on the line before a block marks it:
``<!-- test: slow (why) -->`` runs it in the slow session, ``<!-- test: gpu (why) -->`` where CUDA exists.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^(?:<!-- test: (?P<mark>\w+)[^>]*-->\n)?```(?P<lang>\w*)\n(?P<body>.*?)^```", re.S | re.M)


@dataclass
class Example:
    page: Path
    line: int
    lang: str
    body: str
    mark: Optional[str]

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def examples(lang: str) -> List[Example]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            if match["lang"] == lang:
                line = text[: match.start("body")].count("\n")
                found.append(Example(page, line, lang, match["body"], match["mark"]))
    return found


def _marks(mark: Optional[str]) -> list:
    if mark is None:
        return []
    assert mark in ("slow", "gpu"), f"unknown test mark {mark!r}: slow or gpu"
    return [getattr(pytest.mark, mark)]


def _pages_with_python() -> list:
    by_page = {}
    for example in examples("python"):
        by_page.setdefault(example.page, []).append(example)
    params = []
    for page, blocks in by_page.items():
        marks = [m for b in blocks for m in _marks(b.mark)]
        params.append(pytest.param(blocks, id=str(page.relative_to(ROOT)), marks=marks))
    return params


@pytest.mark.parametrize("blocks", _pages_with_python())
def test_python_examples_run(blocks: List[Example], tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs_example__"}
    for block in blocks:
        code = compile(block.body, block.name, "exec")  # a traceback names the page and its line
        exec(code, namespace)  # noqa: S102


def _build_cli_callbacks(entries: list) -> list:
    built = []
    for entry in entries:
        module, _, name = entry["class_path"].rpartition(".")
        built.append(getattr(importlib.import_module(module), name)(**entry.get("init_args", {})))
    return built


@pytest.mark.parametrize("example", [pytest.param(e, id=e.name, marks=_marks(e.mark)) for e in examples("yaml")])
def test_yaml_examples_are_accepted(example: Example) -> None:
    from omegaconf import OmegaConf

    from lightning_ac import callbacks_from_config

    loaded = yaml.safe_load(example.body)
    if "activation_checkpointing" in loaded:
        cfg = OmegaConf.create(loaded)
        layer_offloading = cfg.get("layer_offloading", False)
        callbacks = callbacks_from_config(cfg.activation_checkpointing, layer_offloading=layer_offloading)
    else:
        callbacks = _build_cli_callbacks(loaded["trainer"]["callbacks"])
    assert callbacks, f"{example.name}: the example builds no callback"


def test_every_example_is_found() -> None:
    """The pattern sees the fences the pages use: a page whose example it missed would pass untested."""
    fences = sum(len(re.findall(r"^```(?:python|yaml)$", page.read_text(), re.M)) for page in PAGES)
    assert fences == len(examples("python")) + len(examples("yaml"))


def _mode_table(page: Path) -> str:
    text = page.read_text()
    start = text.index("| you need | use | what it costs |")
    return text[start : text.index("\n\n", start)]


def test_the_readme_mode_table_is_the_manuals() -> None:
    """The front door repeats one table of the manual's home page: the two must not drift apart."""
    assert _mode_table(ROOT / "README.md") == _mode_table(ROOT / "docs" / "index.md")
