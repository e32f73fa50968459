"""The :class:`LayerOffload` callback: the decoder layers' frozen weights streamed from host memory."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import lightning.pytorch as pl

from lightning_ac.callbacks.base import OptimizerStep, SuiteCallback
from lightning_ac.config import (
    LayerOffloadRequest,
)
from lightning_ac.layers import LayerSpec
from lightning_ac.units import DEFAULT_HOST_RESERVE_BYTES

__all__ = ["LayerOffload"]


class LayerOffload(SuiteCallback):
    """Keep frozen decoder-layer parameters in host memory and stream them to the device one layer at a time.

    Before a decoder layer runs (forward, and backward in reverse), its frozen parameters are copied to the
    device on a side stream while the layer before it computes; afterwards the device copy is freed. Device
    memory drops by about the frozen parameters of all decoder layers minus two layers' worth (the one running
    and the one arriving), at the price of PCIe traffic each step. Best with LoRA/QLoRA, where almost every
    parameter is frozen; it stacks with :class:`ActivationCheckpointing` and :class:`ActivationOffload`.

    QLoRA bases stream as stored: bitsandbytes' 4-bit ``Params4bit`` weights move packed, with their quant state.
    Trainable parameters, other parameter subclasses (DTensor shards, other quantized formats), parameters shared
    between layers, and everything outside the decoder layers (embeddings, output head) stay on the device. The
    streamed weights move to host memory in ``setup``, before the strategy places the module, so the device never
    holds them whole. Between steps a
    streamed parameter's data is its host copy, so ``state_dict`` and checkpoints hold the right values; after
    the run every parameter has memory of its own again, on the same device as the rest of the module (the CPU
    once Lightning's teardown has moved it there). A parameter unfrozen during training (a fine-tuning schedule)
    leaves the stream at its layer's next call.

    Args:
        layers: For models that are not transformers models: the decoder layers, as layer classes or globs over
            qualified module names (see :class:`ActivationCheckpointing`).
        copy_on_host: On a CPU-only trainer, run the copies anyway (tests, debugging). Without it a CPU-only
            trainer is a :class:`ConfigError`: the parameters already live in host memory there.
        host_reserve_bytes: Host memory left free: if the frozen weights need more, ``setup`` raises
            :class:`~lightning_ac.offload.HostMemoryError` instead of meeting the OOM killer.
        resident_layers: Keep the frozen weights of the last ``k`` decoder layers (of each model) on the device
            for the whole run: they run last in forward and first in backward, so each saves two loads per step
            for one layer of device memory.
        verify_steps: Verify mode (see :class:`ActivationOffload`): the first optimizer steps are checked against
            the same steps with synchronous transfers.
        verify_atol: The largest absolute difference verify mode accepts; ``0`` (default) compares bit for bit.
        verbose: At fit start, print a table per decoder layer (see :class:`ActivationCheckpointing`).
        prog_bar: Show ``lightning_ac/layer_offload_bytes`` in the progress bar.

    Attributes:
        last_step: ``{"loads": n, "bytes": n, "max_resident_layers": n}`` for the most recent optimizer step
            (every micro-batch under gradient accumulation): layer copies to the device, bytes copied, and the
            most streamed layers on the device at once (resident layers not counted). ``bytes`` is also logged,
            once per optimizer step, as ``lightning_ac/layer_offload_bytes``.
        host_bytes: Bytes of parameters held in host memory.

    Raises:
        ConfigError: If an argument is invalid; in ``setup``, on a sharding strategy (FSDP, DeepSpeed), on a
            CPU-only trainer without ``copy_on_host``, for compiled decoder layers, or when the decoder layers
            have no frozen parameters.
    """

    request_kind = "layer_offload"

    def __init__(
        self,
        *,
        layers: Optional[Sequence[LayerSpec]] = None,
        copy_on_host: bool = False,
        host_reserve_bytes: int = DEFAULT_HOST_RESERVE_BYTES,
        resident_layers: int = 0,
        verify_steps: int = 0,
        verify_atol: float = 0.0,
        verbose: bool = False,
        prog_bar: bool = False,
    ) -> None:
        request = LayerOffloadRequest.from_arguments(
            layers=layers,
            copy_on_host=copy_on_host,
            host_reserve_bytes=host_reserve_bytes,
            resident_layers=resident_layers,
            verify_steps=verify_steps,
            verify_atol=verify_atol,
        )
        super().__init__(request, verbose=verbose, prog_bar=prog_bar)

    def _reset(self) -> None:
        self.last_step: Dict[str, int] = _no_loads()
        self.host_bytes = 0
        self._step = OptimizerStep()

    @property
    def layers(self) -> Optional[List[LayerSpec]]:
        return self.request.layers

    @property
    def copy_on_host(self) -> bool:
        return self.request.copy_on_host

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        streamer = self._plan.weight_streamer if self._plan is not None else None
        if streamer is not None:
            if self._step.begin(trainer):
                self._totals = _no_loads()
            streamer.start_step()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        streamer = self._plan.weight_streamer if self._plan is not None else None
        if streamer is None:
            return
        stats = streamer.stats
        self._totals["loads"] += stats["loads"]
        self._totals["bytes"] += stats["bytes"]
        self._totals["max_resident_layers"] = max(self._totals["max_resident_layers"], stats["max_resident_layers"])
        self.host_bytes = streamer.host_bytes
        if not self._step.done(trainer):
            return  # gradient accumulation: more micro-batches of this optimizer step follow
        self.last_step = self._totals
        pl_module.log(
            "lightning_ac/layer_offload_bytes", float(self.last_step["bytes"]),
            on_step=True, on_epoch=False, batch_size=1, prog_bar=self.prog_bar,
        )  # fmt: skip


def _no_loads() -> Dict[str, int]:
    return {"loads": 0, "bytes": 0, "max_resident_layers": 0}
