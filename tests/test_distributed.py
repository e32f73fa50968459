"""Multi-process runs (DDP on CPU with gloo), launched as users launch them: torch.distributed.run in a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_two_ranks(script: str, tmp_path: Path):
    """Launch ``tests/scripts/<script>`` on 2 CPU processes; returns the process and each rank's JSON rows."""
    out = tmp_path / "ranks.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"tests/scripts/{script}", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result, [json.loads(line) for line in out.read_text().splitlines()]


def test_ddp_two_processes_train_exactly_as_without_the_suite(tmp_path):
    result, ranks = run_two_ranks("ddp_parity.py", tmp_path)
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for rank in ranks:
        plain, suite, streamed, chunked = rank["losses"]
        assert plain == suite == streamed == chunked
        assert rank["same"], (
            "parameters after two DDP steps are bit-identical with SAC + hidden_states offload + verify"
        )
        assert rank["same_streamed"], "and with checkpointing + layer offloading"
        assert rank["same_chunked"], "and with checkpointing + the chunked loss (one chunk)"
    # the suite logs on rank zero only: one line for each of the three checkpointing runs
    assert (result.stdout + result.stderr).count("lightning_ac: checkpointing 4/4 decoder layers") == 3
    # verify mode under DDP: the reference passes matched DDP's all-reduced gradients bit for bit
    assert (result.stdout + result.stderr).count("lightning_ac: verified") == 2


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_fsdp2_implementation_and_selective_under_fully_shard(tmp_path):
    result, rows = run_two_ranks("fsdp_parity.py", tmp_path)
    modes = ["fsdp", "fsdp_selective", "fsdp_selective_offload", "hf_selective", "hf_chunked", "hf_tiled"]
    assert sorted((r["mode"], r["rank"]) for r in rows) == sorted((m, rank) for m in modes for rank in (0, 1))
    for row in rows:
        assert row["same"], f"{row['mode']}: loss and gradients match an unmodified FSDP2 run"
        assert not row["left_behind"], "nothing of ours remains on the layers after fit"
        # full recompute replays each of the 4 layers' attention; selective saves it, under either wrapper
        assert row["attention_replayed"] == (4 if row["mode"] in ("fsdp", "hf_chunked", "hf_tiled") else 0), row
    # each layer's input, and what the policy saves (SDPA's output and log-sum-exp), move to the host
    offloaded = [r["offloaded"] for r in rows if r["mode"] == "fsdp_selective_offload"]
    assert offloaded == [{"hidden_states": 4, "selective": 8, "all": 0}] * 2
    logs = result.stdout + result.stderr
    assert "checkpointing 4/4 decoder layers (fsdp, non-reentrant)" in logs
    assert "checkpointing 4/4 decoder layers (fsdp, non-reentrant, selective: save attention)" in logs


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_budget_picks_one_plan_on_every_rank_under_ddp_and_fsdp2(tmp_path):
    result, rows = run_two_ranks("budget_parity.py", tmp_path)
    modes = ("ddp", "fsdp", "ddp_estimate")
    assert sorted((r["mode"], r["rank"]) for r in rows) == sorted((m, rank) for m in modes for rank in (0, 1))
    for mode in modes:
        ranks = [r for r in rows if r["mode"] == mode]
        assert ranks[0]["choices"] == ranks[1]["choices"], "the ranks' figures were reduced before choosing"
        assert "keep" in ranks[0]["choices"] and "recompute" in ranks[0]["choices"], ranks[0]
        for row in ranks:
            assert row["same"], f"{mode}: losses and gradients match an unmodified run at every step"
            assert row["settled"] and row["peak"] <= row["budget"], row
    # one line per run, from rank zero; the estimated run's first plan said once too
    logs = result.stdout + result.stderr
    assert len(re.findall(r"lightning_ac: budget [\d.]+ [KM]iB: keeping", logs)) == 3
    assert logs.count("budget: the first plan, from the training step on fake tensors") == 1


def test_the_estimate_per_rank_is_what_a_real_rank_holds_under_fsdp2_and_ddp(tmp_path):
    """``--strategy fsdp|ddp --devices 2``: the fake step of rank 0 on a fake process group holds what each rank of a
    real 2-process gloo run holds (tests/scripts/rank_memory.py), to the byte.

    FSDP2 (float32, and bf16-mixed as Lightning's plugin runs it): the device total (the batch aside, which torch's
    FSDPMemTracker does not see) is FSDPMemTracker's peak; the sharded parameters, gradients and optimizer state are
    the ranks' own. DDP: the gradients column is the gradients plus DDP's buckets as its reducer holds them;
    measure_step's activation peak is the estimate's plus one bucket: the buckets exist before the step, and
    measure_step counts a storage it first sees in the step (the reducer writes each gradient into its bucket with an
    out= op) as made there, while the estimate knows them."""
    from conftest import tiny_config

    from lightning_ac.estimate.models import Training
    from lightning_ac.estimate.modes import resolve_modes
    from lightning_ac.estimate.precision import precision_for
    from lightning_ac.estimate.ranks import Ranks
    from lightning_ac.estimate.step import fake_step

    _, rows = run_two_ranks("rank_memory.py", tmp_path)
    config = tiny_config("llama")
    batch_bytes = 2 * 64 * 8  # the per-rank batch's token ids
    runs = sorted({(r["strategy"], r["precision"]) for r in rows})
    assert runs == [("ddp", "32-true"), ("fsdp", "32-true"), ("fsdp", "bf16-mixed")]
    for strategy, precision in runs:
        real = {r["mode"]: r for r in rows if (r["strategy"], r["precision"], r["rank"]) == (strategy, precision, 0)}
        other = {r["mode"]: r for r in rows if (r["strategy"], r["precision"], r["rank"]) == (strategy, precision, 1)}
        assert real and real.keys() == other.keys()
        for mode in resolve_modes(list(real), True):
            fake = fake_step(config, precision_for(precision), Training(None, None), mode, 64, 2, "adamw", "cpu",
                             ranks=Ranks(strategy, 2))  # fmt: skip
            row, case = real[mode.name], (strategy, precision, mode.name)
            assert other[mode.name]["parameter_bytes"] == row["parameter_bytes"], "the ranks hold alike"
            assert fake.parameter_bytes == row["parameter_bytes"], case
            assert fake.optimizer_bytes == row["optimizer_bytes"], case
            if strategy == "fsdp":
                assert fake.gradient_bytes == row["gradient_bytes"], case
                assert fake.device_total_bytes - batch_bytes == row["peak_bytes"], case
                # what a rank gathers: more than nothing, less than the whole model
                assert 0 < fake.streamed_weight_bytes < 2 * row["parameter_bytes"], case
            else:
                assert fake.gradient_bytes == row["gradient_bytes"] + row["bucket_bytes"], case
                assert row["bucket_bytes"] == row["gradient_bytes"], "one more copy of the trainable gradients"
                assert fake.activation_peak_bytes + row["bucket_bytes"] == row["activation_peak_bytes"], case
    sharded = next(r for r in rows if r["strategy"] == "fsdp")
    whole = next(r for r in rows if r["strategy"] == "ddp")
    assert sharded["parameter_bytes"] * 2 == whole["parameter_bytes"], "each FSDP2 rank holds half the weights"
