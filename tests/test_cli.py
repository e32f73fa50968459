"""The Hydra main job, run as users run it: `python examples/train.py ...` in a subprocess."""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# A tiny model and a few steps: these tests check wiring, not training quality.
SMALL = [
    "trainer.max_steps=4",
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "data.seq_len=32",
    "data.batch_size=2",
    "print_every=1",
]


def train(tmp_path: Path, *overrides: str, multirun: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}
    dirs = [f"hydra.sweep.dir={tmp_path}/sweep"] if multirun else [f"hydra.run.dir={tmp_path}/run"]
    cmd = [sys.executable, "examples/train.py", *(["-m"] if multirun else []), *SMALL, *dirs, *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "run" / "summary.json").read_text())


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_default_run_trains_and_writes_summary(tmp_path):
    result = ok(train(tmp_path))
    data = summary(tmp_path)
    assert data["mode"] == "off" and data["model"] == "llama"
    assert data["activation_checkpointing"]["enabled"] is False
    assert data["layer_offloading"] is False
    assert data["steps"] == 4
    assert data["final_loss"] < data["first_loss"], "the loss goes down"
    assert data["peak_memory_bytes"] > 0 and data["peak_activation_bytes"] > 0
    assert data["step_time_s"] > 0
    assert data["cpu_capability"] == torch.backends.cpu.get_cpu_capability(), "the losses depend on it too"
    assert "loss" in result.stdout + result.stderr
    corpus = re.search(r"corpus: (\d+) characters, the docstrings of a fixed list of (\S+ \S+)'s", result.stdout)
    assert corpus and corpus[2] == f"{platform.python_implementation()} {platform.python_version()}"


def _corpus_digest(setup: str) -> str:
    """The main job's corpus, as its data loader reads it, in a fresh process that first runs ``setup``."""
    code = (
        f"import hashlib, sys; sys.path.insert(0, 'examples'); {setup}; import lm; text = lm.corpus_text(); "
        "print(len(text), hashlib.sha256(text.encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split("\n")[-2]


@pytest.mark.slow  # three processes of their own; moved to keep the default run under 15 minutes
def test_the_corpus_is_the_same_whatever_the_process_imported_or_replaced():
    """The loss reproduces across installs only if the text does: it is a function of the Python version alone, not
    of the submodules other libraries import (dir() of a package lists them) or the functions they replace."""
    alone = _corpus_digest("pass")
    crowded = _corpus_digest(
        "import transformers, peft, hydra, matplotlib.pyplot, lightning_ac, email.mime.text, logging.handlers, "
        "unittest.mock, http.cookiejar, xml.dom.minidom; import asyncio; asyncio.run = lambda main, debug=None: None"
    )
    assert alone == crowded
    assert int(alone.split()[0]) > 8 * 256 * 100, "100 steps of 8 x 256 bytes read each chunk at most once"


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_progress_off_a_terminal_is_a_line_a_step_with_the_time_left(tmp_path):
    """Without a terminal (a log, CI, this test) Lightning's progress bar prints nothing readable: the job logs a
    line every step, whatever print_every says, with the time a step takes and the time left."""
    output = "".join(ok(train(tmp_path, "print_every=10")).stdout)
    lines = re.findall(r"step +(\d+)/4  loss \d+\.\d{4}  \d+\.\d\d s a step, (\d+) s left", output)
    assert [int(step) for step, _ in lines] == [1, 2, 3, 4], output[-2000:]
    assert lines[-1][1] == "0"
    assert "train.log" in os.listdir(tmp_path / "run") and "step    2/4" in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.slow  # a second run of the job; the choice itself is checked in-process below
def test_progress_bar_is_lightnings(tmp_path):
    result = ok(train(tmp_path, "progress=bar"))
    assert "Epoch 0" in result.stdout, "Lightning's progress bar (it draws itself even off a terminal)"
    assert " s left" not in result.stdout


@pytest.mark.slow  # two processes (one on a pseudo-terminal); progress lines off a terminal stay in the default run
def test_progress_auto_is_the_bar_on_a_terminal_and_lines_elsewhere():
    """Where stdout (Lightning's bar's stream) is a terminal, auto is the bar; piped, it is lines."""
    # in processes of their own: importing the job sets its warning filters and puts examples/ on the path
    code = (
        "import sys; sys.path.insert(0, 'examples'); from train import progress_mode as p; "
        "print(p('auto'), p(' Lines '), p('bar'), flush=True)"
    )
    cmd, env = [sys.executable, "-c", code], {**os.environ, "PYTHONPATH": str(ROOT)}
    piped = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert piped.stdout.split() == ["lines", "lines", "bar"]
    pty = pytest.importorskip("pty")
    leader, follower = pty.openpty()
    try:
        on_terminal = subprocess.run(cmd, cwd=ROOT, env=env, stdout=follower, stderr=subprocess.PIPE, timeout=300)
        assert on_terminal.returncode == 0, on_terminal.stderr[-3000:]
        assert os.read(leader, 1000).decode().split() == ["bar", "lines", "bar"]
    finally:
        os.close(leader)
        os.close(follower)


@pytest.mark.parametrize(
    "overrides, applied, checkpointed",
    [
        (["activation_checkpointing=full"], {"enabled": True}, "2/2"),
        pytest.param(  # every_2 and selective_attn also train in test_multirun_writes_sweep_summary
            ["activation_checkpointing=every_2"], {"kwargs": {"every_n_layers": 2}}, "1/2", marks=pytest.mark.slow
        ),
        # each case is a process of its own: the ones whose block is also run elsewhere go to the slow session
        pytest.param(  # reentrant: test_checkpointing, test_offload
            ["activation_checkpointing=full", "activation_checkpointing.reentrant=true"],
            {"reentrant": True},
            "2/2",
            marks=pytest.mark.slow,
        ),
        # qwen3 also runs in test_a_boolean_mode_and_a_run_too_short_to_measure: slow session only
        pytest.param(
            ["model=qwen3", "activation_checkpointing=full"], {"enabled": True}, "2/2", marks=pytest.mark.slow
        ),
        pytest.param(  # gemma3: test_checkpointing, test_selective
            ["model=gemma3", "activation_checkpointing=full"], {"enabled": True}, "2/2", marks=pytest.mark.slow
        ),
        pytest.param(
            ["activation_checkpointing=selective_attn"],
            {"selective": {"save": ["attention"]}},
            "2/2",
            marks=pytest.mark.slow,
        ),
        pytest.param(  # the nested selective group (the README's first route to SAC): slow session only
            ["activation_checkpointing=full", "activation_checkpointing/selective=attention_mm"],
            {"selective": {"save": ["attention", "aten::mm"]}},
            "2/2",
            marks=pytest.mark.slow,
        ),
        pytest.param(  # save_modules: the README's route below sets it too
            ["activation_checkpointing=full", "activation_checkpointing.selective={save:[],save_modules:[o_proj]}"],
            {"selective": {"save": [], "save_modules": ["o_proj"]}},
            "2/2",
            marks=pytest.mark.slow,
        ),
        (  # the README's route to selective's fields: selective=true, then the fields
            [
                "activation_checkpointing=full",
                "activation_checkpointing.selective=true",
                "activation_checkpointing.selective.save=[attention]",
                "activation_checkpointing.selective.save_modules=[o_proj]",
            ],
            {"selective": {"save": ["attention"], "save_modules": ["o_proj"]}},
            "2/2",
        ),
        pytest.param(  # the tiled MLP on an option, as Hydra takes it (the MLP only, 8-token tiles): slow session
            [
                "activation_checkpointing=selective_attn",
                "activation_checkpointing.tiled_mlp={tile_tokens:8,norms:false}",
            ],
            {
                "selective": {"save": ["attention"]},
                "tiled_mlp": {"tile_tokens": 8, "norms": False, "mlp_modules": None},
            },
            "2/2",
            marks=pytest.mark.slow,
        ),
        pytest.param(  # the same block as selective_attn, by another syntax: slow session only
            ["activation_checkpointing=full", "activation_checkpointing.selective=true"],
            {"selective": {"save": ["attention"]}},
            "2/2",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_modes_apply(tmp_path, overrides, applied, checkpointed):
    result = ok(train(tmp_path, *overrides))
    block = summary(tmp_path)["activation_checkpointing"]
    for key, value in applied.items():
        if isinstance(value, dict) and isinstance(block[key], dict):
            assert {k: block[key][k] for k in value} == value
        else:
            assert block[key] == value
    assert f"checkpointing {checkpointed} decoder layers" in result.stdout + result.stderr


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_full_matches_off_loss_and_saves_memory(tmp_path):
    ok(train(tmp_path / "off"))
    ok(train(tmp_path / "full", "activation_checkpointing=full"))
    off, full = summary(tmp_path / "off"), summary(tmp_path / "full")
    assert off["final_loss"] == full["final_loss"]
    assert full["peak_activation_bytes"] < off["peak_activation_bytes"]


@pytest.mark.parametrize(
    "overrides, targets",
    [
        # Each option's block is checked without a run (test_config, test_offload); here one offload mode runs
        # through the job in the default session (the nested-group case), the others in the slow session
        # (offload.all: at 256 tokens each layer's input is 128 KiB, over min_offload_bytes; the head's logits and the
        # loss over them, the largest saved tensors, stay on the device)
        pytest.param(
            ["activation_checkpointing=offload_all", "data.seq_len=256"], {"all": True}, marks=pytest.mark.slow
        ),
        pytest.param(
            ["activation_checkpointing=offload_only", "data.seq_len=256"], {"all": True}, marks=pytest.mark.slow
        ),
        pytest.param(["activation_checkpointing=offload_hidden"], {"hidden_states": True}, marks=pytest.mark.slow),
        pytest.param(
            ["activation_checkpointing=offload_hidden_selective"],
            {"hidden_states": True, "selective": True},
            marks=pytest.mark.slow,
        ),
        (["activation_checkpointing=full", "activation_checkpointing/offload=hidden_states"], {"hidden_states": True}),
    ],
)
def test_offload_modes(tmp_path, overrides, targets):
    # On a CPU-only trainer offloading is skipped, and says so...
    result = ok(train(tmp_path / "skip", *overrides))
    assert "activation offloading does nothing on a CPU-only trainer" in result.stdout + result.stderr
    assert summary(tmp_path / "skip")["offload"] == {
        t: {"tensors": 0, "bytes": 0} for t in ("hidden_states", "selective", "all")
    }
    # ...unless the copies are forced, which must not change training.
    ok(train(tmp_path / "copy", *overrides, "offload_copy_on_host=true"))
    copied, skipped = summary(tmp_path / "copy"), summary(tmp_path / "skip")
    assert copied["final_loss"] == skipped["final_loss"]
    for target in ("hidden_states", "selective", "all"):
        assert (copied["offload"][target]["bytes"] > 0) == targets.get(target, False), target


def test_layer_offloading_needs_an_accelerator(tmp_path):
    result = train(tmp_path / "cpu", "activation_checkpointing=full", "layer_offloading=true")
    assert result.returncode == 2
    assert "layer_offloading: true needs an accelerator" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "cpu" / "run" / "summary.json").exists()


@pytest.mark.slow  # layer offloading with forced copies and verify mode: test_layer_offload, test_verify
def test_layer_offloading_with_forced_copies_trains_as_without(tmp_path):
    # forced copies on CPU: the whole path but the streams, and training exactly as without it
    forced_overrides = ("activation_checkpointing=full", "layer_offloading=true", "offload_copy_on_host=true")
    # with verify mode on its first step (Hydra's offload_verify_steps), which changes nothing it checks
    result = ok(train(tmp_path / "forced", *forced_overrides, "offload_verify_steps=1"))
    assert "verified 1 step: gradients bit-identical to synchronous transfers (layer offloading)" in result.stdout
    ok(train(tmp_path / "plain", "activation_checkpointing=full"))
    forced, plain = summary(tmp_path / "forced"), summary(tmp_path / "plain")
    assert forced["layer_offloading"] is True and plain["layer_offload"] is None
    assert forced["layer_offload"]["loads"] == 4 and forced["layer_offload"]["max_resident_layers"] == 2
    assert forced["final_loss"] == plain["final_loss"]


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["activation_checkpointing.offload.all=disk"], ["offload.all", "disk", "pending a fix"]),
        pytest.param(["report=no"], ["report: expected true or false, got 'no'"], marks=pytest.mark.slow),
        (
            ["activation_checkpointing=full", "++activation_checkpointing.kwargs.every_n_layers=0"],
            ["every_n_layers", ">= 1"],
        ),
        # The block's rules are tested without a run (test_config, test_legacy); these reach them through the job,
        # each a process of its own: the slow session runs them
        pytest.param(
            ["activation_checkpointing=off", "activation_checkpointing.reentrant=true"],
            ["enabled is false", "reentrant"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["activation_checkpointing=full", "+activation_checkpointing.kwargs.use_cache=false"],
            ["use_cache"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["+gradient_checkpointing=offload_disk"], ["offload_disk", "pending a fix"], marks=pytest.mark.slow
        ),
        pytest.param(
            ["activation_checkpointing=full", "+gradient_checkpointing=true"],
            ["next to activation_checkpointing"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["activation_checkpointing=selective_attn", "activation_checkpointing.reentrant=true"],
            ["requires non-reentrant"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["activation_checkpointing=selective_attn", "activation_checkpointing.selective.save_matmul_min_k=0"],
            ["save_matmul_min_k"],
            marks=pytest.mark.slow,
        ),
        # a value of the wrong type is ours to report (status 2), not a composition traceback
        (["activation_checkpointing.enabled=maybe"], ["activation_checkpointing.enabled", "'maybe'"]),
        pytest.param(
            ["activation_checkpointing=schema"],
            ["schema is the fields every option extends", "off, offload_all"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["progress=maybe"], ["progress: expected auto, bar or lines, got 'maybe'"], marks=pytest.mark.slow
        ),
        pytest.param(
            ["+trainer.enable_progress_bar=true"],
            ["trainer.enable_progress_bar=True: the job's progress key chooses it. Set progress=bar"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["offload_verify_steps=-1"],
            ["offload_verify_steps: expected an integer >= 0, got -1"],
            marks=pytest.mark.slow,
        ),
        # checked although no LayerOffload is built (layer_offloading is false): slow session only
        pytest.param(
            ["layer_offloading_resident_layers=-3"],
            ["layer_offloading_resident_layers: expected an integer >= 0"],
            marks=pytest.mark.slow,
        ),
    ],
)
def test_bad_values_fail_before_training(tmp_path, overrides, fragments):
    result = train(tmp_path, *overrides)
    assert result.returncode == 2, result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in result.stderr
    assert "Traceback" not in result.stderr
    assert "step    1" not in result.stdout + result.stderr
    # the run's log says why it stopped, too
    assert "error: " in (tmp_path / "run" / "train.log").read_text()


def test_help_lists_each_mode_with_a_line_not_the_schema():
    result = subprocess.run([sys.executable, "examples/train.py", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = result.stdout
    modes = sorted(p.stem for p in (ROOT / "conf" / "activation_checkpointing").glob("*.yaml"))
    for mode in modes:
        assert re.search(rf"^  {mode} +\S", text, re.MULTILINE), f"{mode} is listed with a description"
    assert "schema" not in text
    assert "summary.json" in text and "multirun/" in text


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_a_boolean_mode_and_a_run_too_short_to_measure(tmp_path):
    """activation_checkpointing=true (the block's own syntax) is the option full; two steps are all warm-up, and
    the job says nothing was timed instead of printing nan; it says where the summary went; and it prints no
    third-party noise it can turn off (Qwen3's config asks for the KV cache, which checkpointing turns off)."""
    result = ok(train(tmp_path, "activation_checkpointing=true", "trainer.max_steps=2", "model=qwen3"))
    output = result.stdout + result.stderr
    # and no third-party noise the job can turn off: transformers' cache warning, Lightning's tip, torch deprecations
    for noise in ("use_cache=True", "litlogger", "LeafSpec"):
        assert noise not in output, noise
    assert summary(tmp_path)["mode"] == "full" and summary(tmp_path)["activation_checkpointing"]["enabled"] is True
    assert "step time not measured (trainer.max_steps=2 leaves no step after" in output
    assert "nan" not in output
    assert f"summary: {tmp_path / 'run' / 'summary.json'}" in output


def test_unknown_field_fails_at_composition(tmp_path):
    result = train(tmp_path, "activation_checkpointing.typo=1")
    assert result.returncode != 0
    assert "typo" in result.stderr


def test_resident_layers_without_layer_offloading_stop_the_job_before_it_trains(tmp_path):
    result = train(tmp_path, "layer_offloading_resident_layers=2")
    assert result.returncode != 0
    assert "layer_offloading_resident_layers: 2 keeps" in result.stderr and "layer_offloading is false" in result.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_override_any_field_on_any_option(tmp_path):
    ok(train(tmp_path, "activation_checkpointing=every_2", "activation_checkpointing.kwargs.every_n_layers=1"))
    assert summary(tmp_path)["activation_checkpointing"]["kwargs"] == {"every_n_layers": 1}


def test_nested_groups_compose(tmp_path):
    # The nested offload group merges into the chosen option (here into a mode whose offload is off).
    result = train(tmp_path, "activation_checkpointing=offload_all", "activation_checkpointing/offload=none")
    ok(result)
    assert summary(tmp_path)["activation_checkpointing"]["offload"]["all"] == "none"


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_legacy_key_is_migrated_with_warning(tmp_path):
    result = ok(train(tmp_path, "+gradient_checkpointing=true", "+gradient_checkpointing_kwargs.use_reentrant=true"))
    output = result.stdout + result.stderr
    assert "deprecated" in output and "activation_checkpointing:\n  reentrant: true" in output
    block = summary(tmp_path)["activation_checkpointing"]
    assert block["enabled"] is True and block["reentrant"] is True
    assert "checkpointing 2/2 decoder layers (hf, reentrant)" in output
    assert summary(tmp_path)["mode"] == "custom (from legacy keys)", "not the default option's 'off'"


@pytest.mark.parametrize(
    "block, choice, legacy, label",
    [
        (True, "off", True, "full"),  # +gradient_checkpointing=true under the default option: it recomputes
        ({"offload": {"all": "cpu"}}, "off", True, "offload_all"),  # +gradient_checkpointing=offload
        ({"reentrant": True}, "off", True, "custom (from legacy keys)"),
        ({"kwargs": {"every_n_layers": 2}}, "full", False, "every_2"),  # an override that makes another option
        ({"kwargs": {"every_n_layers": 3}}, "full", False, "custom (full with overrides)"),
        (False, "off", False, "off"),
        ({"selective": True}, "full", False, "selective_attn"),
    ],
)
def test_the_mode_label_comes_from_the_resolved_block(block, choice, legacy, label):
    sys.path.insert(0, str(ROOT / "examples"))
    from modes import mode_label

    from lightning_ac.config import parse_config

    assert mode_label(parse_config(block), choice, legacy) == label


def test_multirun_writes_sweep_summary(tmp_path):
    result = ok(train(tmp_path, "activation_checkpointing=off,full,every_2,selective_attn", multirun=True))
    sweep = tmp_path / "sweep"
    rows = list(csv.DictReader(open(sweep / "sweep_summary.csv")))
    assert [r["mode"] for r in rows] == ["off", "full", "every_2", "selective_attn"]
    assert len({r["final_loss"] for r in rows}) == 1, "every mode trains the same"
    assert all(float(r["peak_activation_bytes"]) > 0 and float(r["step_time_s"]) > 0 for r in rows)
    memory = {r["mode"]: float(r["peak_activation_bytes"]) for r in rows}
    assert memory["full"] < memory["every_2"] < memory["off"]
    assert memory["full"] <= memory["selective_attn"] < memory["off"]
    assert (sweep / "sweep_summary.png").stat().st_size > 1000
    assert result.returncode == 0


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_multirun_records_a_bad_value_and_runs_the_other_jobs(tmp_path):
    result = train(
        tmp_path, "activation_checkpointing=full", "activation_checkpointing.offload.hidden_states=disk,none",
        multirun=True,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "sweep_summary.csv")))
    assert [r["job"] for r in rows] == ["0", "1"]
    assert "'disk' is rejected" in rows[0]["error"] and rows[0]["steps"] == ""
    assert rows[1]["error"] == "" and rows[1]["steps"] == "4", "the job after the bad one still trains"
    listing = result.stderr.split("1 sweep job(s) stopped on a bad value:\n")[1].splitlines()[0]
    assert listing.startswith("  job 0 (") and "activation_checkpointing.offload.hidden_states=disk" in listing
    assert rows[0]["overrides"] != rows[1]["overrides"], "jobs that differ only in an override are told apart"
    # A new sweep into the same directory reports its own jobs only.
    again = train(tmp_path, "activation_checkpointing=full", multirun=True)
    assert again.returncode == 0, again.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "sweep_summary.csv")))
    assert [(r["job"], r["error"]) for r in rows] == [("0", "")]


@pytest.mark.slow  # a sweep with a failing job runs in the default session (test_multirun_records_a_bad_value...)
def test_multirun_records_a_crashed_job(tmp_path):
    result = train(tmp_path, "optim.lr=-1.0,0.001", multirun=True)  # AdamW refuses a negative learning rate
    assert result.returncode == 1 and "Invalid learning rate" in result.stderr  # Hydra's report, after the batch
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "sweep_summary.csv")))
    assert [r["job"] for r in rows] == ["0", "1"]
    assert rows[0]["error"].startswith("crashed: ValueError: Invalid learning rate")
    assert rows[1]["error"] == "" and rows[1]["steps"] == "4"


def test_the_sweep_plot_labels_each_bar_with_its_value(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    from sweep import _plot

    rows = [
        {"job": "0", "mode": "off", "error": None, "peak_activation_bytes": 3 * 2**20, "step_time_s": 0.25},
        {"job": "1", "mode": "full", "error": "crashed", "peak_activation_bytes": None, "step_time_s": None},
    ]
    drawn = _plot(rows, tmp_path / "plot.png")
    assert drawn == ["3.0 MiB", "not measured", "250.0 ms", "not measured"]
    assert (tmp_path / "plot.png").stat().st_size > 1000


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_a_sweep_over_budgets(tmp_path):
    # far below full's peak (every layer recomputed, with a warning) and far above off's (nothing recomputed)
    result = ok(
        train(tmp_path, "activation_checkpointing=budget", "activation_checkpointing.budget=1KiB,1GiB", multirun=True)
    )
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "sweep_summary.csv")))
    assert [r["mode"] for r in rows] == ["budget 1.00 KiB", "budget 1.00 GiB"]
    assert len({r["final_loss"] for r in rows}) == 1, "every budget trains the same"
    low, high = (json.loads((tmp_path / "sweep" / str(i) / "summary.json").read_text())["budget"] for i in (0, 1))
    assert low["choices"] == ["recompute"] * 2 and high["choices"] == ["keep"] * 2
    assert low["settled"] and high["settled"] and high["measured_peak_bytes"] <= 2**30
    assert re.search(r"budget 1\.00 GiB: keeping 2/2 decoder layers, recomputing 0", result.stdout + result.stderr)
    assert "over the budget; training goes on recomputing every layer" in result.stdout + result.stderr
    assert float(rows[0]["peak_activation_bytes"]) < float(rows[1]["peak_activation_bytes"])


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_the_budgets_first_plan_from_a_fake_step_in_the_main_job(tmp_path):
    overrides = ("activation_checkpointing.budget=1GiB", "activation_checkpointing.budget_first_plan=estimate")
    result = ok(train(tmp_path, "activation_checkpointing=budget", *overrides))
    log = result.stdout + result.stderr
    assert "budget 1.00 GiB: a first plan from a step on fake tensors, then choosing per layer" in log
    assert re.search(r"the first plan, from the training step on fake tensors at the first batch's shape \(2x32\): "
                     r"budget 1\.00 GiB: keeping 2/2 decoder layers", log), log[-3000:]  # fmt: skip
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["budget"]["choices"] == ["keep"] * 2 and summary["budget"]["settled"]
    assert summary["activation_checkpointing"]["budget_first_plan"] == "estimate"


def test_the_one_knob_option_leaves_every_tool_to_the_budget(tmp_path):
    """activation_checkpointing=auto: a budget (its YAML's size on the CPU), the save rules where they pay, and the
    chunked loss, the tiled MLP and each layer's input in host memory left to the budget; on the CPU the last says it
    frees nothing. The small model fits the size whole: nothing recomputed, nothing weighed."""
    result = ok(train(tmp_path, "activation_checkpointing=auto"))
    log = result.stdout + result.stderr
    data = summary(tmp_path)
    assert data["mode"] == "auto 100.00 MiB"
    block = data["activation_checkpointing"]
    assert block["budget"] == 100 * 2**20 and block["offload"]["hidden_states"] == "auto"
    assert block["chunked_loss"]["budget_decides"] and block["tiled_mlp"]["budget_decides"]
    assert data["budget"]["settled"] and data["budget"]["choices"] == ["keep"] * 2
    assert "frees nothing on the device" in log and "weighing" not in log


@pytest.mark.parametrize(
    "override, words",
    [
        ("activation_checkpointing.budget=lots", ["activation_checkpointing.budget", "'lots'", "GiB", "auto"]),
        pytest.param(  # slow session only, as the next
            "activation_checkpointing.budget=auto", ["budget: auto", "CUDA", "runs on cpu"], marks=pytest.mark.slow
        ),
        pytest.param(
            "+activation_checkpointing.kwargs.every_n_layers=2",
            ["every_n_layers: 2", "remove budget"],
            marks=pytest.mark.slow,
        ),
    ],
)
def test_bad_budgets_stop_before_training(tmp_path, override, words):
    result = train(tmp_path, "activation_checkpointing=budget", override)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "step    1" not in result.stdout + result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr[-1500:])


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_estimate_prints_the_table_for_the_configured_model_and_trains_nothing(tmp_path):
    modes = "estimate_modes=[off,full,'full+chunked_loss']"
    # lora.dropout: the job's LoRA dropout is the estimate's (each adapted linear keeps a dropped copy of its input)
    result = ok(
        train(
            tmp_path, "estimate=true", "model.config.vocab_size=4096", modes, "estimate_device_memory=2GiB",
            "lora.dropout=0.1",
        )
    )  # fmt: skip
    data = json.loads((tmp_path / "run" / "estimate.json").read_text())
    assert [s["mode"] for s in data["steps"]] == ["off", "full", "full+chunked_loss"]
    assert {(s["seq"], s["batch"]) for s in data["steps"]} == {(32, 2)}, "data.seq_len x data.batch_size"
    assert data["dtype"] == "float32" and data["optimizer"] == "adamw", "the cpu trainer's 32-true, AdamW"
    assert data["device_memory_bytes"] == [2 * 2**30] and all(s["fits"] for s in data["steps"])
    assert (tmp_path / "run" / "estimate.md").read_text() in result.stdout
    assert "| `full+chunked_loss` |" in result.stdout
    assert not (tmp_path / "run" / "summary.json").exists(), "nothing trained"
    # the job's model, as the estimator builds it from the same values
    from lightning_ac.estimate import estimate

    overrides = {**yaml_config("model/llama.yaml"), "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 2}  # fmt: skip
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    direct, without_dropout = (
        estimate("llama", 32, batch=2, dtype="float32", lora=16, lora_targets=targets, modes=["off", "full"],
                 overrides=overrides, lora_dropout=dropout)
        for dropout in (0.1, 0.0)
    )  # fmt: skip
    full, off = (next(s for s in data["steps"] if s["mode"] == mode) for mode in ("full", "off"))
    assert full["activation_peak_bytes"] == direct.step("full", 32).activation_peak_bytes
    assert off["activation_peak_bytes"] == direct.step("off", 32).activation_peak_bytes
    assert off["activation_peak_bytes"] > without_dropout.step("off", 32).activation_peak_bytes  # the dropped copies
    assert full["parameter_bytes"] == direct.step("full", 32).parameter_bytes


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_the_estimate_takes_the_trainers_precision_as_configured(tmp_path):
    """trainer=gpu trains in bf16-mixed: the estimate counts float32 weights under autocast, as the run holds them."""
    ok(train(tmp_path, "estimate=true", "trainer=gpu", "model.config.vocab_size=4096", "estimate_modes=[full]"))
    mixed = json.loads((tmp_path / "run" / "estimate.json").read_text())
    assert mixed["dtype"] == "bf16-mixed (float32 weights, autocast)"
    from lightning_ac.estimate import estimate

    # the same model and batch in bf16-true (SMALL: 2 layers, hidden 64, intermediate 128, 2 x 32 tokens)
    overrides = {**yaml_config("model/llama.yaml"), "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 2}  # fmt: skip
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    true = estimate(
        "llama", 32, batch=2, precision="bf16-true", lora_targets=targets, modes=["full"], overrides=overrides
    )
    # float32 base weights against bf16 ones (the LoRA adapters are float32 in both)
    assert mixed["steps"][0]["parameter_bytes"] > 1.8 * true.steps[0].parameter_bytes


@pytest.mark.parametrize(
    "trainer, ranks",
    [
        ({"devices": 1}, {}),
        ({"devices": 1, "strategy": "auto"}, {}),
        ({"devices": 1, "strategy": "ddp"}, {}),  # a world of one: one device
        ({"devices": 8}, {"strategy": "ddp", "devices": 8}),  # Lightning picks DDP for several devices
        ({"devices": 4, "strategy": "ddp_spawn"}, {"strategy": "ddp", "devices": 4}),
        (
            {"devices": 8, "num_nodes": 2, "strategy": "ddp_find_unused_parameters_true"},
            {"strategy": "ddp", "devices": 16},
        ),
    ],
)
def test_a_multi_device_job_is_estimated_per_rank(trainer, ranks):
    sys.path.insert(0, str(ROOT / "examples"))
    from estimate_job import estimate_ranks
    from omegaconf import OmegaConf

    assert estimate_ranks(OmegaConf.create({"trainer": trainer})) == ranks


@pytest.mark.parametrize(
    "trainer, words",
    [
        ({"devices": 8, "strategy": "deepspeed"}, "trainer.strategy=deepspeed is not estimated"),
        ({"devices": 8, "strategy": "fsdp"}, "trainer.strategy=fsdp is Lightning's FSDPStrategy (FSDP1)"),
        ({"devices": "auto"}, "trainer.devices=auto is not a number"),
        ({"devices": [0, 1]}, "Give trainer.devices as a number (8)"),
        ({"devices": 2, "num_nodes": 0}, "trainer.num_nodes=0 is not a number"),
    ],
)
def test_a_strategy_the_estimate_does_not_count_is_named(trainer, words):
    sys.path.insert(0, str(ROOT / "examples"))
    from estimate_job import estimate_ranks
    from omegaconf import OmegaConf

    from lightning_ac import ConfigError

    with pytest.raises(ConfigError, match=re.escape(words)):
        estimate_ranks(OmegaConf.create({"trainer": trainer}))


def yaml_config(name: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / name).config)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["trainer.precision=transformer-engine"], "trainer.precision transformer-engine: NVIDIA Transformer"),
        (["lora.r=0"], "estimate=true: lora.r 0: expected a rank >= 1 (or lora.enabled=false)"),
        # the rest: slow session (a process each)
        pytest.param(
            ["estimate_modes=[nope]"], "estimate=true: estimate_modes nope: unknown mode", marks=pytest.mark.slow
        ),
        pytest.param(["estimate_device_memory=lots"], "estimate=true: estimate_device_memory", marks=pytest.mark.slow),
        pytest.param(["estimate=maybe"], "estimate", marks=pytest.mark.slow),
    ],
)
def test_bad_estimate_values_stop_with_the_key_and_the_fix(tmp_path, overrides, words):
    result = (
        train(tmp_path, "estimate=true", *overrides)
        if overrides[0] != "estimate=maybe"
        else train(tmp_path, *overrides)
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert words in result.stderr, result.stderr[-2000:]
