"""``python examples/train.py estimate=true ...``: the job's model estimated instead of trained.

Every mode's memory for one training step of the configured model (``model.*``, ``lora.*``) at the configured batch
(``data.batch_size`` x ``data.seq_len``), counted on fake tensors on the CPU by :func:`lightning_ac.estimate.estimate`
(the table ``python -m lightning_ac.estimate`` prints), with AdamW as the job trains. The table goes to stdout and to
``estimate.md`` in the run's output directory, the figures to ``estimate.json``; nothing trains.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_ac import ConfigError

# the estimator's argument names -> the job's keys, for its messages
_JOB_KEYS = {
    "--model": "model.family",
    "--seq": "data.seq_len",
    "--batch": "data.batch_size",
    "--dtype": "estimate_dtype",
    "--lora": "lora.r",
    "--modes": "estimate_modes",
    "--device-memory": "estimate_device_memory",
    "--set": "model.config",
}
# the trainer's precision -> the weights' dtype a step runs in
_PRECISION_DTYPES = {
    "32": "float32",
    "32-true": "float32",
    "bf16-true": "bfloat16",
    "16-true": "float16",
}


def estimate_dtype(cfg: DictConfig) -> str:
    """``estimate_dtype``, or the dtype the configured trainer's precision trains the weights in."""
    if cfg.estimate_dtype is not None:
        return str(cfg.estimate_dtype)
    precision = str(cfg.trainer.get("precision", "32-true"))
    if precision not in _PRECISION_DTYPES:
        raise ConfigError(
            f"estimate=true: trainer.precision={precision} keeps float32 weights and runs the ops in a lower "
            "precision under autocast, which the estimate does not model. Set estimate_dtype=bfloat16 (or float16, "
            "float32) for the dtype of the weights and activations to estimate."
        )
    return _PRECISION_DTYPES[precision]


def _modes(value: Any) -> Optional[List[str]]:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    return [str(v) for v in OmegaConf.to_container(value, resolve=True)]  # type: ignore[union-attr]


def run_estimate(cfg: DictConfig, out_dir: Path) -> Dict[str, Any]:
    """Estimate the configured model, print the table, write ``estimate.md`` and ``estimate.json`` to ``out_dir``;
    the JSON's contents are returned.

    Raises:
        ConfigError: For values the estimate cannot take (the estimator's message, naming the job's key).
    """
    from lightning_ac.estimate import EstimateError, estimate
    from lightning_ac.estimate.cli import to_json
    from lightning_ac.estimate.render import markdown

    overrides = OmegaConf.to_container(cfg.model.config, resolve=True)
    assert isinstance(overrides, dict)
    lora = cfg.lora.enabled
    device_memory = cfg.estimate_device_memory
    try:
        result = estimate(
            str(cfg.model.family),
            int(cfg.data.seq_len),
            batch=int(cfg.data.batch_size),
            dtype=estimate_dtype(cfg),
            lora=int(cfg.lora.r) if lora else None,
            full_finetune=not lora,
            lora_targets=list(cfg.lora.target_modules) if lora else None,
            modes=_modes(cfg.estimate_modes),
            device_memory=None if device_memory is None else str(device_memory),
            overrides=overrides,
            attention=str(cfg.model.attn_implementation),
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except EstimateError as err:
        message = str(err)
        flag = re.match(r"--[a-z-]+", message)
        if flag is not None and flag[0] in _JOB_KEYS:
            message = _JOB_KEYS[flag[0]] + message[flag.end() :]
        raise ConfigError(f"estimate=true: {message}") from None
    table = markdown(result)
    print(table, end="")
    data = to_json(result)
    (out_dir / "estimate.md").write_text(table)
    (out_dir / "estimate.json").write_text(json.dumps(data, indent=2) + "\n")
    return data
