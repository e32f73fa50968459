"""The benchmark's modes: the suite's blocks, the memory budget's rows, the compiled and layer-offloading rows, and
the anchors (what a user would use instead, applied without our code); which of them run here, and why one cannot."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_ac._compat import CHECKPOINT_SIDE_EFFECTS_SETTING, DYNAMO_SKIPS_CHECKPOINT_SIDE_EFFECTS
from lightning_ac.callbacks import ActivationCheckpointing, LayerOffload
from lightning_ac.loss.function import shift_labels

__all__ = [
    "ALL_ANCHORS",
    "ALL_COMPILED",
    "ALL_BUDGET_MODES",
    "ALL_SUITE_MODES",
    "BUDGET_MODES",
    "CHUNKED_BUDGET_MODES",
    "CHUNKED_MODES",
    "FLOOR_MODES",
    "HEAD_ANCHORS",
    "LAYER_OFFLOAD_MODES",
    "MODES",
    "UNPLANNED",
    "availability",
    "budget_block",
    "budget_bounds",
    "default_modes",
    "layer_offload_mode",
    "training_loss",
    "why_not_planned",
]

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
    # with a real vocabulary the head is most of what full and offload_all still hold (gpu-8k: 0.23x and 0.19x off)
    "offload_all_chunked": {"offload": {"all": "cpu"}, "chunked_loss": True},
}


def _hf_native_full(model: nn.Module) -> None:
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def _torch_checkpoint_wrapper(model: nn.Module, context_fn: Optional[Callable[[], Any]] = None) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from transformers.modeling_layers import GradientCheckpointingLayer

    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if context_fn is not None:
        wrapper = functools.partial(wrapper, context_fn=context_fn)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, GradientCheckpointingLayer)
    )


def _torch_sac(model: nn.Module) -> None:
    """torch's own selective checkpointing saving what ``selective_attn`` saves (the attention kernels): torch's
    checkpoint wrapper with ``create_selective_checkpoint_contexts`` and a policy of its own, eager, no code of ours
    but the op names. ``selective_attn`` against it is our policy's cost; it against ``full``, torch's SAC's."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from lightning_ac.selective.ops import is_attention, op_name

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_SAVE if is_attention(op_name(func)) else CheckpointPolicy.PREFER_RECOMPUTE

    _torch_checkpoint_wrapper(model, functools.partial(create_selective_checkpoint_contexts, policy))


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


def compile_layers(model: nn.Module) -> None:
    """Compile each decoder layer by itself (torchtitan's per-block compile), in place in its list."""
    lists = _decoder_layer_lists(model)
    if not lists:
        raise RuntimeError(f"no list of decoder layers found in {type(model).__name__} to compile")
    for layers in lists:
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, backend=COMPILE_BACKEND)


@contextlib.contextmanager
def cold_compiles() -> Iterator[None]:
    """Compile from scratch, as a first run does: dynamo's graphs dropped, and inductor's caches (its kernels, its
    graphs and AOT autograd's, on disk and in memory) in a fresh directory. With them kept, a later mode or
    repetition would find the kernels an earlier one built and report almost no compile time.

    Dynamo traces side effects inside checkpoints meanwhile, as the suite has it do for its compiled rows
    (:func:`lightning_ac.plan.recompute.trace_side_effects_in_checkpoints`): without it, torchtitan's order ran each
    layer eagerly, uncompiled, on transformers >= 5.25 (the ``kernels`` wrapper around each attention's forward),
    and its row would compare an eager run with compiled ones."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    traced = (
        torch._dynamo.config.patch(CHECKPOINT_SIDE_EFFECTS_SETTING, True)
        if DYNAMO_SKIPS_CHECKPOINT_SIDE_EFFECTS
        else contextlib.nullcontext()
    )
    with fresh_cache(), traced:
        yield


def warm_up_compiler(device: torch.device) -> None:
    """Compile a small forward and backward once on ``device``, so that the first compiled mode does not pay what a
    process pays only once (inductor's imports, its pool of compile workers: some 20 s on CPU; Triton's start-up on
    CUDA) as its own compile time."""
    layer = nn.Linear(8, 8, device=device)
    with cold_compiles():
        torch.compile(layer, backend=COMPILE_BACKEND)(torch.randn(4, 8, device=device)).relu().sum().backward()
    torch._dynamo.reset()


def _torchtitan_compiled(model: nn.Module) -> None:
    """torchtitan's order (``apply_ac``, then ``apply_compile``): torch's checkpoint wrapper around each block, then
    each wrapped block compiled, with no code of ours."""
    _torch_checkpoint_wrapper(model)
    compile_layers(model)


_TRL_OFFLOADING = "trl.models.activation_offloading"


def _trl_offloader(full: bool) -> Callable[[nn.Module], None]:
    """An anchor running TRL's activation offloader the way TRL's trainer does: a ``saved_tensors_hooks`` context
    built for the model once it is on its device (it records the parameters' storages, so that their views stay
    put) and entered around each training step, forward and backward. ``full`` adds transformers'
    checkpointing underneath, the counterpart of ``offload_all``; without it the anchor mirrors ``offload_only``."""

    def apply(model: nn.Module) -> None:
        if full:
            _hf_native_full(model)
        model._bench_step_context = _trl_context

    apply.requires = _TRL_OFFLOADING  # type: ignore[attr-defined]
    return apply


def _trl_context(model: nn.Module) -> Any:
    """TRL's offloading context for ``model``, with the state TRL's trainer has: its ``Accelerator`` initialises
    accelerate's state, which TRL's logger needs (the H200 run's ``trl_offload_full`` failed on "You must initialize the
    accelerate state" when the offloader warned of host memory)."""
    from accelerate import PartialState

    PartialState()
    return importlib.import_module(_TRL_OFFLOADING).get_act_offloading_ctx_manager(model)


ANCHORS: Dict[str, Callable[[nn.Module], None]] = {
    "hf_native_full": _hf_native_full,
    "torch_checkpoint_wrapper": _torch_checkpoint_wrapper,
    "torch_sac": _torch_sac,
}
_TORCHTUNE_LOSS = "torchtune.modules.loss"
TORCHTUNE_CHUNKS = 8  # CEWithChunkedOutputLoss's default, and what torchtune's recipes use


def _torchtune_chunked(model: nn.Module) -> None:
    """transformers' own checkpointing, the loss from torchtune's ``CEWithChunkedOutputLoss`` (see
    :func:`_torchtune_chunked_loss`)."""
    _hf_native_full(model)


_torchtune_chunked.requires = _TORCHTUNE_LOSS  # type: ignore[attr-defined]


def _torchtune_chunked_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The loss as torchtune computes it: the head applied to each of ``TORCHTUNE_CHUNKS`` chunks of the final hidden
    states (its ``TransformerDecoder.chunked_output``), then ``CEWithChunkedOutputLoss``, which upcasts one chunk of
    logits to float32 at a time; the labels shifted as transformers' loss shifts them."""
    loss = importlib.import_module(_TORCHTUNE_LOSS).CEWithChunkedOutputLoss(num_output_chunks=TORCHTUNE_CHUNKS)
    hidden = model.get_decoder()(input_ids=batch, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    logits = [head(chunk) for chunk in hidden.chunk(TORCHTUNE_CHUNKS, dim=1)]
    return loss(logits, shift_labels(batch, loss.ignore_index))


def _no_head_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """A loss that leaves the output head nothing to hold: the last token's logits only, and their mean."""
    return model(input_ids=batch, logits_to_keep=1, use_cache=False).logits.float().mean()


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
# The output head (the presets with a real vocabulary): the block's chunked_loss (chunk_tokens: auto) beside off, full
# and selective_attn; the floor, full with none of the head's activations (the logits of the last token only, and a
# loss that saves nothing of them: their mean), which full_chunked is measured against; and torchtune's chunked loss
# over transformers' checkpointing, where a user of torchtune's recipes would turn. The floor trains another loss:
# its gradients are compared with nothing, and it is no mode to choose (neither planned nor a fixed mode that fits).
CHUNKED_LOSS: Dict[str, Any] = {"chunked_loss": True}
CHUNKED_MODES: Dict[str, Any] = {
    f"{name}_chunked": {**(block if isinstance(block, dict) else {"enabled": block}), **CHUNKED_LOSS}
    for name, block in SUITE_MODES.items()
    if name in ("off", "full", "selective_attn")
}
# auto's floor (128 tokens a chunk; the hidden states' size would be 16.4 tokens here) against the chunks it would
# take without the floor: smaller, slower matmuls for 3 MiB less
CHUNKED_MODES["full_chunked_32"] = {"enabled": True, "chunked_loss": {"chunk_tokens": 32}}
# with the tiled MLP (and norms) too: what the longest contexts train with, against full_chunked's step time
CHUNKED_MODES["full_chunked_tiled"] = {"enabled": True, "chunked_loss": True, "tiled_mlp": True}
FLOOR_MODES: Dict[str, Any] = {"full_no_head": SUITE_MODES["full"]}
HEAD_ANCHORS: Dict[str, Callable[[nn.Module], None]] = {"torchtune_chunked_ce": _torchtune_chunked}
# The training loss of the modes that do not take the model's own (``model(input_ids, labels=...).loss``)
TRAINING_LOSSES: Dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "full_no_head": _no_head_loss,
    "torchtune_chunked_ce": _torchtune_chunked_loss,
}
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
# The same with chunked_loss, placed between off_chunked's and full_chunked's peaks.
CHUNKED_BUDGET_MODES: Dict[str, float] = {f"{name}_chunked": fraction for name, fraction in BUDGET_MODES.items()}
# The one knob (issue 58): the budget rows' budgets, with every tool left to the budget (the chunked loss, the tiled MLP
# and each layer's input in host memory where the budget needs or gains by them). Weighing takes a second measuring
# step and a step for each tool: AUTO_SETTLE_STEPS warm-up steps.
AUTO_MODES: Dict[str, float] = {"auto_25": 0.25, "auto_50": 0.5, "auto_75": 0.75}
AUTO_BLOCK: Dict[str, Any] = {
    **BUDGET_BLOCK,
    "chunked_loss": "auto",
    "tiled_mlp": "auto",
    "offload": {"hidden_states": "auto"},
}
AUTO_SETTLE_STEPS = 7
ALL_BUDGET_MODES = {**BUDGET_MODES, **CHUNKED_BUDGET_MODES, **AUTO_MODES}
MODES = {**SUITE_MODES, **BUDGET_MODES, **AUTO_MODES, **COMPILED_MODES, **ANCHORS, **COMPILED_ANCHORS}
# Every mode this harness knows, whether or not it runs on this machine.
ALL_SUITE_MODES = {
    **SUITE_MODES,
    **CHUNKED_MODES,
    **FLOOR_MODES,
    **ALL_BUDGET_MODES,
    **COMPILED_MODES,
    **ACCELERATOR_SUITE_MODES,
    **LAYER_OFFLOAD_MODES,
}
ALL_ANCHORS = {**ANCHORS, **HEAD_ANCHORS, **COMPILED_ANCHORS, **ACCELERATOR_ANCHORS}
ALL_COMPILED = {**COMPILED_MODES, **COMPILED_ANCHORS}
# What the budget planner leaves out (see why_not_planned)
UNPLANNED = {**LAYER_OFFLOAD_MODES, **ALL_BUDGET_MODES, **ALL_COMPILED, **FLOOR_MODES}


def budget_bounds(mode: str) -> Tuple[str, str]:
    """The rows between whose activation peaks a budget row is placed: ``off`` and ``full``, or with chunked_loss
    ``off_chunked`` and ``full_chunked``."""
    return ("off_chunked", "full_chunked") if mode in CHUNKED_BUDGET_MODES else ("off", "full")


def budget_block(mode: str, budget: Optional[int]) -> Dict[str, Any]:
    """A budget row's block."""
    if mode in AUTO_MODES:
        return {**AUTO_BLOCK, "budget": budget}
    return {**BUDGET_BLOCK, "budget": budget, **(CHUNKED_LOSS if mode in CHUNKED_BUDGET_MODES else {})}


def settle_steps(mode: str) -> int:
    """The warm-up steps a budget row takes beyond the others' before it is measured and timed."""
    return AUTO_SETTLE_STEPS if mode in AUTO_MODES else BUDGET_SETTLE_STEPS


def training_loss(mode: str) -> Optional[Callable[[nn.Module, torch.Tensor], torch.Tensor]]:
    """The loss ``mode`` trains with, ``None`` for the model's own."""
    return TRAINING_LOSSES.get(mode)


def availability(mode: str, on_accelerator: bool) -> str:
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
            first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
            return f"unavailable: cannot import {module}: {type(err).__name__}: {first[:160]}"
    return "ok"


def layer_offload_mode(model: nn.Module, resident: Optional[str], on_host: bool) -> Tuple[nn.Module, List[pl.Callback]]:
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
    modes = list(SUITE_MODES) + list(BUDGET_MODES) + list(AUTO_MODES)
    modes += list(ACCELERATOR_SUITE_MODES) if on_accelerator else []
    # on the GPU, the output head's rows too (a preset there has a real vocabulary), and torch's own SAC beside ours
    modes += ["full_chunked"] if on_accelerator else []
    anchors = [a for a in ANCHORS if on_accelerator or a != "torch_sac"]  # on the CPU: python -m ...bench.sac_cost
    modes += (list(COMPILED_MODES) if compiled else []) + anchors + (list(COMPILED_ANCHORS) if compiled else [])
    modes += list(ACCELERATOR_ANCHORS) if on_accelerator else []
    return modes + (list(LAYER_OFFLOAD_MODES) if on_accelerator else [])


def why_not_planned(modes: Sequence[str]) -> str:
    """Why the budget planner leaves ``modes`` out: the reasons that apply to them."""
    reasons = []
    if any(m in LAYER_OFFLOAD_MODES for m in modes):
        reasons.append("layer offloading saves weights, not activations")
    if any(m in ALL_BUDGET_MODES for m in modes):
        reasons.append("a budget row is the budget itself")
    if any(m in ALL_COMPILED for m in modes):
        reasons.append("a compiled row is its eager mode, compiled; its peak is measured on CUDA only")
    if any(m in FLOOR_MODES for m in modes):
        reasons.append("the floor trains no loss of the model's own: a measure, not a mode")
    return "; ".join(reasons)
