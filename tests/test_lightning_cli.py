"""LightningCLI: the suite's callbacks as ``trainer.callbacks`` entries of a YAML config (examples/cli/).

One test runs the documented command in a subprocess; the others call the same ``LightningCLI`` in this process
(its parse, its instantiation and its fit), at the tests' small sizes.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "cli"
# the tests' sizes: two steps of a 64-wide model on 32-token sequences
SMALL = [
    "--trainer.max_steps=2",
    "--trainer.enable_progress_bar=false",
    "--data.seq_len=32",
    "--data.batch_size=2",
    "--model.hidden_size=64",
    "--model.intermediate_size=128",
]
FIT_DONE = "`Trainer.fit` stopped: `max_steps=2` reached."


@pytest.fixture
def cli_main(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["examples/cli.py"])  # LightningCLI(args=...) warns beside pytest's own
    spec = importlib.util.spec_from_file_location("lightning_ac_cli_example", ROOT / "examples" / "cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def run_in_process(cli_main, args: List[str], capsys, caplog) -> Tuple[int, str, Any]:
    """``(exit status, everything printed and logged, the LightningCLI or None)`` of ``python examples/cli.py <args>``,
    in this process."""
    status, raised, cli = 0, "", None
    try:
        cli = cli_main(args)
    except SystemExit as exit:  # jsonargparse's parse errors, and --print_config
        status = exit.code if isinstance(exit.code, int) else 1
    except Exception as error:  # noqa: BLE001 - what would reach the user's terminal as a traceback
        status, raised = 1, f"{type(error).__name__}: {error}"
    captured = capsys.readouterr()
    return status, "\n".join([captured.out, captured.err, caplog.text, raised]), cli


def with_init_args(tmp_path: Path, example: str, callback: int, **init_args: Any) -> Path:
    """A copy of ``examples/cli/<example>.yaml`` whose ``callback``-th callback takes ``init_args`` as well."""
    config: Dict[str, Any] = yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text())
    config["trainer"]["callbacks"][callback]["init_args"].update(init_args)
    path = tmp_path / f"{example}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_documented_command_trains_with_the_suite_callbacks():
    result = subprocess.run(
        [sys.executable, "examples/cli.py", "fit", "--config", "examples/cli/budget.yaml", *SMALL],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "budget 100.00 MiB" in output and "offloading hidden_states to host memory" in output, output
    assert "selective: save attention" in output and "decoder layers" in output, output  # verbose: true
    assert FIT_DONE in output, output


def test_layer_offload_example_streams_the_lora_base(cli_main, capsys, caplog):
    status, output, cli = run_in_process(
        cli_main, ["fit", "--config", str(EXAMPLES / "layer_offload.yaml"), *SMALL], capsys, caplog
    )
    assert status == 0, output
    assert "checkpointing 2/4 decoder layers" in output, output
    assert "layer offloading" in output and "1 resident" in output, output
    # (Lightning's own "fit stopped" line goes to a logger other tests may have reconfigured: read the trainer)
    assert cli.trainer.global_step == 2
    offload = next(c for c in cli.trainer.callbacks if type(c).__name__ == "LayerOffload")
    assert offload.last_step["loads"] > 0, "the base was streamed"


def test_print_config_shows_the_callbacks_arguments(cli_main, capsys, caplog):
    status, output, _ = run_in_process(
        cli_main, ["fit", "--config", str(EXAMPLES / "budget.yaml"), "--print_config"], capsys, caplog
    )
    assert status == 0, output
    callbacks = yaml.safe_load(output[: output.index("\n", output.index("weights_only"))])["trainer"]["callbacks"]
    assert [c["class_path"] for c in callbacks] == [
        "lightning_ac.ActivationCheckpointing",
        "lightning_ac.ActivationOffload",
    ]
    checkpointing, offload = callbacks[0]["init_args"], callbacks[1]["init_args"]
    # what the YAML sets, and every default beside it
    assert checkpointing["budget"] == "100MiB" and checkpointing["selective"] == {"save": ["attention"]}
    assert checkpointing["implementation"] == "hf" and checkpointing["reentrant"] is None
    assert offload["hidden_states"] == "cpu" and offload["copy_on_host"] is True
    assert offload["all"] == "none" and offload["verify_steps"] == 0 and offload["min_offload_bytes"] == 2**16


@pytest.mark.parametrize(
    "example, callback, init_args, message",
    [
        ("budget", 0, {"budget": "lots"}, "ActivationCheckpointing(budget=...): expected a size"),
        ("budget", 0, {"selective": {"saves": ["attention"]}}, "selective: unknown field(s) 'saves'"),
        ("budget", 0, {"kwargs": {"every_n_layers": 2}}, "kwargs.every_n_layers"),
        ("budget", 1, {"hidden_states": "gpu"}, "ActivationOffload(hidden_states=...)"),
        ("budget", 1, {"verify_steps": -1}, "ActivationOffload(verify_steps=...)"),
        ("layer_offload", 1, {"resident_layers": -3}, "LayerOffload(resident_layers=...)"),
    ],
)
def test_a_bad_value_stops_with_the_config_error_before_training(
    cli_main, capsys, caplog, tmp_path, example, callback, init_args, message
):
    config = with_init_args(tmp_path, example, callback, **init_args)
    status, output, _ = run_in_process(cli_main, ["fit", "--config", str(config), *SMALL], capsys, caplog)
    assert status == 2, output  # a bad value, as jsonargparse's own parse errors
    assert f"error: {message}" in output or ("error: " in output and message in output), output
    assert "Does not validate against any of the Union subtypes" not in output, "our message, not jsonargparse's"
    assert "Trainer.fit" not in output and "lightning_ac: checkpointing" not in output, "no training started"


def test_a_rejected_value_prints_the_config_error_and_exits_2_without_a_traceback(tmp_path):
    config = with_init_args(tmp_path, "budget", 1, hidden_states="gpu")
    result = subprocess.run(
        [sys.executable, "examples/cli.py", "fit", "--config", str(config), *SMALL],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: ActivationOffload(hidden_states=...): expected none, cpu, auto, true or false, got 'gpu'. "
        "Pass hidden_states='cpu' or hidden_states='none'."
    ], result.stderr
    # where that argument is in the user's config, right below it
    assert "init_args.hidden_states of the trainer.callbacks entry with class_path: lightning_ac.ActivationOffload" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr and "Union subtypes" not in result.stderr, result.stderr


@pytest.mark.parametrize("flag, placement", [("true", "cpu"), ("False", "none"), ("TRUE", "cpu")])
def test_a_boolean_offload_target_on_the_command_line(cli_main, capsys, caplog, flag, placement):
    # jsonargparse keeps --x=true as the text 'true' where the type hint also takes strings (Union[str, bool])
    args = ["fit", "--config", str(EXAMPLES / "budget.yaml"), f"--trainer.callbacks.hidden_states={flag}", *SMALL]
    status, output, cli = run_in_process(cli_main, args, capsys, caplog)
    assert status == 0, output
    offload = next(c for c in cli.trainer.callbacks if type(c).__name__ == "ActivationOffload")
    assert offload.offload.hidden_states == placement


@pytest.mark.parametrize(
    "callback, init_args, key",
    [
        (1, {"verify_steps": "two"}, "verify_steps"),
        (1, {"copy_on_host": "maybe"}, "copy_on_host"),
        (0, {"budget": [100]}, "budget"),
        (0, {"reentrant": "sometimes"}, "reentrant"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_at_parse_time(
    cli_main, capsys, caplog, tmp_path, callback, init_args, key
):
    # The type hints let jsonargparse refuse these before anything is built: it names the argument and the value.
    config = with_init_args(tmp_path, "budget", callback, **init_args)
    status, output, _ = run_in_process(cli_main, ["fit", "--config", str(config), *SMALL], capsys, caplog)
    assert status == 2, output
    assert key in output and repr(list(init_args.values())[0]).strip("'") in output, output
    assert "Trainer.fit" not in output


def test_a_layer_class_path_in_layers_names_the_class(cli_main, capsys, caplog, tmp_path):
    # YAML holds no classes: the class path the README's rule reads as a class, not as a module-name glob
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    path = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
    config = with_init_args(tmp_path, "layer_offload", 1, layers=[path])
    status, output, cli = run_in_process(cli_main, ["fit", "--config", str(config), *SMALL], capsys, caplog)
    assert status == 0, output
    offload = next(c for c in cli.trainer.callbacks if type(c).__name__ == "LayerOffload")
    assert offload.layers == [LlamaDecoderLayer]
    assert offload.last_step["loads"] > 0, "the layers of that class were streamed"
