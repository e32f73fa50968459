"""One rank of N: what each data-parallel rank holds under DDP or FSDP2, counted on a fake process group.

The estimate runs rank 0 of a world of N on torch's fake process group (``init_process_group("fake")``: collectives
return at once and move no data, the shapes are those of N ranks), with the real wrappers a Lightning run uses:

- ``fsdp``: FSDP2's ``fully_shard`` on each decoder layer and on the root, as Lightning's ``ModelParallelStrategy``
  runs it (``configure_model``, after the suite's ``setup``). Each rank holds a 1/N shard of the parameters, the
  gradients and the optimizer state; the gathered parameters of the layer running (and of the next one, gathered
  ahead) are counted as they are allocated and freed (FSDP2 resizes their storages in place), with the all-gather
  buffers, as streamed weights; the unsharded gradients before the reduce-scatter, and its buffers, as temporaries.
- ``ddp``: ``DistributedDataParallel`` with Lightning's defaults (25 MiB buckets, ``gradient_as_bucket_view``
  off): every rank holds the whole model, its gradients and optimizer state, and DDP's gradient buckets (one more
  copy of the trainable gradients, allocated when DDP wraps the model) counted with the gradients. The all-reduce
  runs in place on the buckets; on the fake group it is not run at all (a no-op communication hook), which
  allocates what the in-place all-reduce does: nothing.

The batch is the per-rank batch, as Lightning's ``batch_size`` is.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

import torch
from torch import nn

from lightning_ac.estimate.errors import EstimateError
from lightning_ac.estimate.meter import tagged_method
from lightning_ac.estimate.tracker import Kind, MemoryTracker
from lightning_ac.fake import patched

__all__ = ["STRATEGIES", "Ranks", "counted", "distribute", "fake_world", "ranks_for"]

STRATEGIES = ("single", "ddp", "fsdp")
DDP_BUCKET_MB = 25  # Lightning's DDPStrategy leaves DDP's default


@dataclass(frozen=True)
class Ranks:
    """The data-parallel strategy a run trains under, and its number of ranks.

    Attributes:
        strategy: ``single`` (one device, the default), ``ddp``, or ``fsdp``: FSDP2's ``fully_shard`` on each decoder
            layer and the root, as a ``configure_model`` runs it under Lightning's ``ModelParallelStrategy``
            (Lightning's ``strategy="fsdp"`` is FSDP1, whose wrap policy decides what is gathered at once: not
            modelled).
        devices: The number of ranks (devices), 1 for ``single``.
    """

    strategy: str = "single"
    devices: int = 1

    @property
    def distributed(self) -> bool:
        return self.strategy != "single"

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    def notes(self) -> List[str]:
        """What the per-rank figures count, for the table's notes."""
        if self.strategy == "fsdp":
            return [
                "FSDP2: weights, grads and optimizer are the rank's 1/N shards; the weights column adds the most "
                "gathered parameters held at once (the layer running, the next one gathered ahead, the all-gather "
                "buffers); the unsharded gradients before the reduce-scatter are temporaries; a mixed precision runs "
                "as Lightning's plugin runs it (autocast over float32 shards: FSDP2's MixedPrecisionPolicy, which "
                "gathers in bf16, is not modelled); the collectives move no data here (a fake process group)"
            ]
        if self.strategy == "ddp":
            return [
                "DDP: every rank holds the whole model, its gradients and optimizer state; grads adds DDP's gradient "
                "buckets (one more copy of the trainable gradients, gradient_as_bucket_view off as Lightning leaves "
                "it); the all-reduce runs in place on them and allocates nothing"
            ]
        return []

    def describe(self) -> str:
        """What the table's figures are: ``""`` for one device, else ``per rank of N under ...``."""
        if self.strategy == "fsdp":
            return f"per rank of {self.devices} under FSDP2 (fully_shard on each decoder layer and the root)"
        if self.strategy == "ddp":
            return f"per rank of {self.devices} under DDP ({DDP_BUCKET_MB} MiB gradient buckets)"
        return ""


def ranks_for(strategy: Optional[str], devices: Optional[int]) -> Ranks:
    """The checked :class:`Ranks` for ``--strategy`` and ``--devices``.

    Raises:
        EstimateError: For an unknown strategy, a number of devices below 1 (or above 1 with ``single``), or
            ``ddp``/``fsdp`` on one device.
    """
    strategy = strategy or "single"
    if strategy not in STRATEGIES:
        raise EstimateError(f"--strategy {strategy}: choose from {', '.join(STRATEGIES)}")
    if devices is None:
        devices = 1
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise EstimateError(f"--devices {devices!r}: expected a whole number of ranks >= 1")
    if strategy == "single" and devices != 1:
        raise EstimateError(
            f"--devices {devices} on one device (no --strategy): say how the {devices} ranks share the work "
            "(--strategy ddp: each holds the whole model; --strategy fsdp: each holds 1/N of it)"
        )
    if strategy != "single" and devices < 2:
        raise EstimateError(
            f"--strategy {strategy} on {devices} device: a world of one rank is one device, which the estimate counts "
            "without --strategy. Give --devices N (N >= 2) for each rank's share."
        )
    return Ranks(strategy, devices)


@contextlib.contextmanager
def fake_world(ranks: Ranks) -> Iterator[Any]:
    """Inside: rank 0 of a fake process group of ``ranks.devices`` (yields FSDP's device mesh, or ``None``);
    destroyed afterwards, whatever happens. Nothing is done for one device.

    Raises:
        EstimateError: If this process is already a rank of a process group (the fake world would replace it).
    """
    if not ranks.distributed:
        yield None
        return
    import torch.distributed as dist

    if not dist.is_available():
        raise EstimateError(
            f"--strategy {ranks.strategy}: this torch is built without torch.distributed, whose fake process group "
            "the per-rank estimate runs on. Estimate one device (no --strategy), or use a torch with distributed."
        )
    import torch.nn.parallel.distributed as ddp_module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise EstimateError(
            f"--strategy {ranks.strategy}: this process is already a rank of a process group, which the estimate's "
            "fake one would replace. Run the estimate in a process of its own (python -m lightning_ac.estimate)."
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks.devices)
    try:
        # DDP checks the ranks' parameter shapes and broadcasts rank 0's weights when it wraps the model: both read
        # the tensors' data, which fake tensors have none of; the ranks are one model here
        with patched(ddp_module, "_verify_param_shape_across_processes", lambda *args, **kwargs: None):
            with patched(ddp_module, "_sync_module_states", lambda *args, **kwargs: None):
                yield init_device_mesh("cpu", (ranks.devices,)) if ranks.sharded else None
    finally:
        dist.destroy_process_group()


def distribute(model: nn.Module, ranks: Ranks, mesh: Any, tracker: MemoryTracker) -> nn.Module:
    """``model`` as the strategy wraps it: sharded by ``fully_shard`` (in place), or wrapped in DDP, whose gradient
    buckets ``tracker`` counts as gradients."""
    if ranks.sharded:
        from torch.distributed.fsdp import fully_shard

        from lightning_ac.layers import find_decoder_layers

        for layer in find_decoder_layers(model).modules:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if ranks.strategy == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
        from torch.nn.parallel import DistributedDataParallel

        with tracker, tracker.tagging(Kind.GRADIENT):
            wrapped = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_MB)
        wrapped.register_comm_hook(None, noop_hook)
        return wrapped
    return model


@contextlib.contextmanager
def counted(ranks: Ranks, tracker: MemoryTracker) -> Iterator[None]:
    """Inside, FSDP2's own memory is counted as it comes and goes: what its unshard allocates (the all-gather
    buffers, the gathered parameters) as streamed weights, storages it resizes in place at their new size, and the
    sharded gradients its post-backward leaves as gradients."""
    if not ranks.sharded:
        yield
        return
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    post_backward = FSDPParamGroup.__dict__["post_backward"]
    resize = torch.UntypedStorage.resize_

    def counted_post_backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = post_backward(self, *args, **kwargs)
        for fsdp_param in self.fsdp_params:
            tracker.label(fsdp_param.sharded_param.grad, Kind.GRADIENT)
        return out

    def counted_resize(storage: torch.UntypedStorage, size: int) -> Any:
        out = resize(storage, size)
        if tracker.active:
            tracker.resized(storage)
        return out

    with contextlib.ExitStack() as stack:
        # the all-gather's buffers, and the gathered parameters it copies out into
        stack.enter_context(tagged_method(tracker, FSDPParamGroup, "unshard", Kind.WEIGHTS))
        stack.enter_context(tagged_method(tracker, FSDPParamGroup, "wait_for_unshard", Kind.WEIGHTS))
        stack.enter_context(patched(FSDPParamGroup, "post_backward", counted_post_backward))
        stack.enter_context(patched(torch.UntypedStorage, "resize_", counted_resize))
        yield
