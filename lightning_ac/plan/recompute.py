"""Installing recompute: the engine the block names around the decoder layers, with the checkpoint function and the
policy the other parts of the plan ask for (offloading's hooks, the selective policy, the memory budget's per-layer
switches), and the rules that keep compiled layers compiled. What was installed comes back as one small record."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch._dynamo.config
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ac._compat import CHECKPOINT_SIDE_EFFECTS_SETTING, DYNAMO_SKIPS_CHECKPOINT_SIDE_EFFECTS
from lightning_ac.budget import BudgetController, BudgetSettings, Choice
from lightning_ac.budget.first_plan import check_first_plan
from lightning_ac.budget.host import offload_pricing
from lightning_ac.checkpoint import CheckpointSettings, enable_hf_checkpointing, wrap_layers
from lightning_ac.checkpoint.packed import notice_for
from lightning_ac.config import AUTO, ActivationCheckpointingConfig, ConfigError, Placement
from lightning_ac.layers import CompiledModules, DecoderLayers, compiled_layers
from lightning_ac.offload.activations import ActivationOffloadRuntime
from lightning_ac.offload.compiled import checkpointed_inside_too, compiled_call, offload_inputs_of_compiled_layer
from lightning_ac.selective.apply import build_policy
from lightning_ac.selective.policy import SelectivePolicy
from lightning_ac.units import format_bytes

__all__ = [
    "Recompute",
    "cache_off_for_the_run",
    "check_compiled",
    "describe_recompute",
    "install_recompute",
    "trace_side_effects_in_checkpoints",
]


@dataclass
class Recompute:
    """What :func:`install_recompute` installed.

    Attributes:
        engine: The recompute engine in force: ``hf``, ``torch`` or ``fsdp``.
        recomputed: For each decoder layer, whether it is recomputed in backward (the budget changes it).
        selective: The selective checkpointing policy, if any.
        budget: The memory budget's controller, if the block sets ``budget``.
        compiled_note: What compiling changes, for the applied line.
        inputs_around_compiled: Compiled layers whose inputs offload.hidden_states moves around the call.
        restore_dynamo_config: Puts back the dynamo setting changed for the run, if one was
            (:func:`trace_side_effects_in_checkpoints`).
    """

    engine: str = ""
    recomputed: List[bool] = field(default_factory=list)
    selective: Optional[SelectivePolicy] = None
    budget: Optional[BudgetController] = None
    compiled_note: str = ""
    inputs_around_compiled: int = 0
    restore_dynamo_config: Optional[Callable[[], None]] = None


def install_recompute(
    done: Recompute,
    config: ActivationCheckpointingConfig,
    module: nn.Module,
    layers: DecoderLayers,
    device: torch.device,
    activation_offload: Optional[ActivationOffloadRuntime],
    *,
    layer_offloading: bool,
    on_budget_change: Callable[[List[Choice]], None],
    tools: Callable[[], Sequence[Any]],
) -> None:
    """Checkpoint the decoder layers with the engine ``config`` names, and the policy and checkpoint function the
    other parts of the plan ask for.

    Args:
        done: Filled in as each part is installed, so that the caller can remove what was installed when a later
            part raises.
        config: The combined block (``enabled``).
        module: The module the plan applies to.
        layers: Its decoder layers.
        device: The Trainer's root device.
        activation_offload: The activation-offload runtime, if installed (its checkpoint wrapper, its SAC storage).
        layer_offloading: Whether layer offloading streams the frozen weights (the budget's first plan checks it).
        on_budget_change: Called with the budget's new choices whenever it chooses again.
        tools: The chunked loss and the tiled MLP, where installed (installed after this: read when the budget
            needs them), for the budget to turn on where the block leaves them to it (its advice reads the chunked
            loss's latest chunk count).

    The caller removes the selective policy and the budget; the module's journal puts back the attributes the engines
    set.
    """
    modules = layers.modules
    # the recompute engine: transformers' own; else (plain torch layers, or implementation: fsdp) torch's
    # non-reentrant checkpoint around each layer's forward, outside transformers (FSDP2's hooks stay outside)
    if layers.hf_models and config.implementation == "hf":
        engine = "hf"
    else:
        engine = "fsdp" if config.implementation == "fsdp" else "torch"
    done.engine = engine
    found = compiled_layers(module, layers)
    # layers whose checkpoint call is inside a compiled graph of their own, and where eager code calls it
    calls = {i: compiled_call(module, *layers.layers[i], engine) for i in found.layers}
    compiled = {i: call for i, call in calls.items() if call is not None}
    outside = [i for i, call in calls.items() if call is None]
    inside_too = [i for i in outside if checkpointed_inside_too(modules[i], engine)]
    hidden_states = activation_offload.hidden_states if activation_offload is not None else None
    check_compiled(config, found, outside, inside_too, hidden_states_offloaded=hidden_states is not None)
    context_fn: Optional[Callable[[], Any]] = None
    if config.selective is not None:
        storage = activation_offload.sac_storage if activation_offload is not None else None
        done.selective = build_policy(config.selective, module, layers, storage_factory=storage)
        done.selective.install()
        context_fn = done.selective.checkpoint_context_fn()
    checkpoint_fn = activation_offload.wrap_checkpoint(checkpoint) if activation_offload else checkpoint
    # offload.hidden_states: auto: the budget decides per layer which inputs go to host memory (the rest recompute
    # through torch's checkpoint alone)
    inputs_decided = config.budget is not None and config.offload.hidden_states == Placement.auto
    offload_fn = checkpoint_fn if inputs_decided else None
    checkpoint_fn = checkpoint if inputs_decided else checkpoint_fn
    switches = None
    if hidden_states is not None and compiled:
        # a compiled layer's inputs move around its compiled call (offload/compiled.py): hooks around its
        # checkpoint call would be inside the compiled region
        switches = [checkpoint if i in compiled else checkpoint_fn for i in range(len(modules))]
    if config.budget is not None:
        moved = activation_offload.targets if activation_offload is not None and device.type != "cpu" else []
        if config.budget_first_plan == "estimate":
            offloads = activation_offload is not None and bool(activation_offload.targets)
            check_first_plan(module, offloads, layer_offloading)
        if inputs_decided:
            moved = [t for t in moved if t != "hidden_states"]  # measured on the device: the choice moves them
        settings = BudgetSettings(
            config.budget,
            first_plan=config.budget_first_plan,
            input_held="hidden_states" not in moved,
            rules_held="selective" not in moved,
            # what the loss holds can shrink: the nothing-fits advice may name chunked_loss
            head_chunkable=config.chunked_loss is None and bool(layers.output_heads()),
            **(offload_pricing(activation_offload, device) if inputs_decided else {}),
        )
        done.budget = BudgetController(
            settings,
            modules,
            checkpoint_fn,
            device,
            on_change=on_budget_change,
            noun=layers.noun,
            policy=done.selective,
            layer_types=layers.layer_types,
            tools=tools,
            offload_fn=offload_fn,
        )
        switches = done.budget.switches
    settings = CheckpointSettings(config.checkpoint_kwargs, config.every_n_layers)
    if engine == "hf":
        done.recomputed = enable_hf_checkpointing(
            layers.hf_models, modules, settings, context_fn, checkpoint_fn, layer_checkpoint_fns=switches
        )
    else:
        done.recomputed = wrap_layers(modules, settings, context_fn, checkpoint_fn, layer_checkpoint_fns=switches)
    if done.selective is not None:
        done.selective.set_checkpointed(done.recomputed)
    if found.above or compiled:
        done.compiled_note = "recomputed inside the graphs, where the partitioner keeps attention's outputs"
        done.restore_dynamo_config = trace_side_effects_in_checkpoints()
    elif found.layers:  # the checkpoint wraps each compiled call from outside
        done.compiled_note = "each checkpoint wraps a compiled layer, whose compiled forward the recompute runs again"
    if hidden_states is not None:
        for index, call in compiled.items():
            if done.recomputed[index]:
                offload_inputs_of_compiled_layer(modules[index], call, hidden_states)
                done.inputs_around_compiled += 1


def trace_side_effects_in_checkpoints() -> Optional[Callable[[], None]]:
    """Let dynamo trace checkpointed regions whose forward has Python side effects, for the run: each checkpoint
    inside a compiled graph is a higher-order op, and dynamo refuses a side effect inside one (eager checkpointing
    would replay it in the recompute, which a compiled graph cannot), breaking the graph at the checkpoint, so that
    the decoder layers run eagerly, uncompiled. transformers >= 5.25 installs the ``kernels`` package, whose wrapper
    around each attention's forward (``use_kernelized_func``) sets and then resets a module-level variable in every
    call: every checkpointed layer broke its graph there. That side effect undoes itself within the forward, so not
    replaying it in the recompute changes nothing (torchtitan's SimpleFSDP path turns the same setting on where it
    compiles checkpointed blocks). A setting the user already turned on stays on.

    Returns:
        A function that puts the setting back, or ``None`` when nothing changed (already on, or a torch without the
        setting, where such a layer still runs eagerly).
    """
    if not DYNAMO_SKIPS_CHECKPOINT_SIDE_EFFECTS or getattr(torch._dynamo.config, CHECKPOINT_SIDE_EFFECTS_SETTING):
        return None
    setattr(torch._dynamo.config, CHECKPOINT_SIDE_EFFECTS_SETTING, True)
    return lambda: setattr(torch._dynamo.config, CHECKPOINT_SIDE_EFFECTS_SETTING, False)


def check_compiled(
    config: ActivationCheckpointingConfig,
    found: CompiledModules,
    outside: List[int],
    inside_too: List[int],
    *,
    hidden_states_offloaded: bool,
) -> None:
    """Refuse what would make dynamo run compiled decoder layers eagerly, uncompiled, without a word, or fail
    (the selective policy checks its own parts under compile, and layer offloading its own).

    Args:
        config: The combined block.
        found: What is compiled around the decoder layers (:func:`~lightning_ac.layers.compiled_layers`).
        outside: The compiled layers whose checkpoint wraps their compiled call from outside, in eager.
        inside_too: Those of them whose compiled forward checkpoints inside as well
            (:func:`~lightning_ac.offload.compiled.checkpointed_inside_too`).
        hidden_states_offloaded: Whether offload.hidden_states moves the layers' inputs in this run.
    """
    compiled = found.describe()
    if not compiled:
        return
    if config.budget is not None:
        raise ConfigError(
            f"activation_checkpointing.budget: {compiled}, and the budget measures each layer's activations and "
            "recompute time with dispatch modes and hooks around its calls, under which dynamo would run the "
            "layers eagerly, uncompiled, without a word. Choose a mode instead (full, kwargs.every_n_layers, "
            "selective save rules), or leave the layers uncompiled."
        )
    if outside and not found.above and config.selective is not None:
        raise ConfigError(
            f"activation_checkpointing.selective: {compiled}, and the checkpoint of decoder layers {outside} "
            "wraps their compiled call from outside (the layers selected are the compiled wrappers themselves, or "
            "their compiled forward is what the checkpoint calls), where the selective policy, a dispatch mode "
            "around the call, would make dynamo run the layers eagerly, uncompiled, or fail in backward. Put the "
            "checkpoint inside the graphs: select the layers inside the wrappers (layers=[<layer class>], or the "
            "'..._orig_mod' names), or compile each layer with layer.compile(); or drop selective (full "
            "checkpointing recomputes the compiled forward from outside)."
        )
    if inside_too and hidden_states_offloaded:
        raise ConfigError(
            f"activation_checkpointing.offload.hidden_states: {compiled}, and transformers' checkpoint around a "
            f"forward compiled in the class of decoder layers {inside_too} checkpoints inside that compiled "
            "forward as well, where offload.hidden_states' hooks would make dynamo run the layers eagerly, "
            "uncompiled, without a word. Compile the layer instances instead (layer.compile(), layers[i] = "
            "torch.compile(layers[i])), or select the layers with layers=[...] (torch's checkpoint then wraps the "
            "compiled forward from outside, where the hooks work)."
        )
    if found.above and hidden_states_offloaded:
        raise ConfigError(
            f"activation_checkpointing.offload.hidden_states: {compiled}, and offload.hidden_states moves each "
            "layer's input with saved-tensor hooks around its call, which would be inside the compiled region: "
            "dynamo cannot trace them and would run the layers eagerly, uncompiled, without a word. Compile the "
            "decoder layers one by one instead (layers[i] = torch.compile(layers[i]), torchtitan's way; their "
            "inputs then move after each compiled forward), use offload.all (its hooks take what the compiled "
            "graph saves, after its forward), or leave the model uncompiled."
        )


def describe_recompute(config: ActivationCheckpointingConfig, done: Recompute) -> str:
    """The recompute engine and options in force, as the applied line shows them."""
    parts = [done.engine, "reentrant" if config.use_reentrant else "non-reentrant"]
    if config.every_n_layers > 1:
        parts.append(f"every {config.every_n_layers} layers")
    if done.budget is not None:
        what = "auto" if config.budget == AUTO else format_bytes(config.budget)
        how = "a first plan from a step on fake tensors" if config.budget_first_plan == "estimate" else None
        parts.append(f"budget {what}: {how or 'measuring in the first step'}, then choosing per layer")
    if config.selective is not None:
        saves = [*config.selective.save, *(f"module {m}" for m in config.selective.save_modules)]
        if config.selective.save_matmul_min_k:
            saves.append(f"matmuls with K >= {config.selective.save_matmul_min_k}")
        parts.append(f"selective: save {', '.join(saves) or 'registered ops only'}")
    compiled = [done.compiled_note] if done.compiled_note else []
    if done.selective is not None and done.selective.compiled:
        compiled.append("the save rules apply when the graphs are traced (no warning about saves never replayed)")
    if compiled:
        parts.append("compiled: " + "; ".join(compiled))
    return ", ".join(parts)


def cache_off_for_the_run(layers: DecoderLayers) -> None:
    """transformers turns the KV cache off in a checkpointed training forward anyway, with a warning in every run
    whose model config asks for the cache: each transformers model that takes ``use_cache`` is called with
    ``use_cache=False`` in training forwards instead, where the call does not say (a pre-hook, removed with the plan's
    other hooks), so the log keeps to what a user should read. The config is not touched: a copy, a pickle or a
    ``save_pretrained`` during the run has it as found, and evaluation and generation keep the cache. Without a cache
    transformers masks packed documents apart: a packed batch is said (:mod:`lightning_ac.checkpoint.packed`).

    Args:
        layers: The decoder layers found (their transformers models).
    """
    if not layers.hf_models:
        return
    from transformers import PreTrainedModel  # hf_models holds some: transformers is there

    for model in layers.hf_models:
        if getattr(getattr(model, "config", None), "use_cache", False) is not True:
            continue
        # the model and the models inside it (its decoder, a multimodal model's language model), called on their own
        for module in model.modules():
            if isinstance(module, PreTrainedModel) and _takes_use_cache(module):
                module.register_forward_pre_hook(_cache_off_in_training, with_kwargs=True)
        notice_for(model)  # packed batches are masked otherwise without the cache: said once


def _takes_use_cache(module: nn.Module) -> bool:
    """``module.forward`` has a ``use_cache`` parameter."""
    try:
        return "use_cache" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _cache_off_in_training(module: nn.Module, args: Any, kwargs: Dict[str, Any]) -> Any:
    """``use_cache=False`` for a training forward with gradients that does not say (a call's own value stands)."""
    if module.training and torch.is_grad_enabled() and kwargs.get("use_cache") is None:
        return args, {**kwargs, "use_cache": False}
    return None
