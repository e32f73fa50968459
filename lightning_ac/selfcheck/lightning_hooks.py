"""The self-check of the Lightning hooks the suite callbacks implement (on a Lightning release newer than the tested
ones): each exists on ``Callback`` with as many parameters, and a one-step fit calls them in the order the plan
relies on."""

from __future__ import annotations

from typing import Any, List

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_ac.callbacks.activation_offload import ActivationOffload
from lightning_ac.callbacks.base import SuiteCallback
from lightning_ac.callbacks.checkpointing import ActivationCheckpointing
from lightning_ac.callbacks.layer_offload import LayerOffload
from lightning_ac.private_trainer import lightning_quiet, without_trainer_environment
from lightning_ac.release_gate import register
from lightning_ac.selfcheck.verdict import SelfCheckFailed

__all__ = []


# The hooks the suite callbacks rely on, in the order Lightning calls them in a fit of one step (DESIGN.md).
_FIT_ORDER = (
    "setup",
    "configure_model",
    "on_fit_start",
    "on_train_batch_start",
    "training_step",
    "on_before_backward",
    "on_after_backward",
    "on_train_batch_end",
    "teardown",
)


class _HookProbe(Callback):
    """Records the hooks the suite callbacks implement as Lightning calls them, and overrides the module's
    ``configure_model`` and ``training_step`` on the instance in ``setup``, as the plan does."""

    def __init__(self) -> None:
        self.calls: List[str] = []

    def _record(self, name: str) -> None:
        self.calls.append(name)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._record("setup")
        configure_model, training_step = pl_module.configure_model, pl_module.training_step

        def configure_model_override() -> None:
            self._record("configure_model")
            configure_model()

        def training_step_override(*args: Any, **kwargs: Any) -> Any:
            self._record("training_step")
            return training_step(*args, **kwargs)

        pl_module.configure_model = configure_model_override  # type: ignore[method-assign]
        pl_module.training_step = training_step_override  # type: ignore[method-assign]

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._record("teardown")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._record("on_exception")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record("on_fit_start")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self._record("on_train_batch_start")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._record("on_before_backward")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record("on_after_backward")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self._record("on_train_batch_end")


class _ProbeModule(pl.LightningModule):
    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail:
            raise _ProbeFailure()
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _ProbeFailure(Exception):
    pass


def _probe_fit(fail: bool) -> List[str]:
    """The hooks a one-step fit on the CPU calls, in order (``fail``: its training step raises)."""
    probe = _HookProbe()
    with without_trainer_environment():
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=1, callbacks=[probe], barebones=True, num_sanity_val_steps=0
        )
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(2, 2)), batch_size=2)
    try:
        trainer.fit(_ProbeModule(fail), data)
    except _ProbeFailure:
        pass
    return probe.calls


def _check_lightning_hooks(others: Any) -> None:
    """The Lightning hooks the suite callbacks implement exist on ``Callback`` with as many parameters (a hook that a
    release removed or reshaped would never be called, silently); and a one-step fit calls them, and the instance
    overrides of ``configure_model`` and ``training_step`` the plan installs, in the order the plan relies on, with
    ``on_exception`` and no ``teardown`` when the step raises."""
    import inspect

    for cls in (SuiteCallback, ActivationCheckpointing, ActivationOffload, LayerOffload):
        for name, ours in vars(cls).items():
            if not (name.startswith("on_") or name in ("setup", "teardown", "state_dict", "load_state_dict")):
                continue
            theirs = getattr(Callback, name, None)
            if theirs is None:
                raise SelfCheckFailed(
                    f"lightning's Callback has no {name} hook, which {cls.__name__}.{name} implements"
                )
            expected = list(inspect.signature(theirs).parameters)
            if len(inspect.signature(ours).parameters) != len(expected):
                raise SelfCheckFailed(f"lightning's Callback.{name} now takes ({', '.join(expected)})")
    with lightning_quiet():
        calls, failing = _probe_fit(fail=False), _probe_fit(fail=True)
    if calls != list(_FIT_ORDER):
        raise SelfCheckFailed(
            f"a one-step fit called {', '.join(calls)}, where the suite callbacks rely on {', '.join(_FIT_ORDER)}"
        )
    if "on_exception" not in failing or "teardown" in failing:
        raise SelfCheckFailed(
            f"a fit whose step raised called {', '.join(failing)}: the suite callbacks remove what they installed in "
            "on_exception, which Lightning calls there instead of teardown"
        )


register(
    "callbacks",
    ("lightning",),
    None,
    _check_lightning_hooks,
    "compared the Lightning hooks the suite callbacks implement with Callback's, and ran a one-step fit recording them",
)
