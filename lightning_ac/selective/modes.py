"""The dispatch modes a selective policy runs in a checkpointed call: above torch's SAC mode in the forward (which
rule saved what) and in the recompute (how far the replay got), and alone in a dry run (what the saves would hold).
They know a :class:`Region` and, for the dry run, a ``decide`` callable, never the policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import SAC_IGNORED_OPS

from lightning_ac.selective.ops import op_name

__all__ = [
    "Decide",
    "DryRunMode",
    "ForwardMode",
    "RecomputeMode",
    "Region",
    "RuleStats",
    "clone_tensors",
    "is_skipped",
    "tensor_bytes",
]


@dataclass(eq=False)
class RuleStats:
    """What one rule did: a ``save`` entry, a ``save_modules`` entry, the threshold, or a registered save."""

    label: str
    mandatory: bool = False
    modules: int = 0  # save_modules: modules matched at install
    hook_calls: int = 0  # save_modules: forward calls of matched modules
    matched_ops: int = 0  # ops that matched the rule (saved or, for sliding layers, recomputed)
    saved: int = 0  # outputs saved in forwards
    replayed: int = 0  # saved outputs that a recompute reached
    max_k: int = 0  # save_matmul_min_k: the largest K of any matmul seen, whichever rule took it
    covered: int = 0  # save_matmul_min_k: matmuls with K >= min_k that a rule ahead of it saved


@dataclass(eq=False)
class Region:
    """One checkpointed call: its forward decisions and how far its recompute replayed."""

    layer: Optional[int]
    layer_type: Optional[str]
    last_rule: Optional[RuleStats] = None
    ops: int = 0
    saved: List[Tuple[int, RuleStats, str]] = field(default_factory=list)
    mandatory: set = field(default_factory=set)
    replayed_ops: int = 0
    saved_bytes: int = 0  # what the saved outputs hold
    math_softmax: bool = False  # SDPA's math backend ran its softmax: the next bmm is its output (ops.py)
    mandatory_saves: bool = False  # a registered mandatory save exists: the modes clone its outputs


# decide(region, func, args, kwargs, count=...) -> the rule that saves the op, or None to recompute it
Decide = Callable[..., Optional[RuleStats]]


def clone_tensors(out: Any) -> Any:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


def tensor_bytes(out: Any) -> int:
    total = 0

    def add(t: Any) -> Any:
        nonlocal total
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
        return t

    tree_map(add, out)
    return total


def is_skipped(func: Any) -> bool:
    # the ops torch's SAC ignores (checkpoint's recompute adds detaches of its own): leaving them out keeps the
    # forward's indices, the replay's and those of the policy's own count (torch asks it about the others) aligned
    return func in SAC_IGNORED_OPS


class ForwardMode(TorchDispatchMode):
    """In a checkpointed call's forward: records which rule saved which op (the policy, asked by torch's SAC mode
    below this one, sets ``region.last_rule``), what the saves hold, and hands the forward a clone of each mandatory
    save (so an in-place edit cannot corrupt the cached tensor)."""

    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_skipped(func):
            return func(*args, **kwargs)
        name = op_name(func)
        region = self.region
        region.last_rule = None
        out = func(*args, **kwargs)  # torch's SAC mode below consults the policy, which sets last_rule
        index, region.ops = region.ops, region.ops + 1
        rule, region.last_rule = region.last_rule, None
        if rule is not None:
            region.saved.append((index, rule, name))
            region.saved_bytes += tensor_bytes(out)
            rule.saved += 1
            if rule.mandatory:
                region.mandatory.add(index)
                out = clone_tensors(out)
        return out


class DryRunMode(TorchDispatchMode):
    """Asks ``decide`` about every op of a call that runs without the policy, and adds up what its saves would hold
    (the memory budget plans selective layers from this before running any)."""

    def __init__(self, decide: Decide, region: Region) -> None:
        super().__init__()
        self.decide, self.region = decide, region

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not is_skipped(func) and self.decide(self.region, func, args, kwargs, count=False):
            self.region.saved_bytes += tensor_bytes(out)
        return out


class RecomputeMode(TorchDispatchMode):
    """In a recompute: counts how far the replay got (which tells whether a saved tensor was ever used), and hands
    the recompute a clone of each mandatory save, as the forward had."""

    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_skipped(func):
            return func(*args, **kwargs)
        region = self.region
        index, region.replayed_ops = region.replayed_ops, region.replayed_ops + 1
        out = func(*args, **kwargs)
        if index in region.mandatory:
            out = clone_tensors(out)
        return out
