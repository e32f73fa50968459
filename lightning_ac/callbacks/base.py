"""The base of the suite callbacks: one plan per Trainer run, shared by every suite callback in
``trainer.callbacks``. Whichever reaches ``setup`` first gathers their requests, builds the plan (which checks
their combination) and applies it; the others find it applied. Removal happens once, in ``teardown`` or
``on_exception``."""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Optional, Sequence, Type, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_ac._logging import rank_zero_info
from lightning_ac.budget.first_plan import plan_from_fake_step
from lightning_ac.config import ConfigError, parse_bool
from lightning_ac.plan import Plan
from lightning_ac.report import render_layer_table

__all__ = ["SuiteCallback"]

_Suite = TypeVar("_Suite", bound="SuiteCallback")


class SuiteCallback(Callback):
    """Base of the suite callbacks: shares one plan per Trainer run, applies it in ``setup``, removes it in
    ``teardown`` and ``on_exception``."""

    #: The :class:`~lightning_ac.plan.Plan` argument this callback's ``request`` is (each subclass names its own).
    request_kind: ClassVar[str]
    _plan: Optional[Plan] = None
    _peers: List[SuiteCallback] = []
    verbose: bool = False
    prog_bar: bool = False
    _step: OptimizerStep

    def __init__(self, request: Any, *, verbose: Any = False, prog_bar: Any = False) -> None:
        """Each subclass validates its own arguments into ``request`` (its typed request), then calls this."""
        name = type(self).__name__
        self.request = request
        self.verbose = bool(parse_bool(verbose, f"{name}(verbose=...)"))
        self.prog_bar = bool(parse_bool(prog_bar, f"{name}(prog_bar=...)"))
        self._reset()

    @classmethod
    def from_request(cls: Type[_Suite], request: Any, *, verbose: bool = False) -> _Suite:
        """The callback for an already validated request (:func:`~lightning_ac.callbacks_from_config` builds its
        requests from a validated block): the arguments are not parsed again. The one alternate constructor, like
        ``fractions.Fraction``'s: it skips only the subclass's argument parsing, and the state is set up where the
        subclass's constructor sets it up (``SuiteCallback.__init__`` and ``_reset``)."""
        callback = cls.__new__(cls)
        SuiteCallback.__init__(callback, request, verbose=verbose)
        return callback

    def _reset(self) -> None:
        """Set this callback's own figures and state to what a new callback has (each subclass its own)."""

    @property
    def plan(self) -> Optional[Plan]:
        """The plan in force during a run, ``None`` outside one."""
        return self._plan

    def __getstate__(self) -> Dict[str, Any]:
        """What a copy (``copy.deepcopy``, ``pickle``) holds: the arguments and the latest figures, not the plan of a
        run in progress. The plan's hooks, engines and host buffers belong to the model it was applied to (its
        storage references must never be duplicated); a copy is applied to nothing until a Trainer sets it up."""
        state = self.__dict__.copy()
        # the run's: our plan and peers, and the LightningModule's log methods Lightning binds onto callbacks
        for name in ("_plan", "_peers", "log", "log_dict"):
            state.pop(name, None)
        return state

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._step = OptimizerStep()  # a new run: no optimizer step under way
        self._shown_choices: Optional[tuple] = None  # the budget's choices the last table showed
        if self._plan is not None and self._plan.module is pl_module:
            return  # another suite callback applied the shared plan already
        peers = [cb for cb in trainer.callbacks if isinstance(cb, SuiteCallback)]
        plan = Plan(**{kind: _request_of(peers, kind) for kind in dict.fromkeys(type(cb).request_kind for cb in peers)})
        for cb in peers:
            cb._plan, cb._peers = plan, peers
        plan.apply(trainer, pl_module)

    def _release(self, after_exception: bool = False) -> None:
        plan, peers = self._plan, self._peers
        if plan is None:
            return
        for cb in peers:
            cb._keep_after_run(plan)
        try:
            plan.remove(after_exception)
        finally:
            for cb in peers:
                cb._plan, cb._peers = None, []

    def _keep_after_run(self, plan: Plan) -> None:
        """What a callback keeps of the run's plan before it is removed (its figures, for after the run)."""

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._plan is not None and self._plan.chunked_loss is not None:
            self._plan.chunked_loss.explain(exception, trainer.training)
        self._release(after_exception=True)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._plan is None or not self._is_first() or not any(cb.verbose for cb in self._peers):
            return  # one table per run, from the first suite callback
        rows = self._plan.layer_rows()
        if rows:
            rank_zero_info("decoder layers\n" + render_layer_table(rows))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._is_first() and pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        budget = self._plan.budget if self._is_first() and self._plan is not None else None
        if budget is not None and budget.wants_fake_step:
            plan_from_fake_step(budget, pl_module, batch, batch_idx)
        if budget is not None:
            budget.begin_step(pl_module, trainer.optimizers)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._is_first() and self._plan is not None and self._plan.verifier is not None:
            self._plan.verifier.check_loss(trainer, pl_module, loss)
        if self._is_first() and self._plan is not None and self._plan.budget is not None:
            self._plan.budget.before_backward()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._is_first() and self._plan is not None and self._plan.verifier is not None:
            self._plan.verifier.check_gradients(trainer, pl_module)
        if self._is_first() and self._plan is not None and self._plan.budget is not None:
            self._plan.budget.after_backward()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._is_first() and self._plan is not None and self._plan.verifier is not None:
            self._plan.verifier.step_done(trainer)
        budget = self._plan.budget if self._is_first() and self._plan is not None else None
        if budget is not None and budget.in_step:
            budget.end_step()
            for name, value in budget.metrics().items():
                pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
            self._show_settled_table(budget)
        if self._is_first() and pl_module.device.type == "cuda":
            peak = float(torch.cuda.max_memory_allocated(pl_module.device))
            pl_module.log(
                "lightning_ac/peak_memory_bytes", peak, on_step=True, on_epoch=False, batch_size=1,
                prog_bar=any(cb.prog_bar for cb in self._peers),
            )  # fmt: skip

    def _show_settled_table(self, budget: Any) -> None:
        """With ``verbose``: the per-layer table again when the budget's plan settles, and whenever a settled plan
        changes (the table at fit start shows the measuring step's choices)."""
        if not budget.settled or not any(cb.verbose for cb in self._peers) or self._plan is None:
            return
        choices = tuple(budget.choices)
        if choices == self._shown_choices:
            return
        self._shown_choices = choices
        rank_zero_info("decoder layers, as the budget settled\n" + render_layer_table(self._plan.layer_rows()))

    def _is_first(self) -> bool:
        return self._plan is not None and bool(self._peers) and self._peers[0] is self


def _request_of(peers: Sequence[SuiteCallback], kind: str) -> Any:
    """The request of the one callback of ``kind`` among ``peers``."""
    found = [cb for cb in peers if cb.request_kind == kind]
    if len(found) > 1:
        raise ConfigError(
            f"Trainer(callbacks=...) holds more than one {type(found[0]).__name__}. Each suite callback may appear "
            "once: merge their arguments into one instance."
        )
    return found[0].request


class OptimizerStep:
    """Which micro-batches make up one optimizer step (Lightning's step: ``global_step``, the logger's x-axis).

    ``global_step`` counts optimizer steps: it stays the same over the micro-batches of one step under gradient
    accumulation and has moved on by the end of the micro-batch that stepped. Under manual optimization it
    moves with the optimizers ``self.optimizers()`` hands out; stepping a raw torch optimizer publishes nothing.
    """

    def __init__(self) -> None:
        self.global_step: Optional[int] = None

    def begin(self, trainer: pl.Trainer) -> bool:
        """At a micro-batch's start: whether it is the first of a new optimizer step."""
        if trainer.global_step == self.global_step:
            return False
        self.global_step = trainer.global_step
        return True

    def done(self, trainer: pl.Trainer) -> bool:
        """At a micro-batch's end: whether the optimizer stepped, so the optimizer step is complete."""
        return trainer.global_step != self.global_step
