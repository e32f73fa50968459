"""Will it fit? The memory of every mode for a model at the target scale, counted on the CPU on fake tensors.

    python -m lightning_ac.estimate --model llama3-8b --seq 8192 32768 --device-memory 80GiB

Each mode's training step runs once per length on fake tensors (shapes and dtypes, no memory): the model built on the
meta device, the suite applied by a real Lightning ``Trainer`` with the mode's callbacks, every storage counted as it
is made and freed. See :func:`estimate`; the modules, one job each:

    :mod:`~lightning_ac.estimate.models`: the config (presets, files, model types, ``--set``) and the model on meta.
    :mod:`~lightning_ac.estimate.overrides`: where ``--set`` puts its values (a multimodal config's language model).
    :mod:`~lightning_ac.estimate.imports`: bitsandbytes only for a run that uses it, its import's log lines at DEBUG.
    :mod:`~lightning_ac.estimate.modes`: the benchmark's modes, and ``chunked_loss`` as a setting of any of them.
    :mod:`~lightning_ac.estimate.tracker`: the O(1)-per-op memory tracker, by storage identity.
    :mod:`~lightning_ac.fake`: the fake session, and what it puts back for the caller.
    :mod:`~lightning_ac.estimate.step`: one fake training step of one mode.
    :mod:`~lightning_ac.estimate.meter`: what the step reads while it runs (the tracker, the layers, the head).
    :mod:`~lightning_ac.estimate.ranks`: one rank of N under DDP or FSDP2, on a fake process group.
    :mod:`~lightning_ac.estimate.fit`: fits or not (with a stated margin), and the longest length that fits.
    :mod:`~lightning_ac.estimate.budget`: the memory budget's plan for a device, from a fake measuring step.
    :mod:`~lightning_ac.estimate.results`: the typed results.
    :mod:`~lightning_ac.estimate.render`: the markdown table.
    :mod:`~lightning_ac.estimate.plot`: activation peak and device total against the length (``--out``).
    :mod:`~lightning_ac.estimate.cli`: ``python -m lightning_ac.estimate``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from lightning_ac.estimate.attention import stand_in_registered
from lightning_ac.estimate.budget import BUDGET, BudgetPlan, budget_plans
from lightning_ac.estimate.fit import MARGIN_NOTE, fits, longest_fit, margin_bytes
from lightning_ac.estimate.models import (
    EstimateError,
    Training,
    build_model,
    describe,
    load_config,
    position_limit,
    presets,
)
from lightning_ac.estimate.models import lora_targets as _targets_of
from lightning_ac.estimate.modes import CHUNKED, known_modes, resolve_modes
from lightning_ac.estimate.optimizers import OPTIMIZERS, OptimizerArgument, optimizer_choice
from lightning_ac.estimate.precision import PRECISIONS, as_precision, precision_for
from lightning_ac.estimate.ranks import STRATEGIES, Ranks, ranks_for
from lightning_ac.estimate.results import Estimate, LongestFit, StepEstimate
from lightning_ac.estimate.step import fake_step
from lightning_ac.fake import fake_session

__all__ = [
    "BudgetPlan",
    "DTYPES",
    "NOTES",
    "Estimate",
    "EstimateError",
    "LongestFit",
    "OPTIMIZERS",
    "PRECISIONS",
    "Ranks",
    "STRATEGIES",
    "StepEstimate",
    "estimate",
    "known_modes",
    "presets",
]

DTYPES = ("bfloat16", "float16", "float32")
NOTES = [
    "not seen: allocator fragmentation and the CUDA context (the margin stands for them), kernels' internal "
    "workspaces other than cuBLAS's (counted on a CUDA target: two of 32 MiB, the forward's and the backward's; "
    "CUBLAS_WORKSPACE_CONFIG sets their size), custom or Triton kernels (a fake step needs a fake implementation of "
    "each op)",
    "attention: the CPU's SDPA kernel saves what CUDA's flash kernel saves (q, k, v, out, logsumexp) for causal "
    "batches without padding; with an attention mask CUDA may pick another kernel, which saves other tensors; on a "
    "CUDA target an attention dropout is counted as CUDA's flash kernel runs it (the CPU's SDPA would run its math "
    "kernel, which keeps a seq x seq matrix per layer)",
    "dropout (LoRA's, a model's hidden dropout): each keeps its mask as the target does, 1 byte an element on a CUDA "
    "target (torch's fused kernel), a full-size one of the input's dtype on a CPU target",
    "the step is the one after a first: the step before's gradients exist until Lightning zeroes them after the "
    "forward; the optimizer's state exists; on a CUDA target adamw and sgd run their foreach implementation, as "
    "there, and the step counters of an optimizer neither fused nor capturable are host memory, where torch keeps "
    "them",
    "offloading: host is host memory the offload engines hold (a pool apart from the device's), each copy at its "
    "own size as on a CPU trainer (copy_on_host): an accelerator's pinned arenas hold more (about a quarter; up to "
    "twice on CUDA, whose pinned allocator rounds each arena up to a power of two); "
    "the device holds what waits for its copy to the host as the slowest bus would leave it (the engine's bound, two "
    "of the largest tensors offloaded) and, in backward, the reloaded copies a node uses and at most one loaded "
    "ahead",
]


def _check(
    seq: Sequence[int],
    batch: int,
    dtype: Optional[str],
    lora: Optional[int],
    full_finetune: bool,
    optimizer: OptimizerArgument,
    target: str,
    seq_step: int,
) -> None:
    if not seq:
        raise EstimateError("--seq: give at least one sequence length")
    for name, values in (("--seq", list(seq)), ("--batch", [batch]), ("--seq-step", [seq_step])):
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise EstimateError(f"{name} {bad[0]!r}: expected a whole number >= 1")
    if dtype is not None and dtype not in DTYPES:
        raise EstimateError(f"--dtype {dtype}: choose from {', '.join(DTYPES)}")
    if not full_finetune and (isinstance(lora, bool) or not isinstance(lora, int) or lora < 1):
        # None too: a full fine-tune is asked for by name, never taken from a missing rank
        raise EstimateError(f"--lora {lora!r}: expected a rank >= 1 (or --full-finetune)")
    optimizer_choice(optimizer, target)  # an unknown name or class fails before any step
    if target not in ("cuda", "cpu"):
        raise EstimateError(f"target {target!r}: cuda (allocations rounded to 512 bytes) or cpu (exact bytes)")


def _budget_modes(modes: Optional[Sequence[str]]) -> tuple[List[str], Optional[List[str]]]:
    """The budget modes asked for (``budget``, ``budget+chunked_loss``; ``chunked_loss`` adds the latter), and the
    other names (``None`` when none were given: every mode)."""
    if not modes:
        return [], None
    budgets = [m for m in modes if m.partition("+")[0] == BUDGET]
    for name in budgets:
        if name not in (BUDGET, f"{BUDGET}+{CHUNKED}"):
            raise EstimateError(f"--modes {name}: unknown mode; the budget's are {BUDGET} and {BUDGET}+{CHUNKED}")
    if BUDGET in budgets and CHUNKED in modes and f"{BUDGET}+{CHUNKED}" not in budgets:
        budgets.append(f"{BUDGET}+{CHUNKED}")
    others = [m for m in modes if m.partition("+")[0] != BUDGET]
    if budgets and others == [CHUNKED]:
        others = []
    return budgets, others


def _device_bytes(device_memory: Union[int, str, Sequence[Union[int, str]], None]) -> List[int]:
    if device_memory is None:
        return []
    from lightning_ac.config import ConfigError, parse_size

    sizes = [device_memory] if isinstance(device_memory, (int, str)) else list(device_memory)
    # a bare byte count given as text is bytes here (a command line's, torch's figure for a device: 85097971712);
    # the config block keeps text for sizes with a unit, where "12" would be ambiguous
    sizes = [int(size) if isinstance(size, str) and size.strip().isdigit() else size for size in sizes]
    try:
        return [parse_size(size, "--device-memory") for size in sizes]
    except ConfigError as err:
        raise EstimateError(str(err).replace(" Give the activation memory one training step may use.", "")) from None


def estimate(
    model: str,
    seq: Union[int, Sequence[int]],
    batch: int = 1,
    dtype: Optional[str] = None,
    lora: Optional[int] = 16,
    full_finetune: bool = False,
    lora_targets: Optional[Sequence[str]] = None,
    optimizer: OptimizerArgument = "adamw",
    modes: Optional[Sequence[str]] = None,
    device_memory: Union[int, str, Sequence[Union[int, str]], None] = None,
    overrides: Optional[Mapping[str, Any]] = None,
    target: str = "cuda",
    longest: bool = True,
    seq_step: int = 512,
    progress: Optional[Callable[[str], None]] = None,
    attention: Optional[str] = None,
    qlora: bool = False,
    loss: str = "causal_lm",
    first_step: bool = False,
    precision: Union[str, int, None] = None,
    qlora_as_loaded: bool = False,
    double_quant: bool = False,
    quant_type: str = "nf4",
    strategy: Optional[str] = None,
    devices: Optional[int] = None,
    adapter_dtype: Optional[str] = None,
    lora_dropout: float = 0.0,
    plan_on: Optional[Tuple[str, Any]] = None,
    host_memory: Optional[int] = None,
) -> Estimate:
    """Estimate every mode's memory for one training step of ``model`` at each length, on fake tensors.

    Args:
        model: A preset (:func:`presets`: ``llama3-8b``...), a ``config.json`` or model directory, or a transformers
            model type (``llama``, ``qwen3``...), built from its config; nothing is downloaded.
        seq: Tokens per sequence: one length or several.
        batch: Sequences per step.
        dtype: The weights' dtype: ``bfloat16`` (the default), ``float16`` or ``float32``; every op runs in it (its
            ``*-true`` precision). Not with ``precision``.
        lora: LoRA's rank (PEFT's default target modules for the model type, or ``lora_targets``); ignored with
            ``full_finetune``.
        full_finetune: Train every parameter instead of LoRA adapters.
        lora_targets: The modules LoRA adapts, instead of PEFT's default for the model type.
        optimizer: The optimizer: ``adamw`` (foreach on a CUDA target), ``adamw_fused``, ``adamw_8bit``
            (bitsandbytes), ``sgd`` (no momentum: no state), ``sgd_momentum``, ``none`` (gradients, no step), or a
            ``torch.optim`` class, alone or as ``(class, kwargs)``
            (:func:`~lightning_ac.estimate.optimizers.optimizer_choice`).
        modes: Mode names (:func:`known_modes`), ``NAME+chunked_loss``, or ``chunked_loss`` (each mode with the
            chunked loss too); every suite mode when ``None``, and ``budget`` with ``device_memory``. ``budget``
            (and ``budget+chunked_loss``) needs ``device_memory``: the memory budget's plan for each device
            (:mod:`lightning_ac.estimate.budget`).
        device_memory: The device's size (bytes, or ``"80GiB"``), or several: each step says whether it fits each,
            with a stated margin (:data:`lightning_ac.estimate.fit.MARGIN_NOTE`), and each mode its longest length
            that fits each.
        overrides: Config values to set (``{"num_hidden_layers": 2}``; dotted keys reach nested configs).
        target: ``cuda`` (allocations rounded to the CUDA allocator's 512 bytes) or ``cpu`` (exact bytes, as a CPU
            run's measurement counts them).
        longest: With ``device_memory``, search each mode's longest length that fits (fake steps of their own).
        seq_step: The granularity of that search.
        progress: Called with a line as each fake step ends.
        attention: The attention implementation: ``sdpa``, ``eager`` or ``flash_attention_2`` (run as SDPA's flash
            kernel, which saves what it saves: :mod:`~lightning_ac.estimate.attention`); ``None``, what transformers
            picks for the model (SDPA where the model supports it, else eager).
        qlora: The frozen base's decoder linears in bitsandbytes 4-bit, LoRA on top (not with ``full_finetune``),
            counted as the QLoRA recipe trains it: after PEFT's ``prepare_model_for_kbit_training``
            (:mod:`~lightning_ac.estimate.qlora`).
        qlora_as_loaded: With ``qlora``: the 4-bit model as loaded, not prepared (for runs that skip it).
        double_quant: With ``qlora``: ``bnb_4bit_use_double_quant``.
        quant_type: With ``qlora``: ``nf4`` or ``fp4``.
        loss: ``causal_lm`` (the model's loss on ``labels=input_ids``) or ``last_logit_mean`` (``logits_to_keep=1``,
            ``logits.float().mean()``: Axolotl's memory measurements' loss).
        precision: The precision as Lightning's ``Trainer(precision=...)`` takes it (``bf16-mixed``: float32
            weights, gradients and optimizer state, the step under autocast; ``bf16-true``...;
            :mod:`~lightning_ac.estimate.precision`). Not with ``dtype``.
        first_step: The step starts without gradients or optimizer state (a run's first, or one after
            ``zero_grad(set_to_none=True)``): they are allocated in it, and counted in its device total (DDP's
            gradient buckets exist before it: DDP allocates them when it wraps the model).
        strategy: How ``devices`` ranks train: ``ddp`` (each holds the whole model and DDP's gradient buckets) or
            ``fsdp`` (FSDP2's ``fully_shard`` on each decoder layer and the root, as under Lightning's
            ``ModelParallelStrategy``: each holds 1/N of the parameters, gradients and optimizer state, and gathers
            a layer's parameters as it runs); every figure is then one rank's, at the per-rank ``batch``
            (:mod:`~lightning_ac.estimate.ranks`). ``None``: one device.
        devices: The number of ranks, with ``strategy``.
        adapter_dtype: LoRA's adapters in this dtype (``bfloat16``: all of the step computes in bf16, the adapters
            too); ``None``: as PEFT makes them (float32 on a 4-bit or half-precision base, each adapted linear then
            saving a float32 copy of its input).
        lora_dropout: LoRA's dropout (PEFT's ``lora_dropout``): each adapted linear keeps a dropped copy of its input
            and a mask, counted as ``target`` keeps it (CUDA a 1-byte mask per element, the CPU a full-size one:
            :mod:`~lightning_ac.estimate.dropout`).
        plan_on: ``(name, GpuRates)``: with ``device_memory``, the block the memory budget would settle on for the
            first device on that GPU, at each length (:mod:`~lightning_ac.estimate.gpu_plan`).
        host_memory: With ``plan_on``: the host memory the offloaded inputs may hold (``None``: no limit).

    Returns:
        An :class:`Estimate`: a :class:`StepEstimate` per mode and length, the longest fits, and notes.

    Raises:
        EstimateError: For arguments that cannot be estimated (before any step runs), an op without a fake
            implementation (naming the op and the mode), or a mode the model does not take.
    """
    seqs = [seq] if isinstance(seq, int) else list(seq)
    _check(seqs, batch, dtype, lora, full_finetune, optimizer, target, seq_step)
    if precision is not None and dtype is not None:
        raise EstimateError(
            f"--dtype {dtype} with --precision {precision}: the precision decides the weights' dtype (--dtype "
            "bfloat16 is --precision bf16-true). Give one of them."
        )
    if precision is not None:
        chosen_precision = precision_for(precision)
    else:
        chosen_precision = as_precision(getattr(torch, dtype or "bfloat16"))
    memories = _device_bytes(device_memory)
    targets = tuple(lora_targets) if lora_targets else None
    rank = None if full_finetune else lora
    if qlora_as_loaded and not qlora:
        raise EstimateError("--qlora-as-loaded is a QLoRA run's 4-bit model as loaded: it stands in place of --qlora")
    training = Training(
        rank,
        None if full_finetune else targets,
        qlora,
        loss,
        first_step,
        qlora_prepared=not qlora_as_loaded,
        double_quant=double_quant,
        quant_type=quant_type,
        adapter_dtype=adapter_dtype,
        lora_dropout=0.0 if full_finetune else lora_dropout,
    )
    ranks = ranks_for(strategy, devices)
    if ranks.sharded and training.qlora:
        raise EstimateError(
            "--qlora with --strategy fsdp: sharding bitsandbytes' 4-bit weights with fully_shard is not counted yet. "
            "Estimate QLoRA on one device, or per rank under --strategy ddp."
        )
    budgets, others = _budget_modes(modes)
    if not modes and memories and not ranks.distributed:  # every mode: the budget's too, which has a device to plan for
        budgets = [BUDGET]
    if budgets and ranks.distributed:
        raise EstimateError(
            f"--modes {budgets[0]} with --strategy {ranks.strategy}: the budget's plan is made for one device here. "
            "Leave it out of --modes; the other modes give each rank's figures."
        )
    if plan_on is not None and (not memories or ranks.distributed):
        raise EstimateError(
            "--plan makes the budget's plan for one device: give --device-memory SIZE, and no --strategy"
        )
    if budgets and not memories:
        raise EstimateError(
            f"--modes {budgets[0]}: the budget's plan is made for a device's memory; give --device-memory SIZE"
        )
    # [] when only the budget's were named
    chosen = [] if others == [] else resolve_modes(others, training.full_finetune, ranks.sharded)
    config = load_config(model, overrides or {}, attention)
    with fake_session(), stand_in_registered(config):  # quiet, leaving the caller's state as it was, as the steps do
        shape = build_model(config, chosen_precision.build_dtype(training.qlora), training)
    positions = position_limit(shape)
    if positions is not None and max(seqs) > positions:
        raise EstimateError(
            f"--seq {max(seqs)}: {config.model_type} learns {positions} positions, and its forward fails on a longer "
            f"sequence. Estimate --seq {positions} or less, or a config with more positions (--set "
            f"{'n_positions' if hasattr(config, 'n_positions') else 'max_position_embeddings'}=N)."
        )
    shown = chosen_precision.dtype_name
    if chosen_precision.autocast is not None:
        built = "a bf16-loaded 4-bit base" if training.qlora else "float32 weights"
        shown = f"{chosen_precision.name} ({built}, autocast)"
    result = Estimate(
        model=model,
        description=describe(config, shape),
        dtype=shown,
        training=training.describe(None if training.full_finetune else _targets_of(config, training)),
        optimizer=optimizer_choice(optimizer, target).name,
        target=target,
        device_memory_bytes=memories,
        ranks=ranks.describe(),
        notes=list(NOTES) + ([MARGIN_NOTE] if memories else []) + ranks.notes(),
    )
    del shape

    def run(mode: Any, length: int) -> StepEstimate:
        step = fake_step(config, chosen_precision, training, mode, length, batch, optimizer, target, ranks=ranks)
        if memories:
            on = [fits(step, device) for device in memories]
            step = dataclasses.replace(step, fits=on[0], fits_on=on, margin_bytes=margin_bytes(step.device_total_bytes))
        if progress is not None:
            from lightning_ac.estimate.render import progress_line

            progress(progress_line(step))
        return step

    for mode in chosen:
        for length in seqs:
            result.steps.append(run(mode, length))
    for length in seqs if plan_on is not None else []:
        from lightning_ac.estimate.gpu_plan import gpu_plan

        gpu, rates = plan_on
        args = (config, chosen_precision, training, length, batch, optimizer, target, memories[0], rates, gpu)
        result.gpu_plans.append(gpu_plan(*args, host_bytes=host_memory, progress=progress))
    for name in budgets:
        for length in seqs:
            step, plans = budget_plans(
                name, config, chosen_precision, training, length, batch, optimizer, target, memories
            )
            result.budget_plans += plans
            if progress is not None:
                progress(f"estimate: {name} measuring step at {length} x {batch} tokens ({step.seconds:.1f} s)")
    searched: dict = {}  # (mode, length) -> step: the search on one size reuses the steps it made on another
    for device in memories if longest else []:
        for mode in chosen:
            known = [s for s in result.steps if s.mode == mode.name]
            known += [s for (name, _), s in searched.items() if name == mode.name]

            def probe(length: int, mode: Any = mode) -> StepEstimate:
                searched[mode.name, length] = step = run(mode, length)
                return step

            upper = positions if positions is not None else 2**20
            result.longest.append(longest_fit(mode.name, known, probe, device, seq_step, upper=upper))
    result.search_steps = [step for (_, length), step in searched.items() if length not in seqs]
    return result
