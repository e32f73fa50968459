"""Benchmark every mode side by side with what a user would use instead.

    python -m lightning_ac.bench --out bench_out            # cpu-small on CPU
    python -m lightning_ac.bench --preset gpu-8k --out bench_out

Each mode trains the same model from the same weights on the same batch, in one process, with repetitions
alternating between modes so that machine drift hits all modes alike. Suite modes go through our callbacks
in a real Trainer; anchors apply transformers' or torch's checkpointing directly, without our code, in the
same Trainer harness. Memory and step time come from :mod:`lightning_ac.bench.memory`, the code the main job uses.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib
import importlib.util
import json
import logging
import math
import statistics
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_ac._logging import log
from lightning_ac.bench.memory import StepMetrics
from lightning_ac.callbacks import ActivationCheckpointing, LayerOffload, callbacks_from_config

__all__ = [
    "BUDGET_MODES",
    "LAYER_OFFLOAD_MODES",
    "MODES",
    "PRESETS",
    "Row",
    "fastest_fixed_mode",
    "main",
    "plot",
    "results_markdown",
    "run_benchmark",
]

PRESETS: Dict[str, Dict[str, Any]] = {
    # A Llama-style model where attention is a large share of each layer: hidden 256, 8 layers, 2k tokens.
    "cpu-small": dict(
        model=dict(
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=256,
            max_position_embeddings=8192,
        ),
        seq=2048,
        batch=1,
        dtype="float32",
        reps=3,
        steps=3,
    ),
    # ~1B-parameter Llama-style model in bf16 at 8k tokens, for one accelerator.
    "gpu-8k": dict(
        model=dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=8192,
        ),
        seq=8192,
        batch=1,
        dtype="bfloat16",
        reps=2,
        steps=4,
    ),
}

SUITE_MODES: Dict[str, Any] = {
    "off": False,
    "full": True,
    "every_2": {"kwargs": {"every_n_layers": 2}},
    "selective_attn": {"selective": {"save": ["attention"]}},
    "selective_attn_mm": {"selective": {"save": ["attention", "aten::mm"]}},
}
ACCELERATOR_SUITE_MODES: Dict[str, Any] = {
    "offload_hidden": {"offload": {"hidden_states": "cpu"}},
    "offload_hidden_selective": {
        "selective": {"save": ["attention"]},
        "offload": {"hidden_states": "cpu", "selective": "cpu"},
    },
    "offload_all": {"offload": {"all": "cpu"}},
    "offload_only": {"enabled": False, "offload": {"all": "cpu"}},
}


def _hf_native_full(model: nn.Module) -> None:
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def _torch_checkpoint_wrapper(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from transformers.modeling_layers import GradientCheckpointingLayer

    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, GradientCheckpointingLayer),
    )


def _hf_native_offload(model: nn.Module) -> None:
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, offload=True)


def _decoder_layer_lists(model: nn.Module) -> List[nn.ModuleList]:
    """The lists that hold the decoder layers (bare, or in torch's checkpoint wrapper)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    def layer(module: nn.Module) -> nn.Module:
        return getattr(module, "_checkpoint_wrapped_module", module)

    return [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and any(isinstance(layer(c), GradientCheckpointingLayer) for c in m)
    ]


# The compiled modes' backend (the tests run the harness with aot_eager, which compiles in a fraction of the time).
COMPILE_BACKEND = "inductor"


def _compile_layers(model: nn.Module) -> None:
    """Compile each decoder layer by itself (torchtitan's per-block compile), in place in its list."""
    lists = _decoder_layer_lists(model)
    if not lists:
        raise RuntimeError(f"no list of decoder layers found in {type(model).__name__} to compile")
    for layers in lists:
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, backend=COMPILE_BACKEND)


def _cold_compiles() -> Any:
    """Compile from scratch, as a first run does: dynamo's graphs dropped, and inductor's caches (its kernels, its
    graphs and AOT autograd's, on disk and in memory) in a fresh directory. With them kept, a later mode or
    repetition would find the kernels an earlier one built and report almost no compile time."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    return fresh_cache()


def _warm_up_compiler(device: torch.device) -> None:
    """Compile a small forward and backward once on ``device``, so that the first compiled mode does not pay what a
    process pays only once (inductor's imports, its pool of compile workers: some 20 s on CPU; Triton's start-up on
    CUDA) as its own compile time."""
    layer = nn.Linear(8, 8, device=device)
    with _cold_compiles():
        torch.compile(layer, backend=COMPILE_BACKEND)(torch.randn(4, 8, device=device)).relu().sum().backward()
    torch._dynamo.reset()


def _torchtitan_compiled(model: nn.Module) -> None:
    """torchtitan's order (``apply_ac``, then ``apply_compile``): torch's checkpoint wrapper around each block, then
    each wrapped block compiled, with no code of ours."""
    _torch_checkpoint_wrapper(model)
    _compile_layers(model)


_TRL_OFFLOADING = "trl.models.activation_offloading"


def _trl_offloader(full: bool) -> Callable[[nn.Module], None]:
    """An anchor running TRL's activation offloader the way TRL's trainer does: a ``saved_tensors_hooks`` context
    built for the model once it is on its device (it records the parameters' storages, so that their views stay
    put) and entered around each training step, forward and backward. ``full`` adds transformers'
    checkpointing underneath, the counterpart of ``offload_all``; without it the anchor mirrors ``offload_only``."""

    def apply(model: nn.Module) -> None:
        if full:
            _hf_native_full(model)
        model._bench_step_context = lambda m: importlib.import_module(_TRL_OFFLOADING).get_act_offloading_ctx_manager(m)

    apply.requires = _TRL_OFFLOADING  # type: ignore[attr-defined]
    return apply


ANCHORS: Dict[str, Callable[[nn.Module], None]] = {
    "hf_native_full": _hf_native_full,
    "torch_checkpoint_wrapper": _torch_checkpoint_wrapper,
}
# Anchors that only mean something on an accelerator. TRL's offloader runs when trl is installed; it is CUDA-only
# upstream (it creates device streams at construction).
ACCELERATOR_ANCHORS: Dict[str, Callable[[nn.Module], None]] = {
    "hf_native_offload": _hf_native_offload,
    "trl_offload_only": _trl_offloader(full=False),
    "trl_offload_full": _trl_offloader(full=True),
}
# The suite's block on decoder layers compiled one by one with inductor before fit (torchtitan's per-block compile;
# the callbacks apply in setup, so the recompute and the save rules run inside each layer's graph), and torchtitan's
# own order as their anchor. Each repetition compiles afresh (a new copy of the model, compile caches off): the
# warm-up steps' excess over the median step is the compile time, reported apart. CPU has no allocator statistics
# and torch's MemTracker, a dispatch mode, cannot see inside compiled graphs, so their memory is measured on CUDA only.
COMPILED_MODES: Dict[str, Any] = {
    "full_compiled": SUITE_MODES["full"],
    "selective_attn_compiled": SUITE_MODES["selective_attn"],
    "selective_attn_mm_compiled": SUITE_MODES["selective_attn_mm"],
}
COMPILED_ANCHORS: Dict[str, Callable[[nn.Module], None]] = {"torchtitan_compiled": _torchtitan_compiled}
# Layer offloading moves frozen weights, so these modes train LoRA adapters (r=8 on every decoder linear) on the
# frozen base, with full checkpointing, and compare with the same LoRA run without LayerOffload (``lora_full``): the
# whole device peak, not the activation peak. The value is LayerOffload's resident_layers ("L/4": a quarter of the
# decoder layers). On the accelerator by default; asked for on CPU, they run the copies on the host.
LAYER_OFFLOAD_MODES: Dict[str, Optional[str]] = {
    "lora_full": None,
    "layer_offload": "0",
    "layer_offload_resident": "L/4",
}
# The memory budget at a fraction of the way from full's measured activation peak to off's (so these rows run after
# off and full, which they need), with selective_attn's save rules for the layers where they measure faster than a
# whole recompute. The budget settles in its first steps (one measuring step, then checks), so these rows run
# BUDGET_SETTLE_STEPS more warm-up steps before the measured and timed ones.
BUDGET_MODES: Dict[str, float] = {"budget_25": 0.25, "budget_50": 0.5, "budget_75": 0.75}
BUDGET_BLOCK: Dict[str, Any] = {"selective": {"save": ["attention"]}}
BUDGET_SETTLE_STEPS = 3
MODES = {**SUITE_MODES, **BUDGET_MODES, **COMPILED_MODES, **ANCHORS, **COMPILED_ANCHORS}
# Every mode this harness knows, whether or not it runs on this machine.
ALL_SUITE_MODES = {**SUITE_MODES, **BUDGET_MODES, **COMPILED_MODES, **ACCELERATOR_SUITE_MODES, **LAYER_OFFLOAD_MODES}
ALL_ANCHORS = {**ANCHORS, **COMPILED_ANCHORS, **ACCELERATOR_ANCHORS}
ALL_COMPILED = {**COMPILED_MODES, **COMPILED_ANCHORS}


@dataclass
class Row:
    """One mode's result."""

    mode: str
    kind: str  # "suite" or "anchor"
    peak_activation_bytes: Optional[int]
    step_time_s: Optional[float]
    max_grad_diff: Optional[float]  # against off; for the layer-offloading modes, against lora_full
    status: str = "ok"
    peak_device_bytes: Optional[int] = None  # the device allocator's peak (CUDA); the layer-offloading modes' figure
    # (slowest - fastest) / median of the repetitions' median steps; None with one repetition
    step_time_spread: Optional[float] = None
    budget_bytes: Optional[int] = None  # the budget modes: their budget, and what each decoder layer settled on
    budget_choices: Optional[List[str]] = None
    compile_time_s: Optional[float] = None  # the compiled modes: the warm-up steps' excess over the median step


def _unwrapped_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


class _BenchModule(pl.LightningModule):
    def __init__(self, model: nn.Module, capture_grads: bool, capture_step: int = 0) -> None:
        super().__init__()
        self.model = model
        self.capture_grads = capture_grads
        self.capture_step = capture_step  # the same step in every mode: they train bit-identically until then
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
        return self.model(input_ids=batch, labels=batch, use_cache=False).loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.capture_grads and self.grads is None and self.trainer.global_step == self.capture_step:
            # torch's checkpoint_wrapper and torch.compile re-parent layers; strip their prefixes so names match
            self.grads = {
                _unwrapped_name(n): p.grad.detach().float().cpu().clone()
                for n, p in self.named_parameters()
                if p.grad is not None
            }

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


def _model_config(preset: Dict[str, Any], model: Optional[str]) -> Any:
    """The preset's Llama-style config, another transformers model type with the preset's sizes (``qwen3``),
    or a JSON config file (with a ``model_type``)."""
    from transformers import AutoConfig

    if model is None:
        return AutoConfig.for_model("llama", **preset["model"])
    path = Path(model)
    if path.suffix == ".json" or path.exists():
        data = json.loads(path.read_text())
        return AutoConfig.for_model(data.pop("model_type", "llama"), **data)
    return AutoConfig.for_model(model, **preset["model"])


def _build_model(config: Any, dtype: torch.dtype, seed: int) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype)


def _availability(mode: str, on_accelerator: bool) -> str:
    """``"ok"``, or why this mode cannot run here (reported in its row instead of failing the run)."""
    anchor = ALL_ANCHORS.get(mode)
    if mode in ACCELERATOR_ANCHORS and not on_accelerator:
        return "unavailable: needs a CUDA device"
    module = getattr(anchor, "requires", None)
    if module is not None:
        package = module.split(".")[0]
        if importlib.util.find_spec(package) is None:
            return f"unavailable: {package} is not installed"
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - installed but broken (a missing dependency): say so in the row
            return f"unavailable: cannot import {module}: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return "ok"


def _run_mode(
    mode: str,
    base: nn.Module,
    batch: torch.Tensor,
    steps: int,
    measure: bool,
    capture: bool,
    accelerator: str,
    budget: Optional[int] = None,
):
    model = copy.deepcopy(base)
    callbacks: List[pl.Callback] = []
    settle = 0
    if mode in COMPILED_MODES:
        _compile_layers(model)
    if mode in ALL_ANCHORS:
        ALL_ANCHORS[mode](model)
    elif mode in LAYER_OFFLOAD_MODES:
        model, callbacks = _layer_offload_mode(model, LAYER_OFFLOAD_MODES[mode], on_host=accelerator == "cpu")
    elif mode in BUDGET_MODES:
        callbacks, settle = callbacks_from_config({**BUDGET_BLOCK, "budget": budget}), BUDGET_SETTLE_STEPS
    else:
        callbacks = callbacks_from_config(ALL_SUITE_MODES[mode])
    if mode in ALL_COMPILED and accelerator == "cpu":
        measure = False  # MemTracker cannot see inside compiled graphs (see COMPILED_MODES)
    metrics = StepMetrics(measure_step=1 + settle if measure else -1, warmup_steps=2 + settle)
    module = _BenchModule(model, capture, capture_step=1 + steps)  # every mode's last step but the budget's
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
        with _cold_compiles() if mode in ALL_COMPILED else contextlib.nullcontext():
            trainer.fit(module, loader)
    finally:
        module.leave_step_context()
    plan = callbacks[0].budget_plan if mode in BUDGET_MODES else None
    return metrics, module.grads, plan


def _layer_offload_mode(
    model: nn.Module, resident: Optional[str], on_host: bool
) -> Tuple[nn.Module, List[pl.Callback]]:
    """A LoRA model on the frozen base, with full checkpointing, and LayerOffload unless ``resident`` is None."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)  # the same adapters in every mode
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets))
    callbacks: List[pl.Callback] = [ActivationCheckpointing()]
    if resident is not None:
        layers = model.config.num_hidden_layers
        k = max(1, layers // 4) if resident == "L/4" else int(resident)
        callbacks.append(LayerOffload(resident_layers=k, copy_on_host=on_host))
    return model, callbacks


def default_modes(on_accelerator: bool, compiled: bool = True) -> List[str]:
    """Every mode that runs here, in table order; without the compiled ones unless ``compiled``."""
    modes = list(SUITE_MODES) + list(BUDGET_MODES) + (list(ACCELERATOR_SUITE_MODES) if on_accelerator else [])
    modes += (list(COMPILED_MODES) if compiled else []) + list(ANCHORS) + (list(COMPILED_ANCHORS) if compiled else [])
    modes += list(ACCELERATOR_ANCHORS) if on_accelerator else []
    return modes + (list(LAYER_OFFLOAD_MODES) if on_accelerator else [])


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
) -> List[Row]:
    """Run the benchmark and return one :class:`Row` per mode."""
    preset = copy.deepcopy(PRESETS[preset_name])
    seq, batch_size = seq or preset["seq"], batch or preset["batch"]
    reps, steps = reps or preset["reps"], steps or preset["steps"]
    torch_dtype = getattr(torch, dtype or preset["dtype"])
    on_accelerator = torch.cuda.is_available()
    accelerator = "gpu" if on_accelerator else "cpu"
    if modes is None:
        modes = default_modes(on_accelerator)
    unknown = [m for m in modes if m not in ALL_SUITE_MODES and m not in ALL_ANCHORS]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {sorted({**ALL_SUITE_MODES, **ALL_ANCHORS})}")
    if any(m in BUDGET_MODES for m in modes):  # placed between full's peak and off's: those run first
        modes = [m for m in ("off", "full") if m not in modes] + modes
        modes = sorted(modes, key=lambda m: m in BUDGET_MODES)
    status: Dict[str, str] = {m: _availability(m, on_accelerator) for m in modes}
    if any(m in ALL_COMPILED for m in modes):
        try:
            _warm_up_compiler(torch.device("cuda" if on_accelerator else "cpu"))
        except Exception as err:  # noqa: BLE001 - no compiler here (no C++ toolchain): those rows say so
            cause = getattr(err, "inner_exception", None) or err  # dynamo's BackendCompilerFailed wraps the cause
            lines = str(cause).splitlines() or [""]
            why = f"failed: torch.compile cannot compile here: {type(cause).__name__}: {lines[0][:160]}"
            status.update({m: why for m in modes if m in ALL_COMPILED})
    config = _model_config(preset, model)
    base = _build_model(config, torch_dtype, seed)
    generator = torch.Generator().manual_seed(seed)
    batch_ids = torch.randint(0, config.vocab_size, (batch_size, seq), generator=generator)

    # one statistic throughout: each repetition's median step, and the median of those (printed and tabled alike)
    times: Dict[str, List[float]] = {m: [] for m in modes}
    peaks: Dict[str, Optional[int]] = {m: None for m in modes}
    device_peaks: Dict[str, Optional[int]] = {m: None for m in modes}
    grads: Dict[str, Optional[Dict[str, torch.Tensor]]] = {m: None for m in modes}
    plans: Dict[str, Optional[Dict[str, Any]]] = {m: None for m in modes}
    compile_times: Dict[str, List[float]] = {m: [] for m in modes}
    for mode in modes:
        if status[mode] != "ok":
            print(f"{mode}: {status[mode]}", file=sys.stderr, flush=True)
    for rep in range(reps):
        # Alternate the order so that drift (thermal, other load) does not favour the modes that run first.
        order = modes if rep % 2 == 0 else list(reversed(modes))
        for mode in order:
            if status[mode] != "ok":
                continue
            budget = None
            if mode in BUDGET_MODES:
                off, full = peaks.get("off"), peaks.get("full")
                if off is None or full is None:
                    status[mode] = "failed: off and full have no measured peak to place the budget between"
                    continue
                budget = int(full + BUDGET_MODES[mode] * (off - full))
            try:
                metrics, mode_grads, plan = _run_mode(
                    mode, base, batch_ids, steps, rep == 0, rep == 0, accelerator, budget=budget
                )
            except Exception as err:  # a mode that cannot run here is reported, not fatal
                status[mode] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
                continue
            times[mode].append(statistics.median(metrics.step_times))
            if mode in ALL_COMPILED:  # what the warm-up steps took beyond a step's time: compiling
                compile_times[mode].append(sum(max(0.0, t - times[mode][-1]) for t in metrics.warmup_times))
            if rep == 0:
                peaks[mode] = metrics.peak.activation_bytes if metrics.peak else None
                if metrics.peak is not None and metrics.peak.source == "cuda_allocator":
                    device_peaks[mode] = metrics.peak.peak_bytes
                grads[mode], plans[mode] = mode_grads, plan
            print(f"rep {rep} {mode:26s} step {times[mode][-1]:.3f} s", file=sys.stderr, flush=True)

    rows = []
    for mode in modes:
        diff = None
        reference = grads.get("lora_full" if mode in LAYER_OFFLOAD_MODES else "off")
        if reference is not None and grads[mode] is not None:
            diff = max(float((grads[mode][n] - g).abs().max()) for n, g in reference.items())
        rows.append(
            Row(
                mode=mode,
                kind="anchor" if mode in ALL_ANCHORS else "suite",
                peak_activation_bytes=peaks[mode],
                step_time_s=statistics.median(times[mode]) if times[mode] else None,
                step_time_spread=_spread(times[mode]),
                max_grad_diff=diff,
                status=status[mode],
                peak_device_bytes=device_peaks[mode],
                budget_bytes=plans[mode]["budget_bytes"] if plans[mode] else None,
                budget_choices=plans[mode]["choices"] if plans[mode] else None,
                compile_time_s=statistics.median(compile_times[mode]) if compile_times[mode] else None,
            )
        )
    return rows


def _spread(medians: List[float]) -> Optional[float]:
    if len(medians) < 2:
        return None
    return (max(medians) - min(medians)) / statistics.median(medians)


def _ratio(value: Optional[float], base: Optional[float]) -> str:
    return f"{value / base:.2f}x" if value is not None and base else "—"


def _time_ratio(row: Row, base: Optional[Row]) -> str:
    """A step-time ratio, marked ``~`` when the repetitions of either row spread by more than the difference
    the ratio reports (noise decided it), and ``¹`` when either row ran one repetition (no spread to tell)."""
    text = _ratio(row.step_time_s, base and base.step_time_s)
    if base is None or row is base or row.step_time_s is None or not base.step_time_s:
        return text
    if row.step_time_spread is None or base.step_time_spread is None:  # one repetition: no spread was measured
        return f"{text}{ONE_REPETITION}"
    difference = abs(row.step_time_s / base.step_time_s - 1)
    spread = max(row.step_time_spread or 0.0, base.step_time_spread or 0.0)
    return f"{text}~" if spread > difference else text


NOISE_NOTE = (
    "~: within noise: the repetitions' median steps of this mode or of the mode it is compared with spread by more "
    "than the difference the ratio shows (rerun on a quieter machine, or with more --reps)."
)
ONE_REPETITION = "¹"
ONE_REPETITION_NOTE = (
    f"{ONE_REPETITION}: one repetition: this mode or the mode it is compared with ran once, so no spread tells whether "
    "noise decided the ratio (rerun with --reps 2 or more)."
)


def results_markdown(rows: List[Row]) -> str:
    """A table with ratios to ``off`` and to ``hf_native_full``."""
    by = {r.mode: r for r in rows}
    off, hf = by.get("off"), by.get("hf_native_full")
    offloaded = [r for r in rows if r.mode in LAYER_OFFLOAD_MODES]
    compiled = [r for r in rows if r.mode in ALL_COMPILED]
    rows = [r for r in rows if r.mode not in LAYER_OFFLOAD_MODES and r.mode not in ALL_COMPILED]
    lines = [
        "| mode | kind | activation peak (MiB) | vs off | vs hf_native_full "
        "| step (s) | vs off | vs hf_native_full | max grad diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if not rows:  # only layer-offloading or compiled modes ran: their own tables, no empty one above them
        lines = []
    for r in rows:
        mib = f"{r.peak_activation_bytes / 2**20:.1f}" if r.peak_activation_bytes is not None else "—"
        step, diff = _step_and_diff(r)
        lines.append(
            f"| `{r.mode}` | {r.kind} | {mib} | {_ratio(r.peak_activation_bytes, off and off.peak_activation_bytes)} | "
            f"{_ratio(r.peak_activation_bytes, hf and hf.peak_activation_bytes)} | {step} | "
            f"{_time_ratio(r, off)} | {_time_ratio(r, hf)} | {diff} |"
        )
    budgets = [r for r in rows if r.mode in BUDGET_MODES]
    text = ("\n".join(lines) + "\n" if lines else "") + (_budget_markdown(budgets, rows) if budgets else "")
    text += _compiled_markdown(compiled, by.get("full")) if compiled else ""
    text += _layer_offload_markdown(offloaded) if offloaded else ""
    text = text.removeprefix("\n")  # a table that follows none starts the text
    notes = [note for mark, note in (("~", NOISE_NOTE), (ONE_REPETITION, ONE_REPETITION_NOTE)) if f"x{mark} |" in text]
    return text + "".join(f"\n{note}\n" for note in notes)


def fastest_fixed_mode(rows: Sequence[Row], budget_bytes: int) -> Optional[Row]:
    """The fastest suite mode of one fixed choice (not a budget) whose measured activation peak fits the budget."""
    fitting = [
        r
        for r in rows
        if r.kind == "suite"
        and r.mode not in BUDGET_MODES
        and r.mode not in LAYER_OFFLOAD_MODES
        and r.status == "ok"
        and r.peak_activation_bytes is not None
        and r.step_time_s is not None
        and r.peak_activation_bytes <= budget_bytes
    ]
    return min(fitting, key=lambda r: r.step_time_s or float("inf"), default=None)


def _budget_markdown(budgets: List[Row], rows: List[Row]) -> str:
    """The budget rows' three claims: under the budget, no slower than the fastest fixed mode that fits it, exact."""
    lines = [
        "",
        "Memory budget (placed 1/4, 1/2 and 3/4 of the way from full's activation peak to off's, with "
        "`selective: {save: [attention]}`; each layer's choice: k keep, s selective, r recompute):",
        "",
        "| mode | budget (MiB) | peak (MiB) | under budget | layers | fastest fixed mode that fits | step vs it "
        "| max grad diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in budgets:
        budget = r.budget_bytes
        peak = r.peak_activation_bytes
        fixed = fastest_fixed_mode(rows, budget) if budget is not None else None
        under = "yes" if peak is not None and budget is not None and peak <= budget else "no"
        layers = "".join(c[0] for c in r.budget_choices) if r.budget_choices else "—"
        _, diff = _step_and_diff(r)
        lines.append(
            f"| `{r.mode}` | {_mib(budget)} | {_mib(peak)} | {under} | {layers} | "
            f"{'`' + fixed.mode + '`' if fixed else '—'} | {_time_ratio(r, fixed) if fixed else '—'} | {diff} |"
        )
    return "\n".join(lines) + "\n"


def _mib(value: Optional[int]) -> str:
    return f"{value / 2**20:.1f}" if value is not None else "—"


def _step_and_diff(row: Row) -> Tuple[str, str]:
    """A row's step-time cell (its status when it did not run) and max-grad-diff cell."""
    if row.status != "ok":
        step = row.status
    else:
        step = f"{row.step_time_s:.3f}" if row.step_time_s is not None else "—"
    return step, f"{row.max_grad_diff:.1e}" if row.max_grad_diff is not None else "—"


def _compiled_markdown(rows: List[Row], full: Optional[Row]) -> str:
    """The compiled modes against eager ``full``: step time, compile time apart, and (on CUDA) the peak."""
    lines = [
        "",
        "torch.compile (each decoder layer compiled by itself with inductor; the warm-up steps' excess over the "
        "median step is the compile time, caches off; max grad diff against eager `off`; activation peak on CUDA "
        "only, as MemTracker cannot see inside compiled graphs):",
        "",
        "| mode | kind | activation peak (MiB) | vs full | step (s) | vs full | compile (s) | max grad diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        step, diff = _step_and_diff(r)
        compile_time = f"{r.compile_time_s:.1f}" if r.compile_time_s is not None else "—"
        lines.append(
            f"| `{r.mode}` | {r.kind} | {_mib(r.peak_activation_bytes)} | "
            f"{_ratio(r.peak_activation_bytes, full and full.peak_activation_bytes)} | {step} | "
            f"{_time_ratio(r, full)} | {compile_time} | {diff} |"
        )
    return "\n".join(lines) + "\n"


def _layer_offload_markdown(rows: List[Row]) -> str:
    """The layer-offloading modes against ``lora_full``: whole device peak and step time."""
    base = next((r for r in rows if r.mode == "lora_full"), None)
    lines = [
        "",
        "Layer offloading (LoRA r=8 on the frozen base, full checkpointing; device peak from the CUDA allocator):",
        "",
        "| mode | resident layers | device peak (MiB) | vs lora_full | step (s) | vs lora_full | max grad diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = f"{r.peak_device_bytes / 2**20:.1f}" if r.peak_device_bytes is not None else "—"
        step, diff = _step_and_diff(r)
        resident = LAYER_OFFLOAD_MODES[r.mode] or "—"
        lines.append(
            f"| `{r.mode}` | {resident} | {peak} | {_ratio(r.peak_device_bytes, base and base.peak_device_bytes)} | "
            f"{step} | {_time_ratio(r, base)} | {diff} |"
        )
    return "\n".join(lines) + "\n"


Box = Tuple[float, float, float, float]  # x0, y0, x1, y1 in display pixels
Point = Tuple[float, float]


def _around(point: Point, half: float) -> Box:
    """The square of half side ``half`` centred on ``point``."""
    return point[0] - half, point[1] - half, point[0] + half, point[1] + half


def _overlaps(a: Box, b: Box) -> bool:
    """Whether two boxes share any area (touching edges do not count)."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _distance(point: Point, box: Box) -> float:
    """How far ``point`` lies from ``box`` (0 inside it)."""
    return math.hypot(max(box[0] - point[0], 0, point[0] - box[2]), max(box[1] - point[1], 0, point[1] - box[3]))


def _crosses(p: Point, q: Point, box: Box) -> bool:
    """Whether the segment from ``p`` to ``q`` passes through ``box`` (Liang-Barsky clipping)."""
    t0, t1 = 0.0, 1.0  # the part of the segment, as fractions of it, inside the box's slabs so far
    for start, delta, low, high in ((p[0], q[0] - p[0], box[0], box[2]), (p[1], q[1] - p[1], box[1], box[3])):
        if delta == 0:
            if not low < start < high:
                return False
            continue
        a, b = (low - start) / delta, (high - start) / delta
        t0, t1 = max(t0, min(a, b)), min(t1, max(a, b))
    return t0 < t1


def label_offsets(
    points: Sequence[Point],
    sizes: Sequence[Tuple[float, float]],
    area: Box,
    obstacles: Sequence[Box] = (),
    gap: float = 7.0,
    marker: float = 6.0,
    clear: float = 12.0,
    lead: float = 20.0,
    step: float = 4.0,
) -> List[Tuple[float, float, bool]]:
    """Places one label per point, greedily, so that no two labels overlap; all in display pixels.

    Each label in turn takes the first free spot of: next to its point on the right, next to it on the left, then
    rings of spots around the point at growing distances, from ``lead`` on so that its leader line shows. A spot is
    free when the label's box

    - lies inside ``area`` and covers no label placed before it, no obstacle and its own marker;
    - keeps ``clear`` away from the other points (room for their own labels and leader lines);
    - lies nearer its own point than any other (so that it reads as that point's label);

    and when neither its leader line (if it has moved) nor a leader line drawn before crosses another label or
    marker. The rings reach across the whole area, so a label finds a spot wherever there is room for it; where no
    spot meets the last two conditions, the first that meets the others is taken (the labels still never overlap).
    The order of the spots is fixed: the same input always gives the same placement.

    Args:
        points: Each label's point.
        sizes: Each label's ``(width, height)``, padding included.
        area: Where the labels must stay (the axes).
        obstacles: Boxes that no label or leader line may cover (the legend).
        gap: Distance from a point to the edge of a label next to it; more than ``marker``.
        marker: Half the side of the square taken as each point's marker.
        clear: Least distance from a label to the other points.
        lead: Least distance from a point to the edge of its label once the label has moved away from it.
        step: Distance between the rings of spots, and about the spacing of the spots along one.

    Returns:
        Per label, ``(dx, dy, moved)``: its centre's offset from its point, and whether it has moved away from
        its point (and needs a leader line). A label with no room anywhere stays on its point's right.
    """
    reach = max(area[2] - area[0], area[3] - area[1])  # no spot further out lies inside the area

    def spots(w: float, h: float) -> Iterator[Tuple[float, float, bool]]:
        """The candidate offsets of a ``w`` by ``h`` label's centre, in the order they are tried."""
        yield gap + w / 2, 0.0, False
        yield -gap - w / 2, 0.0, False
        for distance in range(int(lead), int(reach), max(1, int(step))):
            # centres on the rectangle that keeps the label's edges `distance` away from the point (sideways or
            # up and down), one per direction, starting on the right and going round anticlockwise
            half_w, half_h = w / 2 + distance, h / 2 + distance
            n = int(8 * (half_w + half_h) / step)  # twice the ring's length over `step`: no gaps along its sides
            for k in range(n):
                c, s = math.cos(2 * math.pi * k / n), math.sin(2 * math.pi * k / n)
                scale = min(half_w / abs(c) if c else math.inf, half_h / abs(s) if s else math.inf)
                yield c * scale, s * scale, True

    labels: List[Box] = []
    leaders: List[Tuple[Point, Point]] = []  # from a moved label's centre to its point
    placed = []
    for i, ((x, y), (w, h)) in enumerate(zip(points, sizes)):
        others = list(points[:i]) + list(points[i + 1 :])
        keep_off = [*labels, *obstacles, _around((x, y), marker), *(_around(p, clear) for p in others)]
        # a leader line ends on its point, so inside any marker drawn over that point: those do not count
        markers = [b for b in (_around(p, marker) for p in others) if not _overlaps(b, _around((x, y), 0.5))]
        line_off = [*labels, *obstacles, *markers]
        first_with_room = None
        for spot in spots(w, h):
            dx, dy, moved = spot
            box = (x + dx - w / 2, y + dy - h / 2, x + dx + w / 2, y + dy + h / 2)
            inside = area[0] <= box[0] and box[2] <= area[2] and area[1] <= box[1] and box[3] <= area[3]
            if not inside or any(_overlaps(box, b) for b in keep_off):
                continue  # no room for the label here
            first_with_room = first_with_room or spot
            # and it reads as its point's label: nearest that point, no leader line across another label or marker
            nearest = all(_distance((x, y), box) <= _distance(p, box) for p in others)
            led = not moved or not any(_crosses((x + dx, y + dy), (x, y), b) for b in line_off)
            if nearest and led and not any(_crosses(p, q, box) for p, q in leaders):
                break
        else:  # no spot reads clearly: the first with room, else (no room anywhere) the first of all
            spot = first_with_room or (gap + w / 2, 0.0, False)
        dx, dy, moved = spot
        labels.append((x + dx - w / 2, y + dy - h / 2, x + dx + w / 2, y + dy + h / 2))
        if moved:
            leaders.append(((x + dx, y + dy), (x, y)))
        placed.append((dx, dy, moved))
    return placed


def _why_not_planned(modes: Sequence[str]) -> str:
    """Why the budget planner leaves ``modes`` out: the reasons that apply to them."""
    reasons = []
    if any(m in LAYER_OFFLOAD_MODES for m in modes):
        reasons.append("layer offloading saves weights, not activations")
    if any(m in BUDGET_MODES for m in modes):
        reasons.append("a budget row is the budget itself")
    if any(m in ALL_COMPILED for m in modes):
        reasons.append("a compiled row is its eager mode, compiled; its peak is measured on CUDA only")
    return "; ".join(reasons)


def plot(rows: List[Row], path: Path) -> None:
    """Activation memory against step time, one point per mode, anchors marked, each point labelled.

    The labels are placed after the figure is laid out, from the renderer's measure of each one, so that none
    overlaps another or a marker, however close the points lie; one moved away from its point gets a leader line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # another model (LoRA) and another figure (the whole device peak) for the layer-offloading modes: their table
    shown = [
        r
        for r in rows
        if r.mode not in LAYER_OFFLOAD_MODES and r.peak_activation_bytes is not None and r.step_time_s is not None
    ]
    points = [(r.step_time_s, r.peak_activation_bytes / 2**20) for r in shown]  # type: ignore[operator]
    fig, ax = plt.subplots(figsize=(7, 5))
    for r, (x, y) in zip(shown, points):
        anchor, budget = r.kind == "anchor", r.mode in BUDGET_MODES
        color = "tab:gray" if anchor else "tab:green" if budget else "tab:blue"
        ax.scatter(x, y, marker="s" if anchor else "D" if budget else "o", color=color, s=60, zorder=3)
    # the budget's frontier: full, the budget points by budget, off
    frontier = sorted(
        ((x, y) for r, (x, y) in zip(shown, points) if r.mode in BUDGET_MODES or r.mode in ("off", "full")),
        key=lambda p: p[1],
    )
    legend = None
    if any(r.mode in BUDGET_MODES for r in shown):
        ax.plot(*zip(*frontier), color="tab:green", alpha=0.5, linestyle="--", zorder=2, label="memory budget")
        legend = ax.legend(loc="upper right", fontsize=8)
    ax.margins(x=0.12, y=0.12)  # room for the labels of the outermost points
    ax.set_xlabel("median step time (s)")
    ax.set_ylabel("activation peak (MiB)")
    ax.set_title("lightning_ac modes (circles), budgets (diamonds) and anchors (squares)")
    ax.grid(alpha=0.3)
    # Lay the figure out and fix the limits first: the labels sit a fixed number of points from their markers, so a
    # later change of scale would move the markers under them.
    fig.tight_layout()
    ax.set_xlim(ax.get_xlim())
    ax.set_ylim(ax.get_ylim())
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    pixels = renderer.points_to_pixels(1.0)
    sizes = []
    for r in shown:  # each label's size as drawn, with a little room around it
        probe = ax.text(0, 0, r.mode, fontsize=8)
        extent = probe.get_window_extent(renderer)
        probe.remove()
        sizes.append((extent.width + 3 * pixels, extent.height + 2 * pixels))
    offsets = label_offsets(
        [tuple(p) for p in ax.transData.transform(points)] if points else [],
        sizes,
        tuple(ax.bbox.extents),
        [tuple(legend.get_window_extent(renderer).extents)] if legend is not None else [],
        gap=5 * pixels,
        marker=4.5 * pixels,
        clear=9 * pixels,
        lead=14 * pixels,
        step=3 * pixels,
    )
    for r, (x, y), (dx, dy, moved) in zip(shown, points, offsets):
        leader = dict(arrowstyle="-", color="0.35", linewidth=0.6, shrinkA=0, shrinkB=5) if moved else None
        ax.annotate(
            r.mode,
            (x, y),
            xytext=(dx / pixels, dy / pixels),  # in points, as the offsets scale with the saved figure's dpi
            textcoords="offset points",
            ha="center",
            va="center",
            fontsize=8,
            arrowprops=leader,
            zorder=4,
        )
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The budget planner measures at the sequence length and at half of it; below this, fixed costs swamp the
# per-token terms it extrapolates.
MIN_PLAN_SEQ = 32


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, preset: str) -> None:
    """Refuse values the benchmark cannot measure with (exit status 2, naming the flag), before any training."""
    for flag in ("seq", "batch", "reps", "steps", "plan_seq"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} {value}: expected an integer >= 1")
    if args.plan_seq is not None and args.budget_gib is None:
        parser.error(
            f"--plan-seq {args.plan_seq}: it is the sequence length the budget planner plans for, and there is no "
            "--budget-gib to plan with; add --budget-gib, or leave --plan-seq out"
        )
    compiled = [m for m in args.modes or [] if m in ALL_COMPILED]
    if args.no_compiled and compiled:
        parser.error(
            f"--no-compiled leaves out the compiled rows, and --modes asks for {' '.join(compiled)}: drop "
            "--no-compiled, or those modes"
        )
    unplanned = {**LAYER_OFFLOAD_MODES, **BUDGET_MODES, **ALL_COMPILED}
    if args.budget_gib is not None and args.modes and all(m in unplanned for m in args.modes):
        parser.error(
            f"--modes {' '.join(args.modes)} --budget-gib {args.budget_gib:g}: the planner compares the activation "
            "modes of one fixed choice (off, full, every_2, the selective and offload modes), and none of these is "
            f"one ({_why_not_planned(args.modes)}). Add such modes, or leave --budget-gib out"
        )
    if args.budget_gib is not None:
        if not args.budget_gib > 0:
            parser.error(f"--budget-gib {args.budget_gib}: expected a budget > 0 GiB")
        seq = args.seq or PRESETS[preset]["seq"]
        if seq < MIN_PLAN_SEQ:
            parser.error(
                f"--seq {seq}: the budget planner measures every mode at the sequence length and at half of it and "
                f"extrapolates per token, which needs --seq >= {MIN_PLAN_SEQ} (fixed costs swamp shorter ones)"
            )


def main(argv: Optional[List[str]] = None) -> List[Row]:
    parser = argparse.ArgumentParser(prog="python -m lightning_ac.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="default: cpu-small on CPU, gpu-8k on CUDA"
    )
    parser.add_argument(
        "--modes", nargs="+", default=None, help=f"default: all that run here ({', '.join(MODES)}, ...)"
    )
    parser.add_argument(
        "--model", default=None, help="a transformers model type with the preset's sizes (qwen3), or a JSON config"
    )
    parser.add_argument(
        "--no-compiled",
        action="store_true",
        help="leave out the torch.compile rows (they compile afresh in every repetition: seconds on cpu-small, "
        "minutes on a large model)",
    )
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the preset's)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    parser.add_argument(
        "--reps", type=int, default=None, help="alternating repetitions per mode (default: the preset's)"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps per repetition (default: the preset's)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench_out"),
        help="where results.json, results.md, memory_time.png go (default: bench_out)",
    )
    parser.add_argument(
        "--budget-gib", type=float, default=None, help="print the fastest mode whose activation peak fits this budget"
    )
    parser.add_argument(
        "--plan-seq", type=int, default=None, help="sequence length to plan for (default: the measured one)"
    )
    args = parser.parse_args(argv)
    preset = args.preset or ("gpu-8k" if torch.cuda.is_available() else "cpu-small")
    _check_arguments(parser, args, preset)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    log.setLevel(logging.WARNING)  # the suite's own logger: the table below is the output
    warnings.filterwarnings("ignore")
    modes = args.modes or (default_modes(torch.cuda.is_available(), compiled=False) if args.no_compiled else None)
    rows = run_benchmark(preset, modes, args.seq, args.batch, args.dtype, args.reps, args.steps, model=args.model)
    table = results_markdown(rows)
    print(table)
    print(f"results: {args.out / 'results.md'}, {args.out / 'results.json'}, {args.out / 'memory_time.png'}")
    advice = None
    if args.budget_gib is not None:
        from lightning_ac.bench.planner import explain, plan_mode, scaling_errors

        seq = args.seq or PRESETS[preset]["seq"]
        batch = args.batch or PRESETS[preset]["batch"]
        # the scaling check: measure every mode's peak at half the sequence too (activation modes: the layer
        # offloading modes train another model, LoRA, and save weights, not activations)
        planned_rows = [r for r in rows if r.mode not in {**LAYER_OFFLOAD_MODES, **BUDGET_MODES, **ALL_COMPILED}]
        unplanned = [r.mode for r in rows if r not in planned_rows]
        modes = [r.mode for r in planned_rows if r.status == "ok"]
        half = run_benchmark(preset, modes, seq // 2, batch, args.dtype, reps=1, steps=1, model=args.model)
        errors = scaling_errors(planned_rows, half, ratio=seq / (seq // 2))
        planned = (args.plan_seq or seq) * batch
        budget = int(args.budget_gib * 2**30)
        advice = explain(plan_mode(planned_rows, budget, seq * batch, planned, errors), budget, planned, seq * batch)
        if unplanned:
            advice += f"\nNot planned: {', '.join(unplanned)} ({_why_not_planned(unplanned)})."
        print(advice)
    if args.out:  # always set (default bench_out)
        args.out.mkdir(parents=True, exist_ok=True)
        if advice is not None:
            (args.out / "plan.txt").write_text(advice + "\n")
        (args.out / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        (args.out / "results.md").write_text(f"preset: {preset}\n\n{table}")
        plot(rows, args.out / "memory_time.png")
    return rows
