"""``--plan``: the block the memory budget would settle on for a device and a GPU, before the GPU is rented.

The budget's own first step recomputes every decoder layer and measures it; here that step runs on fake tensors
(:func:`lightning_ac.estimate.budget.measure`), once without the tools and once with each of the chunked loss, the
tiled MLP and both, for the bytes each layer and the head hold. Their times come from the time model
(:mod:`lightning_ac.estimate.timing`) at the named GPU's rates, not from the fake ops' wall time: a layer's recompute
is its share of the measuring step's recompute phase; under the save rules, that scaled by what ``selective_attn``'s
recompute costs against ``full``'s, plus the policy's per-op cost; with its input in host memory, its recompute and
what the input's copies take past the compute (:func:`lightning_ac.budget.host.offload_seconds` at the host link's
rate). :func:`lightning_ac.budget.choice.choose` then makes each plan, with the offloaded inputs under
``host_bytes``, and the fastest predicted step that fits is the plan: what the budget's closed loop would weigh and
measure on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from lightning_ac.budget.choice import Choice, choose
from lightning_ac.budget.host import CopyRates, offload_seconds
from lightning_ac.estimate.budget import BUDGET_BLOCK, measure, usable_bytes
from lightning_ac.estimate.modes import resolve_modes
from lightning_ac.estimate.results import StepEstimate
from lightning_ac.estimate.timing import POLICY_SECONDS, GpuRates, phase_seconds, step_seconds
from lightning_ac.units import format_bytes

__all__ = ["GpuPlan", "gpu_plan", "plan_markdown"]

# the tool combinations weighed: (chunked loss, tiled MLP)
TOOLS: Tuple[Tuple[bool, bool], ...] = ((False, False), (True, False), (False, True), (True, True))


@dataclass
class GpuPlan:
    """The plan for one device, GPU and length.

    Attributes:
        gpu: The GPU's name (or ``custom``) and rates.
        seq: Tokens per sequence.
        batch: Sequences per step.
        device_memory_bytes: The device's size.
        budget_bytes: The activation memory the device leaves (the ``budget:`` the block sets).
        chunked_loss: Whether the plan has the chunked loss on.
        tiled_mlp: Whether it has the tiled MLP on.
        choices: Per decoder layer: ``keep``, ``selective``, ``recompute`` or ``offload``.
        activation_peak_bytes: The plan's activation peak by the figures.
        device_total_bytes: What is not activations, plus that peak.
        host_bytes: What the offloaded inputs hold in host memory.
        step_seconds: The plan's predicted step; ``off_seconds``, ``full_seconds``: those of ``off`` and ``full``.
        fits: Whether a plan fits the budget (else the least memory the tools allow, over it).
        weighed: Per tool combination, its predicted step where its plan fits (``None`` where it does not).
    """

    gpu: str
    seq: int
    batch: int
    device_memory_bytes: int
    budget_bytes: int
    chunked_loss: bool
    tiled_mlp: bool
    choices: List[str]
    activation_peak_bytes: int
    device_total_bytes: int
    host_bytes: int
    step_seconds: float
    off_seconds: float
    full_seconds: float
    fits: bool
    weighed: Dict[str, Optional[float]] = field(default_factory=dict)

    @property
    def layers(self) -> str:
        """One letter per layer: k keep, s selective, r recompute, o recompute with the input in host memory."""
        return "".join(c[0] for c in self.choices)

    def block(self) -> Dict[str, Any]:
        """The ``activation_checkpointing`` block that asks the budget for this plan."""
        block: Dict[str, Any] = {"budget": f"{max(self.budget_bytes, 0) // 2**20}MiB", **BUDGET_BLOCK}
        block["chunked_loss"] = self.chunked_loss
        block["tiled_mlp"] = self.tiled_mlp
        if Choice.offload.value in self.choices:
            block["offload"] = {"hidden_states": "auto"}
        return block


def _label(chunked: bool, tiled: bool) -> str:
    return "+".join(["budget"] + (["chunked_loss"] if chunked else []) + (["tiled_mlp"] if tiled else []))


def gpu_plan(
    config: Any,
    precision: Any,
    training: Any,
    seq: int,
    batch: int,
    optimizer: Any,
    target: str,
    device_memory: int,
    rates: GpuRates,
    gpu: str,
    host_bytes: Optional[int] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> GpuPlan:
    """The fastest plan the budget's choice makes under ``device_memory`` on a GPU of ``rates`` (see the module)."""
    from lightning_ac.estimate.step import fake_step

    def reference(name: str) -> StepEstimate:
        (mode,) = resolve_modes([name], training.full_finetune)
        return fake_step(config, precision, training, mode, seq, batch, optimizer, target)

    off, full, selective = reference("off"), reference("full"), reference("selective_attn")
    layers = len(full.layer_saved_bytes) or 1
    full_recompute = phase_seconds(full, rates, "recompute")
    rules_ratio = phase_seconds(selective, rates, "recompute") / full_recompute if full_recompute else 1.0
    rules_policy = POLICY_SECONDS * (selective.ops.get("forward", 0) + selective.ops.get("recompute", 0)) / layers
    link = CopyRates(rates.link_gbps * 1e9, rates.link_gbps * 1e9)
    off_seconds, full_seconds = step_seconds(off, rates), step_seconds(full, rates)
    best: Optional[GpuPlan] = None
    least: Optional[GpuPlan] = None
    weighed: Dict[str, Optional[float]] = {}
    for chunked, tiled in TOOLS:
        block = {**BUDGET_BLOCK, "chunked_loss": chunked, "tiled_mlp": tiled}
        step, figures = measure(
            _label(chunked, tiled), config, precision, training, seq, batch, optimizer, target, block
        )
        if progress is not None:
            progress(
                f"estimate: --plan: {_label(chunked, tiled)} measuring step at {seq} x {batch} ({step.seconds:.1f} s)"
            )
        recompute = phase_seconds(step, rates, "recompute") / layers
        base = step_seconds(step, rates, copy_seconds=0.0) - recompute * layers
        priced = []
        for f in figures.layers:
            f = dataclasses.replace(
                f, recompute_seconds=recompute, selective_seconds=recompute * rules_ratio + rules_policy
            )
            priced.append(dataclasses.replace(f, offload_seconds=offload_seconds(f, link)))
        budget = usable_bytes(device_memory) - figures.fixed_bytes
        plan = choose(priced, max(budget, 1), figures.outside_bytes, figures.head_bytes, host_bytes=host_bytes)
        found = GpuPlan(
            gpu=gpu,
            seq=seq,
            batch=batch,
            device_memory_bytes=device_memory,
            budget_bytes=budget,
            chunked_loss=chunked,
            tiled_mlp=tiled,
            choices=[c.value for c in plan.choices],
            activation_peak_bytes=plan.peak_bytes,
            device_total_bytes=figures.fixed_bytes + plan.peak_bytes,
            host_bytes=plan.host_bytes,
            step_seconds=base + plan.recompute_seconds,
            off_seconds=off_seconds,
            full_seconds=full_seconds,
            fits=plan.fits and budget > 0,
        )
        weighed[_label(chunked, tiled)] = found.step_seconds if found.fits else None
        if found.fits and (best is None or found.step_seconds < best.step_seconds):
            best = found
        if (
            least is None
            or found.activation_peak_bytes - found.budget_bytes < least.activation_peak_bytes - least.budget_bytes
        ):
            least = found
    chosen = best if best is not None else least
    assert chosen is not None
    chosen.weighed = weighed
    return chosen


def plan_markdown(plans: List[GpuPlan]) -> str:
    """``--plan``'s section of the estimate's output."""
    lines = []
    for p in plans:
        lines += [
            "",
            f"Plan for {format_bytes(p.device_memory_bytes)} on {p.gpu} at {p.seq} x {p.batch} tokens "
            f"({'fits' if p.fits else 'nothing fits: the least memory the tools allow, over the budget'}):",
            "",
            "```yaml",
            "activation_checkpointing:",
            *(f"  {k}: {_yaml(v)}" for k, v in p.block().items()),
            "```",
            "",
            f"- layers: `{p.layers}` (k keep, s selective, r recompute, o recompute with the input in host memory)",
            f"- predicted device peak: {format_bytes(p.activation_peak_bytes)} of activations, "
            f"{format_bytes(p.device_total_bytes)} in all; host memory for the inputs: {format_bytes(p.host_bytes)}",
            f"- predicted step: {p.step_seconds:.3f} s, {p.step_seconds / p.off_seconds:.2f}x `off`'s "
            f"({p.off_seconds:.3f} s) and {p.step_seconds / p.full_seconds:.2f}x `full`'s ({p.full_seconds:.3f} s)",
            "- weighed: " + ", ".join(f"{k} {'over' if v is None else f'{v:.3f} s'}" for k, v in p.weighed.items()),
        ]
    return "\n".join(lines) + "\n"


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return str(value)
