"""What an estimate finds: one :class:`StepEstimate` per mode and sequence length, and the report around them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["Estimate", "LongestFit", "StepEstimate"]


@dataclass
class StepEstimate:
    """The memory and compute of one training step of one mode at one shape, counted on fake tensors.

    Byte figures are device bytes unless named host; with a CUDA target each storage is rounded up to the CUDA
    allocator's 512-byte blocks.

    Attributes:
        mode: The mode's name (``full``, ``full+chunked_loss``...).
        seq: Tokens per sequence.
        batch: Sequences per step.
        parameter_bytes: Parameters on the device when the step starts (layer offloading: what it keeps there; the
            streamed layers' copies are ``streamed_weight_bytes``; under FSDP2, the rank's shards).
        buffer_bytes: The model's buffers on the device (rotary tables...).
        gradient_bytes: The trainable parameters' gradients (under FSDP2, the rank's shards; under DDP, with its
            gradient buckets).
        optimizer_bytes: The optimizer's state (under FSDP2, the rank's shards).
        activation_peak_bytes: The most that activations and temporaries hold together at any moment of the step, as
            :func:`lightning_ac.memory.measure_step` counts it (the benchmark's ``peak_activation_bytes``).
        activation_peak_at: Where in the step that peak falls: ``forward``, ``head`` (the output head and the loss,
            forward and backward), ``backward``, ``recompute`` or ``optimizer``.
        head_bytes: The output head's working set: the most activations held while the head and the loss run
            (forward and backward) beyond what was held when it started.
        layer_saved_bytes: Per decoder layer, what its forward leaves on the device for backward, its input and
            output apart (0 for a layer that is recomputed and keeps only its input).
        layer_input_bytes: The decoder layers' inputs kept on the device for backward (and the head's input).
        outside_bytes: What is kept outside the decoder layers when the head starts (embeddings' output, masks...).
        streamed_weight_bytes: Layer offloading: the most bytes of streamed weights on the device at once; under
            FSDP2, of gathered parameters and their all-gather buffers.
        host_bytes: The most host memory the step's offloading holds (activations offloaded, streamed weights
            between uses): a pool apart from the device's.
        device_total_bytes: The most device bytes held at any moment of the step: parameters, buffers, gradients,
            optimizer state, activations and streamed weights, plus the batch and ``workspace_bytes``.
        one_memory_peak_bytes: The most activations, streamed weights' copies and host memory the step adds, held
            together: a CPU run's activation peak, where offloaded activations and loaded layers stay in the one memory
            there is (what measure_step reports on the CPU).
        flops: The step's floating-point operations: ``forward``, ``backward``, ``recompute`` (forward ops run again
            in backward), ``optimizer`` (counted for matmuls and attention: ``torch.utils.flop_counter``'s formulas).
        ops: The ops the step dispatched, by phase (as ``flops``).
        moved_bytes: What the ops without FLOPs (elementwise work: norms, activations, copies) wrote, by phase.
        seconds: Wall time of the fake step on this machine.
        fits: With a device size: whether ``device_total_bytes`` plus the margin fits it (the first size, when several
            were given); ``None`` without one.
        fits_on: With device sizes: whether it fits each (in the order given).
        margin_bytes: The margin added for what the allocator and the CUDA context take beyond allocated bytes.
        workspace_bytes: With a CUDA target, the libraries' workspaces the step's first matmuls allocate through the
            allocator and keep (cuBLAS's: :mod:`~lightning_ac.estimate.workspaces`); in the device total, not in the
            activations.
    """

    mode: str
    seq: int
    batch: int
    parameter_bytes: int
    buffer_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_peak_bytes: int
    activation_peak_at: str
    head_bytes: int
    layer_saved_bytes: List[int]
    layer_input_bytes: int
    outside_bytes: int
    streamed_weight_bytes: int
    host_bytes: int
    device_total_bytes: int
    one_memory_peak_bytes: int
    flops: Dict[str, int]
    seconds: float
    fits: Optional[bool] = None
    fits_on: List[bool] = field(default_factory=list)
    margin_bytes: int = 0
    workspace_bytes: int = 0
    ops: Dict[str, int] = field(default_factory=dict)
    moved_bytes: Dict[str, int] = field(default_factory=dict)

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass
class LongestFit:
    """The longest sequence a mode fits on the device (a search over the length, a fake step each).

    Attributes:
        mode: The mode's name.
        device_memory_bytes: The device size it fits.
        seq: The longest length found to fit (a multiple of ``step``), ``0`` when not even ``step`` tokens fit.
        step: The granularity of the search.
        limited: ``True`` when the search stopped at its upper bound (the mode fits more).
    """

    mode: str
    device_memory_bytes: int
    seq: int
    step: int
    limited: bool = False


@dataclass
class Estimate:
    """An estimate of every mode asked for, at every length asked for.

    Attributes:
        model: What was estimated (``llama3-8b``, a model type, a path).
        description: The model's shape in one line (parameters, layers, hidden size, vocabulary).
        dtype: The precision: the weights' dtype (``bfloat16``: every op in it), or a mixed precision as
            ``bf16-mixed (float32 weights, autocast)``.
        training: ``lora r=16 (q_proj, v_proj)`` or ``full fine-tune``.
        optimizer: The optimizer's name (:data:`~lightning_ac.estimate.optimizers.OPTIMIZERS`, or a class and its
            arguments).
        target: The device the figures are for (``cuda``: storages rounded to 512 bytes; ``cpu``: exact).
        device_memory_bytes: The device sizes fits are judged against (empty when none was given).
        ranks: ``""`` for one device; else what every figure is: ``per rank of 8 under FSDP2 (...)``
            (:mod:`~lightning_ac.estimate.ranks`).
        steps: One :class:`StepEstimate` per mode and length.
        longest: With device sizes: the longest sequence each mode fits on each.
        search_steps: The fake steps that search ran, at lengths not asked for.
        budget_plans: With ``budget`` among the modes: the memory budget's plan for each device and length
            (:class:`lightning_ac.estimate.budget.BudgetPlan`).
        notes: What the figures do not see or assume, one sentence each.
        gpu_plans: With ``plan_on``: the block the budget would settle on, per length
            (:class:`~lightning_ac.estimate.gpu_plan.GpuPlan`).
    """

    model: str
    description: str
    dtype: str
    training: str
    optimizer: str
    target: str
    device_memory_bytes: List[int] = field(default_factory=list)
    ranks: str = ""
    steps: List[StepEstimate] = field(default_factory=list)
    longest: List[LongestFit] = field(default_factory=list)
    search_steps: List[StepEstimate] = field(default_factory=list)
    budget_plans: List[Any] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    gpu_plans: List[Any] = field(default_factory=list)

    def step(self, mode: str, seq: int) -> StepEstimate:
        """The estimate of ``mode`` at ``seq`` tokens."""
        for s in self.steps:
            if s.mode == mode and s.seq == seq:
                return s
        raise KeyError(f"no estimate of {mode} at {seq} tokens")

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)
