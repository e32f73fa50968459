"""The self-checks of recompute and offloading: each trains the toy one step with its feature and without it, compares
the two bit for bit, and counts that the feature did what it is for (layers recomputed, attention kept, tensors moved
to the host and back, weights streamed)."""

from __future__ import annotations

import copy
from typing import Any, Callable, FrozenSet, List, Optional, Tuple

import torch

from lightning_ac.selfcheck.toy import (
    LAYERS,
    TOY_HOST_RESERVE_BYTES,
    Step,
    checkpointed,
    decoder_layers,
    offload_runtime,
    offloaded_step,
    recomputed_but_attention,
    same_as,
    toy,
    train_step,
)
from lightning_ac.selfcheck.verdict import SelfCheckFailed

__all__ = [
    "check_activation_checkpointing",
    "check_layer_offloading",
    "check_offload_all",
    "check_offload_hidden_states",
    "check_offload_selective",
    "check_selective",
]


def _recording(function: Callable[..., Any], calls: List[Optional[bool]]) -> Callable[..., Any]:
    """``function`` (a layer's checkpoint function), appending to ``calls`` for each call, once its region runs,
    whether it ran with grad enabled: a reentrant checkpoint runs its region without grad in the forward, a
    non-reentrant one with it."""

    def recorded(region: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        index = len(calls)
        calls.append(None)

        def recording_region(*a: Any, **k: Any) -> Any:
            if calls[index] is None:  # the forward's run, not the recompute's
                calls[index] = torch.is_grad_enabled()
            return region(*a, **k)

        return function(recording_region, *args, **kwargs)

    return recorded


def _recorded_checkpoints(model: torch.nn.Module, engine: str, reentrant: Optional[bool]) -> List[Optional[bool]]:
    """Checkpoint ``model``'s layers with ``engine``, each layer's checkpoint function recorded (:func:`_recording`):
    under ``hf``, the one transformers installed, which its layers must call (the plan puts its own there for
    offload.hidden_states and the memory budget); under ``torch``, the one the engine is given."""
    from torch.utils.checkpoint import checkpoint

    calls: List[Optional[bool]] = []
    if engine == "hf":
        checkpointed(model, engine=engine, reentrant=reentrant)
        for layer in decoder_layers(model).modules:
            layer._gradient_checkpointing_func = _recording(layer._gradient_checkpointing_func, calls)
    else:
        recorded = [_recording(checkpoint, calls)] * LAYERS
        checkpointed(model, engine=engine, reentrant=reentrant, layer_checkpoint_fns=recorded)
    return calls


def check_activation_checkpointing(others: FrozenSet[str]) -> None:
    """Both recompute engines, as the plan installs them: transformers' own (``hf``, non-reentrant and reentrant) and
    torch's checkpoint around each layer's forward (plain torch layers, ``implementation: fsdp``) recompute each layer
    once in backward, with exact gradients; each layer calls the checkpoint function it was given once in the
    forward, which runs reentrant exactly when the block says so."""
    model, ids = toy()
    reference = train_step(copy.deepcopy(model), ids)
    for engine, reentrant in (("hf", None), ("hf", True), ("torch", None)):
        recomputed = copy.deepcopy(model)
        calls = _recorded_checkpoints(recomputed, engine, reentrant)
        step = train_step(recomputed, ids)
        what = f"checkpointing ({engine} engine{', reentrant' if reentrant else ''})"
        same_as(reference, step, what)
        if step.attention != 2 * reference.attention:
            raise SelfCheckFailed(
                f"with {what}, attention ran {step.attention} times in a step, where recomputing {LAYERS} layers "
                f"runs it {2 * reference.attention} times: the layers were not recomputed"
            )
        if len(calls) != LAYERS:
            who = "transformers' layers" if engine == "hf" else "the torch engine's layer wrappers"
            raise SelfCheckFailed(
                f"with {what}, the layers recomputed, but called the checkpoint function lightning_ac gave them "
                f"{len(calls)} times in a step of {LAYERS} layers (once each): {who} no longer checkpoint through "
                "the function lightning_ac installs, so reentrant: true, offload.hidden_states and the memory "
                "budget's choices would be ignored"
            )
        if any(grad == bool(reentrant) for grad in calls):
            asked, ran = ("reentrant", "non-reentrant") if reentrant else ("non-reentrant", "reentrant")
            raise SelfCheckFailed(
                f"with {what}, a layer's checkpoint ran {ran}, where the block asks for {asked} (use_reentrant="
                f"{bool(reentrant)}): the checkpoint function no longer passes it on"
            )


def check_selective(others: FrozenSet[str]) -> None:
    """SAC through our policy: the attention outputs it saves are answered from SAC's storage in the recompute
    (not run again), nothing else changes, and the policy's diagnostics find nothing wrong. Beside offload.hidden_states
    or offload.all, SAC's saves also bypass their saved-tensor hooks: each target moves what it moves without
    selective checkpointing (offload.selective moves SAC's saves, never a hook)."""
    model, ids = toy()
    reference = train_step(copy.deepcopy(model), ids)
    policy = checkpointed(model, selective=True)
    step = train_step(model, ids)
    same_as(reference, step, "selective checkpointing")
    recomputed_but_attention(reference, step, "selective checkpointing")
    if policy.problems():
        raise SelfCheckFailed(policy.problems()[0].rstrip("."))
    for target in ("hidden_states", "all"):
        if f"offload.{target}" not in others:
            continue
        moved = {
            selective: _recompute_offloading(target, selective, f"selective checkpointing with offload.{target}")[2]
            for selective in (False, True)
        }
        if moved[True] != moved[False]:
            raise SelfCheckFailed(
                f"selective checkpointing changed what offload.{target} moves ({moved[True]} tensors instead of "
                f"{moved[False]}): SAC's saves now reach the saved-tensor hooks (respect_saved_tensors_hooks)"
            )


def _recompute_offloading(target: str, selective: bool, what: str = "") -> Tuple[Step, Step, int]:
    """The toy's step as it is, and recomputed (``selective``: under selective checkpointing) with ``target``
    offloaded, which must train the same (``what`` names the run in the error); and how many tensors ``target``
    moved."""
    model, ids = toy()
    reference = train_step(copy.deepcopy(model), ids)
    runtime = offload_runtime(model, **{target: "cpu"})
    checkpointed(model, selective=selective, runtime=runtime)
    step, moved = offloaded_step(model, ids, runtime, target)
    same_as(reference, step, what or f"offload.{target}")
    return reference, step, moved


def check_offload_selective(others: FrozenSet[str]) -> None:
    """offload.selective's host-resident storage inside SAC's modes: what the policy saves is moved to the host in the
    forward and comes back for the recompute (SAC's storage layout is what the storage speaks)."""
    reference, step, moved = _recompute_offloading("selective", selective=True)
    recomputed_but_attention(reference, step, "offload.selective")
    if moved < LAYERS:
        raise SelfCheckFailed(
            f"{moved} tensors went to host memory, where selective checkpointing saves at least one attention output "
            f"in each of {LAYERS} layers: SAC's modes no longer keep their saves in the storage they are given"
        )


def check_offload_hidden_states(others: FrozenSet[str]) -> None:
    """offload.hidden_states: transformers' layers call the checkpoint function it installs, and the saved-tensor hooks
    around each checkpoint call see exactly the layer's input (the checkpoint's own saves stay in its frame), moved to
    the host and back."""
    _, _, moved = _recompute_offloading("hidden_states", selective=False)
    if moved == 0:
        raise SelfCheckFailed(
            "no layer input went to host memory: transformers' layers did not call the checkpoint function "
            "offload.hidden_states installs in place of torch's"
        )
    if moved != LAYERS:
        raise SelfCheckFailed(
            f"the saved-tensor hooks around the checkpoint calls of {LAYERS} layers saw {moved} tensors, where "
            "they see one per layer (its input): the checkpoint's own saves now reach them"
        )


def check_offload_all(others: FrozenSet[str]) -> None:
    """offload.all: every saved activation of a step moves to the host and back; a checkpointed layer saves only its
    input under the hooks."""
    model, ids = toy()
    reference = train_step(copy.deepcopy(model), ids)
    moved = {}
    for case in ("no recompute", "recompute"):
        copied = copy.deepcopy(model)
        runtime = offload_runtime(copied, all="cpu")
        if case == "recompute":
            checkpointed(copied, runtime=runtime)
        step, moved[case] = offloaded_step(copied, ids, runtime, "all")
        same_as(reference, step, f"offload.all ({case})")
    if moved["no recompute"] == 0:
        raise SelfCheckFailed("offload.all moved no tensor to host memory: its saved-tensor hooks were never called")
    if moved["recompute"] >= moved["no recompute"]:
        raise SelfCheckFailed(
            f"with recompute, offload.all moved {moved['recompute']} tensors, no fewer than without it "
            f"({moved['no recompute']}): the checkpointed layers' own saves reach the saved-tensor hooks"
        )


def check_layer_offloading(others: FrozenSet[str]) -> None:
    """Layer offloading: the frozen decoder-layer weights live on the host and visit the device one layer at a time,
    in the forward and for the backward (a recompute included), with exact gradients for the trainable rest; what
    else a layer saves goes on to the saved-tensor hooks in force (offload.all's)."""
    from lightning_ac.offload.weights import LayerWeightStreamer, frozen_layer_parameters

    model, ids = toy()
    for layer in decoder_layers(model).modules:
        layer.requires_grad_(False)
    reference = train_step(copy.deepcopy(model), ids)
    all_alone = copy.deepcopy(model)
    _, moved_alone = offloaded_step(all_alone, ids, offload_runtime(all_alone, all="cpu"), "all")
    for case in ("alone", "with recompute", "with offload.all"):
        copied = copy.deepcopy(model)
        modules = decoder_layers(copied).modules
        runtime = offload_runtime(copied, all="cpu") if case == "with offload.all" else None
        streamer = LayerWeightStreamer(
            modules,
            frozen_layer_parameters(modules),
            torch.device("cpu"),
            copy_on_host=True,
            host_reserve_bytes=TOY_HOST_RESERVE_BYTES,
        )
        streamer.install()
        try:
            if case == "with recompute":
                checkpointed(copied)
            streamer.start_step()
            if runtime is not None:
                step, moved = offloaded_step(copied, ids, runtime, "all")
            else:
                step = train_step(copied, ids)
            stats = dict(streamer.stats)
        finally:
            streamer.close()
        what = f"layer offloading ({case})"
        same_as(reference, step, what)
        if stats["loads"] < 2 * LAYERS or not 1 <= stats["max_resident_layers"] <= 2:
            raise SelfCheckFailed(
                f"{what} loaded {stats['loads']} layers in a step of {LAYERS} layers (at least one load each in "
                f"the forward and the backward) with {stats['max_resident_layers']} on the device at once (1 or 2)"
            )
        if runtime is not None and moved != moved_alone:
            raise SelfCheckFailed(
                f"under layer offloading, offload.all moved {moved} tensors instead of {moved_alone}: the layers' "
                "saves no longer reach the saved-tensor hooks in force (_top_saved_tensors_default_hooks)"
            )
