"""The name a run goes by in summaries and sweeps: the activation_checkpointing option whose block it ran."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Dict

from omegaconf import OmegaConf

from lightning_ac import ActivationCheckpointingConfig
from lightning_ac.config import AUTO, config_to_dict, parse_budget
from lightning_ac.offload.device import format_bytes

OPTIONS = Path(__file__).resolve().parents[1] / "conf" / "activation_checkpointing"


def _budget_on(accelerator: str, on_accelerator: str, on_cpu: str) -> str:
    """``${budget_on:${trainer.accelerator},auto,100MiB}``: a budget that depends on where the job runs (``auto`` reads
    a GPU's free memory; a CPU has none to read)."""
    return on_cpu if str(accelerator).lower() == "cpu" else on_accelerator


# conf/activation_checkpointing/auto.yaml's budget: auto on a GPU, a size on the CPU
OmegaConf.register_new_resolver("budget_on", _budget_on, replace=True)


@functools.lru_cache(maxsize=1)
def option_blocks() -> Dict[str, Dict[str, Any]]:
    """Each ``activation_checkpointing`` option's block, resolved as the job resolves it (schema defaults first)."""
    schema = OmegaConf.structured(ActivationCheckpointingConfig)
    blocks = {}
    for path in sorted(OPTIONS.glob("*.yaml")):
        raw = OmegaConf.load(path)
        raw.pop("defaults", None)
        # an option's interpolations read the job's config (auto.yaml's budget reads trainer.accelerator): resolved
        # against a CPU trainer (a budget option's label takes the run's own budget); a tool's "auto" is the mapping
        # parsing makes of it
        with_trainer = OmegaConf.create({"trainer": {"accelerator": "cpu"}, "block": raw})
        raw = OmegaConf.create(OmegaConf.to_container(with_trainer, resolve=True)["block"])
        for tool, size in (("chunked_loss", "chunk_tokens"), ("tiled_mlp", "tile_tokens")):
            if raw.get(tool) == AUTO:
                raw[tool] = {size: AUTO, "budget_decides": True}
        # merged over the schema, an option is already in the form config_to_dict gives a parsed block, but for a
        # budget's size, which parsing turns into bytes (the options are valid; the job parses the user's block once,
        # and nothing else)
        block = OmegaConf.to_container(OmegaConf.merge(schema, raw), resolve=True)
        block["budget"] = parse_budget(block["budget"], f"{path.name}: budget")
        blocks[path.stem] = block
    return blocks


def mode_label(block: Any, choice: str, from_legacy_keys: bool) -> str:
    """What ran, by option name: the chosen option if the resolved block is its block; else the option whose
    block it is (a legacy key, an override or a nested group can make it another); else ``custom``, saying what
    the block came from. A legacy key such as ``gradient_checkpointing: true`` under the default ``off`` option
    is labelled by what it does (``full``), not by the option it replaced."""
    resolved = config_to_dict(block)
    tiled = resolved.get("tiled_mlp")
    if tiled is not None and not tiled.get("budget_decides"):  # a setting of any mode too (auto: the option's own)
        tokens = tiled["tile_tokens"]
        label = mode_label(dataclasses.replace(block, tiled_mlp=None), choice, from_legacy_keys)
        details = ([] if tokens == AUTO else [f"{tokens} tokens"]) + ([] if tiled.get("norms", True) else ["MLP only"])
        return f"{label} + tiled_mlp" + (f" ({', '.join(details)})" if details else "")
    chunked = resolved.get("chunked_loss")
    if chunked is not None and not chunked.get("budget_decides"):  # a setting of any mode: its name, and the chunks
        tokens = chunked["chunk_tokens"]
        label = mode_label(dataclasses.replace(block, chunked_loss=None), choice, from_legacy_keys)
        return f"{label} + chunked_loss" + ("" if tokens == AUTO else f" ({tokens} tokens)")
    options = option_blocks()
    budget = resolved.get("budget")
    if budget is not None and choice in options and {**options[choice], "budget": budget} == resolved:
        # a run under a budget goes by its budget too (a sweep over budgets tells its jobs apart)
        return f"{choice} {AUTO if budget == AUTO else format_bytes(budget)}"
    if not from_legacy_keys and options.get(choice) == resolved:
        return choice
    match = next((name for name, option in options.items() if option == resolved), None)
    if match is not None:
        return match
    return "custom (from legacy keys)" if from_legacy_keys else f"custom ({choice} with overrides)"
