"""Edges of ``python -m lightning_ac.estimate`` (issue 57): ``--set`` on a multimodal config reaches its language
model; a vocabulary that leaves the padding token out is refused naming ``pad_token_id``; and bitsandbytes is
imported only by a run that uses it, its import's log lines held at DEBUG instead of read as the run's failure."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_ac.estimate.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 vocab_size=1000, num_hidden_layers=1)  # fmt: skip
TINY_LLAMA = ["--model", "llama", "--set", "hidden_size=64", "--set", "intermediate_size=128", "--set",
              "num_attention_heads=2", "--set", "num_key_value_heads=1", "--set", "vocab_size=1000", "--set",
              "num_hidden_layers=1", "--seq", "32", "--modes", "off", "--target", "cpu"]  # fmt: skip
# -X importtime lists each module a process imports on stderr, one line each: "import time: ... | <module>". An import
# of bitsandbytes loads its submodules (bitsandbytes.nn, bitsandbytes.backends...); an attempt that is refused, none.
BITSANDBYTES_IMPORTED = re.compile(r"^import time:.*\|\s*bitsandbytes\.\S+\s*$", re.MULTILINE)


def _sets(values: dict) -> list:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={json.dumps(value)}")]


def _run(*args: str) -> subprocess.CompletedProcess:
    """A real ``python -X importtime -m lightning_ac.estimate ...``, from the repository's root."""
    command = [sys.executable, "-X", "importtime", "-m", "lightning_ac.estimate", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


# -- item 14: --set on a multimodal config ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, values, says",
    [
        ("gemma3", {"num_hidden_layers": 1}, "1 layers, hidden 2304"),  # the issue's command: Gemma 3's own sizes
        ("gemma3", TINY_TEXT, "K parameters"),
        ("llama4", {**TINY_TEXT, "intermediate_size_mlp": 128, "num_local_experts": 2}, "K parameters"),
    ],
    ids=["gemma3-layers", "gemma3-tiny", "llama4-tiny"],
)
def test_set_on_a_multimodal_config_reaches_its_language_model(capsys, model, values, says):
    """``--set`` on Gemma 3 or Llama 4 (a text_config beside a vision_config) sets their language model's config,
    which is what trains: no traceback, nor a default-sized model under the values' description."""
    main(["--model", model, *_sets(values), "--seq", "32", "--modes", "off", "--target", "cpu"])
    described = capsys.readouterr().out.splitlines()[0]
    assert described.startswith(f"{model}: {model}_text: ") and says in described, described
    shown = {"num_hidden_layers": "{} layers", "hidden_size": "hidden {}", "vocab_size": "vocabulary {}"}
    for key, text in shown.items():
        assert key not in values or text.format(values[key]) in described, key


# -- item 15: a vocabulary without the padding token -----------------------------------------------------------


def test_a_vocabulary_without_the_padding_token_is_refused_naming_pad_token_id(capsys):
    """Phi-3 keeps pad_token_id=32000: --set vocab_size=1000 leaves it outside, and the refusal says so."""
    with pytest.raises(SystemExit) as stopped:
        main(["--model", "phi3", "--set", "vocab_size=1000", "--seq", "32", "--modes", "off"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err
    assert "pad_token_id 32000" in err and "vocabulary of 1000 tokens (vocab_size)" in err
    assert "--set pad_token_id=" in err, "the refusal says how to fix it"


def test_the_padding_token_set_inside_the_vocabulary_is_estimated(capsys):
    argv = ["--model", "phi3", *_sets({**TINY_TEXT, "pad_token_id": 0}), "--lora-targets", "qkv_proj"]
    main([*argv, "--seq", "32", "--modes", "off", "--target", "cpu"])
    assert "vocabulary 1000" in capsys.readouterr().out


# -- item 16: bitsandbytes only for a run that uses it -----------------------------------------------------------


def test_a_run_without_a_4_bit_base_does_not_import_bitsandbytes():
    done = _run(*TINY_LLAMA)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not BITSANDBYTES_IMPORTED.search(done.stderr), "a LoRA run imported bitsandbytes"
    assert "Failed to load" not in done.stderr and "kernels-community" not in done.stderr


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_a_4_bit_run_imports_bitsandbytes_without_its_warning():
    done = _run(*TINY_LLAMA, "--qlora")
    assert done.returncode == 0, done.stderr[-3000:]
    assert BITSANDBYTES_IMPORTED.search(done.stderr), "a QLoRA run needs bitsandbytes"
    printed = "\n".join(line for line in done.stderr.splitlines() if not line.startswith("import time:"))
    assert "Failed to load" not in printed and "kernels-community" not in printed, printed[-3000:]


def test_what_bitsandbytes_logs_on_import_is_logged_at_debug(tmp_path):
    """Whatever the machine (bitsandbytes warns where the CPU has AVX-512 BF16 and the kernels package is there): a
    stand-in bitsandbytes that warns on import, imported for a 4-bit run, prints nothing; at DEBUG, one line of ours
    says what it is."""
    (tmp_path / "bitsandbytes").mkdir()
    (tmp_path / "bitsandbytes" / "__init__.py").write_text(
        "import logging\nlogging.getLogger('bitsandbytes.backends.cpu.ops').warning('Failed to load a CPU kernel')\n"
    )
    script = textwrap.dedent(
        f"""
        import io, logging, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from lightning_ac.estimate.imports import import_bitsandbytes
        assert import_bitsandbytes().__file__.startswith({str(tmp_path)!r})
        print("quiet")
        held = io.StringIO()
        logger = logging.getLogger("lightning_ac.estimate")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(logging.StreamHandler(held))
        logger.propagate = False  # to our StringIO only: lightning_ac's own handler would print it on stderr
        del sys.modules["bitsandbytes"]
        import_bitsandbytes()
        print(held.getvalue())
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Failed to load" not in done.stderr, "printed as if the run failed"
    quiet, debug = done.stdout.split("quiet\n")
    assert "bitsandbytes" in debug and "Failed to load a CPU kernel" in debug and "not run" in debug
