"""What a selective policy's rules did, turned into problems a user can act on: a ``save`` entry that matched no
op, ``attention`` that ran SDPA's math backend (only its output saved), a ``save_modules`` entry whose modules never
ran or whose saves no recompute replayed, a matmul threshold no matmul reached or whose matmuls a rule ahead of it
saved."""

from __future__ import annotations

from typing import Any, List, Optional

__all__ = ["math_attention", "no_match", "no_matmul_reached", "problems", "threshold_covered", "traced_problems"]

# ``policy`` below is a SelectivePolicy, read for its rules' statistics (typed Any: the policy imports this module)


def no_match(entry: str, where: str) -> str:
    """The problem of a ``save`` entry that matched no op in ``where``."""
    hint = (
        "no attention kernel ran (eager attention is bmm + softmax, which `attention` does not name)"
        if entry == "attention"
        else "no op's qualified name contains it"
    )
    return (
        f"selective.save entry {entry!r} matched no op in {where}: {hint}. "
        "Ops are matched at the dispatcher level as substrings of names like 'aten::mm'."
    )


def math_attention(calls: int) -> str:
    """The problem of ``attention`` calls that ran SDPA's math backend, of which only the output is saved."""
    return (
        f"selective.save entry 'attention': {calls} attention calls ran SDPA's math backend, which is aten ops "
        "(QK^T, softmax, probs @ V), not one kernel. `attention` saves their output (probs @ V: as much memory as a "
        "fused kernel's output), but the recompute still replays QK^T and the softmax: the backward needs the "
        "probabilities, seq x seq per head, and keeping them would cost the memory checkpointing saves. SDPA falls "
        "back to math when no fused kernel takes the call: float32 on CUDA with grouped-query heads (flash and cuDNN "
        "take only float16/bfloat16, the efficient kernel refuses enable_gqa), attention dropout on the CPU, or a "
        "backend forced with torch.nn.attention.sdpa_kernel. To save the whole attention, let a fused kernel run: "
        "train in bfloat16 (precision='bf16-mixed' or a bf16 model), or set attention_dropout to 0."
    )


def no_matmul_reached(min_k: Optional[int], max_k: int) -> str:
    """The problem of a ``save_matmul_min_k`` that no matmul reached."""
    return (
        f"selective.save_matmul_min_k: {min_k} saved nothing: no matmul reached K >= {min_k} (largest K seen: "
        f"{max_k}). Lower it to a linear layer's in_features."
    )


def threshold_covered(min_k: Optional[int], max_k: int) -> str:
    """The problem of a ``save_matmul_min_k`` whose matmuls a rule ahead of it saved: it adds nothing."""
    return (
        f"selective.save_matmul_min_k: {min_k} saved nothing of its own: every matmul with K >= {min_k} (largest K "
        f"seen: {max_k}) was saved by a rule ahead of it (a registered save, a save entry or save_modules), so it "
        "adds nothing here. Remove it, or keep it for layers those rules do not cover; lowering it would save the "
        "smaller projections too."
    )


def _threshold_saved_nothing(policy: Any) -> str:
    """Why the threshold saved nothing: its matmuls were a rule's ahead of it, or none reached it."""
    threshold, min_k = policy.threshold_rule, policy.config.save_matmul_min_k
    if threshold.covered:
        return threshold_covered(min_k, threshold.max_k)
    return no_matmul_reached(min_k, threshold.max_k)


def problems(policy: Any) -> List[str]:
    """The rules of ``policy`` that saved nothing useful so far, or less than they name, one sentence each. Under
    ``torch.compile``, what tracing tells: the rules that matched no op in the graphs traced with this policy (none
    before a graph is traced: one traced for an earlier run serves this one too); whether a recompute replays a save
    is not known there."""
    if policy.compiled:
        return traced_problems(policy)
    found = [
        no_match(entry, f"{policy.regions} checkpointed regions")
        for entry, rule in policy.save_rules.items()
        if rule.matched_ops == 0
    ]
    if policy.rules.math_attention_calls and "attention" in policy.save_rules:
        found.append(math_attention(policy.rules.math_attention_calls))
    for entry, rule in policy.module_rules.items():
        if rule.modules and rule.hook_calls == 0:
            found.append(f"selective.save_modules entry {entry!r} matched {rule.modules} modules, but none ran.")
        elif rule.saved and rule.replayed == 0:
            found.append(
                f"selective.save_modules entry {entry!r} saved {rule.saved} matmul outputs that no recompute "
                "replayed: recompute stops at the last tensor backward needs (a layer's final projection, like "
                "down_proj, is never replayed), so this costs memory for nothing. "
                "Prefer o_proj, gate_proj or up_proj."
            )
    threshold = policy.threshold_rule
    if threshold is not None and threshold.saved == 0:
        found.append(_threshold_saved_nothing(policy))
    elif threshold is not None and threshold.replayed == 0:
        found.append(
            f"selective.save_matmul_min_k: {policy.config.save_matmul_min_k} saved {threshold.saved} matmul "
            "outputs that no recompute replayed; they cost memory for nothing."
        )
    for rule in policy.registered_rules.values():
        if rule.saved and rule.replayed == 0 and not rule.mandatory:
            found.append(f"{rule.label} saved {rule.saved} outputs that no recompute replayed.")
    return found


def traced_problems(policy: Any) -> List[str]:
    """Under ``torch.compile``: the ``save`` entries and the matmul threshold that matched no op when the graphs
    were traced (save_modules is refused there, and registered saves are the plugins' own)."""
    if not policy.traced_ops:
        return []
    found = [no_match(e, "the traced graphs") for e, rule in policy.save_rules.items() if rule.matched_ops == 0]
    threshold = policy.threshold_rule
    if threshold is not None and threshold.matched_ops == 0:
        found.append(_threshold_saved_nothing(policy))
    return found
