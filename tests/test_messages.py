"""What users read: warnings attributed to their own line, the Hydra job's keys in its errors, and no deprecation
warning of the suite's own making (checked under ``simplefilter("always")``, not behind pyproject's filters)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import LM, batches, clone, make_trainer

from lightning_ac import ActivationCheckpointing, ActivationOffload, LayerOffload, LightningACWarning

ROOT = Path(__file__).resolve().parents[1]


def _fit_recording_warnings(model, callbacks):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(callbacks, max_steps=2).fit(LM(model), batches())  # the user's line each warning should name
    return caught


@pytest.mark.parametrize(
    "callbacks, message",
    [
        # the memory budget's "nothing fits" warning (lightning_ac/budget/controller.py)
        (lambda: [ActivationCheckpointing(budget=1)], "over the budget"),
        # the plan's warning about an ActivationOffload with no target (lightning_ac/plan.py)
        (lambda: [ActivationCheckpointing(), ActivationOffload()], "has no target"),
    ],
)
def test_a_warning_names_the_users_line_not_the_suites_module(llama, callbacks, message):
    caught = _fit_recording_warnings(clone(llama), callbacks())
    ours = [w for w in caught if issubclass(w.category, LightningACWarning) and message in str(w.message)]
    assert ours, [str(w.message) for w in caught]
    where = {(w.filename, w.lineno) for w in ours}
    assert where == {(__file__, _fit_line())}, where


def _fit_line() -> int:
    source = Path(__file__).read_text().splitlines()
    call = "make_trainer(callbacks, max_steps=2).fit(LM(model), batches())"
    return next(i for i, line in enumerate(source, 1) if call in line and "call =" not in line)


def test_the_suite_calls_no_deprecated_transformers_or_lightning_api(llama):
    """transformers' is_gradient_checkpointing FutureWarning comes from peft's get_peft_model (outside the fit here:
    the model is built before), Lightning's LeafSpec one from Lightning itself (README); every feature of the suite
    applied and removed adds no deprecation of its own."""
    from conftest import tiny_model

    lora = tiny_model("llama", lora=True)  # peft's FutureWarning, if any, here
    runs = [
        (
            clone(llama),
            [ActivationCheckpointing(selective=True), ActivationOffload(hidden_states="cpu", copy_on_host=True)],
        ),
        (clone(llama), [ActivationCheckpointing(budget="1GiB"), ActivationOffload(all="cpu", copy_on_host=True)]),
        (lora, [ActivationCheckpointing(kwargs={"every_n_layers": 2}), LayerOffload(copy_on_host=True)]),
    ]
    for model, callbacks in runs:
        caught = _fit_recording_warnings(model, callbacks)
        deprecation = (DeprecationWarning, FutureWarning, PendingDeprecationWarning)
        deprecations = [str(w.message) for w in caught if issubclass(w.category, deprecation)]
        # Lightning's own, each fit (README: not the suite's)
        theirs = [m for m in deprecations if "isinstance(treespec, LeafSpec)" in m]
        assert set(deprecations) - set(theirs) == set(), deprecations


def _train(*overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}
    cmd = [sys.executable, "examples/train.py", "trainer.max_steps=1", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("activation_checkpointing.foo=1", "error: activation_checkpointing: unknown field(s) 'foo'. Valid fields"),
        pytest.param(  # this and the next: slow session (a process each)
            "activation_checkpointing.offload.gpu=cpu",
            "error: activation_checkpointing.offload: unknown field(s)",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "activation_checkpointing.selective.saves=[attention]",
            "error: activation_checkpointing.selective: unknown",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_an_unknown_field_in_a_hydra_override_is_named_in_the_blocks_terms(override, expected):
    result = _train(override)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert expected in result.stderr, output
    assert "Schema" not in output and "OffloadConfig" not in output and "object_type" not in output, output
