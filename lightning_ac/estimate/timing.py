"""A training step's time on a GPU, predicted from what its fake step counted: a model of three costs, priced at a named
GPU's rates (or the rates given).

- **Math.** The matmuls' and attention's FLOPs (``torch.utils.flop_counter``'s formulas, every phase) at the GPU's dense
  bf16 throughput times :data:`MATMUL_SHARE`, the share a large matmul reaches.
- **Memory.** What the ops without FLOPs write (norms, activations, rotary, casts, the optimizer's elementwise update),
  read about twice over and written once (:data:`TRAFFIC`), at the memory bandwidth times :data:`MEMORY_SHARE`. These
  ops are what a recompute with every matmul saved still runs: FLOPs alone price it at nothing.
- **The save rules' policy.** Selective checkpointing decides per op in Python, in the forward and in the recompute of
  each selective layer: :data:`POLICY_SECONDS` an op, on the host, where the device waits for it at these sizes (what
  made ``selective_attn`` slower than ``full`` on the H200 at 8k tokens of a 1B model).

Copies to and from host memory run beside the compute on their own streams: what they add is what the link takes past
the compute of the same phase (``offload_seconds``). How far this model is from the H200's measured rows is in the
estimator's docs page (``tests/test_estimate_timing.py`` holds it to them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from lightning_ac.estimate.results import StepEstimate

__all__ = [
    "GPUS",
    "GpuRates",
    "MATMUL_SHARE",
    "MEMORY_SHARE",
    "POLICY_SECONDS",
    "TRAFFIC",
    "phase_seconds",
    "policy_ops",
    "step_seconds",
]

# The share of the dense bf16 peak a transformer's large matmuls reach, and of the memory bandwidth its elementwise
# kernels reach (typical of eager PyTorch on Hopper; neither is measured per GPU here).
MATMUL_SHARE = 0.7
MEMORY_SHARE = 0.7
# Bytes an elementwise op moves per byte it writes: its inputs read (about two of its output's size) and its output.
TRAFFIC = 3
# The save rules' policy, per op it decides, on the host (python -m lightning_ac.bench.sac_cost's difference between
# ``ours`` and ``torch_full``, per op of the forward and the recompute: the estimator's page gives the measurement).
POLICY_SECONDS = 5e-6


@dataclass(frozen=True)
class GpuRates:
    """What a GPU does a second.

    Attributes:
        bf16_tflops: Dense bf16 matmul throughput, TFLOP/s.
        memory_gbps: Device memory bandwidth, GB/s.
        link_gbps: The host link, each way, GB/s (what a pinned copy reaches).
    """

    bf16_tflops: float
    memory_gbps: float
    link_gbps: float


# Vendors' dense (not sparse) bf16 figures, memory bandwidth, and what a pinned copy reaches on the host link (PCIe 5.0
# x16 about 55 GB/s, 4.0 about 25).
GPUS: Dict[str, GpuRates] = {
    "h100-sxm": GpuRates(989, 3350, 55),
    "h100-pcie": GpuRates(756, 2000, 55),
    "h200": GpuRates(989, 4800, 55),
    "a100-80gb": GpuRates(312, 2039, 25),
    "a100-40gb": GpuRates(312, 1555, 25),
    "l40s": GpuRates(362, 864, 25),
    "rtx-4090": GpuRates(165, 1008, 25),
    "a10g": GpuRates(125, 600, 25),
}


def policy_ops(step: StepEstimate, selective_share: float) -> int:
    """The ops the save rules' policy decides in ``step``: those of the forward and the recompute, for the share of
    the decoder layers that run under the rules (1 for a ``selective`` mode, 0 without)."""
    return int(selective_share * (step.ops.get("forward", 0) + step.ops.get("recompute", 0)))


def phase_seconds(step: StepEstimate, rates: GpuRates, phase: str) -> float:
    """The math and memory time of one phase of ``step`` (``forward``, ``head``, ``backward``, ``recompute``,
    ``optimizer``) on a GPU of ``rates``."""
    math = step.flops.get(phase, 0) / (rates.bf16_tflops * 1e12 * MATMUL_SHARE)
    return math + TRAFFIC * step.moved_bytes.get(phase, 0) / (rates.memory_gbps * 1e9 * MEMORY_SHARE)


def step_seconds(
    step: StepEstimate, rates: GpuRates, selective_share: float = 0.0, copy_seconds: Optional[float] = None
) -> float:
    """``step``'s predicted time on a GPU of ``rates``.

    Args:
        step: A fake step's estimate (its FLOPs, ops and elementwise bytes by phase).
        rates: The GPU's.
        selective_share: The share of the decoder layers under the save rules.
        copy_seconds: What the step's copies to and from host memory add past the compute; ``None``: the host bytes
            each way at the link's rate, less the forward's (out) and the backward's (back) compute, which they run
            beside.
    """
    math = sum(step.flops.values()) / (rates.bf16_tflops * 1e12 * MATMUL_SHARE)
    memory = TRAFFIC * sum(step.moved_bytes.values()) / (rates.memory_gbps * 1e9 * MEMORY_SHARE)
    policy = policy_ops(step, selective_share) * POLICY_SECONDS
    if copy_seconds is None:
        link = step.host_bytes / (rates.link_gbps * 1e9)
        share = (math + memory) / max(1, sum(step.ops.values()))  # a phase's compute, by its ops
        forward = share * step.ops.get("forward", 0)
        backward = share * (step.ops.get("backward", 0) + step.ops.get("recompute", 0))
        copy_seconds = max(0.0, link - forward) + max(0.0, link - backward)
    return math + memory + policy + copy_seconds
