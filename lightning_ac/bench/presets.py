"""The benchmark's presets (a model's shape, the batch, the repetitions) and the model each one builds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn

__all__ = ["PRESETS", "build_model", "model_config"]

PRESETS: Dict[str, Dict[str, Any]] = {
    # A Llama-style model where attention is a large share of each layer: hidden 256, 8 layers, 2k tokens.
    "cpu-small": dict(
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
