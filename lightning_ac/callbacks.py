"""The Lightning faces of the suite: thin callbacks over one shared :class:`~lightning_ac.plan.Plan`."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Mapping, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_ac._logging import rank_zero_log
from lightning_ac.config import ConfigError, OffloadConfig, Placement, config_to_dict, parse_config, parse_placement
from lightning_ac.layers import LayerSpec
from lightning_ac.offload.host_memory import available_host_bytes
from lightning_ac.offload.runtime import TARGETS
from lightning_ac.plan import Plan
from lightning_ac.report import layer_rows, render_layer_table

__all__ = ["ActivationCheckpointing", "ActivationOffload", "LayerOffload", "SuiteCallback", "callbacks_from_config"]


def _check_layers(layers: Optional[Sequence[LayerSpec]], owner: str) -> Optional[List[LayerSpec]]:
    if layers is None:
        return None
    if isinstance(layers, (str, type)) or not all(isinstance(s, (str, type)) for s in layers):
        raise ConfigError(
            f"{owner}(layers=...): expected a list of layer classes or module-name globs, "
            f"got {layers!r}. Write layers=[MyBlock] or layers=['model.blocks.*']."
        )
    return list(layers)


class SuiteCallback(Callback):
    """Base of the suite callbacks: shares one plan per Trainer run, applies it in ``setup``, removes it in
    ``teardown`` and ``on_exception``."""

    _plan: Optional[Plan] = None
    verbose: bool = False
    prog_bar: bool = False

    def block(self) -> Dict[str, Any]:
        """This callback's part of the ``activation_checkpointing`` block."""
        raise NotImplementedError

    @property
    def plan(self) -> Optional[Plan]:
        """The plan in force during a run, ``None`` outside one."""
        return self._plan

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._plan is not None and self._plan.module is pl_module:
            return  # another suite callback applied the shared plan already
        plan = Plan.gather(trainer)
        for cb in plan.callbacks:
            cb._plan = plan
        plan.apply(trainer, pl_module)

    def _release(self, after_exception: bool = False) -> None:
        plan = self._plan
        if plan is None:
            return
        try:
            plan.remove(after_exception)
        finally:
            for cb in plan.callbacks:
                cb._plan = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release(after_exception=True)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plan = self._plan
        if plan is None or plan.callbacks[0] is not self or not any(cb.verbose for cb in plan.callbacks):
            return  # one table per run, from the first suite callback
        rows = layer_rows(plan)
        if rows:
            rank_zero_log(render_layer_table(rows))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._is_first() and pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._is_first() and pl_module.device.type == "cuda":
            peak = float(torch.cuda.max_memory_allocated(pl_module.device))
            pl_module.log(
                "lightning_ac/peak_memory_bytes", peak, on_step=True, on_epoch=False, batch_size=1,
                prog_bar=any(cb.prog_bar for cb in self._plan.callbacks),
            )  # fmt: skip

    def _is_first(self) -> bool:
        return self._plan is not None and self._plan.callbacks[0] is self


class ActivationCheckpointing(SuiteCallback):
    """Recompute decoder layers in backward instead of keeping their activations.

    Args:
        implementation: ``"hf"`` (transformers' checkpointing; plain torch layers get the equivalent torch
            wrapper) or ``"fsdp"`` (FSDP2's checkpoint wrapper; needs an FSDP strategy).
        reentrant: ``use_reentrant``. ``None`` (default) picks non-reentrant checkpointing.
        kwargs: Extra ``torch.utils.checkpoint.checkpoint`` arguments (``preserve_rng_state``,
            ``determinism_check``, ``debug``, ``early_stop``) plus ``every_n_layers``.
        selective: Selective activation checkpointing: ``True`` (save attention) or a mapping with ``save``,
            ``save_modules``, ``save_matmul_min_k``, ``save_sliding_window``, ``recompute_layer_types``.
        layers: For models that are not transformers models: the decoder layers, as layer classes or globs
            over qualified module names (``"model.blocks.*"``). ``None`` finds transformers layers.
        verbose: At fit start, print a table per decoder layer: recomputed or not, what SAC saves, what is
            offloaded where (rich when installed, plain text otherwise).
        prog_bar: Show ``lightning_ac/peak_memory_bytes`` (logged each step on CUDA) in the progress bar.

    Raises:
        ConfigError: If an argument is invalid; the message names the argument and the fix.

    Example::

        trainer = Trainer(callbacks=[ActivationCheckpointing(kwargs={"every_n_layers": 2})])
    """

    def __init__(
        self,
        *,
        implementation: str = "hf",
        reentrant: Optional[bool] = None,
        kwargs: Optional[Mapping[str, Any]] = None,
        selective: Any = None,
        layers: Optional[Sequence[LayerSpec]] = None,
        verbose: bool = False,
        prog_bar: bool = False,
    ) -> None:
        layers = _check_layers(layers, "ActivationCheckpointing")
        self.config = parse_config(
            {
                "implementation": implementation,
                "reentrant": reentrant,
                "kwargs": dict(kwargs or {}),
                "selective": selective,
            }
        )
        self.layers = layers
        self.verbose = bool(verbose)
        self.prog_bar = bool(prog_bar)

    def block(self) -> Dict[str, Any]:
        cfg = self.config
        return {
            "implementation": cfg.implementation,
            "reentrant": cfg.reentrant,
            "kwargs": dict(cfg.kwargs),
            "selective": config_to_dict(cfg)["selective"],
        }

    @property
    def state_key(self) -> str:
        return "ActivationCheckpointing"

    def state_dict(self) -> Dict[str, Any]:
        return {"activation_checkpointing": config_to_dict(self.config)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        saved = state_dict.get("activation_checkpointing")
        if saved is not None and saved != config_to_dict(self.config):
            rank_zero_log(
                f"lightning_ac: resuming with activation_checkpointing {config_to_dict(self.config)}; the "
                f"checkpoint was written with {saved}. Memory use and step time may differ; gradients do not.",
                logging.WARNING,
            )


class ActivationOffload(SuiteCallback):
    """Move saved activations to host memory until backward needs them.

    Targets (each ``"none"`` or ``"cpu"``; ``True``/``False`` mean cpu/none):

    - ``hidden_states``: each checkpointed decoder layer's input. Needs :class:`ActivationCheckpointing`.
    - ``selective``: what the selective checkpointing policy saves. Needs ``ActivationCheckpointing(selective=...)``.
    - ``all``: every activation saved in the training forward (with recompute: what is saved outside the
      layers plus each layer's input). Cannot be combined with ``hidden_states``.

    On an accelerator, copies run on side streams with pinned host buffers and are prefetched in backward.
    On a CPU-only trainer there is nothing to gain: the callback logs once and does nothing, unless
    ``copy_on_host=True`` forces the full pack/unpack path (copies into separate host buffers).

    Args:
        hidden_states: Placement of each checkpointed layer's input.
        selective: Placement of what the selective policy saves.
        all: Placement of every saved activation.
        copy_on_host: On a CPU device, still run the copies (tests, debugging).
        min_offload_bytes: ``all`` leaves smaller tensors on the device (copying them costs more than it saves).
        max_pinned_bytes: Upper bound of the reusable pinned host-buffer pool.
        host_reserve_bytes: Host memory left free; offloading past ``MemAvailable`` minus this raises
            :class:`~lightning_ac.offload.HostMemoryError` instead of an OOM kill.
        verbose: At fit start, print a table per decoder layer (see :class:`ActivationCheckpointing`).
        prog_bar: Show ``lightning_ac/offload_bytes`` in the progress bar.

    Attributes:
        last_step: ``{"hidden_states": {"tensors": n, "bytes": n}, "selective": {...}, "all": {...}}`` for the
            most recent training step. The same figures are logged as ``lightning_ac/offload_bytes`` and
            ``lightning_ac/offload_<target>_bytes``.
    """

    def __init__(
        self,
        *,
        hidden_states: Any = "none",
        selective: Any = "none",
        all: Any = "none",
        copy_on_host: bool = False,
        min_offload_bytes: int = 2**16,
        max_pinned_bytes: int = 8 * 2**30,
        host_reserve_bytes: int = 2 * 2**30,
        verbose: bool = False,
        prog_bar: bool = False,
    ) -> None:
        self.verbose = bool(verbose)
        self.prog_bar = bool(prog_bar)
        self.offload = OffloadConfig(
            hidden_states=parse_placement(hidden_states, "ActivationOffload(hidden_states=...)"),
            selective=parse_placement(selective, "ActivationOffload(selective=...)"),
            all=parse_placement(all, "ActivationOffload(all=...)"),
        )
        if self.offload.hidden_states != Placement.none and self.offload.all != Placement.none:
            raise ConfigError(
                "ActivationOffload: hidden_states='cpu' cannot be combined with all='cpu', which already offloads "
                "each layer's input. Keep one of them."
            )
        for name, value in (("min_offload_bytes", min_offload_bytes), ("max_pinned_bytes", max_pinned_bytes),
                            ("host_reserve_bytes", host_reserve_bytes)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"ActivationOffload({name}=...): expected an integer >= 0, got {value!r}.")
        if not isinstance(copy_on_host, bool):
            raise ConfigError(f"ActivationOffload(copy_on_host=...): expected True or False, got {copy_on_host!r}.")
        self.copy_on_host = copy_on_host
        self.min_offload_bytes = min_offload_bytes
        self.max_pinned_bytes = max_pinned_bytes
        self.host_reserve_bytes = host_reserve_bytes
        self.last_step: Dict[str, Dict[str, int]] = {t: {"tensors": 0, "bytes": 0} for t in TARGETS}
        self._reported_host_use = False

    def _report_host_use(self, step_bytes: int) -> None:
        """After the first step: how much host memory a step holds, and a warning when little is left."""
        available = available_host_bytes()
        free = f", {available / 2**30:.1f} GiB host memory available" if available is not None else ""
        rank_zero_log(f"lightning_ac: offloading {step_bytes / 2**20:.1f} MiB to host memory per step{free}")
        if available is not None and step_bytes > 0.5 * available:
            rank_zero_log(
                f"lightning_ac: offloading holds {step_bytes / 2**30:.1f} GiB of host memory per step, more than half "
                f"of the {available / 2**30:.1f} GiB available; a larger batch or sequence will not fit. Consider "
                "offload.hidden_states instead of offload.all.",
                logging.WARNING,
            )

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._reported_host_use = False
        super().setup(trainer, pl_module, stage)

    @property
    def targets(self) -> List[str]:
        """The targets that move to the host."""
        return [t for t in TARGETS if getattr(self.offload, t) != Placement.none]

    def needs_checkpointing(self) -> Optional[str]:
        """A description of this callback if it cannot work without ActivationCheckpointing, else ``None``."""
        needs = [t for t in ("hidden_states", "selective") if getattr(self.offload, t) != Placement.none]
        return f"ActivationOffload({', '.join(f'{t}={chr(39)}cpu{chr(39)}' for t in needs)})" if needs else None

    def runtime_kwargs(self) -> Dict[str, Any]:
        return {
            "copy_on_host": self.copy_on_host,
            "min_offload_bytes": self.min_offload_bytes,
            "max_pinned_bytes": self.max_pinned_bytes,
            "host_reserve_bytes": self.host_reserve_bytes,
        }

    def block(self) -> Dict[str, Any]:
        return {"offload": {t: str(getattr(self.offload, t)) for t in TARGETS}}

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._plan is not None and self._plan.offload is not None:
            self._plan.offload.start_step()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        runtime = self._plan.offload if self._plan is not None else None
        if runtime is None:
            return
        runtime.finish_step()
        self.last_step = runtime.last_step
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


class LayerOffload(SuiteCallback):
    """Keep frozen decoder-layer parameters in host memory and stream them to the device one layer at a time.

    Before a decoder layer runs (forward, and backward in reverse), its frozen parameters are copied to the
    device on a side stream while the layer before it computes; afterwards the device copy is freed. Device
    memory drops by about the frozen parameters of all decoder layers minus two layers' worth (the one running
    and the one arriving), at the price of PCIe traffic each step. Best with LoRA/QLoRA, where almost every
    parameter is frozen; it stacks with :class:`ActivationCheckpointing` and :class:`ActivationOffload`.

    Trainable parameters, quantized or sharded parameter subclasses, parameters shared between layers, and
    everything outside the decoder layers (embeddings, output head) stay on the device. Between steps a
    streamed parameter's data is its host copy, so ``state_dict`` and checkpoints hold the right values; after
    the run every parameter has memory of its own again, on the same device as the rest of the module (the CPU
    once Lightning's teardown has moved it there). A parameter unfrozen during training (a fine-tuning schedule)
    leaves the stream at its layer's next call.

    Args:
        layers: For models that are not transformers models: the decoder layers, as layer classes or globs over
            qualified module names (see :class:`ActivationCheckpointing`).
        copy_on_host: On a CPU-only trainer, run the copies anyway (tests, debugging). Without it a CPU-only
            trainer is a :class:`ConfigError`: the parameters already live in host memory there.
        host_reserve_bytes: Host memory left free: if the frozen weights need more, the first forward raises
            :class:`~lightning_ac.offload.HostMemoryError` instead of meeting the OOM killer.
        verbose: At fit start, print a table per decoder layer (see :class:`ActivationCheckpointing`).
        prog_bar: Show ``lightning_ac/layer_offload_bytes`` in the progress bar.

    Attributes:
        last_step: ``{"loads": n, "bytes": n, "max_resident_layers": n}`` for the most recent training step:
            layer copies to the device, bytes copied, and the most layers on the device at once. ``bytes`` is
            also logged as ``lightning_ac/layer_offload_bytes``.
        host_bytes: Bytes of parameters held in host memory.

    Raises:
        ConfigError: If an argument is invalid; in ``setup``, on a sharding strategy (FSDP, DeepSpeed), on a
            CPU-only trainer without ``copy_on_host``, for compiled decoder layers, or when the decoder layers
            have no frozen parameters.
    """

    def __init__(
        self,
        *,
        layers: Optional[Sequence[LayerSpec]] = None,
        copy_on_host: bool = False,
        host_reserve_bytes: int = 2 * 2**30,
        verbose: bool = False,
        prog_bar: bool = False,
    ) -> None:
        self.layers = _check_layers(layers, "LayerOffload")
        if not isinstance(copy_on_host, bool):
            raise ConfigError(f"LayerOffload(copy_on_host=...): expected True or False, got {copy_on_host!r}.")
        if isinstance(host_reserve_bytes, bool) or not isinstance(host_reserve_bytes, int) or host_reserve_bytes < 0:
            raise ConfigError(
                f"LayerOffload(host_reserve_bytes=...): expected an integer >= 0, got {host_reserve_bytes!r}."
            )
        self.copy_on_host = copy_on_host
        self.host_reserve_bytes = host_reserve_bytes
        self.verbose = bool(verbose)
        self.prog_bar = bool(prog_bar)
        self.last_step: Dict[str, int] = {"loads": 0, "bytes": 0, "max_resident_layers": 0}
        self.host_bytes = 0

    def block(self) -> Dict[str, Any]:
        return {}  # a separate key (layer_offloading), not part of the activation_checkpointing block

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        streamer = self._plan.layer_streamer if self._plan is not None else None
        if streamer is not None:
            streamer.start_step()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        streamer = self._plan.layer_streamer if self._plan is not None else None
        if streamer is None:
            return
        self.last_step = dict(streamer.stats)
        self.host_bytes = streamer.host_bytes
        pl_module.log(
            "lightning_ac/layer_offload_bytes", float(self.last_step["bytes"]),
            on_step=True, on_epoch=False, batch_size=1, prog_bar=self.prog_bar,
        )  # fmt: skip


def callbacks_from_config(
    block: Any, *, layer_offloading: bool = False, copy_on_host: bool = False, verbose: bool = False
) -> List[Callback]:
    """Build the suite callbacks an ``activation_checkpointing`` block asks for.

    Args:
        block: The block in any form :func:`~lightning_ac.parse_config` accepts.
        layer_offloading: The separate ``layer_offloading`` key.
        copy_on_host: Passed to :class:`ActivationOffload` and :class:`LayerOffload`: run the offload copies on a
            CPU-only trainer too.
        verbose: Print the per-layer table at fit start.

    Returns:
        The callbacks to pass to ``Trainer(callbacks=...)``; empty when everything is off.

    Raises:
        ConfigError: If the block or ``layer_offloading`` is invalid.
    """
    cfg = parse_config(block)
    if not isinstance(layer_offloading, bool):
        raise ConfigError(f"layer_offloading: expected true or false, got {layer_offloading!r}.")
    callbacks: List[Callback] = []
    if cfg.enabled:
        callbacks.append(
            ActivationCheckpointing(
                implementation=cfg.implementation,
                reentrant=cfg.reentrant,
                kwargs=cfg.kwargs,
                selective=config_to_dict(cfg)["selective"],
                verbose=verbose,
            )
        )
    off = cfg.offload
    if any(getattr(off, t) != Placement.none for t in ("hidden_states", "selective", "all")):
        callbacks.append(
            ActivationOffload(
                hidden_states=off.hidden_states,
                selective=off.selective,
                all=off.all,
                copy_on_host=copy_on_host,
                verbose=verbose,
            )
        )
    if layer_offloading:
        callbacks.append(LayerOffload(copy_on_host=copy_on_host, verbose=verbose))
    return callbacks
