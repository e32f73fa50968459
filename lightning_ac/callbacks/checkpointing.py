"""The :class:`ActivationCheckpointing` callback: recompute (selective or whole, under a memory budget or not) and
the chunked loss."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import lightning.pytorch as pl

from lightning_ac._logging import rank_zero_warn
from lightning_ac.callbacks.base import SuiteCallback
from lightning_ac.config import CheckpointingRequest, config_to_dict, parse_config
from lightning_ac.layers import LayerSpec
from lightning_ac.plan import Plan

__all__ = ["ActivationCheckpointing"]


class ActivationCheckpointing(SuiteCallback):
    """Recompute decoder layers in backward instead of keeping their activations.

    Its arguments are the ``activation_checkpointing`` block's fields
    (:class:`~lightning_ac.ActivationCheckpointingConfig`: YAML writes ``true`` where Python writes ``True``), and
    ``layers``, ``verbose``, ``prog_bar``; each is documented here, once.

    Args:
        implementation: ``"hf"`` (transformers' checkpointing; plain torch layers get torch's checkpoint around their
            ``forward``) or ``"fsdp"`` (torch's non-reentrant checkpoint around each decoder layer's ``forward``,
            outside transformers, so FSDP's hooks stay outside the recompute; needs an FSDP strategy).
        reentrant: ``use_reentrant``. ``None`` (default) picks non-reentrant checkpointing (reentrant under
            DeepSpeed ZeRO-3).
        kwargs: Extra ``torch.utils.checkpoint.checkpoint`` arguments (``preserve_rng_state``,
            ``determinism_check``, ``debug``, ``early_stop``), plus ``every_n_layers`` (checkpoint every n-th decoder
            layer only). Keys the suite sets itself (``context_fn``, ``respect_saved_tensors_hooks``), ``offload``
            (use ``ActivationOffload(hidden_states=...)``), ``use_reentrant`` (use ``reentrant``) and anything torch
            does not accept are rejected: torch would hand them to each layer's forward.
        selective: Selective activation checkpointing: ``True`` (save attention) or a mapping of
            :class:`~lightning_ac.SelectiveConfig`'s fields (``save``, ``save_modules``, ``save_matmul_min_k``,
            ``save_sliding_window``, ``recompute_layer_types``); ``None`` or ``False`` when off.
        layers: For models that are not transformers models: the decoder layers, as layer classes or globs
            over qualified module names (``"model.blocks.*"``). ``None`` finds transformers layers. A string that
            imports as ``package.module.Class`` to an ``nn.Module`` subclass names that class (a YAML or LightningCLI
            config names classes so); any other string is a glob.
        budget: The memory budget: the activation memory one training step may use, as bytes or text with a unit
            (``"24GiB"``, ``"512MiB"``, ``"20GB"``, ``"300 MB"``), or ``"auto"`` (CUDA: the memory free at the first
            step, less a margin). The first step recomputes every layer and measures each; from then on the layers
            that fit keep their activations, the rest are recomputed, at the least recompute time (see
            :mod:`lightning_ac.budget`). Not with ``kwargs.every_n_layers``, which chooses the layers itself.
        budget_first_plan: With ``budget``: ``"measure"`` (default: the first step recomputes every layer and
            measures each) or ``"estimate"`` (before the first step, this run's training step runs once on fake
            tensors at the first batch's shape, allocating nothing, and the first real step runs its plan and
            checks it). See :mod:`lightning_ac.budget.first_plan`.
        chunked_loss: Compute a transformers causal-LM model's training loss a chunk of tokens at a time, so that
            the output head's logits never exist whole (for a real vocabulary they hold most of a step's activation
            memory): ``True`` (``chunk_tokens: auto``: chunks whose logits hold as many elements as the final hidden
            states, at least 128 tokens), ``"auto"`` (on where ``budget`` needs it, or where a step measured with it
            predicts a faster plan: :mod:`lightning_ac.budget.tools`)
            or ``{"chunk_tokens": N}`` (:class:`~lightning_ac.config.ChunkedLossConfig`). In those forwards the
            output's ``logits`` is ``None``. Applies with ``enabled=False`` too. See :mod:`lightning_ac.loss`.
        tiled_mlp: Run each decoder layer's MLP a tile of tokens at a time, saving only its input: in the backward each
            tile is recomputed and backpropagated at once, so the whole sequence's MLP intermediates (each ``tokens x
            intermediate_size``) never exist. ``True`` (``tile_tokens: auto``, the norms tiled too), ``"auto"`` (on
            where ``budget`` needs it or it predicts a faster plan, as ``chunked_loss``) or a mapping with
            ``tile_tokens``, ``norms`` and ``mlp_modules`` (:class:`~lightning_ac.config.TiledMLPConfig` says what each
            does). The MLP is the layer's ``mlp``; a sparse mixture of experts is refused. Applies with
            ``enabled=False`` too. See :mod:`lightning_ac.tiled_mlp`.
        enabled: ``False`` recomputes no decoder layer (then ``chunked_loss`` and ``tiled_mlp`` are what the callback
            does).
        verbose: At fit start, print a table per decoder layer: recomputed or not, what SAC saves, what is
            offloaded where (rich when installed, plain text otherwise).
        prog_bar: Show ``lightning_ac/peak_memory_bytes`` (logged each step on CUDA) in the progress bar.

    Raises:
        ConfigError: If an argument is invalid; the message names the argument and the fix.

    Example::

        trainer = Trainer(callbacks=[ActivationCheckpointing(kwargs={"every_n_layers": 2})])
        trainer = Trainer(callbacks=[ActivationCheckpointing(budget="20GiB")])
    """

    request_kind = "checkpointing"

    def __init__(
        self,
        *,
        implementation: str = "hf",
        reentrant: Optional[bool] = None,
        kwargs: Optional[Mapping[str, Any]] = None,
        selective: Union[bool, Mapping[str, Any], None] = None,
        layers: Optional[Sequence[LayerSpec]] = None,
        budget: Union[int, str, None] = None,
        chunked_loss: Union[bool, str, Mapping[str, Any], None] = None,
        enabled: bool = True,
        budget_first_plan: str = "measure",
        tiled_mlp: Union[bool, str, Mapping[str, Any], None] = None,
        verbose: bool = False,
        prog_bar: bool = False,
    ) -> None:
        request = CheckpointingRequest.from_arguments(
            implementation=implementation,
            reentrant=reentrant,
            kwargs=kwargs,
            selective=selective,
            layers=layers,
            budget=budget,
            chunked_loss=chunked_loss,
            enabled=enabled,
            budget_first_plan=budget_first_plan,
            tiled_mlp=tiled_mlp,
        )
        super().__init__(request, verbose=verbose, prog_bar=prog_bar)

    def _reset(self) -> None:
        self._budget_state: Optional[Dict[str, Any]] = None  # a checkpoint's settled plan, until this run takes it
        self._budget_summary: Optional[Dict[str, Any]] = None

    @property
    def config(self) -> Any:
        """The recompute part of the block this callback asks for."""
        return self.request.config

    @property
    def layers(self) -> Optional[List[LayerSpec]]:
        return self.request.layers

    @property
    def state_key(self) -> str:
        return "ActivationCheckpointing"

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"activation_checkpointing": config_to_dict(self.config)}
        budget = self._plan.budget if self._plan is not None else None
        if budget is not None and (budget.settled or budget.turned_on):  # tools on: a resumed step needs them too
            state["budget_plan"] = budget.state_dict()
        return state

    @property
    def budget_plan(self) -> Optional[Dict[str, Any]]:
        """With ``budget`` set: the plan of the latest run (per layer choices, estimated and measured peaks, its line),
        kept after the run ends; ``None`` before any run or without a budget."""
        budget = self._plan.budget if self._plan is not None else None
        return budget.summary() if budget is not None else self._budget_summary

    def _keep_after_run(self, plan: Plan) -> None:
        if plan.budget is not None and plan.budget.steps:  # a run that trained (validate and test keep the fit's)
            self._budget_summary = plan.budget.summary()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._hand_over_budget_state()

    def _hand_over_budget_state(self) -> None:
        """A checkpoint's settled plan goes to this run's budget (Lightning restores callback state after setup,
        and a plan deferred to configure_model exists only after that)."""
        budget = self._plan.budget if self._plan is not None else None
        if budget is not None and self._budget_state is not None:
            state, self._budget_state = self._budget_state, None
            budget.load_state_dict(state)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._hand_over_budget_state()
        super().on_fit_start(trainer, pl_module)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._budget_state = state_dict.get("budget_plan")
        self._hand_over_budget_state()
        saved = state_dict.get("activation_checkpointing")
        if saved is not None:
            # written before the block had a field (budget, chunked_loss, tiled_mlp...): that field at its default
            saved = {**config_to_dict(parse_config(True)), **saved}
        if saved is not None and saved != config_to_dict(self.config):
            rank_zero_warn(
                f"resuming with activation_checkpointing {config_to_dict(self.config)}; the checkpoint was written "
                f"with {saved}. Memory use and step time may differ; gradients do not."
            )
