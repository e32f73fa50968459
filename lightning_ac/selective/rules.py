"""What a selective policy decides for each op of a checkpointed forward: the rule that saves its output, or none
(recompute it), and what each rule matched.

Decisions, in order:

1. plugin-registered saves (mandatory, then preferred);
2. attention calls in sliding-window layers are recomputed unless ``save_sliding_window``;
3. ``save`` entries (``attention`` names the attention kernels, and the output matmul of SDPA's math backend;
   others are op-name substrings);
4. matmuls inside ``save_modules``;
5. matmuls whose contraction dim reaches ``save_matmul_min_k``.

Most ops of a forward (elementwise ops, views, norms, and matmuls when no module or threshold rule is set) are
decided by their kind alone: the first call of each op decides, later calls look the answer up. Per op, torch's own
selective checkpointing is a Python dispatch mode with a policy function; a decision worked out again for each call
was most of what ours added to it (1.22x torch's own step on a tiny Llama on the CPU, where per-op cost is all there
is). Attention (a sliding window, SDPA's math backend) and the module and threshold rules depend on the call, and are
decided for each.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, Optional, Tuple

from lightning_ac.config import SelectiveConfig
from lightning_ac.selective.modes import Region, RuleStats
from lightning_ac.selective.ops import (
    MATH_ATTENTION_OPS,
    MATH_ATTENTION_OUTPUT,
    MATH_ATTENTION_SOFTMAX,
    is_attention,
    is_matmul,
    matmul_k,
    op_name,
    sliding_window_of,
)
from lightning_ac.selective.registry import RegisteredSave, registered_saves, registry_version

__all__ = ["OpRules"]

_UNDECIDED = object()


class OpRules:
    """The rules of one selective policy, applied op by op.

    Args:
        config: The ``selective`` block.

    Attributes:
        save_rules: Per ``save`` entry, what it matched and saved.
        module_rules: Per ``save_modules`` entry, likewise.
        threshold_rule: ``save_matmul_min_k``'s, or ``None``.
        registered_rules: Per registered save, likewise.
        active: Per ``save_modules`` entry, how deep the forward is in its modules now (the policy's hooks count).
        math_attention_calls: Attention calls that ran SDPA's math backend (only their output is saved).
    """

    def __init__(self, config: SelectiveConfig) -> None:
        self.config = config
        self.save_rules = {entry: RuleStats(f"save: {entry}") for entry in config.save}
        self.module_rules = {entry: RuleStats(f"save_modules: {entry}") for entry in config.save_modules}
        self.threshold_rule = (
            RuleStats(f"save_matmul_min_k: {config.save_matmul_min_k}") if config.save_matmul_min_k else None
        )
        # keyed by the registered save itself, never by id(): a removed save, freed, leaves its address to the next
        # one, which would inherit its rule (a mandatory save taken for a preferred one gets no clone)
        self.registered_rules: Dict[RegisteredSave, RuleStats] = {}
        self.active: Counter = Counter()
        self.math_attention_calls = 0
        self._by_kind: Dict[Any, Optional[RuleStats]] = {}  # op -> its decision, for ops decided by kind alone
        self._registry = registry_version()

    def decide(self, region: Region, func: Any, args: tuple, kwargs: dict, count: bool = True) -> Optional[RuleStats]:
        """The rule that saves this op, or ``None`` to recompute it.

        Args:
            region: The checkpointed call the op runs in.
            func: The op.
            args: Its positional arguments.
            kwargs: Its keyword arguments.
            count: Count the match in the rule's statistics (not when a recompute asks again).
        """
        rule = self._by_kind.get(func, _UNDECIDED)
        if rule is _UNDECIDED:
            rule, by_kind = self._decide(region, func, args, kwargs, count)
            if by_kind:
                self._by_kind[func] = rule
        if rule is not None:
            rule.matched_ops += count
        return rule  # type: ignore[return-value]

    def refresh(self) -> None:
        """Forget the decisions by kind if a save was registered or removed since they were made (checked once per
        checkpointed call, not per op)."""
        if self._registry != registry_version():
            self._by_kind.clear()
            self._registry = registry_version()

    def recomputes_attention(self, layer_type: Optional[str]) -> bool:
        """Whether ``save: [attention]`` gives way to recompute in layers of this type (sliding windows)."""
        return not self.config.save_sliding_window and layer_type in self.config.recompute_layer_types

    def _decide(
        self, region: Region, func: Any, args: tuple, kwargs: dict, count: bool
    ) -> Tuple[Optional[RuleStats], bool]:
        """The decision, and whether the op's kind alone made it (then it holds for every call of the op)."""
        name = op_name(func)
        rule, by_kind = self._first_rule(region, name, func, args, kwargs, count)
        threshold = self.threshold_rule
        if threshold is not None and rule is not threshold and is_matmul(name):
            # a matmul a rule ahead of the threshold saved: its diagnostics count it as seen (its K), and as covered
            # where it reaches K, so that they never advise lowering a threshold whose matmuls are saved. Each call,
            # not each kind: the first matmul of a kind need not be the largest
            by_kind = False
            k = matmul_k(name, args)
            if k is not None and rule is not None:
                threshold.max_k = max(threshold.max_k, k)
                threshold.covered += count and k >= (self.config.save_matmul_min_k or 0)
        return rule, by_kind

    def _first_rule(
        self, region: Region, name: str, func: Any, args: tuple, kwargs: dict, count: bool
    ) -> Tuple[Optional[RuleStats], bool]:
        """The first rule, in the module docstring's order, that saves the op (or ``None``), and whether the op's
        kind alone decided it."""
        for entry in registered_saves():
            if entry.matches(name):
                return self._registered_rule(entry), True
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable:
            return None, True  # an in-place op's output aliases its input: never cache it
        attention = is_attention(name)
        by_kind = not attention
        if name in MATH_ATTENTION_OPS:  # SDPA's math backend: no kernel, but its output is the bmm after its softmax
            attention = region.math_softmax and name == MATH_ATTENTION_OUTPUT
            region.math_softmax = name == MATH_ATTENTION_SOFTMAX
            self.math_attention_calls += attention and count
            by_kind = False
        for entry, rule in self.save_rules.items():
            if (attention and entry == "attention") or (
                entry != "attention" and entry in name and "backward" not in name
            ):
                if attention and (
                    self.recomputes_attention(region.layer_type)
                    or (not self.config.save_sliding_window and sliding_window_of(func, args, kwargs))
                ):
                    rule.matched_ops += count  # matched, and recomputed: sliding-window attention is cheap to recompute
                    return None, False
                return rule, by_kind
        if not is_matmul(name):
            return None, by_kind
        for entry, depth in self.active.items():
            if depth > 0:
                return self.module_rules[entry], False
        if self.threshold_rule is not None:
            k = matmul_k(name, args)
            if k is not None:
                self.threshold_rule.max_k = max(self.threshold_rule.max_k, k)
                if k >= (self.config.save_matmul_min_k or 0):
                    return self.threshold_rule, False
            return None, False
        return None, by_kind and not self.module_rules

    def _registered_rule(self, entry: RegisteredSave) -> RuleStats:
        rule = self.registered_rules.get(entry)
        if rule is None:
            kind = "register_mandatory_save" if entry.mandatory else "register_preferred_save"
            rule = self.registered_rules[entry] = RuleStats(f"{kind}: {entry.pattern}", mandatory=entry.mandatory)
        return rule
