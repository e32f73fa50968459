"""Self-checks: on a release of torch, transformers or Lightning newer than the ones lightning_ac was tested with,
each feature that relies on their private behaviour proves itself on a toy model before the user's first step.

``pyproject.toml`` admits every release up to the next major one, so that installing lightning_ac never replaces a
user's torch; a few features are built on behaviour that torch, transformers and Lightning do not promise to keep
(SAC's caching and cached dispatch modes and their storage layout, whether SAC's saves reach saved-tensor hooks,
which tensors a checkpoint saves outside its region, the checkpoint function transformers' layers call, the
Lightning hooks the callbacks implement). On a tested release the test suite covers them and nothing runs here. On a
newer one, the first time the plan applies a feature, its check trains a two-layer Llama (hidden size 16, built from
a config, on the CPU: a few milliseconds) one step with the feature and without it, compares the loss and every
gradient bit for bit, and checks that the feature did what it is for (layers recomputed, attention kept, tensors
moved to the host and back, weights streamed). A failure raises :class:`IncompatibleReleaseError`, naming the
feature, the release and what to do, before anything trains.

The checks run in isolation: the caller's random state, default device and dtype are left as they were, and the
toy is thrown away. Run every check by hand with ``python -m lightning_ac.selfcheck``.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_ac._compat as _compat
from lightning_ac._compat import TESTED, tested_range, untested_release
from lightning_ac._logging import rank_zero_info

__all__ = [
    "FEATURES",
    "IncompatibleReleaseError",
    "SelfCheckFailed",
    "ensure",
    "features_of",
    "register",
    "run_check",
]


class IncompatibleReleaseError(RuntimeError):
    """A feature's self-check failed on a release of torch, transformers or Lightning that lightning_ac was not tested
    with: the feature would not do what it says there."""


class SelfCheckFailed(Exception):
    """What a check found wrong, in one sentence."""


@dataclass(frozen=True)
class _Check:
    """One feature's self-check.

    Attributes:
        packages: The packages whose private behaviour the feature relies on: the check runs when any of them is
            newer than its newest tested release.
        turn_off: How to turn the feature off, in the block's words (``None``: it cannot be, every run uses it).
        run: Called with the other features the plan applies; raises :class:`SelfCheckFailed` (or anything else) when
            the feature does not work on this release.
        method: What the check did, for the error message.
        context: The other features that change what the check checks (it runs again for each combination).
    """

    packages: Tuple[str, ...]
    turn_off: Optional[str]
    run: Callable[[FrozenSet[str]], None]
    method: str = "trained a two-layer toy model one step with {feature} and without it"
    context: FrozenSet[str] = frozenset()


# -- the toy and what is measured on it --------------------------------------------------------------------------

_LAYERS = 2


def _toy() -> Tuple[nn.Module, torch.Tensor]:
    """A two-layer Llama with SDPA attention and a batch of token ids, the same on every call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.default_generator.manual_seed(0)  # the CPU's only: torch.manual_seed would reseed every accelerator too
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        attn_implementation="sdpa",
        use_cache=False,
    )
    model = LlamaForCausalLM(config).train()
    return model, torch.randint(0, config.vocab_size, (2, 8))


class _CountOps(TorchDispatchMode):
    """Counts the matmuls and attention kernels that run, forward and backward: a recompute runs a layer's again,
    but not an output that selective checkpointing kept (SAC's modes, above this one, answer it from their storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls = self.attention = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        from lightning_ac.selective.ops import is_attention, is_matmul, op_name

        name = op_name(func)
        self.matmuls += is_matmul(name)
        self.attention += is_attention(name)
        return func(*args, **(kwargs or {}))


@dataclass
class _Step:
    """One training step's loss and gradients, and how many matmuls and attention kernels ran."""

    loss: torch.Tensor
    grads: Dict[str, torch.Tensor]
    matmuls: int
    attention: int


def _train_step(model: nn.Module, ids: torch.Tensor) -> _Step:
    model.zero_grad(set_to_none=True)
    with _CountOps() as counter:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return _Step(loss.detach(), grads, counter.matmuls, counter.attention)


def _recomputed_but_attention(reference: _Step, step: _Step, what: str) -> None:
    """Under selective checkpointing saving attention: the layers were recomputed, their attention was not."""
    if step.matmuls <= reference.matmuls:
        raise SelfCheckFailed(f"{what} recomputed nothing ({step.matmuls} matmuls ran in the step, as many without it)")
    if step.attention != reference.attention:
        raise SelfCheckFailed(
            f"attention ran {step.attention} times in a step where {what} saves it ({reference.attention} without "
            "checkpointing): SAC's caching modes did not keep what the policy saved"
        )


def _bitwise(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    return torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))  # NaN == NaN, -0 != 0


def _same_as(reference: _Step, step: _Step, what: str) -> None:
    """``step`` trained exactly as ``reference``: the same loss and the same gradients, bit for bit."""
    if not _bitwise(reference.loss, step.loss):
        raise SelfCheckFailed(f"{what} changed the loss ({step.loss.item()!r} instead of {reference.loss.item()!r})")
    if step.grads.keys() != reference.grads.keys():
        missing = sorted(reference.grads.keys() - step.grads.keys()) or sorted(step.grads.keys() - reference.grads)
        raise SelfCheckFailed(f"{what} changed which parameters get a gradient ({missing[0]}, {len(missing)} in all)")
    for name, grad in reference.grads.items():
        if not _bitwise(grad, step.grads[name]):
            diff = (grad - step.grads[name]).abs().max().item()
            raise SelfCheckFailed(f"{what} changed the gradient of {name} (by up to {diff:.3g})")


def _layers(model: nn.Module) -> Any:
    from lightning_ac.layers import find_decoder_layers

    layers = find_decoder_layers(model)
    if len(layers) != _LAYERS:
        raise SelfCheckFailed(f"found {len(layers)} decoder layers in a {_LAYERS}-layer LlamaForCausalLM")
    return layers


def _checkpointed(
    model: nn.Module,
    selective: bool = False,
    runtime: Any = None,
    engine: str = "hf",
    reentrant: Optional[bool] = None,
) -> Any:
    """Checkpoint ``model``'s layers as the plan does (:meth:`lightning_ac.plan.Plan._install_recompute`): the
    recompute engine, a selective policy saving attention, the offload runtime's checkpoint function and storage.
    Returns the policy, if any."""
    from torch.utils.checkpoint import checkpoint

    from lightning_ac.checkpoint import enable_hf_checkpointing, wrap_layers
    from lightning_ac.config import ActivationCheckpointingConfig, SelectiveConfig
    from lightning_ac.selective.policy import SelectivePolicy

    # the block built directly: the user's block is the one parse_config reads (once)
    config = ActivationCheckpointingConfig(
        reentrant=reentrant, selective=SelectiveConfig(save=["attention"]) if selective else None
    )
    layers = _layers(model)
    policy = None
    if config.selective is not None:
        storage = runtime.sac_storage if runtime is not None else None
        names = {module: name for name, module in model.named_modules()}
        policy = SelectivePolicy(config.selective, layers.modules, names, layers.layer_types, storage_factory=storage)
        policy.install()
    checkpoint_fn = runtime.wrap_checkpoint(checkpoint) if runtime is not None else checkpoint
    context_fn = policy.context_fn if policy is not None else None
    if engine == "hf":
        recomputed = enable_hf_checkpointing(layers.hf_models, layers.modules, config, context_fn, checkpoint_fn)
    else:
        recomputed = wrap_layers(layers.modules, config, context_fn, checkpoint_fn)
    if not all(recomputed):
        raise SelfCheckFailed(f"the {engine} engine checkpointed {sum(recomputed)} of {_LAYERS} decoder layers")
    return policy


def _offload_runtime(model: nn.Module, **targets: str) -> Any:
    """The activation-offload runtime the plan installs, copying on the host (the toy's tensors are all small)."""
    from lightning_ac.config import ActivationOffloadRequest, OffloadConfig
    from lightning_ac.offload.activations import ActivationOffloadRuntime

    request = ActivationOffloadRequest(OffloadConfig(**targets), copy_on_host=True, min_offload_bytes=0)
    runtime = ActivationOffloadRuntime(request, torch.device("cpu"))
    runtime.install(model, output_heads=_layers(model).output_heads())
    return runtime


def _offloaded_step(model: nn.Module, ids: torch.Tensor, runtime: Any, target: str) -> Tuple[_Step, int]:
    runtime.start_step()
    try:
        step = _train_step(model, ids)
    finally:
        runtime.close()
    return step, runtime.last_step[target]["tensors"]


# -- the checks ----------------------------------------------------------------------------------------------------


def _check_activation_checkpointing(others: FrozenSet[str]) -> None:
    """Both recompute engines, as the plan installs them: transformers' own (``hf``, non-reentrant and reentrant) and
    torch's checkpoint around each layer's forward (plain torch layers, ``implementation: fsdp``) recompute each layer
    once in backward, with exact gradients."""
    model, ids = _toy()
    reference = _train_step(copy.deepcopy(model), ids)
    for engine, reentrant in (("hf", None), ("hf", True), ("torch", None)):
        checkpointed = copy.deepcopy(model)
        _checkpointed(checkpointed, engine=engine, reentrant=reentrant)
        step = _train_step(checkpointed, ids)
        what = f"checkpointing ({engine} engine{', reentrant' if reentrant else ''})"
        _same_as(reference, step, what)
        if step.attention != 2 * reference.attention:
            raise SelfCheckFailed(
                f"with {what}, attention ran {step.attention} times in a step, where recomputing {_LAYERS} layers "
                f"runs it {2 * reference.attention} times: the layers were not recomputed"
            )


def _check_selective(others: FrozenSet[str]) -> None:
    """SAC through our policy: the attention outputs it saves are answered from SAC's storage in the recompute
    (not run again), nothing else changes, and the policy's diagnostics find nothing wrong. Beside offload.hidden_states
    or offload.all, SAC's saves also bypass their saved-tensor hooks: each target moves what it moves without
    selective checkpointing (offload.selective moves SAC's saves, never a hook)."""
    model, ids = _toy()
    reference = _train_step(copy.deepcopy(model), ids)
    policy = _checkpointed(model, selective=True)
    step = _train_step(model, ids)
    _same_as(reference, step, "selective checkpointing")
    _recomputed_but_attention(reference, step, "selective checkpointing")
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


def _recompute_offloading(target: str, selective: bool, what: str = "") -> Tuple[_Step, _Step, int]:
    """The toy's step as it is, and recomputed (``selective``: under selective checkpointing) with ``target``
    offloaded, which must train the same (``what`` names the run in the error); and how many tensors ``target``
    moved."""
    model, ids = _toy()
    reference = _train_step(copy.deepcopy(model), ids)
    runtime = _offload_runtime(model, **{target: "cpu"})
    _checkpointed(model, selective=selective, runtime=runtime)
    step, moved = _offloaded_step(model, ids, runtime, target)
    _same_as(reference, step, what or f"offload.{target}")
    return reference, step, moved


def _check_offload_selective(others: FrozenSet[str]) -> None:
    """offload.selective's host-resident storage inside SAC's modes: what the policy saves is moved to the host in the
    forward and comes back for the recompute (SAC's storage layout is what the storage speaks)."""
    reference, step, moved = _recompute_offloading("selective", selective=True)
    _recomputed_but_attention(reference, step, "offload.selective")
    if moved < _LAYERS:
        raise SelfCheckFailed(
            f"{moved} tensors went to host memory, where selective checkpointing saves at least one attention output "
            f"in each of {_LAYERS} layers: SAC's modes no longer keep their saves in the storage they are given"
        )


def _check_offload_hidden_states(others: FrozenSet[str]) -> None:
    """offload.hidden_states: transformers' layers call the checkpoint function it installs, and the saved-tensor hooks
    around each checkpoint call see exactly the layer's input (the checkpoint's own saves stay in its frame), moved to
    the host and back."""
    _, _, moved = _recompute_offloading("hidden_states", selective=False)
    if moved == 0:
        raise SelfCheckFailed(
            "no layer input went to host memory: transformers' layers did not call the checkpoint function "
            "offload.hidden_states installs in place of torch's"
        )
    if moved != _LAYERS:
        raise SelfCheckFailed(
            f"the saved-tensor hooks around the checkpoint calls of {_LAYERS} layers saw {moved} tensors, where "
            "they see one per layer (its input): the checkpoint's own saves now reach them"
        )


def _check_offload_all(others: FrozenSet[str]) -> None:
    """offload.all: every saved activation of a step moves to the host and back; a checkpointed layer saves only its
    input under the hooks."""
    model, ids = _toy()
    reference = _train_step(copy.deepcopy(model), ids)
    moved = {}
    for case in ("no recompute", "recompute"):
        toy = copy.deepcopy(model)
        runtime = _offload_runtime(toy, all="cpu")
        if case == "recompute":
            _checkpointed(toy, runtime=runtime)
        step, moved[case] = _offloaded_step(toy, ids, runtime, "all")
        _same_as(reference, step, f"offload.all ({case})")
    if moved["no recompute"] == 0:
        raise SelfCheckFailed("offload.all moved no tensor to host memory: its saved-tensor hooks were never called")
    if moved["recompute"] >= moved["no recompute"]:
        raise SelfCheckFailed(
            f"with recompute, offload.all moved {moved['recompute']} tensors, no fewer than without it "
            f"({moved['no recompute']}): the checkpointed layers' own saves reach the saved-tensor hooks"
        )


def _check_layer_offloading(others: FrozenSet[str]) -> None:
    """Layer offloading: the frozen decoder-layer weights live on the host and visit the device one layer at a time,
    in the forward and for the backward (a recompute included), with exact gradients for the trainable rest; what
    else a layer saves goes on to the saved-tensor hooks in force (offload.all's)."""
    from lightning_ac.offload.weights import LayerWeightStreamer, frozen_layer_parameters

    model, ids = _toy()
    for layer in _layers(model).modules:
        layer.requires_grad_(False)
    reference = _train_step(copy.deepcopy(model), ids)
    all_alone = copy.deepcopy(model)
    _, moved_alone = _offloaded_step(all_alone, ids, _offload_runtime(all_alone, all="cpu"), "all")
    for case in ("alone", "with recompute", "with offload.all"):
        toy = copy.deepcopy(model)
        modules = _layers(toy).modules
        runtime = _offload_runtime(toy, all="cpu") if case == "with offload.all" else None
        streamer = LayerWeightStreamer(modules, frozen_layer_parameters(modules), torch.device("cpu"), True)
        streamer.install()
        try:
            if case == "with recompute":
                _checkpointed(toy)
            streamer.start_step()
            if runtime is not None:
                step, moved = _offloaded_step(toy, ids, runtime, "all")
            else:
                step = _train_step(toy, ids)
            stats = dict(streamer.stats)
        finally:
            streamer.close()
        what = f"layer offloading ({case})"
        _same_as(reference, step, what)
        if stats["loads"] < 2 * _LAYERS or not 1 <= stats["max_resident_layers"] <= 2:
            raise SelfCheckFailed(
                f"{what} loaded {stats['loads']} layers in a step of {_LAYERS} layers (at least one load each in "
                f"the forward and the backward) with {stats['max_resident_layers']} on the device at once (1 or 2)"
            )
        if runtime is not None and moved != moved_alone:
            raise SelfCheckFailed(
                f"under layer offloading, offload.all moved {moved} tensors instead of {moved_alone}: the layers' "
                "saves no longer reach the saved-tensor hooks in force (_top_saved_tensors_default_hooks)"
            )


# "callbacks" (the Lightning hooks the suite callbacks implement) is registered by lightning_ac.callbacks, which knows
# them: register()
_CHECKS: Dict[str, _Check] = {
    "activation_checkpointing": _Check(
        ("torch", "transformers"), "activation_checkpointing: false", _check_activation_checkpointing
    ),
    "selective": _Check(
        ("torch", "transformers"),
        "remove activation_checkpointing.selective",
        _check_selective,
        context=frozenset({"offload.hidden_states", "offload.all"}),
    ),
    # transformers too: its layers must call the checkpoint function offload.hidden_states puts in place of torch's
    "offload.hidden_states": _Check(
        ("torch", "transformers"), "activation_checkpointing.offload.hidden_states: none", _check_offload_hidden_states
    ),
    "offload.selective": _Check(
        ("torch",), "activation_checkpointing.offload.selective: none", _check_offload_selective
    ),
    "offload.all": _Check(("torch",), "activation_checkpointing.offload.all: none", _check_offload_all),
    "layer_offloading": _Check(("torch",), "layer_offloading: false", _check_layer_offloading),
}

FEATURES: Tuple[str, ...] = ("callbacks", *_CHECKS)
"""The features that check themselves, in the block's words."""


def register(
    feature: str,
    packages: Tuple[str, ...],
    turn_off: Optional[str],
    run: Callable[[FrozenSet[str]], None],
    method: str,
) -> None:
    """Add the self-check of ``feature``, which relies on private behaviour of ``packages``.

    Args:
        feature: A name from :data:`FEATURES`.
        packages: The packages whose release decides whether the check runs.
        turn_off: How to turn the feature off, in the block's words (``None``: every run uses it).
        run: Called with the other features in force; raises when the feature does not work on the installed
            releases (:class:`SelfCheckFailed` with one sentence of what was found).
        method: What the check does, as the error says it ("ran ...").
    """
    if feature not in FEATURES:
        raise ValueError(f"{feature!r} is not a self-checked feature ({', '.join(FEATURES)})")
    _CHECKS[feature] = _Check(packages, turn_off, run, method)


# (feature, the other features that changed what it checked) -> seconds the check took, in this process
_passed: Dict[Tuple[str, FrozenSet[str]], float] = {}


def features_of(enabled: bool, selective: bool, offload_targets: Sequence[str], layer_offloading: bool) -> List[str]:
    """The self-checked features a plan applies.

    Args:
        enabled: Whether decoder layers are recomputed.
        selective: Whether a selective policy decides what they save.
        offload_targets: The activation-offload targets in force (``hidden_states``, ``selective``, ``all``).
        layer_offloading: Whether frozen layer weights are streamed.
    """
    found = ["callbacks"]
    found += ["activation_checkpointing"] if enabled else []
    found += ["selective"] if enabled and selective else []
    found += [f"offload.{target}" for target in offload_targets]
    found += ["layer_offloading"] if layer_offloading else []
    return found


def _releases(packages: Iterable[str]) -> Dict[str, str]:
    """``package -> installed release`` of those of ``packages`` that are installed."""
    found = {p: _compat.installed_release(p) for p in packages}
    return {p: r for p, r in found.items() if r is not None}


def ensure(features: Iterable[str], installed: Optional[Dict[str, Optional[str]]] = None) -> None:
    """Run the self-check of each feature that relies on a release newer than the tested ones, once per process.

    Args:
        features: Names from :data:`FEATURES` (:func:`features_of`).
        installed: ``package -> version`` to judge instead of what is installed (tests).

    Raises:
        IncompatibleReleaseError: If a feature's check fails on such a release.
    """
    features = frozenset(features)
    for feature in sorted(features, key=FEATURES.index):
        check = _CHECKS[feature]
        newer = {p: r for p in check.packages if (r := untested_release(p, installed)) is not None}
        others = features & check.context
        if not newer or (feature, others) in _passed:
            continue
        _passed[feature, others] = seconds = run_check(feature, newer, others)
        on = ", ".join(f"{p} {r}" for p, r in newer.items())
        rank_zero_info(f"self-check of {feature} on {on} (newer than the tested releases): passed in {seconds:.2f} s")


@contextlib.contextmanager
def _isolated() -> Iterator[None]:
    """The caller's random state, default device and dtype, grad mode and warnings filters, untouched; the toy's
    copies synchronous host copies, apart from any (simulated) device the caller's engines use."""
    from lightning_ac.offload.device import host_copies

    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"), torch.enable_grad(), host_copies():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # about the toy, not the user's run
                yield
    finally:
        torch.set_default_dtype(dtype)


def run_check(feature: str, releases: Optional[Dict[str, str]] = None, others: Optional[Iterable[str]] = None) -> float:
    """Run ``feature``'s self-check now, whatever the installed releases.

    Args:
        feature: A name from :data:`FEATURES`.
        releases: The releases to name in the error (default: the installed releases the feature relies on).
        others: The other features in force, which some checks also check the feature beside (default: all).

    Returns:
        The seconds the check took.

    Raises:
        IncompatibleReleaseError: If the feature does not work on the installed releases.
    """
    check = _CHECKS[feature]
    releases = releases or _releases(check.packages)
    others = frozenset(others if others is not None else FEATURES) - {feature}
    start = time.perf_counter()
    try:
        with _isolated():
            check.run(others)
        return time.perf_counter() - start
    except SelfCheckFailed as broken:
        found = str(broken).rstrip(".")
    except Exception as error:  # noqa: BLE001 - a private API that moved or changed shape: the same verdict
        found = f"{type(error).__name__}: {str(error).rstrip('.')}"
    raise IncompatibleReleaseError(_failure(feature, check, releases, found))


def _failure(feature: str, check: _Check, releases: Dict[str, str], found: str) -> str:
    on = ", ".join(f"{p} {r}" for p, r in releases.items())
    newer = [p for p in releases if untested_release(p, releases) is not None]
    tested = "; ".join(tested_range(p) for p in (newer or releases))
    status = "newer than the releases lightning_ac was tested with" if newer else "tested"
    off = f"turn {feature} off ({check.turn_off})" if check.turn_off else ""
    if newer:
        pins = " ".join(f"'{p}<={TESTED[p][1]}'" for p in newer)
        fix = f"Install a tested release (pip install {pins})" + (f", or {off}." if off else ".")
    else:  # only by hand (python -m lightning_ac.selfcheck, tests): a tested release that fails is our bug
        fix = "This is a bug of lightning_ac on a tested release: please report it with this message" + (
            f"; meanwhile {off}." if off else "."
        )
    return (
        f"lightning_ac: {feature} does not work with {on} ({status}: {tested}). Its self-check "
        f"{check.method.format(feature=feature)}, and {found}. {feature} relies on behaviour of "
        f"{' and '.join(check.packages)} that is not part of {'its' if len(check.packages) == 1 else 'their'} public "
        f"API, so training with it would not do what it says. {fix}"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lightning_ac.selfcheck [FEATURE ...]``: run the checks (all by default) on the installed releases,
    one line each; exits 1 if one fails."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m lightning_ac.selfcheck",
        description="Check each feature that relies on behaviour torch, transformers or Lightning do not promise to "
        "keep, on the installed releases: a two-layer toy model trained one step on the CPU with the feature and "
        "without it, compared bit for bit. Exits 1 if a check fails.",
    )
    parser.add_argument("features", nargs="*", metavar="FEATURE", help=f"the checks to run: {', '.join(FEATURES)}")
    features = parser.parse_args(argv).features or list(FEATURES)
    unknown = [f for f in features if f not in FEATURES]
    if unknown:  # checked here: argparse's choices= lists an empty list among them when nargs="*"
        parser.error(f"unknown feature(s) {', '.join(map(repr, unknown))}; choose from {', '.join(FEATURES)}")
    failed = 0
    for feature in features:
        try:
            seconds = run_check(feature)
        except IncompatibleReleaseError as error:
            failed += 1
            print(f"FAIL {feature}: {error}")
        else:
            print(f"ok   {feature} ({seconds * 1e3:.0f} ms)")
    versions = ", ".join(f"{p} {r}" for p, r in _releases(TESTED).items())
    print(f"{len(features) - failed}/{len(features)} features work with {versions}")
    return 1 if failed else 0
