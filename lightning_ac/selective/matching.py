"""Which modules a ``save_modules`` entry names inside the decoder layers (PEFT's tuner layers resolved to the base
layer whose matmul runs)."""

from __future__ import annotations

import fnmatch
from typing import Dict, List, Optional, Sequence

from torch import nn

__all__ = ["match_modules"]


def _name_matches(name: str, entry: str) -> bool:
    if any(c in entry for c in "*?["):
        return fnmatch.fnmatchcase(name, entry)
    return name == entry or name.endswith("." + entry)


def _peft_tuner_class() -> Optional[type]:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return None
    return BaseTunerLayer


def match_modules(
    layers: Sequence[nn.Module], save_modules: Sequence[str], module_names: Dict[nn.Module, str]
) -> Dict[str, List[nn.Module]]:
    """For each ``save_modules`` entry, the modules whose matmuls it saves (PEFT layers resolved to
    their ``base_layer``), only from inside the decoder layers."""
    tuner = _peft_tuner_class()
    matched: Dict[str, List[nn.Module]] = {entry: [] for entry in save_modules}
    for layer in layers:
        inside_tuner: set = set()
        for module in layer.modules():
            if module is layer or id(module) in inside_tuner:
                continue
            if tuner is not None and isinstance(module, tuner):
                inside_tuner.update(id(m) for m in module.modules() if m is not module)
            name = module_names.get(module)
            if name is None:
                continue
            for entry in matched:
                if _name_matches(name, entry):
                    target = module
                    if tuner is not None and isinstance(module, tuner):
                        target = module.get_base_layer()
                    matched[entry].append(target)
    return matched
