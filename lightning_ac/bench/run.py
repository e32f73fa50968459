"""Running the benchmark: each mode trains the same model from the same weights on the same batch, in one process,
with repetitions alternating between modes so that machine drift hits all modes alike. Suite modes go through our
callbacks in a real Trainer; anchors apply transformers' or torch's checkpointing directly, without our code, in the
same Trainer harness. Memory and step time come from :mod:`lightning_ac.bench.memory`, the code the main job uses.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import statistics
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_ac._logging import log
from lightning_ac.bench.bus import copy_bandwidth, copy_floor_s
from lightning_ac.bench.grads import REFERENCES, GradientDiffs
from lightning_ac.bench.memory import MemoryPeak, StepMetrics
from lightning_ac.bench.modes import (
    ALL_ANCHORS,
    ALL_BUDGET_MODES,
    ALL_COMPILED,
    ALL_SUITE_MODES,
    COMPILED_MODES,
    FLOOR_MODES,
    LAYER_OFFLOAD_MODES,
    availability,
    budget_block,
    budget_bounds,
    cold_compiles,
    compile_layers,
    default_modes,
    layer_offload_mode,
    settle_steps,
    training_loss,
    warm_up_compiler,
)
from lightning_ac.bench.presets import PRESETS, build_model, model_config
from lightning_ac.bench.settle import MOST_EXTRA_STEPS, SettledCheck
from lightning_ac.callbacks import ActivationOffload, callbacks_from_config

__all__ = ["Row", "quiet", "release_mode", "run_benchmark"]


def quiet() -> None:
    """Silence Lightning's and the suite's log lines and warnings: the benchmark's tables are its output."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    log.setLevel(logging.WARNING)  # the suite's own logger
    warnings.filterwarnings("ignore")


@dataclass
class Row:
    """One mode's result."""

    mode: str
    kind: str  # "suite", "anchor", or "floor" (a measure to compare with, not a mode to train with)
    peak_activation_bytes: Optional[int]
    step_time_s: Optional[float]
    max_grad_diff: Optional[float]  # against off; the layer-offloading modes against lora_full; the floor: None
    status: str = "ok"
    peak_device_bytes: Optional[int] = None  # the device allocator's peak (CUDA); the layer-offloading modes' figure
    # (slowest - fastest) / median of the repetitions' median steps; None with one repetition
    step_time_spread: Optional[float] = None
    budget_bytes: Optional[int] = None  # the budget modes: their budget, and what each decoder layer settled on
    budget_choices: Optional[List[str]] = None
    compile_time_s: Optional[float] = None  # the compiled modes: the warm-up steps' excess over the median step
    moved_bytes: Optional[int] = None  # the suite's offload rows: the bytes a step moves to the host (and back)
    copy_floor_s: Optional[float] = None  # ... and the time they take on the bus at its measured bandwidth
    max_grad_ref_abs: Optional[float] = None  # the reference's largest gradient: max_grad_diff is relative to it


def _unwrapped_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


class _BenchModule(pl.LightningModule):
    def __init__(
        self,
        model: nn.Module,
        capture_grads: bool,
        capture_step: int = 0,
        loss: Optional[Callable[[nn.Module, torch.Tensor], torch.Tensor]] = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.loss = loss  # None: the model's own, from the labels
        self.capture_grads = capture_grads
        # the same step in every mode (they train bit-identically until then), a warm-up step: the copy of a large
        # model's gradients to the host falls in no timed step
        self.capture_step = capture_step
        self.grads: Optional[Dict[str, torch.Tensor]] = None
        self._step_context: Any = None
        self._in_step_context = False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # An anchor's context around the whole training step (TRL's offloader), built on the device
        factory = getattr(self.model, "_bench_step_context", None)
        if factory is not None:
            if self._step_context is None:
                self._step_context = factory(self.model)
            self._step_context.__enter__()
            self._in_step_context = True

    def on_after_backward(self) -> None:
        self.leave_step_context()

    def leave_step_context(self) -> None:
        """Exit the anchor's step context if a step entered it (also after a failed step: its saved-tensor hooks
        must not leak into the next mode)."""
        if self._in_step_context:
            self._in_step_context = False
            self._step_context.__exit__(None, None, None)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.loss is not None:
            return self.loss(self.model, batch)
        return self.model(input_ids=batch, labels=batch, use_cache=False).loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.capture_grads and self.grads is None and self.trainer.global_step == self.capture_step:
            # torch's checkpoint_wrapper and torch.compile re-parent layers; strip their prefixes so names match
            self.grads = {
                _unwrapped_name(n): p.grad.detach().float().cpu().clone()
                for n, p in self.named_parameters()
                if p.grad is not None
            }

    def take_grads(self) -> Optional[Dict[str, torch.Tensor]]:
        """The captured gradients, handed over and no longer held here: the module and its trainer refer to each
        other and outlive the mode until Python's cycle collector runs (and a traceback a library keeps from inside
        ``fit`` keeps the frames that called it), so gradients (a model's size in float32) left on the module, or in a
        local of the caller's frame, would stay alive after the comparison is done with them."""
        grads, self.grads = self.grads, None
        return grads

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # A tiny learning rate keeps the weights (and the next step's cost) nearly unchanged between steps.
        return torch.optim.AdamW(self.parameters(), lr=1e-6)


class _SameBatch(torch.utils.data.Dataset):
    def __init__(self, batch: torch.Tensor, length: int) -> None:
        self.batch, self.length = batch, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.batch


@dataclass(frozen=True)
class _Measured:
    """What a mode's :class:`StepMetrics` measured, apart from the callback: Lightning hands every callback its
    module's ``log`` methods, bound to the module, so the callback kept the module, and with it the mode's model copy,
    optimizer state and trainer, for as long as the caller held it (into the next mode)."""

    step_times: List[float]
    warmup_times: List[float]
    peak: Optional[MemoryPeak]


# The step whose gradients every mode hands over for the comparison: the first, a warm-up step that is neither timed
# (StepMetrics leaves the first two steps out of the step times, and the budget rows more) nor measured (the second
# step is: on the CPU a copy of the gradients there would count as its memory)
CAPTURE_STEP = 0


def _run_mode(
    mode: str,
    base: nn.Module,
    batch: torch.Tensor,
    steps: int,
    measure: bool,
    capture: bool,
    accelerator: str,
    budget: Optional[int] = None,
) -> Tuple[_Measured, Optional[Dict[str, torch.Tensor]], Optional[Dict[str, Any]], Optional[int]]:
    """Train one mode on a copy of ``base``. Returns its figures, its captured gradients (with ``capture``), its budget
    plan (the budget modes) and the bytes a step moves to the host (the offload modes): nothing that holds the
    mode's model copy, optimizer or trainer, which :func:`release_mode` frees once this returns."""
    model = copy.deepcopy(base)
    callbacks: List[pl.Callback] = []
    settle = 0
    if mode in COMPILED_MODES:
        compile_layers(model)
    if mode in ALL_ANCHORS:
        ALL_ANCHORS[mode](model)
    elif mode in LAYER_OFFLOAD_MODES:
        model, callbacks = layer_offload_mode(model, LAYER_OFFLOAD_MODES[mode], on_host=accelerator == "cpu")
    elif mode in ALL_BUDGET_MODES:
        callbacks, settle = callbacks_from_config(budget_block(mode, budget)), settle_steps(mode)
    else:
        callbacks = callbacks_from_config(ALL_SUITE_MODES[mode])
    if mode in ALL_COMPILED and accelerator == "cpu":
        measure = False  # MemTracker cannot see inside compiled graphs (see COMPILED_MODES)
    metrics = StepMetrics(measure_step=1 + settle if measure else -1, warmup_steps=2 + settle)
    if mode in ALL_BUDGET_MODES:  # more warm-up steps where its budget has not settled, and the run ends after them
        callbacks, settle = [*callbacks, SettledCheck(callbacks[0], metrics, steps)], settle + MOST_EXTRA_STEPS
    module = _BenchModule(model, capture, capture_step=CAPTURE_STEP, loss=training_loss(mode))
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=2 + steps + settle,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, metrics],
    )
    # Each sample is the whole [batch, seq] tensor; the loader adds the batch dim.
    loader = torch.utils.data.DataLoader(_SameBatch(batch, 2 + steps + settle), batch_size=None)
    try:
        with cold_compiles() if mode in ALL_COMPILED else contextlib.nullcontext():
            trainer.fit(module, loader)
    finally:
        module.leave_step_context()
    plan = callbacks[0].budget_plan if mode in ALL_BUDGET_MODES else None
    offload = next((cb for cb in callbacks if isinstance(cb, ActivationOffload)), None)
    moved = sum(target["bytes"] for target in offload.last_step.values()) if offload is not None else None
    return _Measured(metrics.step_times, metrics.warmup_times, metrics.peak), module.take_grads(), plan, moved


def release_mode(on_accelerator: bool) -> None:
    """Free everything the mode that just ended held (its model copy, optimizer state, trainer, callbacks) before
    the next one starts; on CUDA, hand the allocator's cached blocks back too, so that a later mode neither runs
    beside an earlier one's leftovers nor reuses its cache.

    A mode's objects refer to one another in cycles that no reference count ends: the module and its trainer (and
    the trainer's loops, connectors and strategy, each pointing back at it), hooks and closures that capture their
    owners, the step's measurement. Python's cycle collector frees them when it happens to run a full collection,
    which a mode's few large allocations seldom trigger, and on a GPU each mode's device memory stayed allocated
    beside the next mode's. Breaking each cycle by hand would depend on Lightning's and every anchor's internals; a
    collection between modes frees them all, whatever holds them (it takes milliseconds, a step takes far longer).
    With it (and nothing else holding a mode: :class:`_Measured`, :mod:`lightning_ac.module_tracking`), cpu-small at
    256 tokens peaks at 736 MiB of resident memory for 8 modes and 669 MiB for 2, against 2,911 and 1,137 before.
    """
    gc.collect()
    if on_accelerator:
        torch.cuda.empty_cache()


def run_benchmark(
    preset_name: str = "cpu-small",
    modes: Optional[List[str]] = None,
    seq: Optional[int] = None,
    batch: Optional[int] = None,
    dtype: Optional[str] = None,
    reps: Optional[int] = None,
    steps: Optional[int] = None,
    seed: int = 0,
    model: Optional[str] = None,
    vocab_size: Optional[int] = None,
    on_progress: Optional[Callable[[List[Row]], None]] = None,
) -> List[Row]:
    """Run the benchmark and return one :class:`Row` per mode (by default the preset's own rows, where it has them,
    else every mode that runs here); ``vocab_size`` replaces the preset model's. ``on_progress`` is handed the rows as
    they stand after each mode runs (the CLI writes them: a run cut short still leaves its table)."""
    preset = copy.deepcopy(PRESETS[preset_name])
    seq, batch_size = seq or preset["seq"], batch or preset["batch"]
    reps, steps = reps or preset["reps"], steps or preset["steps"]
    torch_dtype = getattr(torch, dtype or preset["dtype"])
    on_accelerator = torch.cuda.is_available()
    accelerator = "gpu" if on_accelerator else "cpu"
    if modes is None:
        modes = list(preset.get("modes") or default_modes(on_accelerator))
    unknown = [m for m in modes if m not in ALL_SUITE_MODES and m not in ALL_ANCHORS]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {sorted({**ALL_SUITE_MODES, **ALL_ANCHORS})}")
    bounds = [b for m in modes if m in ALL_BUDGET_MODES for b in budget_bounds(m)]
    if bounds:  # placed between full's peak and off's (or their chunked rows'): those run first
        modes = list(dict.fromkeys([m for m in bounds if m not in modes] + modes))
        modes = sorted(modes, key=lambda m: m in ALL_BUDGET_MODES)
    status: Dict[str, str] = {m: availability(m, on_accelerator) for m in modes}
    if any(m in ALL_COMPILED for m in modes):
        try:
            warm_up_compiler(torch.device("cuda" if on_accelerator else "cpu"))
        except Exception as err:  # noqa: BLE001 - no compiler here (no C++ toolchain): those rows say so
            cause = getattr(err, "inner_exception", None) or err  # dynamo's BackendCompilerFailed wraps the cause
            lines = str(cause).splitlines() or [""]
            why = f"failed: torch.compile cannot compile here: {type(cause).__name__}: {lines[0][:160]}"
            status.update({m: why for m in modes if m in ALL_COMPILED})
    config = model_config(preset, model)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    base = build_model(config, torch_dtype, seed)
    generator = torch.Generator().manual_seed(seed)
    batch_ids = torch.randint(0, config.vocab_size, (batch_size, seq), generator=generator)

    # one statistic throughout: each repetition's median step, and the median of those (printed and tabled alike)
    times: Dict[str, List[float]] = {m: [] for m in modes}
    peaks: Dict[str, Optional[int]] = {m: None for m in modes}
    device_peaks: Dict[str, Optional[int]] = {m: None for m in modes}
    diffs = GradientDiffs(lambda m: None if m in FLOOR_MODES else "lora_full" if m in LAYER_OFFLOAD_MODES else "off")
    plans: Dict[str, Optional[Dict[str, Any]]] = {m: None for m in modes}
    moved: Dict[str, Optional[int]] = {m: None for m in modes}
    bandwidth = copy_bandwidth(torch.device("cuda")) if on_accelerator else None
    compile_times: Dict[str, List[float]] = {m: [] for m in modes}
    for mode in modes:
        if status[mode] != "ok":
            print(f"{mode}: {status[mode]}", file=sys.stderr, flush=True)

    def current_rows() -> List[Row]:
        return _rows(modes, status, times, peaks, device_peaks, diffs, plans, compile_times, moved, bandwidth)

    for rep in range(reps):
        # Alternate the order so that drift (thermal, other load) does not favour the modes that run first; the
        # references run first in the first repetition, so that each mode's gradients are compared as it ends.
        order = modes if rep % 2 == 0 else list(reversed(modes))
        if rep == 0:
            order = sorted(order, key=lambda m: m not in REFERENCES)
        for mode in order:
            if status[mode] != "ok":
                continue
            budget = None
            if mode in ALL_BUDGET_MODES:
                low, high = budget_bounds(mode)
                off, full = peaks.get(low), peaks.get(high)
                if off is None or full is None:
                    status[mode] = f"failed: {low} and {high} have no measured peak to place the budget between"
                    continue
                budget = int(full + ALL_BUDGET_MODES[mode] * (off - full))
            failure = None
            try:
                metrics, mode_grads, plan, mode_moved = _run_mode(
                    mode, base, batch_ids, steps, rep == 0, rep == 0, accelerator, budget=budget
                )
            except Exception as err:  # a mode that cannot run here is reported, not fatal
                failure = f"failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
            release_mode(on_accelerator)  # after the except clause, whose traceback held the failed mode's frames
            if failure is not None:
                status[mode] = failure
                print(f"rep {rep} {mode:26s} {failure}", file=sys.stderr, flush=True)
                if on_progress is not None:
                    on_progress(current_rows())
                continue
            times[mode].append(statistics.median(metrics.step_times))
            if mode in ALL_COMPILED:  # what the warm-up steps took beyond a step's time: compiling
                compile_times[mode].append(sum(max(0.0, t - times[mode][-1]) for t in metrics.warmup_times))
            if rep == 0:
                peaks[mode] = metrics.peak.activation_bytes if metrics.peak else None
                if metrics.peak is not None and metrics.peak.source == "cuda_allocator":
                    device_peaks[mode] = metrics.peak.peak_bytes
                plans[mode], moved[mode] = plan, mode_moved
                diffs.add(mode, mode_grads)  # compared now; only the references' gradients are kept
                del mode_grads
            print(f"rep {rep} {mode:26s} step {times[mode][-1]:.3f} s", file=sys.stderr, flush=True)
            if on_progress is not None:
                on_progress(current_rows())
    return current_rows()


def _rows(
    modes: List[str],
    status: Dict[str, str],
    times: Dict[str, List[float]],
    peaks: Dict[str, Optional[int]],
    device_peaks: Dict[str, Optional[int]],
    diffs: GradientDiffs,
    plans: Dict[str, Optional[Dict[str, Any]]],
    compile_times: Dict[str, List[float]],
    moved: Dict[str, Optional[int]],
    bandwidth: Optional[Any],
) -> List[Row]:
    """The rows as measured so far."""
    rows = []
    for mode in modes:
        rows.append(
            Row(
                mode=mode,
                kind="anchor" if mode in ALL_ANCHORS else "floor" if mode in FLOOR_MODES else "suite",
                peak_activation_bytes=peaks[mode],
                step_time_s=statistics.median(times[mode]) if times[mode] else None,
                step_time_spread=_spread(times[mode]),
                max_grad_diff=diffs.diff(mode) if mode not in FLOOR_MODES else None,
                max_grad_ref_abs=diffs.scale(mode) if mode not in FLOOR_MODES else None,
                status=status[mode],
                peak_device_bytes=device_peaks[mode],
                budget_bytes=plans[mode]["budget_bytes"] if plans[mode] else None,
                budget_choices=plans[mode]["choices"] if plans[mode] else None,
                compile_time_s=statistics.median(compile_times[mode]) if compile_times[mode] else None,
                moved_bytes=moved[mode],
                copy_floor_s=copy_floor_s(moved[mode], bandwidth),
            )
        )
    return rows


def _spread(medians: List[float]) -> Optional[float]:
    return (max(medians) - min(medians)) / statistics.median(medians) if len(medians) > 1 else None
