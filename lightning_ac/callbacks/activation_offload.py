"""The :class:`ActivationOffload` callback: saved activations in host memory until backward."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

import lightning.pytorch as pl

from lightning_ac._logging import rank_zero_info, rank_zero_warn
from lightning_ac.callbacks.base import OptimizerStep, SuiteCallback
from lightning_ac.config import (
    OFFLOAD_TARGETS,
    ActivationOffloadRequest,
    OffloadConfig,
)
from lightning_ac.offload.device import available_host_bytes
from lightning_ac.units import DEFAULT_HOST_RESERVE_BYTES

__all__ = ["ActivationOffload"]


class ActivationOffload(SuiteCallback):
    """Move saved activations to host memory until backward needs them.

    Targets are the block's ``offload`` fields (:class:`~lightning_ac.OffloadConfig`), each ``"none"`` or ``"cpu"``
    (``"disk"`` is refused, pending a fix); ``True``/``False``, or the text ``"true"``/``"false"`` in any case, mean
    cpu/none.

    On an accelerator, copies run on side streams with pinned host buffers and are prefetched in backward.
    On a CPU-only trainer there is nothing to gain: the callback logs once and does nothing, unless
    ``copy_on_host=True`` forces the full pack/unpack path (copies into separate host buffers).

    Args:
        hidden_states: Each checkpointed decoder layer's input. Needs :class:`ActivationCheckpointing`. ``"auto"``
            (beside ``ActivationCheckpointing(budget=...)``): the memory budget decides per layer whether its input
            goes to host memory, where the device needs it and the host has the room (docs/budget.md).
        selective: What the selective checkpointing policy saves. Needs ``ActivationCheckpointing(selective=...)``.
        all: Every activation saved in the training forward (with recompute: what is saved outside the layers plus
            each layer's input). Cannot be combined with ``hidden_states``.
        copy_on_host: On a CPU device, still run the copies (tests, debugging).
        min_offload_bytes: ``all`` leaves smaller tensors on the device (copying them costs more than it saves).
        max_pinned_bytes: Upper bound of the reusable pinned host-buffer pool, past which copies go through
            pageable memory (synchronous on CUDA, and slower); ``None`` (default): the pool grows to what a step
            moves, within the host memory check (``host_reserve_bytes``), so that a steady-state step allocates no
            pinned memory.
        host_reserve_bytes: Host memory left free; offloading past ``MemAvailable`` minus this raises
            :class:`~lightning_ac.offload.HostMemoryError` instead of an OOM kill.
        verify_steps: Verify mode: each micro-batch of the first ``verify_steps`` optimizer steps runs once more
            beforehand with every transfer synchronous, and the real loss and gradients must match it
            (:class:`~lightning_ac.OffloadVerificationError` before the optimizer steps otherwise). Costs one
            forward and backward per verified micro-batch and the reference gradients in host memory.
        verify_atol: The largest absolute difference verify mode accepts; ``0`` (default) compares bit for bit.
        verbose: At fit start, print a table per decoder layer (see :class:`ActivationCheckpointing`).
        prog_bar: Show ``lightning_ac/offload_bytes`` in the progress bar.

    Attributes:
        last_step: ``{"hidden_states": {"tensors": n, "bytes": n}, "selective": {...}, "all": {...}}`` for the
            most recent optimizer step (Lightning's step: every micro-batch under gradient accumulation). The
            same figures are logged, once per optimizer step, as ``lightning_ac/offload_bytes`` and
            ``lightning_ac/offload_<target>_bytes``.
    """

    request_kind = "activation_offload"

    def __init__(
        self,
        *,
        hidden_states: Union[str, bool] = "none",
        selective: Union[str, bool] = "none",
        all: Union[str, bool] = "none",
        copy_on_host: bool = False,
        min_offload_bytes: int = 2**16,
        max_pinned_bytes: Optional[int] = None,
        host_reserve_bytes: int = DEFAULT_HOST_RESERVE_BYTES,
        verify_steps: int = 0,
        verify_atol: float = 0.0,
        verbose: bool = False,
        prog_bar: bool = False,
    ) -> None:
        request = ActivationOffloadRequest.from_arguments(
            hidden_states=hidden_states,
            selective=selective,
            all=all,
            copy_on_host=copy_on_host,
            min_offload_bytes=min_offload_bytes,
            max_pinned_bytes=max_pinned_bytes,
            host_reserve_bytes=host_reserve_bytes,
            verify_steps=verify_steps,
            verify_atol=verify_atol,
        )
        super().__init__(request, verbose=verbose, prog_bar=prog_bar)

    def _reset(self) -> None:
        self.last_step: Dict[str, Dict[str, int]] = _no_transfers()
        self._reported_host_use = False
        self._step = OptimizerStep()

    @property
    def offload(self) -> OffloadConfig:
        """Where each target's tensors go."""
        return self.request.offload

    @property
    def copy_on_host(self) -> bool:
        return self.request.copy_on_host

    @property
    def targets(self) -> List[str]:
        """The targets that move to the host."""
        return self.offload.targets

    def _report_host_use(self, step_bytes: int) -> None:
        """After the first step: how much host memory a step holds, and a warning when little is left."""
        available = available_host_bytes()
        free = f", {available / 2**30:.1f} GiB host memory available" if available is not None else ""
        rank_zero_info(f"offloading {step_bytes / 2**20:.1f} MiB to host memory per step{free}")
        if available is not None and step_bytes > 0.5 * available:
            rank_zero_warn(
                f"offloading holds {step_bytes / 2**30:.1f} GiB of host memory per step, more than half of the "
                f"{available / 2**30:.1f} GiB available; a larger batch or sequence will not fit. Consider "
                "offload.hidden_states instead of offload.all."
            )

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._reported_host_use = False
        super().setup(trainer, pl_module, stage)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        # the runtime's step itself starts with the training step (Plan), which an on_train_batch_start of the
        # LightningModule returning -1 skips
        if self._plan is not None and self._plan.activation_offload is not None and self._step.begin(trainer):
            self._totals = _no_transfers()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        runtime = self._plan.activation_offload if self._plan is not None else None
        if runtime is None:
            return
        runtime.finish_step()
        for target, moved in runtime.last_step.items():
            for key, value in moved.items():
                self._totals[target][key] += value
        if not self._step.done(trainer):
            return  # gradient accumulation: more micro-batches of this optimizer step follow
        self.last_step = self._totals
        total = sum(v["bytes"] for v in self.last_step.values())
        if not self._reported_host_use:
            self._reported_host_use = True
            self._report_host_use(total)
        pl_module.log(
            "lightning_ac/offload_bytes",
            float(total),
            on_step=True,
            on_epoch=False,
            batch_size=1,
            prog_bar=self.prog_bar,
        )
        for target in runtime.targets:
            pl_module.log(
                f"lightning_ac/offload_{target}_bytes", float(self.last_step[target]["bytes"]),
                on_step=True, on_epoch=False, batch_size=1,
            )  # fmt: skip


def _no_transfers() -> Dict[str, Dict[str, int]]:
    return {t: {"tensors": 0, "bytes": 0} for t in OFFLOAD_TARGETS}
