"""``python -m lightning_ac.estimate ... --plan --gpu NAME``: the block the memory budget would settle on for a device
on a GPU, from fake steps priced by the time model (lightning_ac.estimate.gpu_plan).

Oracles apart from the planner: the block it prints is one the config parser accepts and sets what it says; its
activation peak is under its budget, by the budget choice's own estimate; the plan is the fastest of the tool
combinations it weighed that fit; a host with no room offloads nothing; the arguments' errors.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from lightning_ac.config import parse_config
from lightning_ac.estimate import estimate
from lightning_ac.estimate.cli import main
from lightning_ac.estimate.timing import GPUS

TINY = dict(
    model_type="llama",
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=8000,
    max_position_embeddings=4096,
)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "tiny.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def plan(config, device, host=None):
    found = estimate(
        config, 1024, modes=["off"], device_memory=device, longest=False, plan_on=("h100-pcie", GPUS["h100-pcie"]),
        host_memory=host, full_finetune=True,
    )  # fmt: skip
    (gpu_plan,) = found.gpu_plans
    return gpu_plan


@pytest.mark.slow  # seven fake steps (about 15 s)
def test_the_plan_is_the_fastest_tool_combination_that_fits_and_its_block_parses(config, capsys):
    found = main([
        "--model", config, "--seq", "1024", "--full-finetune", "--device-memory", "1.2GiB", "--modes", "off",
        "--no-longest", "--plan", "--gpu", "h100-pcie",
    ])  # fmt: skip
    (p,) = found.gpu_plans
    out = capsys.readouterr().out
    block = yaml.safe_load(re.search(r"```yaml\n(.*?)```", out, re.S).group(1))["activation_checkpointing"]
    parsed = parse_config(block)
    assert parsed.budget == int(p.budget_bytes) // 2**20 * 2**20 and parsed.selective is not None
    assert bool(parsed.chunked_loss) == p.chunked_loss and bool(parsed.tiled_mlp) == p.tiled_mlp
    assert p.fits and p.activation_peak_bytes <= p.budget_bytes and len(p.layers) == 4
    fitting = {k: v for k, v in p.weighed.items() if v is not None}
    assert p.step_seconds == min(fitting.values())
    assert f"predicted step: {p.step_seconds:.3f} s" in out and "x `off`'s" in out and "x `full`'s" in out


@pytest.mark.slow  # seven fake steps more (about 10 s)
def test_without_host_room_no_input_is_offloaded(config):
    p = plan(config, "1.2GiB", host=0)
    assert "o" not in p.layers and p.host_bytes == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpu", "h200"], "go with --plan"),
        (["--plan"], "--plan needs --gpu"),
        (["--plan", "--gpu", "h200", "--host-memory", "lots"], "--host-memory 'lots'"),
        (["--plan", "--tflops", "100", "--memory-gbps", "0", "--link-gbps", "1"], "must be positive"),
        # the break-it pass: NaN passed a "<= 0" test and priced every step at NaN; an infinite link hid every copy
        (["--plan", "--gpu", "h100-pcie", "--tflops", "nan"], "must be positive and finite, got --tflops nan"),
        (["--plan", "--gpu", "h100-pcie", "--memory-gbps", "nan"], "got --memory-gbps nan"),
        (["--plan", "--gpu", "h100-pcie", "--link-gbps", "inf"], "got --link-gbps inf"),
    ],
)
def test_the_plan_arguments_are_checked_before_anything_runs(config, argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["--model", config, "--seq", "256", "--device-memory", "1GiB", *argv])
    assert message in capsys.readouterr().err


def test_a_plan_needs_one_device(config):
    from lightning_ac.estimate import EstimateError

    with pytest.raises(EstimateError, match="--plan makes the budget's plan for one device"):
        estimate(config, 256, modes=["off"], plan_on=("h200", GPUS["h200"]), longest=False)
