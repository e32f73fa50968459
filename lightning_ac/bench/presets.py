"""The benchmark's presets (a model's shape, the batch, the repetitions; where a preset has them, its own rows and
goals) and the model each one builds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from lightning_ac.bench.goals import Goal

__all__ = ["PRESETS", "build_model", "model_config"]

# A Llama-style model where attention is a large share of each layer: hidden 256, 8 layers, 2k tokens.
_CPU_SMALL: Dict[str, Any] = dict(
    model=dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=8192,
    ),
    seq=2048,
    batch=1,
    dtype="float32",
    reps=3,
    steps=3,
)

# The rows of the vocabulary preset: each mode with and without chunked_loss, the floor, and the anchors
VOCAB_MODES: List[str] = [
    "off",
    "off_chunked",
    "full",
    "full_chunked",
    "full_chunked_32",
    "full_chunked_tiled",
    "selective_attn",
    "selective_attn_chunked",
    "full_no_head",
    "hf_native_full",
    "torch_checkpoint_wrapper",
    "torchtune_chunked_ce",
    *(f"{budget}{chunked}" for budget in ("budget_25", "budget_50", "budget_75") for chunked in ("", "_chunked")),
    "auto_25",
    "auto_50",
    "auto_75",
]
# issue 31: with chunked_loss, full holds at most a fifth of its activations without it, comes within 1.3x of the
# floor (none of the head's activations), and steps at most 5% slower
VOCAB_GOALS: List[Goal] = [
    Goal("full_chunked", "peak", "full", 0.2),
    Goal("full_chunked", "peak", "full_no_head", 1.3),
    Goal("full_chunked", "step", "full", 1.05),
    Goal("full_chunked_tiled", "peak", "full_chunked", 1.0),
    Goal("full_chunked_tiled", "step", "full_chunked", 1.05),
]

PRESETS: Dict[str, Dict[str, Any]] = {
    "cpu-small": _CPU_SMALL,
    # cpu-small's shape with a real vocabulary (Llama 2's 32,000 tokens): the output head's logits, their float32
    # upcast and their gradient hold most of full's activations. Its own rows (``modes``) and goals.
    "cpu-vocab": dict(
        _CPU_SMALL, model=dict(_CPU_SMALL["model"], vocab_size=32000), modes=VOCAB_MODES, goals=VOCAB_GOALS
    ),
    # ~1B-parameter Llama-style model in bf16 at 8k tokens, for one accelerator.
    "gpu-8k": dict(
        model=dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=8192,
        ),
        seq=8192,
        batch=1,
        dtype="bfloat16",
        reps=2,
        steps=4,
    ),
}


def model_config(preset: Dict[str, Any], model: Optional[str]) -> Any:
    """The preset's Llama-style config, another transformers model type with the preset's sizes (``qwen3``),
    or a JSON config file (with a ``model_type``)."""
    from transformers import AutoConfig

    if model is None:
        return AutoConfig.for_model("llama", **preset["model"])
    path = Path(model)
    if path.suffix == ".json" or path.exists():
        data = json.loads(path.read_text())
        return AutoConfig.for_model(data.pop("model_type", "llama"), **data)
    return AutoConfig.for_model(model, **preset["model"])


def build_model(config: Any, dtype: torch.dtype, seed: int) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype)
