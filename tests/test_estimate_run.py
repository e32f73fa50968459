"""The estimate answers for the run the user runs: the precision as Lightning names it, the attention kernel the
model trains with, and refusals in the estimator's own words (exit 2, the key and the value named), never a
traceback. (Mixed precision against real CPU steps under Lightning's plugin: tests/test_estimate.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from lightning_ac.config import ConfigError, parse_size
from lightning_ac.estimate import EstimateError, estimate
from lightning_ac.estimate.cli import main
from lightning_ac.estimate.precision import precision_for

TINY_LLAMA = tiny_config("llama").to_diff_dict()
GEMMA2 = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
              head_dim=32, vocab_size=1000)  # fmt: skip


def _peak(model, overrides, seq=256, **kwargs):
    result = estimate(model, seq, overrides=overrides, modes=["off"], target="cpu", **kwargs)
    return result, result.steps[0].activation_peak_bytes


# -- attention ---------------------------------------------------------------------------------------------------


def test_the_default_attention_is_the_models():
    """Gemma 2 runs eager in transformers (no SDPA: its logits are soft-capped), Llama SDPA: no flag needed."""
    gemma2, _ = _peak("gemma2", GEMMA2)
    llama, _ = _peak("llama", TINY_LLAMA)
    assert gemma2.description.endswith("attention eager") and llama.description.endswith("attention sdpa")


def test_flash_attention_saves_what_sdpas_flash_kernel_saves():
    _, sdpa = _peak("llama", TINY_LLAMA, attention="sdpa")
    _, flash = _peak("llama", TINY_LLAMA, attention="flash_attention_2")
    _, eager = _peak("llama", TINY_LLAMA, attention="eager")
    assert flash == sdpa < eager  # eager keeps the seq x seq attention probabilities
    # a model transformers refuses under SDPA still gets flash attention's figures
    gemma_flash, flash2 = _peak("gemma2", GEMMA2, attention="flash_attention_2")
    _, eager2 = _peak("gemma2", GEMMA2)
    assert flash2 < eager2 and "flash_attention_2 (counted as SDPA's flash kernel)" in gemma_flash.description


def test_flash_attention_keeps_no_mask_past_a_sliding_window():
    """Past the window transformers builds SDPA a real mask, which SDPA's kernel keeps for backward; flash attention
    takes none: the stand-in's peak is SDPA's own for a model without sliding layers."""
    windowed = dict(GEMMA2, sliding_window=64)
    _, flash = _peak("gemma2", windowed, attention="flash_attention_2")
    _, unwindowed = _peak("gemma2", dict(GEMMA2, sliding_window=4096), attention="flash_attention_2")
    assert flash == unwindowed


@pytest.mark.parametrize(
    "model, overrides, attention, words",
    [
        ("gemma2", GEMMA2, "sdpa", "--attn sdpa: transformers does not run Gemma2ForCausalLM under SDPA"),
        ("llama", TINY_LLAMA, "flex", "--attn flex: choose from sdpa, eager, flash_attention_2"),
    ],
)
def test_an_attention_the_model_does_not_run_is_refused(model, overrides, attention, words):
    with pytest.raises(EstimateError, match=words):
        estimate(model, 32, overrides=overrides, modes=["off"], attention=attention)


# -- precision ---------------------------------------------------------------------------------------------------


def test_precision_as_lightning_names_it():
    assert precision_for("bf16-mixed").weights is torch.float32 and precision_for("bf16").name == "bf16-mixed"
    assert precision_for("16-true").weights is torch.float16 and precision_for("32").name == "32-true"
    result = estimate("llama", 32, overrides=TINY_LLAMA, modes=["off"], precision="bf16-mixed", full_finetune=True)
    true = estimate("llama", 32, overrides=TINY_LLAMA, modes=["off"], precision="bf16-true", full_finetune=True)
    assert result.dtype == "bf16-mixed (float32 weights, autocast)" and true.dtype == "bfloat16"
    mixed_step, true_step = result.steps[0], true.steps[0]
    # float32 weights, gradients and AdamW state: twice bf16-true's
    for field in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"):
        assert abs(getattr(mixed_step, field) - 2 * getattr(true_step, field)) <= 2 * 512 * 30, field


def test_qlora_under_mixed_precision_is_the_recipes_bf16_base():
    mixed = estimate("llama", 32, overrides=TINY_LLAMA, modes=["off"], precision="bf16-mixed", qlora=True)
    true = estimate("llama", 32, overrides=TINY_LLAMA, modes=["off"], precision="bf16-true", qlora=True)
    assert mixed.dtype == "bf16-mixed (a bf16-loaded 4-bit base, autocast)"
    # the same model (prepared: float32 but for the 4-bit layers); autocast changes what the step keeps
    assert mixed.steps[0].parameter_bytes == true.steps[0].parameter_bytes


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"precision": "transformer-engine"}, "NVIDIA Transformer Engine"),
        ({"precision": "bf16-mixd"}, "--precision bf16-mixd: choose from 32-true, bf16-true"),
        ({"precision": "bf16-mixed", "dtype": "float32"}, "Give one of them"),
    ],
)
def test_bad_precisions_are_refused(kwargs, words):
    with pytest.raises(EstimateError, match=words):
        estimate("llama", 32, overrides=TINY_LLAMA, modes=["off"], **kwargs)


# -- the CLI's refusals --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--set", "hidden_size=6x4"], "--set hidden_size='6x4': transformers rejects it"),
        (["--set", "tie_word_embeddings=3"], "--set tie_word_embeddings=3: transformers rejects it"),
        (["--set", "num_hidden_layers=0"], "--set num_hidden_layers=0: the model would have no decoder layer"),
        (["--set", "hidden_size=63"], "transformers rejects the config"),
        (["--precision", "fp8"], "--precision fp8: choose from"),
        (["--optimizer", "adafactor"], "invalid choice: 'adafactor'"),
        (["--double-quant"], "--double-quant and --quant-type describe the 4-bit base of a QLoRA run"),
        (["--qlora", "--qlora-as-loaded"], "not allowed with argument"),
    ],
)
def test_bad_input_is_the_clis_one_line_error(capsys, argv, words):
    with pytest.raises(SystemExit) as stopped:
        main(["--model", "llama", "--seq", "32", "--modes", "off", *argv])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_a_bare_byte_count_is_a_size():
    """torch reports a device's memory in bytes; the CLI's error message says a whole number of bytes is a size."""
    with pytest.raises(ConfigError, match="12GiB|unit"):
        parse_size("12", "budget")  # the block's text sizes carry a unit: "12" could mean 12 GiB
    with pytest.raises(EstimateError, match="--device-memory"):
        estimate("llama", 32, overrides=TINY_LLAMA, modes=["off"], device_memory="0")
    result = estimate("llama", 32, overrides=TINY_LLAMA, modes=["off"], device_memory="85097971712", longest=False)
    assert result.device_memory_bytes == [85097971712] and result.steps[0].fits
