"""The modes an estimate runs: the benchmark's mode table (one definition of the modes, used by both), and
``chunked_loss`` and ``tiled_mlp`` as settings of any of them (``full+chunked_loss``, ``full+chunked_loss+tiled_mlp``).

The benchmark's budget rows place a budget between two measured peaks and settle over several steps; an estimate's
``budget`` is the plan for a device instead (:mod:`lightning_ac.estimate.budget`), outside this table. The benchmark's
compiled rows and anchors are not the suite's block, and fake tensors do not compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from lightning_ac.estimate.models import EstimateError

__all__ = ["CHUNKED", "Mode", "SETTINGS", "TILED", "default_modes", "known_modes", "resolve_modes"]

CHUNKED = "chunked_loss"
TILED = "tiled_mlp"
SETTINGS = (CHUNKED, TILED)  # what a mode name takes after "+", each at most once


@dataclass(frozen=True)
class Mode:
    """One mode: its name, its ``activation_checkpointing`` block, and layer offloading's resident layers
    (``None``: no layer offloading; ``"L/4"``: a quarter of the decoder layers)."""

    name: str
    block: Any
    layer_offload: Optional[str] = None

    def resident_layers(self, layers: int) -> int:
        value = self.layer_offload or "0"
        return max(1, layers // 4) if value == "L/4" else int(value)


def _table() -> Dict[str, Mode]:
    """The benchmark's suite modes (those it runs on an accelerator too) and its layer-offloading modes (with full
    checkpointing, as the benchmark runs them), by name."""
    import lightning_ac.bench as bench

    skipped = {**bench.ALL_BUDGET_MODES}  # the budget's rows, the auto ones too: the estimate's own mode is `budget`
    table: Dict[str, Mode] = {}
    for name, block in {**bench.MODES, **bench.ACCELERATOR_SUITE_MODES}.items():
        if name in skipped or callable(block) or name.endswith("_compiled"):
            continue
        table[name] = Mode(name, block)
    for name, resident in bench.LAYER_OFFLOAD_MODES.items():
        if resident is not None:  # the table's baseline without layer offloading is `full`
            table[name] = Mode(name, True, resident)
    return table


def known_modes() -> List[str]:
    """Every mode name an estimate takes: the table's, ``budget`` (the memory budget's plan for a device), and
    ``chunked_loss`` last."""
    return list(_table()) + ["budget", CHUNKED]


def default_modes(full_finetune: bool, sharded: bool = False) -> List[str]:
    """The modes an estimate runs when none are named: every suite mode (layer offloading only where frozen weights
    exist to stream, and whole: not under FSDP, which shards them)."""
    streams = not (full_finetune or sharded)
    return [m.name for m in _table().values() if streams or m.layer_offload is None]


def _with(block: Any, settings: Sequence[str]) -> Any:
    """``block`` with each of ``settings`` (``chunked_loss``, ``tiled_mlp``) on."""
    on = {setting: True for setting in settings}
    if block is False:
        return {"enabled": False, **on}
    if block is True:
        return on
    return {**block, **on}


def resolve_modes(names: Optional[Sequence[str]], full_finetune: bool, sharded: bool = False) -> List[Mode]:
    """The modes ``names`` ask for: mode names, ``name+chunked_loss``, and ``chunked_loss`` alone, which adds each
    other mode asked for (every mode, when it is alone) with the chunked loss too. ``sharded``: under FSDP."""
    table = _table()
    names = list(names) if names else default_modes(full_finetune, sharded)
    chunk_all = CHUNKED in names
    names = [n for n in names if n != CHUNKED] or (default_modes(full_finetune, sharded) if chunk_all else [])
    modes: List[Mode] = []
    for name in names:
        base, *settings = name.split("+")
        if base not in table or not set(settings) <= set(SETTINGS) or len(set(settings)) != len(settings):
            raise EstimateError(
                f"--modes {name}: unknown mode; choose from {', '.join(known_modes())} (and NAME+{CHUNKED}, "
                f"NAME+{TILED}, NAME+{CHUNKED}+{TILED})"
            )
        mode = table[base]
        if full_finetune and mode.layer_offload is not None:
            raise EstimateError(
                f"--modes {name}: layer offloading streams frozen weights, and a full fine-tune has none; use --lora R"
            )
        if sharded and mode.layer_offload is not None:
            raise EstimateError(
                f"--modes {name}: layer offloading moves whole frozen parameters to host memory, and FSDP shards them "
                "(the suite refuses the pair; FSDP's own CPUOffloadPolicy offloads shards). Leave it out under "
                "--strategy fsdp."
            )
        modes.append(mode if not settings else Mode(name, _with(mode.block, settings), mode.layer_offload))
        if chunk_all and not settings:
            modes.append(Mode(f"{base}+{CHUNKED}", _with(mode.block, [CHUNKED]), mode.layer_offload))
    seen = set()
    return [m for m in modes if not (m.name in seen or seen.add(m.name))]
