"""The selective activation checkpointing (SAC) policy.

Built on torch's selective-checkpoint API (eager): for every op in a checkpointed region's forward, the
policy decides to save its output or recompute it (:class:`~lightning_ac.selective.rules.OpRules`).

torch's SAC mode asks the policy about each op after running it (torch >= 2.13 hands it the op's output): the policy
records there which rule saved which op and what the saves hold. A dispatch mode of ours joins torch's only where
that cannot do: in the forward, to hand the forward a clone of each mandatory save (so an in-place edit cannot
corrupt the cached tensor) and, on a torch that does not hand the policy the output, to record the saves; in the
recompute, to count how far the replay got (which tells the diagnostics whether a saved tensor was ever used: the
first backward only) and to clone mandatory saves again. Each such mode costs a Python call per op, as much as torch's
own SAC adds. The storage of saved tensors comes from ``storage_factory`` (torch's SAC contexts by default), the seam
through which an offloading storage can replace it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import lightning_ac.selective.diagnostics as diagnostics
from lightning_ac._compat import SAC_POLICY_SEES_OUTPUT, sac_saves_bypass_saved_tensor_hooks
from lightning_ac._logging import LightningACWarning, log, rank_zero_warn
from lightning_ac._reenterable import Reenterable
from lightning_ac.config import SelectiveConfig
from lightning_ac.selective.matching import match_modules
from lightning_ac.selective.modes import DryRunMode, ForwardMode, RecomputeMode, Region, RuleStats, tensor_bytes
from lightning_ac.selective.ops import op_name
from lightning_ac.selective.registry import registered_saves
from lightning_ac.selective.rules import OpRules

__all__ = ["RuleStats", "SelectiveCheckpointingWarning", "SelectivePolicy", "StorageFactory"]

StorageFactory = Callable[[Callable[..., CheckpointPolicy]], Tuple[Any, Any]]


class SelectiveCheckpointingWarning(LightningACWarning):
    """A selective-checkpointing rule that saves nothing useful (never matched, never fired, never replayed)."""


class SelectivePolicy:
    """A selective checkpointing policy for a set of decoder layers.

    Args:
        config: The ``selective`` block.
        layers: The decoder layers, in order.
        module_names: The base model's name for every module (before PEFT wraps it); ``save_modules``
            entries match these names.
        layer_types: Per-layer type (``sliding_attention``...) or ``None`` entries.
        storage_factory: Builds the (forward, recompute) contexts that store saved tensors from a policy
            function; torch's ``create_selective_checkpoint_contexts`` by default.
        diagnose_after: Where a recompute runs outside a backward (a saved tensor read by hand), run the
            diagnostics once this many recomputes have finished (default: one per layer). In a backward they run at
            its end, the first backward that recomputed a region of the policy.
        kept: Per layer index, a policy that :func:`~lightning_ac.apply_selective_checkpointing` installed there
            before: those layers' checkpointed calls get its contexts, not this policy's.
    """

    def __init__(
        self,
        config: SelectiveConfig,
        layers: Sequence[nn.Module],
        module_names: Dict[nn.Module, str],
        layer_types: Optional[Sequence[Optional[str]]] = None,
        storage_factory: Optional[StorageFactory] = None,
        diagnose_after: Optional[int] = None,
        compiled: bool = False,
        kept: Optional[Dict[int, SelectivePolicy]] = None,
    ) -> None:
        self.config = config
        self.compiled = compiled
        self.layers = list(layers)
        self.layer_types = list(layer_types) if layer_types is not None else [None] * len(self.layers)
        self.storage_factory: StorageFactory = storage_factory or create_selective_checkpoint_contexts
        self.diagnose_after = diagnose_after if diagnose_after is not None else max(1, len(self.layers))
        self.rules = OpRules(config)
        self.save_rules, self.module_rules = self.rules.save_rules, self.rules.module_rules
        self.threshold_rule, self.registered_rules = self.rules.threshold_rule, self.rules.registered_rules
        self.decide, self.recomputes_attention = self.rules.decide, self.rules.recomputes_attention
        self.saved_ops_per_layer: Dict[int, Counter] = {}
        self.saved_bytes_per_layer: Dict[int, int] = {}
        self.regions = 0
        self.traced_ops = 0  # under torch.compile: the ops the policy was asked about when the graphs were traced
        self.recomputes = 0
        self.diagnosed = False
        self._diagnosis_queued_in = -1  # the backward (graph task id) whose end runs the first diagnostics
        self.kept = dict(kept or {})
        self._module_names = module_names
        # For each save_modules entry, the modules whose matmuls it saves (filled by install)
        self.matched_modules: Dict[str, List[nn.Module]] = {}
        self._active: Counter = self.rules.active
        self._current_layer: Optional[int] = None
        self._handles: List[Any] = []

    # -- install / remove -------------------------------------------------------------------------------

    def install(self) -> None:
        """Register the hooks that tell the policy which layer and which saved module is running."""
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(functools.partial(self._enter_layer, index)))
            self._handles.append(layer.register_forward_hook(self._exit_layer, always_call=True))
        ruled = [layer for index, layer in enumerate(self.layers) if index not in self.kept]  # kept: another policy's
        self.matched_modules = match_modules(ruled, self.config.save_modules, self._module_names)
        for entry, modules in self.matched_modules.items():
            rule = self.module_rules[entry]
            rule.modules = len(modules)
            for module in modules:
                self._handles.append(module.register_forward_pre_hook(functools.partial(self._enter_module, entry)))
                self._handles.append(
                    module.register_forward_hook(functools.partial(self._exit_module, entry), always_call=True)
                )
        unmatched = [entry for entry, modules in self.matched_modules.items() if not modules]
        for entry in unmatched:
            self._warn(
                f"selective.save_modules entry {entry!r} matched no module inside the decoder layers, so it saves "
                "nothing. Entries match a module name exactly, as a dotted suffix (o_proj, self_attn.o_proj) or "
                "as a glob with *, ? or [; names are the base model's (before PEFT wraps it)."
            )

    def remove(self) -> None:
        """Remove the hooks. Safe to call more than once."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._active.clear()
        self._current_layer = None

    def _enter_layer(self, index: int, module: nn.Module, args: Any) -> None:
        self._current_layer = index

    def _exit_layer(self, module: nn.Module, args: Any, output: Any) -> None:
        self._current_layer = None

    def _enter_module(self, entry: str, module: nn.Module, args: Any) -> None:
        self._active[entry] += 1
        if torch._C._current_graph_task_id() == -1:  # the forward, not a recompute during backward
            self.module_rules[entry].hook_calls += 1

    def _exit_module(self, entry: str, module: nn.Module, args: Any, output: Any) -> None:
        if self._active[entry] > 0:
            self._active[entry] -= 1

    # -- the policy --------------------------------------------------------------------------------------

    def set_checkpointed(self, checkpointed: Sequence[bool]) -> None:
        """Tell the policy which layers the recompute engine checkpoints (``diagnose_after``: a recompute outside a
        backward diagnoses once each of them has been recomputed)."""
        self.diagnose_after = max(1, sum(bool(c) for c in checkpointed))

    def describe_layer(self, index: int, recomputed: bool) -> Optional[str]:
        """What the policy saves in decoder layer ``index`` (for the per-layer report); ``None`` if not
        recomputed."""
        if not recomputed:
            return None
        if index in self.kept:
            return "kept: the policy apply_selective_checkpointing installed"
        cfg = self.config
        layer_type = self.layer_types[index] if index < len(self.layer_types) else None
        parts = []
        for entry in cfg.save:
            if entry == "attention" and self.recomputes_attention(layer_type):
                parts.append(f"attention recomputed ({layer_type})")
            else:
                parts.append(entry)
        inside = {id(m) for m in self.layers[index].modules()}
        for entry, modules in self.matched_modules.items():
            count = sum(id(m) in inside for m in modules)
            if count:
                parts.append(f"{entry} ({count} module{'s' if count > 1 else ''})")
        if cfg.save_matmul_min_k:
            parts.append(f"matmuls K >= {cfg.save_matmul_min_k}")
        saved = self.saved_ops_per_layer.get(index)
        if saved is not None:
            parts.append(f"last step: {sum(saved.values())} outputs")
        if self.compiled:  # decided when the graph was traced; nothing counted at run time
            parts.append("compiled: decided when traced")
        return ", ".join(parts) or "registered ops only"

    def checkpoint_context_fn(self) -> Callable[[], Tuple[Any, Any]]:
        """The ``context_fn`` to hand ``torch.utils.checkpoint.checkpoint``: :meth:`context_fn`, or under
        ``torch.compile`` a plain function that returns torch's own contexts (dynamo takes a function or a
        ``functools.partial`` as a ``context_fn``, not a bound method)."""
        if not self.compiled:
            return self.context_fn
        policy = self

        def compiled_context_fn() -> Tuple[Any, Any]:
            return policy._compiled_contexts()

        return compiled_context_fn

    def context_fn(self) -> Tuple[Any, Any]:
        """The eager ``context_fn`` for ``torch.utils.checkpoint.checkpoint``: one region per call."""
        layer = self._current_layer
        if layer in self.kept:  # a policy the user installed on this layer before the plan applied
            return self.kept[layer].context_fn()
        region = Region(layer, self.layer_types[layer] if layer is not None and layer < len(self.layer_types) else None)
        self.rules.refresh()
        region.mandatory_saves = any(entry.mandatory for entry in registered_saves())

        def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            # torch < 2.13 asks again in the recompute (whether to take the op's output from the storage): the same
            # decision, not counted in the rules' statistics a second time
            rule = self.decide(region, func, args, kwargs, count=not ctx.is_recompute)
            output = getattr(ctx, "op_output", ForwardMode)  # torch >= 2.13: the op has run (ForwardMode: unknown)
            if region.mandatory_saves or output is ForwardMode:
                region.last_rule = rule  # for ForwardMode, which records the saves
            elif not ctx.is_recompute:
                index, region.ops = region.ops, region.ops + 1
                if rule is not None:
                    region.saved.append((index, rule, op_name(func)))
                    region.saved_bytes += tensor_bytes(output)
                    rule.saved += 1
            if rule is None:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if rule.mandatory else CheckpointPolicy.PREFER_SAVE

        storage_forward, storage_recompute = self.storage_factory(policy_fn)
        # torch sets this only on a context_fn's own SAC mode, and ours wraps it (_forward_context)
        sac_saves_bypass_saved_tensor_hooks(storage_forward)
        recompute = Reenterable(functools.partial(self._recompute_context, region, storage_recompute))
        return self._forward_context(region, storage_forward), recompute

    def _compiled_contexts(self) -> Tuple[Any, Any]:
        """Under ``torch.compile``: torch's own contexts, the only ones a compiled region takes. AOT autograd asks
        their policy about each op once, when it traces the graph, and the partitioner keeps what it must save; no
        mode of ours runs inside the compiled graph. The rules' matches are counted as they are traced (which rules
        match an op); what a recompute replays is not known there."""
        region = Region(None, None)  # one graph serves every layer of its code: no per-layer decision
        # called when a graph is traced, the first step's or a later one's (a new length): a save registered since
        # the last trace must reach the decisions cached by op kind, as the eager context_fn's refresh does
        self.rules.refresh()

        def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            # MUST_SAVE for every rule: the partitioner takes PREFER_SAVE as a hint it may overrule. Counted: which
            # rules match an op when the graphs are traced (what problems() can tell under compile)
            self.traced_ops += 1
            rule = self.decide(region, func, args, kwargs)
            return CheckpointPolicy.PREFER_RECOMPUTE if rule is None else CheckpointPolicy.MUST_SAVE

        return create_selective_checkpoint_contexts(policy_fn)

    @contextlib.contextmanager
    def dry_run(self, index: int) -> Iterator[Region]:
        """Around a call of decoder layer ``index`` that runs without the policy: ``region.saved_bytes`` becomes what
        the policy would have saved in it. Counts nothing in the rules' statistics."""
        region = Region(index, self.layer_types[index] if index < len(self.layer_types) else None)
        self.rules.refresh()
        with DryRunMode(self.decide, region):
            yield region

    @contextlib.contextmanager
    def _forward_context(self, region: Region, storage: Any) -> Iterator[None]:
        self._active.clear()  # a recompute stopped early can leave a module hook unbalanced
        self.regions += 1
        watch = region.mandatory_saves or not SAC_POLICY_SEES_OUTPUT
        with storage, ForwardMode(region) if watch else contextlib.nullcontext():
            yield
        if region.layer is not None:
            self.saved_ops_per_layer[region.layer] = Counter(name for _, _, name in region.saved)
            self.saved_bytes_per_layer[region.layer] = region.saved_bytes

    @contextlib.contextmanager
    def _recompute_context(self, region: Region, storage: Any) -> Iterator[None]:
        region.replayed_ops = 0
        region.math_softmax = False  # the replay asks again in the forward's order (torch < 2.13)
        watch = region.mandatory_saves or not self.diagnosed  # the replay's reach: for the first diagnostics only
        try:
            with storage, RecomputeMode(region) if watch else contextlib.nullcontext():
                yield
        finally:
            self._active.clear()
            for index, rule, _ in region.saved if watch else ():
                if index < region.replayed_ops:
                    rule.replayed += 1
            self.recomputes += 1
            if not self.diagnosed:
                self._diagnose_after_this_backward()

    def _diagnose_after_this_backward(self) -> None:
        """The first backward that recomputes a region of the policy runs the diagnostics at its end, whichever
        layers it recomputed: a frozen model's layers called under ``no_grad`` (a teacher, a reference model) record
        nothing to recompute, and counting them made the warnings wait steps for recomputes that never come (and
        the replay-watching mode run until then)."""
        task = torch._C._current_graph_task_id()
        if task == -1:  # not in a backward: a saved tensor read by hand
            if self.recomputes >= self.diagnose_after:
                self._diagnose_once()
        elif task != self._diagnosis_queued_in:  # once per backward (one that raised never ran its callback)
            self._diagnosis_queued_in = task
            torch.autograd.Variable._execution_engine.queue_callback(self._diagnose_once)

    def _diagnose_once(self) -> None:
        if not self.diagnosed:
            self.diagnosed = True
            self.diagnose()

    # -- diagnostics -------------------------------------------------------------------------------------

    def problems(self) -> List[str]:
        """Rules that saved nothing useful so far, one sentence each
        (:func:`~lightning_ac.selective.diagnostics.problems`)."""
        return diagnostics.problems(self)

    def diagnose(self) -> None:
        """Warn once about each rule that saved nothing useful, and log what each layer saves (DEBUG)."""
        for problem in self.problems():
            self._warn(problem)
        if log.isEnabledFor(logging.DEBUG):
            for layer, saved in sorted(self.saved_ops_per_layer.items()):
                log.debug("layer %d saves %s", layer, dict(saved) or "nothing")

    def report(self) -> Dict[int, Dict[str, int]]:
        """Per decoder layer, how many outputs of each op its most recent forward saved."""
        return {layer: dict(counts) for layer, counts in sorted(self.saved_ops_per_layer.items())}

    @staticmethod
    def _warn(message: str) -> None:
        rank_zero_warn(message, SelectiveCheckpointingWarning)
