"""The Lightning faces of the suite: thin callbacks over one shared :class:`~lightning_ac.plan.Plan`."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_ac.config import ConfigError, OffloadConfig, Placement, config_to_dict, parse_config, parse_placement
from lightning_ac.layers import LayerSpec
from lightning_ac.plan import Plan

__all__ = ["ActivationCheckpointing", "ActivationOffload", "LayerOffload", "SuiteCallback", "callbacks_from_config"]


class SuiteCallback(Callback):
    """Base of the suite callbacks: shares one plan per Trainer run, applies it in ``setup``, removes it in
    ``teardown`` and ``on_exception``."""

    _plan: Optional[Plan] = None

    def block(self) -> Dict[str, Any]:
        """This callback's part of the ``activation_checkpointing`` block."""
        raise NotImplementedError

    @property
    def plan(self) -> Optional[Plan]:
        """The plan in force during a run, ``None`` outside one."""
        return self._plan

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._plan is not None and self._plan.module is pl_module and (self._plan.applied or self._plan._deferred):
            return  # another suite callback applied the shared plan already
        plan = Plan.gather(trainer)
        for cb in plan.callbacks:
            cb._plan = plan
        plan.apply(trainer, pl_module)

    def _release(self) -> None:
        plan = self._plan
        if plan is None:
            return
        plan.remove()
        for cb in plan.callbacks:
            cb._plan = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release()


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
    ) -> None:
        if layers is not None:
            if isinstance(layers, (str, type)) or not all(isinstance(s, (str, type)) for s in layers):
                raise ConfigError(
                    f"ActivationCheckpointing(layers=...): expected a list of layer classes or module-name globs, "
                    f"got {layers!r}. Write layers=[MyBlock] or layers=['model.blocks.*']."
                )
            layers = list(layers)
        self.config = parse_config(
            {
                "implementation": implementation,
                "reentrant": reentrant,
                "kwargs": dict(kwargs or {}),
                "selective": selective,
            }
        )
        self.layers = layers

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
            import logging

            from lightning_ac._logging import rank_zero_log

            rank_zero_log(
                f"lightning_ac: resuming with activation_checkpointing {config_to_dict(self.config)}; the "
                f"checkpoint was written with {saved}. Memory use and step time may differ; gradients do not.",
                logging.WARNING,
            )


class ActivationOffload(SuiteCallback):
    """Move saved activations to host memory until backward needs them.

    Not available in this version yet: constructing it with any target raises :class:`ConfigError`, so a
    config that asks for offloading never trains silently without it.
    """

    def __init__(
        self, *, hidden_states: Any = "none", selective: Any = "none", all: Any = "none", copy_on_host: bool = False
    ) -> None:
        self.offload = OffloadConfig(
            hidden_states=parse_placement(hidden_states, "ActivationOffload(hidden_states=...)"),
            selective=parse_placement(selective, "ActivationOffload(selective=...)"),
            all=parse_placement(all, "ActivationOffload(all=...)"),
        )
        offload = self.offload
        self.copy_on_host = copy_on_host
        requested = [t for t in ("hidden_states", "selective", "all") if getattr(offload, t) != Placement.none]
        raise ConfigError(
            f"activation_checkpointing.offload: {', '.join(f'{t}: cpu' for t in requested) or 'offloading'} is not "
            "available in this version of lightning_ac yet. Remove the offload targets, or use "
            "activation_checkpointing: true to recompute layers instead."
        )

    def block(self) -> Dict[str, Any]:  # pragma: no cover - unreachable until offloading lands
        return {"offload": {t: str(getattr(self.offload, t)) for t in ("hidden_states", "selective", "all")}}


class LayerOffload(SuiteCallback):
    """Stream frozen decoder-layer parameters from host memory one layer at a time.

    Not available in this version yet: constructing it raises :class:`ConfigError`.
    """

    def __init__(self) -> None:
        raise ConfigError(
            "layer_offloading: true is not available in this version of lightning_ac yet. Set layer_offloading: false."
        )

    def block(self) -> Dict[str, Any]:  # pragma: no cover - unreachable until layer offloading lands
        return {}


def callbacks_from_config(block: Any, *, layer_offloading: bool = False) -> List[Callback]:
    """Build the suite callbacks an ``activation_checkpointing`` block asks for.

    Args:
        block: The block in any form :func:`~lightning_ac.parse_config` accepts.
        layer_offloading: The separate ``layer_offloading`` key.

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
            )
        )
    off = cfg.offload
    if any(getattr(off, t) != Placement.none for t in ("hidden_states", "selective", "all")):
        callbacks.append(ActivationOffload(hidden_states=off.hidden_states, selective=off.selective, all=off.all))
    if layer_offloading:
        callbacks.append(LayerOffload())
    return callbacks
