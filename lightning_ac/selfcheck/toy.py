"""The toy the self-checks train, and what they measure on it: a two-layer Llama built from a config, one training
step's loss, gradients and kernel counts, and the suite's features installed on it as the plan installs them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ac.selfcheck.verdict import SelfCheckFailed

__all__ = [
    "LAYERS",
    "TOY_HOST_RESERVE_BYTES",
    "Step",
    "checkpointed",
    "decoder_layers",
    "offload_runtime",
    "offloaded_step",
    "recomputed_but_attention",
    "same_as",
    "toy",
    "train_step",
]

LAYERS = 2

# The toy's host memory is a few KiB: no reserve is kept for it, so that a check fails only for what it checks, not
# for a host with less free memory than a run's reserve (2 GiB by default).
TOY_HOST_RESERVE_BYTES = 0


def toy() -> Tuple[nn.Module, torch.Tensor]:
    """A two-layer Llama with SDPA attention and a batch of token ids, the same on every call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.default_generator.manual_seed(0)  # the CPU's only: torch.manual_seed would reseed every accelerator too
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=LAYERS,
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
class Step:
    """One training step's loss and gradients, and how many matmuls and attention kernels ran."""

    loss: torch.Tensor
    grads: Dict[str, torch.Tensor]
    matmuls: int
    attention: int


def train_step(
    model: nn.Module,
    ids: torch.Tensor,
    around_forward: Optional[Callable[[], ContextManager[Any]]] = None,
    before_backward: Optional[Callable[[], None]] = None,
) -> Step:
    """One forward and backward of ``model`` on ``ids``: the forward inside ``around_forward()``, then
    ``before_backward()`` (as Lightning's ``training_step`` and ``on_before_backward`` run, for the memory budget)."""
    model.zero_grad(set_to_none=True)
    with _CountOps() as counter:
        with around_forward() if around_forward is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        if before_backward is not None:
            before_backward()
        loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return Step(loss.detach(), grads, counter.matmuls, counter.attention)


def recomputed_but_attention(reference: Step, step: Step, what: str) -> None:
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


def same_as(reference: Step, step: Step, what: str) -> None:
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


def decoder_layers(model: nn.Module) -> Any:
    """The toy's decoder layers, as the plan finds them."""
    from lightning_ac.layers import find_decoder_layers

    layers = find_decoder_layers(model)
    if len(layers) != LAYERS:
        raise SelfCheckFailed(f"found {len(layers)} decoder layers in a {LAYERS}-layer LlamaForCausalLM")
    return layers


def checkpointed(
    model: nn.Module,
    selective: bool = False,
    runtime: Any = None,
    engine: str = "hf",
    reentrant: Optional[bool] = None,
    layer_checkpoint_fns: Optional[Sequence[Callable[..., Any]]] = None,
) -> Any:
    """Checkpoint ``model``'s layers as the plan does (:func:`lightning_ac.plan.recompute.install_recompute`): the
    recompute engine, a selective policy saving attention, the offload runtime's checkpoint function and storage, or
    a checkpoint function per layer (the memory budget's switches). Returns the policy, if any."""
    from torch.utils.checkpoint import checkpoint

    from lightning_ac.checkpoint import CheckpointSettings, enable_hf_checkpointing, wrap_layers
    from lightning_ac.config import ActivationCheckpointingConfig, SelectiveConfig
    from lightning_ac.selective.policy import SelectivePolicy

    # the block built directly: the user's block is the one parse_config reads (once)
    config = ActivationCheckpointingConfig(
        reentrant=reentrant, selective=SelectiveConfig(save=["attention"]) if selective else None
    )
    layers = decoder_layers(model)
    policy = None
    if config.selective is not None:
        storage = runtime.sac_storage if runtime is not None else None
        names = {module: name for name, module in model.named_modules()}
        policy = SelectivePolicy(config.selective, layers.modules, names, layers.layer_types, storage_factory=storage)
        policy.install()
    checkpoint_fn = runtime.wrap_checkpoint(checkpoint) if runtime is not None else checkpoint
    context_fn = policy.context_fn if policy is not None else None
    settings = CheckpointSettings(config.checkpoint_kwargs, config.every_n_layers)
    if engine == "hf":
        recomputed = enable_hf_checkpointing(
            layers.hf_models, layers.modules, settings, context_fn, checkpoint_fn, layer_checkpoint_fns
        )
    else:
        recomputed = wrap_layers(layers.modules, settings, context_fn, checkpoint_fn, layer_checkpoint_fns)
    if not all(recomputed):
        raise SelfCheckFailed(f"the {engine} engine checkpointed {sum(recomputed)} of {LAYERS} decoder layers")
    return policy


def offload_runtime(model: nn.Module, **targets: str) -> Any:
    """The activation-offload runtime the plan installs, copying on the host (the toy's tensors are all small)."""
    from lightning_ac.config import ActivationOffloadRequest, OffloadConfig
    from lightning_ac.offload.activations import ActivationOffloadRuntime

    request = ActivationOffloadRequest(
        OffloadConfig(**targets), copy_on_host=True, min_offload_bytes=0, host_reserve_bytes=TOY_HOST_RESERVE_BYTES
    )
    runtime = ActivationOffloadRuntime(request, torch.device("cpu"))
    runtime.install(model, output_heads=decoder_layers(model).models_and_heads())
    return runtime


def offloaded_step(model: nn.Module, ids: torch.Tensor, runtime: Any, target: str) -> Tuple[Step, int]:
    """One training step under the offload ``runtime``, and how many tensors ``target`` moved in it."""
    runtime.start_step()
    try:
        step = train_step(model, ids)
    finally:
        runtime.close()
    return step, runtime.last_step[target]["tensors"]
