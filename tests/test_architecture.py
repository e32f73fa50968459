"""The package's shape: no import circle, the block parsed once on every path, strategy checks by type."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import clone, fit, tiny_model

import lightning_ac.config.block
from lightning_ac import ActivationCheckpointing, ActivationOffload, ConfigError, LayerOffload, callbacks_from_config

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_ac"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set) -> set:
    """Every lightning_ac module ``path`` imports, anywhere in the file (inside functions and TYPE_CHECKING
    blocks too: an import deferred to run time still ties the two modules together)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # "from lightning_ac.offload import weights" names a module, "from lightning_ac.config import X" a name
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def _import_graph() -> dict:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): _imports(f, modules) - {_module_name(f)} for f in files}


# Tooling packages: they import the core, never the other way (the estimator runs the benchmark's modes).
TOOLING = ("lightning_ac.bench", "lightning_ac.estimate")


def test_the_core_never_imports_the_tooling():
    """lightning_ac.bench and lightning_ac.estimate import the core, never the other way (the memory budget measures
    with lightning_ac.memory, which the benchmark shares)."""
    graph = _import_graph()
    core = {m: deps for m, deps in graph.items() if not m.startswith(TOOLING)}
    assert not {
        m: sorted(d for d in deps if d.startswith(TOOLING))
        for m, deps in core.items()
        if any(d.startswith(TOOLING) for d in deps)
    }


def test_no_import_circle():
    """Read every module's imports and look for a circle. A package's own __init__ importing its modules is
    not a circle with them (Python runs it first either way), so edges into one's own parent package count
    only when written."""
    graph = _import_graph()
    assert "lightning_ac.plan" in graph and "lightning_ac.callbacks" not in graph["lightning_ac.plan"]
    state: dict = {}

    def visit(module: str, path: list) -> None:
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                cycle = path[path.index(dep) :] + [dep]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_modules_import_in_dependency_order():
    """In a fresh interpreter, each module imports after the modules it depends on and before those that
    depend on it (a circle through a package __init__ would fail here with a partially initialised module)."""
    graph = _import_graph()
    order: list = []

    def place(module: str) -> None:
        if module in order:
            return
        for dep in sorted(graph[module]):
            place(dep)
        order.append(module)

    for module in sorted(graph):
        place(module)
    order = [m for m in order if not m.endswith("__main__")]
    script = "\n".join(
        [
            "import importlib, sys",
            "for name in sys.argv[1:]:",
            "    print(name, flush=True)",
            "    importlib.import_module(name)",
        ]
    )
    result = subprocess.run([sys.executable, "-c", script, *order], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, f"{result.stdout.splitlines()[-1:]}:\n{result.stderr[-2000:]}"
    assert result.stdout.split() == order


@pytest.fixture
def parse_count(monkeypatch):
    calls = []
    original = lightning_ac.config.block._parse_block

    def counting(value):
        calls.append(value)
        return original(value)

    monkeypatch.setattr(lightning_ac.config.block, "_parse_block", counting)
    return calls


def test_python_path_parses_once(parse_count):
    fit(
        clone(tiny_model("llama")),
        [ActivationCheckpointing(selective=True), ActivationOffload(hidden_states="cpu", copy_on_host=True)],
        max_steps=1,
    )
    assert len(parse_count) == 1


@pytest.fixture
def combination_checks(monkeypatch):
    import lightning_ac.config.requests

    calls = []
    for module in (lightning_ac.config.block, lightning_ac.config.requests):
        original = module.check_combination

        def counting(cfg, original=original):
            calls.append(cfg)
            return original(cfg)

        monkeypatch.setattr(module, "check_combination", counting)
    return calls


def test_the_dict_path_checks_the_combination_once(combination_checks):
    callbacks = callbacks_from_config({"selective": True, "offload": {"hidden_states": "cpu"}}, copy_on_host=True)
    fit(clone(tiny_model("llama")), callbacks, max_steps=1)
    assert len(combination_checks) == 1, "the requests cut from one checked block are merged without a second check"


def test_the_python_path_checks_the_merged_requests(combination_checks):
    with pytest.raises(ConfigError, match="offload.selective"):
        fit(clone(tiny_model("llama")), [ActivationCheckpointing(), ActivationOffload(selective="cpu")], max_steps=1)
    assert len(combination_checks) == 2, "the callback's own block, then the requests together"


def test_callbacks_from_a_block_are_the_callbacks_built_by_hand():
    """callbacks_from_config's callbacks skip only the argument parsing: their state is a hand-built callback's."""
    from_block = callbacks_from_config(
        {"selective": True, "offload": {"hidden_states": "cpu"}},
        layer_offloading=True,
        layer_offloading_resident_layers=1,
        copy_on_host=True,
        verify_steps=2,
        verbose=True,
    )
    by_hand = [
        ActivationCheckpointing(selective=True, verbose=True),
        ActivationOffload(hidden_states="cpu", copy_on_host=True, verify_steps=2, verbose=True),
        LayerOffload(copy_on_host=True, resident_layers=1, verify_steps=2, verbose=True),
    ]
    assert [type(c) for c in from_block] == [type(c) for c in by_hand]
    for built, hand in zip(from_block, by_hand):
        assert built.request.__dict__.keys() == hand.request.__dict__.keys()
        if not isinstance(built, ActivationCheckpointing):
            assert built.request == hand.request
        else:
            assert built.request.config == hand.request.config
        assert _state(built) == _state(hand)


def _state(callback) -> dict:
    """A callback's attributes but its request, objects as their type and attributes."""
    return {k: (type(v), vars(v)) if hasattr(v, "__dict__") else v for k, v in vars(callback).items() if k != "request"}


@pytest.mark.parametrize("block", [{"selective": True, "offload": {"hidden_states": "cpu"}}, True])
def test_dict_path_parses_once(parse_count, block):
    callbacks = callbacks_from_config(block, copy_on_host=True)
    fit(clone(tiny_model("llama")), callbacks, max_steps=1)
    assert len(parse_count) == 1


def test_hydra_path_parses_once(tmp_path):
    """The main job in a subprocess: Hydra composes the block, the job parses it, callbacks_from_config and the
    plan take it as it is."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scripts" / "count_parses.py"), f"hydra.run.dir={tmp_path}",
         "activation_checkpointing=offload_hidden_selective", "offload_copy_on_host=true", "trainer.max_steps=2",
         "measure.warmup_steps=0", "measure.memory_step=1", "model.config.hidden_size=64",
         "model.config.intermediate_size=128", "data.seq_len=32", "data.batch_size=2"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    counted = json.loads((tmp_path / "parse_count.json").read_text())
    assert counted == {"validations": 1}, counted
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2


def test_strategy_checks_see_subclasses():
    """A user's subclass of a sharding strategy is still a sharding strategy (the checks used class names)."""
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_ac.config import LayerOffloadRequest
    from lightning_ac.plan import Plan

    class MyFSDP(FSDPStrategy):
        pass

    trainer = SimpleNamespace(strategy=MyFSDP())
    with pytest.raises(ConfigError, match="MyFSDP shards them"):
        Plan(layer_offload=LayerOffloadRequest(copy_on_host=True)).check_strategy(trainer)
    plan = Plan(lightning_ac.config.CheckpointingRequest.from_arguments(implementation="fsdp"))
    plan.check_strategy(trainer)  # implementation: fsdp accepts the subclass


def test_requests_use_the_block_error_shape():
    """One dialect: the field as the user wrote it, what it takes, what it got."""
    with pytest.raises(
        ConfigError, match=r"ActivationOffload\(copy_on_host=\.\.\.\): expected true or false, got 'yes'"
    ):
        ActivationOffload(copy_on_host="yes")
    # "no" as text would be true as a truth value: the message says it is text
    with pytest.raises(ConfigError, match=r"got 'no'\. It is text, not a boolean: .* \(in Python True or False\)"):
        ActivationCheckpointing(verbose="no")
    # true/false as text, as a command line or YAML writes them, are the booleans they spell
    assert ActivationCheckpointing(verbose="False").verbose is False and LayerOffload(copy_on_host="TRUE").copy_on_host
    offload = ActivationOffload(hidden_states="true", all="FALSE")
    assert offload.offload.hidden_states == "cpu" and offload.offload.all == "none"
    with pytest.raises(ConfigError) as info:
        ActivationOffload(hidden_states="gpu")
    assert str(info.value) == (
        "ActivationOffload(hidden_states=...): expected none, cpu, auto, true or false, got 'gpu'. "
        "Pass hidden_states='cpu' or hidden_states='none'."
    )
    with pytest.raises(ConfigError, match=r"ActivationOffload: hidden_states: cpu cannot be combined with all"):
        ActivationOffload(hidden_states="cpu", all="cpu")
    with pytest.raises(ConfigError, match=r"activation_checkpointing.offload: hidden_states: cpu cannot be combined"):
        callbacks_from_config({"offload": {"hidden_states": "cpu", "all": "cpu"}})


def _closure(graph: dict, module: str) -> set:
    seen, todo = set(), [module]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_release_gate_imports_no_engine():
    """Engines ask the gate before they act; the checks, which run the engines on a toy model, sit above it and
    register there. The gate reaching an engine (or the checks) would run the layering back up."""
    graph = _import_graph()
    assert _closure(graph, "lightning_ac.release_gate") <= {"lightning_ac._compat", "lightning_ac._logging"}
    for engine in ("lightning_ac.plan.core", "lightning_ac.selective.apply"):
        assert "lightning_ac.release_gate" in graph[engine]
        assert not any(m.startswith("lightning_ac.selfcheck") for m in graph[engine]), engine


def test_the_base_callback_names_no_subclass():
    """SuiteCallback gathers its peers' requests by the kind each declares: a new callback needs no edit there."""
    tree = ast.parse((PACKAGE / "callbacks" / "base.py").read_text())
    named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }
    assert not named & {"ActivationCheckpointing", "ActivationOffload", "LayerOffload"}


def test_no_module_imports_another_modules_private_names():
    """A name with a leading underscore belongs to its module: one that another module needs is made public there
    (a private module, like _compat, may still be imported whole)."""
    modules = {_module_name(f) for f in PACKAGE.rglob("*.py")}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_ac"):
                found += [
                    f"{_module_name(path)}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and f"{node.module}.{alias.name}" not in modules
                ]
    assert found == []


MAX_FILE_LINES, MAX_CLASS_LINES = 400, 300


def test_no_file_or_class_outgrows_one_job():
    """About 400 lines a file and 300 a class: past that a module holds several jobs (torchtitan's activation
    checkpointing is 337 lines; Lightning keeps one callback a file)."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(ROOT))
        text = path.read_text()
        classes = [
            f"{name}:{n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(ast.parse(text))
            if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > MAX_CLASS_LINES
        ]
        lines = len(text.splitlines())
        too_long += classes + ([f"{name} ({lines} lines)"] if lines > MAX_FILE_LINES else [])
    assert too_long == []
