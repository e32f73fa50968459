"""``python examples/train.py estimate=true ...``: the job's model estimated instead of trained.

Every mode's memory for one training step of the configured model (``model.*``, ``lora.*``) at the configured batch
(``data.batch_size`` x ``data.seq_len``), counted on fake tensors on the CPU by :func:`lightning_ac.estimate.estimate`
(the table ``python -m lightning_ac.estimate`` prints), in the trainer's precision and with AdamW, as the job
trains; per rank under DDP on ``trainer.devices`` x ``trainer.num_nodes``. The table goes to stdout
and to ``estimate.md`` in the run's output directory, the figures to ``estimate.json``; nothing trains.
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
    "--precision": "trainer.precision",
    "--lora-targets": "lora.target_modules",
    "--lora": "lora.r",
    "--full-finetune": "lora.enabled=false",
    "--attn": "model.attn_implementation",
    "--modes": "estimate_modes",
    "--device-memory": "estimate_device_memory",
    "--set": "model.config",
    "--strategy": "trainer.strategy",
    "--devices": "trainer.devices",
}
# Lightning's strategy names -> the estimator's (every DDP flavour holds the same memory a rank)
_DDP = ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true")


def estimate_precision(cfg: DictConfig) -> Dict[str, Any]:
    """The estimate's ``dtype`` (``estimate_dtype``, when set) or else ``precision``: the configured trainer's, as it
    trains (``bf16-mixed``: float32 weights, the step under autocast)."""
    if cfg.estimate_dtype is not None:
        return {"dtype": str(cfg.estimate_dtype)}
    return {"precision": str(cfg.trainer.get("precision", "32-true"))}


def estimate_ranks(cfg: DictConfig) -> Dict[str, Any]:
    """The estimate's ``strategy`` and ``devices``: the configured trainer's ranks (``trainer.devices`` times
    ``trainer.num_nodes``; several devices with ``strategy: auto`` are DDP, as Lightning picks it), so that a
    multi-device job is estimated per rank.

    Raises:
        ConfigError: For a strategy the estimate does not model (``fsdp`` is Lightning's FSDP1, which this job runs
            without a wrap policy), or devices that are not a number of ranks.
    """
    strategy = str(cfg.trainer.get("strategy", "auto"))
    devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
    if strategy == "fsdp":
        raise ConfigError(
            "estimate=true: trainer.strategy=fsdp is Lightning's FSDPStrategy (FSDP1), which this job runs without a "
            "wrap policy (the whole model gathered at once); the estimate counts FSDP2's fully_shard on each decoder "
            "layer. Estimate it with python -m lightning_ac.estimate --strategy fsdp --devices N, or set "
            "trainer.strategy=ddp for the estimate."
        )
    if strategy != "auto" and strategy not in _DDP:
        raise ConfigError(
            f"estimate=true: trainer.strategy={strategy} is not estimated; the estimate counts one device or DDP "
            "(ddp and its variants). Set trainer.strategy=ddp or auto for the estimate."
        )
    for key, value in (("trainer.devices", devices), ("trainer.num_nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"estimate=true: {key}={value} is not a number the estimate can count ranks by. Give {key} as a "
                "number (8)."
            )
    ranks = devices * nodes
    return {"strategy": "ddp", "devices": ranks} if ranks > 1 else {}


def job_message(message: str) -> str:
    """An estimator message in the job's words: each of its flags named as the job's key."""
    return re.sub(r"--[a-z][a-z-]*", lambda flag: _JOB_KEYS.get(flag[0], flag[0]), message)


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
            **estimate_precision(cfg),
            **estimate_ranks(cfg),
            lora=int(cfg.lora.r) if lora else None,
            full_finetune=not lora,
            lora_targets=list(cfg.lora.target_modules) if lora else None,
            lora_dropout=float(cfg.lora.dropout) if lora else 0.0,
            modes=_modes(cfg.estimate_modes),
            device_memory=None if device_memory is None else str(device_memory),
            overrides=overrides,
            attention=str(cfg.model.attn_implementation),
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except EstimateError as err:
        raise ConfigError(f"estimate=true: {job_message(str(err))}") from None
    table = markdown(result)
    print(table, end="")
    data = to_json(result)
    (out_dir / "estimate.md").write_text(table)
    (out_dir / "estimate.json").write_text(json.dumps(data, indent=2) + "\n")
    return data
