"""The benchmark harness on a tiny configuration, and the full default example (slow)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightning_ac.bench.settle
import lightning_ac.loss.install
from lightning_ac import bench

ROOT = Path(__file__).resolve().parents[1]


def tiny_preset(monkeypatch, hidden: int = 32, seq: int = 64, reps: int = 1) -> dict:
    """Register a tiny Llama-style preset named "tiny" for the duration of a test."""
    preset = dict(
        model=dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=512),
        seq=seq, batch=1, dtype="float32", reps=reps, steps=1,
    )  # fmt: skip
    monkeypatch.setitem(bench.PRESETS, "tiny", preset)
    return preset


def test_benchmark_rows_files_and_exact_gradients(tmp_path, monkeypatch):
    tiny_preset(monkeypatch, hidden=64, reps=2)
    rows = bench.main(
        ["--preset", "tiny", "--modes", "off", "full", "selective_attn", "hf_native_full", "torch_checkpoint_wrapper",
         "--out", str(tmp_path)]
    )  # fmt: skip
    by = {r.mode: r for r in rows}
    assert [r.kind for r in rows] == ["suite", "suite", "suite", "anchor", "anchor"]
    for row in rows:
        assert row.status == "ok" and row.step_time_s > 0 and row.peak_activation_bytes > 0
        assert row.max_grad_diff == 0.0, row.mode
    assert by["full"].peak_activation_bytes < by["off"].peak_activation_bytes
    # same mechanism as transformers' own checkpointing: no activation overhead of ours
    assert by["full"].peak_activation_bytes <= by["hf_native_full"].peak_activation_bytes
    data = json.loads((tmp_path / "results.json").read_text())
    assert {"mode", "kind", "peak_activation_bytes", "step_time_s", "max_grad_diff"} <= set(data[0])
    assert "vs hf_native_full" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "memory_time.png").stat().st_size > 1000


COMPILED = [
    "off",
    "full",
    "full_compiled",
    "selective_attn_compiled",
    "selective_attn_mm_compiled",
    "torchtitan_compiled",
]


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_rows_report_compile_time_apart_against_eager_full(tmp_path, monkeypatch, backend):
    from lightning_ac.bench import modes

    compiles = []

    def counting(gm, example_inputs):  # each graph dynamo hands over: a compile
        compiles.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    monkeypatch.setattr(modes, "COMPILE_BACKEND", counting)  # aot_eager runs the graphs as traced: exact
    tiny_preset(monkeypatch, reps=2)
    rows = bench.main(["--preset", "tiny", "--modes", *COMPILED, "--out", str(tmp_path)])
    # the warm-up's graph, then every compiled row compiles afresh in each of the two repetitions (nothing reused
    # from an earlier copy of the model): a graph for each of the two layers' calls at least
    assert len(compiles) >= 1 + 4 * 2, len(compiles)
    by = {r.mode: r for r in rows}
    assert by["torchtitan_compiled"].kind == "anchor"
    for mode in COMPILED[2:]:
        row = by[mode]
        assert row.status == "ok" and row.step_time_s > 0, mode
        assert row.compile_time_s > 0, "the warm-up steps compiled"
        assert row.peak_activation_bytes is None, "MemTracker cannot see inside compiled graphs: not measured on CPU"
        # inductor fuses, so its sums round differently from eager's: within float32 rounding of off's gradients
        assert row.max_grad_diff == 0.0 if backend == "aot_eager" else row.max_grad_diff < 1e-5, mode
    assert by["full"].compile_time_s is None
    table = (tmp_path / "results.md").read_text()
    compiled_table = table[table.index("torch.compile (") :]
    assert "| mode | kind | activation peak (MiB) | vs full | step (s) | vs full | compile (s) |" in compiled_table
    assert all(f"`{mode}`" in compiled_table for mode in COMPILED[2:])
    assert "`full_compiled`" not in table[: table.index("torch.compile (")], "compiled rows only in their table"
    assert json.loads((tmp_path / "results.json").read_text())[2]["compile_time_s"] > 0


def test_compiled_rows_where_nothing_compiles_say_why_and_the_rest_runs(tmp_path, monkeypatch):
    from lightning_ac.bench import modes

    def no_compiler(gm, example_inputs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(modes, "COMPILE_BACKEND", no_compiler)
    tiny_preset(monkeypatch)
    rows = bench.main(["--preset", "tiny", "--modes", "full", "full_compiled", "--out", str(tmp_path)])
    by = {r.mode: r for r in rows}
    assert by["full"].status == "ok"
    assert by["full_compiled"].status.startswith("failed: torch.compile cannot compile here: ")
    assert "no C++ compiler found" in by["full_compiled"].status


def test_the_compiled_rows_run_by_default_and_no_compiled_leaves_them_out():
    from lightning_ac.bench import modes

    compiled = set(modes.COMPILED_MODES) | set(modes.COMPILED_ANCHORS)
    assert compiled <= set(modes.default_modes(on_accelerator=False))
    assert not compiled & set(modes.default_modes(on_accelerator=True, compiled=False))
    assert (
        set(modes.default_modes(on_accelerator=False, compiled=False))
        == set(modes.default_modes(on_accelerator=False)) - compiled
    )


@pytest.mark.slow
def test_default_example_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "examples/train.py", f"hydra.run.dir={tmp_path}", "activation_checkpointing=full"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 100
    assert summary["first_loss"] - summary["final_loss"] > 1.0, "the loss goes down"


def _row(mode, peak, step, kind="suite"):
    return bench.Row(mode=mode, kind=kind, peak_activation_bytes=peak, step_time_s=step, max_grad_diff=0.0)


def test_planner_picks_the_fastest_mode_that_fits():
    from lightning_ac.bench.planner import explain, plan_mode, scaling_errors

    rows = [
        _row("off", 1000, 1.0),
        _row("every_2", 600, 1.1),
        _row("full", 200, 1.3),
        _row("hf_native_full", 200, 1.35, "anchor"),
    ]
    half = [
        _row("off", 500, 0.5),
        _row("every_2", 330, 0.6),
        _row("full", 100, 0.7),
        _row("hf_native_full", 100, 0.7, "anchor"),
    ]
    errors = scaling_errors(rows, half)
    assert errors["off"] == 0.0 and errors["every_2"] == pytest.approx(0.1)
    # an odd sequence (33 measured at 16 tokens): a mode linear in tokens shows no error
    assert scaling_errors([_row("off", 3300, 1.0)], [_row("off", 1600, 0.5)], ratio=33 / 16)["off"] == pytest.approx(0)
    # at twice the tokens: off 2000, every_2 1200 (+10% margin = 1320), full 400
    choices = plan_mode(rows, budget_bytes=1300, measured_tokens=100, planned_tokens=200, errors=errors)
    assert [c.mode for c in choices] == ["off", "every_2", "full", "hf_native_full"]
    assert [c.fits for c in choices] == [False, False, True, True]
    text = explain(choices, 1300, 200, 100)
    assert "Use: full (fastest mode that fits; faster modes over budget: off, every_2)." in text
    assert "budget: 1.27KiB in the activation_checkpointing block" in text
    # budgets too small for two decimals of GiB show in a unit that shows them
    assert text.startswith("Activation budget 1.27 KiB at 200 tokens") and "est    1.95 KiB" in text
    text = explain(choices, 24 * 2**30, 200, 100)
    assert 'ActivationCheckpointing(budget="24GiB")' in text and "activation_checkpointing.budget=24GiB" in text
    assert "No mode fits" in explain(plan_mode(rows, 10, 100, 200, errors), 10, 200, 100)


def _recommended_budgets(text):
    from lightning_ac.config import parse_size

    return [parse_size(size, "budget") for size in re.findall(r"budget: (\S+) in the activation_checkpointing", text)]


def test_the_planner_never_recommends_a_budget_below_what_the_least_memory_mode_needs():
    """The memory budget recomputes every layer at the least, as full does: a budget under full's estimate (widened
    by its margin) would only be overrun. Where no mode fits, the planner says what would (fewer tokens, a larger
    budget), and it never rounds a budget it recommends to below full's need."""
    from lightning_ac.bench.planner import explain, plan_mode

    rows = [_row("off", 1000, 1.0), _row("every_2", 600, 1.1), _row("full", 200, 1.3)]
    errors = {"full": 0.25}  # full needs 400 * 1.25 = 500 bytes at 200 tokens
    for budget in (300, 450):  # under full's estimate; over it, under its margin
        text = explain(plan_mode(rows, budget, 100, 200, errors), budget, 200, 100)
        assert "No mode fits: the least activation memory of any mode is full's" in text
        assert f"full at up to {budget * 200 // 500} tokens per step" in text and "a budget of 500B or more" in text
        assert _recommended_budgets(text) == [500], text
    # an offload mode fits where full does not (an accelerator): it is the pick, and the budget is still full's floor
    offload = [*rows, _row("offload_hidden", 150, 1.6)]
    text = explain(plan_mode(offload, 350, 100, 200), 350, 200, 100)
    assert "Use: offload_hidden" in text and _recommended_budgets(text) == [400], text
    # a budget that fits full, but whose setting at three digits would round to below what full needs
    mib = 2**20
    rows = [_row("off", 400 * mib, 1.0), _row("full", int(110.3 * mib), 1.3)]
    budget = int(110.4 * mib)
    text = explain(plan_mode(rows, budget, 100, 100), budget, 100, 100)
    assert "Use: full" in text and _recommended_budgets(text) == [111 * mib], text


def test_budget_rows_hold_their_claims_on_a_tiny_model(tmp_path, monkeypatch):
    tiny_preset(monkeypatch, hidden=64, seq=128)
    rows = bench.main(["--preset", "tiny", "--modes", "budget_50", "budget_25", "--out", str(tmp_path)])
    by = {r.mode: r for r in rows}
    assert [r.mode for r in rows] == ["off", "full", "budget_50", "budget_25"], "off and full run first: they place it"
    off, full = by["off"].peak_activation_bytes, by["full"].peak_activation_bytes
    for mode, fraction in (("budget_25", 0.25), ("budget_50", 0.5)):
        row = by[mode]
        assert row.status == "ok" and row.budget_bytes == int(full + fraction * (off - full))
        assert row.peak_activation_bytes <= row.budget_bytes, "under its budget"
        assert row.max_grad_diff == 0.0 and len(row.budget_choices) == 2
    table = (tmp_path / "results.md").read_text()
    assert "| `budget_50` |" in table and "fastest fixed mode that fits" in table
    data = json.loads((tmp_path / "results.json").read_text())
    assert {"budget_bytes", "budget_choices"} <= set(data[-1])
    assert bench.fastest_fixed_mode(rows, full).mode == "full"
    assert bench.fastest_fixed_mode(rows, full - 1) is None


@pytest.mark.parametrize("most_extra", [8, 0])
def test_a_budget_row_warms_up_until_its_plan_settles_and_measures_only_the_settled_plan(monkeypatch, most_extra):
    """A tiny model whose budget measures over it twice before it settles: the row takes warm-up steps until then,
    so its measured peak is the settled plan's (under the budget), not a checking step's; without those steps
    (MOST_EXTRA_STEPS 0) the row fails and says why instead of reporting a step it does not train with."""
    preset = tiny_preset(monkeypatch)
    preset["model"]["vocab_size"] = 512
    monkeypatch.setattr(bench.run, "settle_steps", lambda mode: 0)
    monkeypatch.setattr(bench.run, "MOST_EXTRA_STEPS", most_extra)
    monkeypatch.setattr(lightning_ac.bench.settle, "MOST_EXTRA_STEPS", most_extra)
    row = bench.run_benchmark("tiny", ["off", "full", "budget_25"], steps=2)[-1]
    if most_extra:
        assert row.status == "ok" and row.peak_activation_bytes <= row.budget_bytes, row
    else:
        assert row.status.startswith("failed: NotSettled: the budget had not settled after 1 warm-up step ("), row


def _settling(summaries, most_extra=2):
    """SettledCheck over a budget whose summary at each step from the first reported one (step 3) is the next of
    ``summaries``: the steps where the measured and timed ones began, and when the run was stopped."""
    from types import SimpleNamespace

    from lightning_ac.bench.memory import StepMetrics
    from lightning_ac.bench.settle import SettledCheck

    checkpointing = SimpleNamespace(budget_plan=None)
    metrics = StepMetrics(measure_step=3, warmup_steps=4)
    check = SettledCheck(checkpointing, metrics, steps=2)
    trainer = SimpleNamespace(global_step=2, should_stop=False)
    check.on_train_batch_start(trainer, None, None, 0)  # before the first reported step: not looked at
    for step, summary in enumerate(summaries, start=3):
        trainer.global_step = step
        checkpointing.budget_plan = summary
        check.on_train_batch_start(trainer, None, None, 0)
        trainer.global_step = step + 1
        check.on_train_batch_end(trainer, None, None, None, 0)
        if trainer.should_stop:
            return metrics.measure_step, metrics.warmup_steps, step
    return metrics.measure_step, metrics.warmup_steps, None


SETTLED = {"settled": True, "choices": ["keep", "recompute"], "turned_on": []}
CHECKING = {**SETTLED, "settled": False}


def test_the_settled_check_moves_the_reported_steps_past_the_warm_up_the_budget_needs():
    # settled at once: measured at step 3, timed at 4 and 5, stopped after 5
    assert _settling([SETTLED] * 5) == (3, 4, 5)
    # two more steps to settle: measured at 5, timed at 6 and 7
    assert _settling([CHECKING, CHECKING] + [SETTLED] * 5) == (5, 6, 7)


@pytest.mark.parametrize(
    "summaries, message",
    [
        ([CHECKING] * 3, "the budget had not settled after 5 warm-up steps (2 more than the row's own)"),
        ([SETTLED, {**SETTLED, "choices": ["keep", "keep"]}], "changed in the timed steps (from layers kr, tools []"),
        ([SETTLED, {**SETTLED, "turned_on": ["chunked_loss"]}], "tools [] to layers kr, tools ['chunked_loss']"),
        ([SETTLED, CHECKING], "changed in the timed steps"),
    ],
)
def test_the_settled_check_fails_a_row_that_never_settles_or_whose_plan_changes(monkeypatch, summaries, message):
    from lightning_ac.bench import settle

    monkeypatch.setattr(settle, "MOST_EXTRA_STEPS", 2)
    with pytest.raises(settle.NotSettled, match=re.escape(message)):
        _settling(summaries)


def test_budget_option_runs_the_scaling_check(tmp_path, monkeypatch, capsys):
    tiny_preset(monkeypatch)
    bench.main(["--preset", "tiny", "--modes", "off", "full", "--budget-gib", "1", "--out", str(tmp_path)])
    plan = (tmp_path / "plan.txt").read_text()
    assert "Activation budget 1.00 GiB at 64 tokens" in plan and "Use: " in plan
    assert "Use: " in capsys.readouterr().out


def test_the_planner_says_which_modes_it_does_not_plan(tmp_path, monkeypatch):
    tiny_preset(monkeypatch)
    bench.main(["--preset", "tiny", "--modes", "off", "full", "lora_full", "--budget-gib", "1", "--out", str(tmp_path)])
    plan = (tmp_path / "plan.txt").read_text()
    # both fit: which is faster at this size is noise
    assert ("Use: off " in plan or "Use: full " in plan) and "Not planned: lora_full (layer offloading saves" in plan
    assert "budget row" not in plan, "only the reasons that apply (it gave both for any mode left out)"


def test_model_option_takes_a_model_type_or_a_json_config(tmp_path, monkeypatch):
    tiny = tiny_preset(monkeypatch, seq=32)
    monkeypatch.chdir(tmp_path)
    rows = bench.main(["--preset", "tiny", "--model", "qwen3", "--modes", "off", "full"])
    assert all(r.status == "ok" and r.max_grad_diff == 0.0 for r in rows)
    assert (tmp_path / "bench_out" / "results.md").exists(), "without --out the results go to bench_out"
    config = tmp_path / "gemma.json"
    config.write_text(json.dumps({"model_type": "gemma3_text", **tiny["model"], "head_dim": 16}))
    rows = bench.main(["--preset", "tiny", "--model", str(config), "--modes", "off", "selective_attn"])
    assert all(r.status == "ok" and r.max_grad_diff == 0.0 for r in rows)


def test_anchors_that_cannot_run_here_say_why(monkeypatch, tmp_path):
    tiny_preset(monkeypatch, seq=32)
    monkeypatch.chdir(tmp_path)
    rows = bench.main(["--preset", "tiny", "--modes", "off", "hf_native_offload", "trl_offload_only"])
    by = {r.mode: r for r in rows}
    assert by["off"].status == "ok"
    for mode in ("hf_native_offload", "trl_offload_only"):
        assert by[mode].kind == "anchor" and by[mode].step_time_s is None
        assert by[mode].status == "unavailable: needs a CUDA device"
    # on an accelerator, an external offloader runs only when its package is installed
    if importlib.util.find_spec("trl") is None:
        assert bench.availability("trl_offload_full", on_accelerator=True) == "unavailable: trl is not installed"
    assert bench.availability("full", on_accelerator=False) == "ok"


def test_an_installed_but_broken_anchor_package_says_so(monkeypatch, tmp_path):
    # a package that is installed but cannot import (a missing dependency) is reported, not raised
    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "__init__.py").write_text("import a_dependency_that_is_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    status = bench.availability("trl_offload_only", on_accelerator=True)
    assert status.startswith("unavailable: cannot import trl.models.activation_offloading: ModuleNotFoundError")


def test_layer_offloading_modes_compare_with_the_same_lora_run(tmp_path, monkeypatch):
    """lora_full, layer_offload (resident_layers 0) and layer_offload_resident (L/4): LoRA on the frozen base with
    full checkpointing; exact against lora_full, and their own table (on CPU the copies run on the host, and no
    device peak exists to report)."""
    tiny_preset(monkeypatch, hidden=64)
    monkeypatch.setitem(bench.PRESETS["tiny"]["model"], "num_hidden_layers", 4)
    rows = bench.main(["--preset", "tiny", "--modes", "off", *bench.LAYER_OFFLOAD_MODES, "--out", str(tmp_path)])
    for row in rows:
        assert row.status == "ok" and row.max_grad_diff == 0.0, row
    table = (tmp_path / "results.md").read_text()
    assert "| `layer_offload_resident` | L/4 | — | — |" in table and "vs lora_full" in table
    main_table = table.split("Layer offloading")[0]
    assert "`off`" in main_table and "lora_full" not in main_table


def test_one_statistic_and_ratios_that_noise_decided_are_marked():
    """The table's step is the median of the repetitions' medians (what the rep lines print); a ratio smaller
    than the spread of those medians is marked as noise, with a note."""
    rows = [
        bench.Row("off", "suite", 100, 1.00, 0.0, step_time_spread=0.05),
        bench.Row("full", "suite", 20, 1.30, 0.0, step_time_spread=0.04),  # 30% slower: a real difference
        bench.Row("every_2", "suite", 60, 1.02, 0.0, step_time_spread=0.60),  # reps 7.26 / 1.43 / 1.84 and so on
    ]
    table = bench.results_markdown(rows)
    assert "| `full` | suite | 0.0 | 0.20x | — | 1.300 | 1.30x | — |" in table
    assert "| 1.020 | 1.02x~ |" in table and "~: within noise" in table


def test_ratios_of_one_repetition_say_so_instead_of_passing_for_measured_differences():
    """One repetition has no spread to tell noise from a difference: its ratios are marked, with a footnote."""
    rows = [
        bench.Row("off", "suite", 100, 1.00, 0.0),  # --reps 1: no spread
        bench.Row("full", "suite", 20, 1.30, 0.0),
        bench.Row("every_2", "suite", 60, 1.02, 0.0, step_time_spread=0.01),  # measured twice, against a single off
    ]
    table = bench.results_markdown(rows)
    assert "| 1.000 | 1.00x | — |" in table, "a row against itself is no comparison"
    assert "| 1.300 | 1.30x¹ | — |" in table and "| 1.020 | 1.02x¹ | — |" in table
    assert "¹: one repetition" in table and "~" not in table


def test_results_of_layer_offloading_modes_alone_have_no_empty_main_table():
    rows = [
        bench.Row("lora_full", "suite", None, 1.0, 0.0, step_time_spread=0.1),
        bench.Row("layer_offload", "suite", None, 1.2, 0.0, step_time_spread=0.1),
    ]
    table = bench.results_markdown(rows)
    assert "vs hf_native_full" not in table, "the main table has no row"
    assert table.startswith("Layer offloading") and "| `layer_offload` | 0 |" in table


def test_labels_of_points_that_sit_together_are_kept_apart_and_led_to_their_points():
    """The placement itself, in display pixels: a label goes next to its point's right, or its left where the area
    ends or an obstacle (the legend) sits there; the labels of points that sit on one another move away, each with
    a leader line, and never overlap; all stay inside the area, and the same points give the same placement."""
    points = [(100.0, 100.0), (103.0, 100.0), (100.0, 102.0), (300.0, 200.0), (395.0, 150.0), (200.0, 50.0)]
    sizes, area = [(60.0, 12.0)] * len(points), (0.0, 0.0, 400.0, 300.0)
    offsets = bench.label_offsets(points, sizes, area, obstacles=[(230.0, 20.0, 330.0, 80.0)], gap=7.0)
    boxes = [(x + dx - 30, y + dy - 6, x + dx + 30, y + dy + 6) for (x, y), (dx, dy, _) in zip(points, offsets)]
    for a, b in itertools.combinations(boxes, 2):
        assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]), (a, b)
    assert all(0 <= x0 and x1 <= 400 and 0 <= y0 and y1 <= 300 for x0, y0, x1, y1 in boxes)
    assert [moved for _, _, moved in offsets] == [True, True, True, False, False, False]
    assert offsets[3] == (37.0, 0.0, False), "next to its point, on the right"
    assert offsets[4] == offsets[5] == (-37.0, 0.0, False), "the area's edge and the obstacle: on the left"
    assert bench.label_offsets(points, sizes, area, obstacles=[(230.0, 20.0, 330.0, 80.0)], gap=7.0) == offsets


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--plan-seq", "4096"], "--plan-seq 4096: it is the sequence length the budget planner plans for"),
        (["--modes", "lora_full", "layer_offload", "--budget-gib", "100"], "none of these is one"),
        (["--seq", "1", "--budget-gib", "0.1"], "--seq 1: the budget planner"),
        (["--seq", "0"], "--seq 0: expected an integer >= 1"),
        (["--reps", "-1"], "--reps -1: expected an integer >= 1"),
        (["--budget-gib", "0"], "--budget-gib 0.0: expected a budget > 0 GiB"),
        (["--modes", "full_compiled", "--budget-gib", "1"], "a compiled row is its eager mode, compiled"),
        (["--modes", "full", "full_compiled", "--no-compiled"], "--modes asks for full_compiled"),
    ],
)
def test_arguments_the_benchmark_cannot_measure_with_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    assert "(default: bench_out)" in capsys.readouterr().out


# cpu-small's measurements, with the three checkpoint-everything modes within 0.1 MiB and 6 ms of each other
CLOSE_ROWS = [
    ("off", 343.4, 0.412),
    ("selective_attn_mm", 212.0, 0.430),
    ("budget_75", 271.0, 0.428),
    ("every_2", 185.2, 0.445),
    ("budget_50", 186.0, 0.447),
    ("selective_attn", 83.5, 0.470),
    ("budget_25", 108.0, 0.466),
    ("full", 55.2, 0.479),
    ("offload_hidden", 57.0, 0.486),
    ("hf_native_full", 55.3, 0.482, "anchor"),
    ("torch_checkpoint_wrapper", 55.2, 0.476, "anchor"),
]


def test_plot_labels_of_close_points_never_overlap_and_stay_inside_the_figure(tmp_path, monkeypatch):
    """On the drawn figure (the renderer's boxes, in display pixels): no two labels overlap, none leaves the
    figure or covers a marker, and a label away from its point has a leader line to that point."""
    import matplotlib.figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    figures = []
    savefig = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):  # the figure plot() draws, to measure after it has saved and closed it
        figures.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    rows = [_row(mode, int(mib * 2**20), step, *kind) for mode, mib, step, *kind in CLOSE_ROWS]
    bench.plot(rows, tmp_path / "memory_time.png")
    assert (tmp_path / "memory_time.png").stat().st_size > 1000
    (fig,) = figures
    ax = fig.axes[0]
    canvas = FigureCanvasAgg(fig)  # pyplot's canvas went with plt.close
    canvas.draw()
    renderer = canvas.get_renderer()
    labels = {t.get_text(): t for t in ax.texts}
    assert sorted(labels) == sorted(r.mode for r in rows)
    boxes = {mode: Text.get_window_extent(t, renderer) for mode, t in labels.items()}  # the text, not its leader
    for a, b in itertools.combinations(sorted(boxes), 2):
        assert not boxes[a].overlaps(boxes[b]), f"the labels of {a} and {b} overlap"
    markers = {r.mode: ax.transData.transform((r.step_time_s, r.peak_activation_bytes / 2**20)) for r in rows}
    for mode, box in boxes.items():
        assert fig.bbox.containsx(box.x0) and fig.bbox.containsx(box.x1), f"{mode}'s label leaves the figure"
        assert fig.bbox.containsy(box.y0) and fig.bbox.containsy(box.y1), f"{mode}'s label leaves the figure"
        covered = [other for other, (x, y) in markers.items() if box.padded(2).contains(x, y)]
        assert not covered, f"{mode}'s label covers the marker of {covered}"
        # a label more than a few pixels from its own point says whose it is with a leader line to that point
        x, y = markers[mode]
        far = max(box.x0 - x, x - box.x1, box.y0 - y, y - box.y1) > 14
        assert not far or labels[mode].arrow_patch is not None, f"{mode}'s label is away from its point, unled"
        assert tuple(labels[mode].xy) == pytest.approx(ax.transData.inverted().transform(markers[mode]))


# -- the output head: the cpu-vocab preset, chunked_loss rows, the floor, torchtune's chunked loss, the goals ---------


def test_the_vocabulary_preset_is_cpu_small_with_a_real_vocabulary_and_its_own_rows_and_goals():
    from lightning_ac.bench import modes

    vocab, small = bench.PRESETS["cpu-vocab"], bench.PRESETS["cpu-small"]
    assert vocab["model"] == {**small["model"], "vocab_size": 32000}
    assert small["model"]["vocab_size"] == 256 and not {"modes", "goals"} & set(small), "cpu-small as it was"
    assert {k: v for k, v in vocab.items() if k not in ("model", "modes", "goals")} == {
        k: v for k, v in small.items() if k != "model"
    }
    rows = vocab["modes"]
    for mode in ("off", "full", "selective_attn", "budget_25", "budget_50", "budget_75"):
        assert mode in rows and f"{mode}_chunked" in rows, mode
    assert {"full_no_head", "hf_native_full", "torchtune_chunked_ce"} <= set(rows)
    assert all(m in modes.ALL_SUITE_MODES or m in modes.ALL_ANCHORS for m in rows)
    # the chunked rows are their modes' blocks with chunked_loss (auto), off's too (enabled: false)
    assert modes.CHUNKED_MODES == {
        "off_chunked": {"enabled": False, "chunked_loss": True},
        "full_chunked": {"enabled": True, "chunked_loss": True},
        "selective_attn_chunked": {"selective": {"save": ["attention"]}, "chunked_loss": True},
        "full_chunked_32": {"enabled": True, "chunked_loss": {"chunk_tokens": 32}},
        "full_chunked_tiled": {"enabled": True, "chunked_loss": True, "tiled_mlp": True},
    }
    assert modes.budget_block("budget_50_chunked", 10)["chunked_loss"] is True
    assert "chunked_loss" not in modes.budget_block("budget_50", 10)
    goals = {(g.mode, g.figure, g.against): g.at_most for g in vocab["goals"]}
    assert goals == {
        ("full_chunked", "peak", "full"): 0.2,
        ("full_chunked", "peak", "full_no_head"): 1.3,
        ("full_chunked", "step", "full"): 1.05,
        ("full_chunked_tiled", "peak", "full_chunked"): 1.0,
        ("full_chunked_tiled", "step", "full_chunked"): 1.05,
    }
    # cpu-small's default rows are what they were: none of these
    assert not {"full_chunked", "full_no_head", "torchtune_chunked_ce"} & set(modes.default_modes(False))


def _fake_torchtune(monkeypatch) -> None:
    """torchtune's CEWithChunkedOutputLoss (0.6.1's interface and arithmetic) where torchtune is not installed."""
    import importlib.machinery
    import types

    import torch.nn.functional as F

    class CEWithChunkedOutputLoss(torch.nn.Module):
        def __init__(self, num_output_chunks: int = 8, ignore_index: int = -100) -> None:
            super().__init__()
            self.num_output_chunks, self.ignore_index = num_output_chunks, ignore_index

        def forward(self, logits, labels):
            total = (labels != self.ignore_index).sum()
            targets = [t.reshape(-1) for t in labels.chunk(self.num_output_chunks, dim=1)]
            chunks = [c.reshape(-1, c.size(-1)) for c in logits]
            return (
                sum(
                    F.cross_entropy(c.float(), t, ignore_index=self.ignore_index, reduction="sum")
                    for c, t in zip(chunks, targets)
                )
                / total
            )

    for name in ("torchtune", "torchtune.modules", "torchtune.modules.loss"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["torchtune.modules.loss"].CEWithChunkedOutputLoss = CEWithChunkedOutputLoss


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_the_vocabulary_rows_run_and_the_goals_are_checked_at_a_tiny_scale(tmp_path, monkeypatch):
    """Every row of cpu-vocab on a tiny model whose head holds most of full's activations (vocabulary 512, hidden
    32: chunked_loss's auto chunks hold 4 tokens, its floor of 128 lowered for this scale): the chunked rows within
    float rounding of off's gradients (the chunks sum in another order), the floor compared with nothing, the
    chunked budgets placed between the chunked rows, and the goals' verdicts in results.md and goals.json."""
    if importlib.util.find_spec("torchtune") is None:
        _fake_torchtune(monkeypatch)
    preset = tiny_preset(monkeypatch)
    preset["model"]["vocab_size"] = 512
    monkeypatch.setattr(lightning_ac.loss.install, "MIN_AUTO_CHUNK_TOKENS", 1)  # else one chunk: the whole step
    monkeypatch.setitem(
        bench.PRESETS, "cpu-vocab", {**preset, **{k: bench.PRESETS["cpu-vocab"][k] for k in ("modes", "goals")}}
    )
    rows = bench.main(["--preset", "cpu-vocab", "--out", str(tmp_path)])
    by = {r.mode: r for r in rows}
    assert set(by) == set(bench.PRESETS["cpu-vocab"]["modes"])
    for row in rows:
        assert row.status == "ok" and row.peak_activation_bytes > 0, row
    for mode in ("off", "full", "selective_attn", "hf_native_full", "budget_50"):
        assert by[mode].max_grad_diff == 0.0, mode
    chunked = ("off_chunked", "full_chunked", "full_chunked_tiled", "selective_attn_chunked", "budget_50_chunked")
    for mode in (*chunked, "torchtune_chunked_ce"):
        assert by[mode].max_grad_diff <= 1e-6, mode
    assert by["full_no_head"].kind == "floor" and by["full_no_head"].max_grad_diff is None
    assert by["torchtune_chunked_ce"].kind == "anchor"
    peak = {m: r.peak_activation_bytes for m, r in by.items()}
    assert peak["full_chunked"] < peak["full"] and peak["off_chunked"] < peak["off"]
    assert peak["full_no_head"] <= peak["full_chunked"] <= 1.3 * peak["full_no_head"]
    for mode, fraction in (("budget_25_chunked", 0.25), ("budget_50_chunked", 0.5), ("budget_75_chunked", 0.75)):
        low, high = peak["off_chunked"], peak["full_chunked"]
        assert by[mode].budget_bytes == int(high + fraction * (low - high)), mode
    table = (tmp_path / "results.md").read_text()
    goals = table[table.index("Goals (checked on the rows of this run):") :]
    assert "| `full_chunked`'s activation peak at most 0.2x `full`'s | " in goals
    assert "| `full_chunked`'s activation peak at most 1.3x `full_no_head`'s | " in goals
    assert "| `full_chunked`'s step time at most 1.05x `full`'s | " in goals and "(one repetition) |" in goals
    assert "from full_chunked's peak to off_chunked's" in table
    verdicts = json.loads((tmp_path / "goals.json").read_text())
    assert [v["goal"]["against"] for v in verdicts][:5] == ["full", "full_no_head", "full", *["full_chunked"] * 2]
    assert verdicts[1]["verdict"] == "met" and verdicts[1]["ratio"] <= 1.3
    # the auto rows (issue 58): under their budgets, each with a step goal against the fastest fixed mode that fits
    assert [v["goal"]["mode"] for v in verdicts[5:]] == ["auto_25", "auto_50", "auto_75"]
    for verdict in verdicts[5:]:
        mode = verdict["goal"]["mode"]
        assert by[mode].peak_activation_bytes <= by[mode].budget_bytes, mode
        fixed = bench.fastest_fixed_mode(rows, by[mode].budget_bytes)
        assert verdict["goal"]["against"] == fixed.mode and verdict["goal"]["at_most"] == 1.05


def test_goal_verdicts_say_met_missed_unmeasured_and_when_noise_could_turn_them():
    from lightning_ac.bench.goals import Goal, check_goals

    def rows(chunked_peak, chunked_step, spread=0.03):
        return [
            bench.Row("full", "suite", 1000, 1.00, 0.0, step_time_spread=0.02),
            bench.Row("full_chunked", "suite", chunked_peak, chunked_step, 1e-8, step_time_spread=spread),
            bench.Row("full_no_head", "floor", 140, 0.90, None, step_time_spread=0.01),
        ]

    goals = [g for g in bench.PRESETS["cpu-vocab"]["goals"] if g.mode == "full_chunked"]  # the rows made here
    assert [v.text for v in check_goals(rows(150, 1.01, spread=0.01), goals)] == ["met", "met", "met"]
    texts = [v.text for v in check_goals(rows(150, 1.04), goals)]
    assert texts == ["met", "met", "met (within noise: the repetitions spread by 3%)"], "1.04x is 0.01 from 1.05x"
    texts = [v.text for v in check_goals(rows(250, 1.20), goals)]
    assert texts == ["missed", "missed", "missed"], "0.25x full's, 1.79x the floor, 1.20x full's step"
    assert check_goals(rows(150, 1.01, spread=None), goals)[2].text == "met (one repetition)"
    failed = rows(150, 1.0)[:1] + [bench.Row("full_chunked", "suite", None, None, None, status="failed: X")]
    assert [v.text for v in check_goals(failed, goals)] == ["not measured"] * 3
    with pytest.raises(ValueError, match="figure"):
        Goal("full", "memory", "off", 1.0)
    table = bench.results_markdown(rows(150, 1.04), check_goals(rows(150, 1.04), goals))
    assert "| `full_chunked`'s activation peak at most 0.2x `full`'s | 0.15x (0.0 / 0.0 MiB) | met |" in table


def test_the_head_table_gives_the_heads_share_and_chunked_loss_against_the_floor(tmp_path, monkeypatch):
    from lightning_ac.bench import head

    mib = 2**20

    def rows(off, off_chunked, full, full_chunked, floor):
        peaks = dict(off=off, off_chunked=off_chunked, full=full, full_chunked=full_chunked, full_no_head=floor)
        return [bench.Row(m, "suite", int(p * mib), 1.0, 0.0) for m, p in peaks.items()]

    table = head.head_markdown(
        {256: rows(138.8, 138.8, 55.6, 55.6, 55.6), 32000: rows(872.7, 180.0, 761.0, 55.6, 55.6)}
    )
    assert "| 256 | 138.8 | 138.8 | 55.6 | 55.6 | 55.6 | 0% | 1.00x |" in table
    assert "| 32,000 | 872.7 | 180.0 | 761.0 | 55.6 | 55.6 | 93% | 1.00x |" in table
    # the command, on a tiny model: one repetition of the head's rows at each vocabulary
    tiny_preset(monkeypatch, seq=32)
    monkeypatch.setitem(bench.PRESETS, "cpu-vocab", bench.PRESETS["tiny"])
    measured = head.main(["--vocab", "32", "512", "--out", str(tmp_path)])
    assert list(measured) == [32, 512] and all(len(r) == len(head.HEAD_MODES) for r in measured.values())
    assert "| 512 |" in (tmp_path / "head.md").read_text()
    assert set(json.loads((tmp_path / "head.json").read_text())) == {"32", "512"}


def test_gradients_are_compared_as_each_mode_ends_and_only_the_references_are_kept():
    """The H200's gpu-8k run kept every mode's float32 gradients (4.4 GB each) for a comparison at the end, and the
    kernel killed it after 28 rows: what the comparison holds is the references' gradients, whatever the number of
    modes."""
    from lightning_ac.bench.grads import GradientDiffs

    def grads(value):
        return {"w": torch.full((1000,), float(value)), "b": torch.full((10,), float(value))}

    held = []
    for count in (1, 5):
        diffs = GradientDiffs(lambda m: "lora_full" if m.startswith("layer") else "off")
        diffs.add("off", grads(0))
        for i in range(count):
            diffs.add(f"mode_{i}", grads(i + 1))
        held.append(diffs.held_bytes)
        assert [diffs.diff(f"mode_{i}") for i in range(count)] == [float(i + 1) for i in range(count)]
    assert held[0] == held[1] == 1010 * 4
    assert diffs.scale("mode_0") == 0.0 and diffs.scale("off") == 0.0, "off's largest gradient, the tolerance's scale"
    diffs.add("layer_offload", grads(1))
    assert diffs.diff("layer_offload") is None, "no lora_full ran: no figure, not a comparison with off"


def test_the_gradient_capture_falls_in_a_warm_up_step_and_a_failed_mode_is_said_at_once(tmp_path, monkeypatch, capsys):
    """The capture (a model-sized copy to the host) fell inside a timed step when --steps was small (the H200's `off`
    at 1.508 s against 0.149 s): it is taken in a warm-up step, which no step time counts; a mode that fails says so
    the moment it does; the table stands after each mode (results.md, marked partial, until the run ends)."""
    import lightning_ac.bench.run as run

    tiny_preset(monkeypatch)
    captured, timed_steps, written = [], [], []

    original = run._BenchModule.on_before_optimizer_step

    def spy(self, optimizer):
        had = self.grads is not None
        original(self, optimizer)
        if self.grads is not None and not had:
            captured.append(self.trainer.global_step)

    monkeypatch.setattr(run._BenchModule, "on_before_optimizer_step", spy)
    original_end = run.StepMetrics.on_train_batch_end

    def timed(self, trainer, *args):
        before = len(self.step_times)
        original_end(self, trainer, *args)
        if len(self.step_times) > before:
            timed_steps.append(trainer.global_step - 1)

    monkeypatch.setattr(run.StepMetrics, "on_train_batch_end", timed)

    def failing(model):
        raise RuntimeError("no such thing here")

    monkeypatch.setitem(run.ALL_ANCHORS, "broken_anchor", failing)
    rows = run.run_benchmark("tiny", ["off", "broken_anchor", "full"], steps=1, on_progress=written.append)
    assert captured == [run.CAPTURE_STEP] * 2 and timed_steps and run.CAPTURE_STEP not in timed_steps
    assert re.search(
        r"rep 0 broken_anchor +failed: RuntimeError: no such thing here\nrep 0 full ", capsys.readouterr().err
    )
    assert [r.status for r in rows] == ["ok", "failed: RuntimeError: no such thing here", "ok"]
    assert len(written) == 3 and rows[2].max_grad_diff == 0.0
    # the capture neither in the measured step: a mode's memory is the same with and without it (on the CPU the copy
    # of the gradients counted as the step's: cpu-vocab's full_chunked read 149.1 MiB instead of 72.0)
    config = run.model_config(bench.PRESETS["tiny"], None)
    config.vocab_size = 8192  # gradients (the embedding's and the head's) far larger than a 16-token step's activations
    base = run.build_model(config, torch.float32, 0)
    ids = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(0))
    peaks = [run._run_mode("full", base, ids, 1, True, capture, "cpu")[0].peak.activation_bytes for capture in (1, 0)]
    assert peaks[0] == peaks[1]


def test_trls_offloader_gets_the_accelerate_state_its_trainer_sets_up():
    """``trl_offload_full`` failed on the H200: "You must initialize the accelerate state ..." when TRL's offloader
    logged a warning. The anchor now sets that state up as TRL's trainer (its Accelerator) does; TRL's offloader
    itself needs a CUDA device (tests/test_gpu.py runs it there), so here the state is checked by the message."""
    pytest.importorskip("trl")
    from accelerate.logging import get_logger
    from accelerate.state import PartialState

    import lightning_ac.bench.modes as modes

    PartialState._reset_state()
    with pytest.raises(RuntimeError, match="You must initialize the accelerate state"):
        get_logger("trl").warning("what TRL's offloader warns of")
    with pytest.raises(Exception) as built:  # TRL's offloader on a CPU-only machine: no accelerator to stream with
        modes._trl_context(torch.nn.Linear(2, 2))
    assert "accelerate state" not in str(built.value)
    get_logger("trl").warning("what TRL's offloader warns of")  # the state is there
    PartialState._reset_state()


def test_torch_sac_saves_attention_as_selective_attn_does_and_the_gpu_rows_gain_the_chunked_loss(monkeypatch):
    """The anchor for SAC's own cost: torch's checkpoint wrapper with torch's selective contexts saving the attention
    kernels, exact against off; on a GPU the default rows add it, full_chunked and offload_all with chunked_loss (the
    head is most of what full and offload_all still hold at a 32,000-word vocabulary)."""
    from lightning_ac.bench.modes import default_modes

    tiny_preset(monkeypatch)
    rows = bench.run_benchmark("tiny", ["off", "selective_attn", "torch_sac"], steps=1)
    by = {r.mode: r for r in rows}
    assert by["torch_sac"].status == "ok" and by["torch_sac"].max_grad_diff == 0.0
    assert by["torch_sac"].peak_activation_bytes == by["selective_attn"].peak_activation_bytes, "the same saves"
    gpu = default_modes(on_accelerator=True)
    assert {"torch_sac", "full_chunked", "offload_all_chunked"} <= set(gpu)
    assert not {"torch_sac", "full_chunked"} & set(default_modes(on_accelerator=False)), "cpu-small as it was"


def test_the_copy_floor_is_the_bytes_each_way_at_the_measured_bandwidth():
    from lightning_ac.bench.bus import copy_bandwidth, copy_floor_s
    from lightning_ac.bench.run import Row
    from lightning_ac.bench.tables import results_markdown

    assert copy_bandwidth(torch.device("cpu")) is None, "on the CPU no copy crosses a bus"
    assert copy_floor_s(2 * 2**30, (4 * 2**30, 2 * 2**30)) == 1.5, "2 GiB to the host at 2 GiB/s, back at 4 GiB/s"
    assert copy_floor_s(None, (1.0, 1.0)) is None and copy_floor_s(2**30, None) is None
    row = Row("offload_only", "suite", 1, 3.0, 0.0, moved_bytes=10 * 2**30, copy_floor_s=0.5)
    assert "| `offload_only` | 10240.0 | 0.500 | 3.000 | 6.00x |" in results_markdown([row])


def test_the_gradients_the_benchmark_holds_do_not_grow_with_the_number_of_modes(monkeypatch):
    """After each mode only the reference's gradients are alive, however many modes ran. A mode's module and trainer
    refer to each other, so what they hold lives until Python's cycle collector runs: with it held off (as it may be
    for many modes: it ran when it chose to), the gradients left on the module stayed alive, one model-sized copy per
    mode (the H200's gpu-8k run: 4.4 GB each). Counted from weak references to the gradients each mode handed over."""
    import gc
    import weakref

    import lightning_ac.bench.run as run

    tiny_preset(monkeypatch)
    handed: list = []
    original = run._run_mode

    def record(result):
        handed.extend(weakref.ref(g) for g in (result[1] or {}).values())
        return result

    def observed(*args, **kwargs):  # no local of its own: a traceback kept from inside fit keeps this frame too
        return record(original(*args, **kwargs))

    monkeypatch.setattr(run, "_run_mode", observed)

    def live_bytes() -> int:
        return sum(g.numel() * g.element_size() for g in (ref() for ref in handed) if g is not None)

    held: dict = {}  # the number of modes: the bytes alive after each mode

    def progress(rows):
        held[len(rows)].append(live_bytes())

    for modes in (["off", "full"], ["off", "full", "every_2", "selective_attn"]):
        handed.clear()
        held[len(modes)] = []
        gc.collect()
        gc.disable()
        try:
            rows = run.run_benchmark("tiny", modes, steps=1, on_progress=progress)
        finally:
            gc.enable()
        assert [r.max_grad_diff for r in rows] == [0.0] * len(modes), "each mode compared with off"
    reference = held[2][0]  # off's gradients, kept for the comparison
    assert reference > 0 and held[2] == [reference] * 2 and held[4] == [reference] * 4, held
