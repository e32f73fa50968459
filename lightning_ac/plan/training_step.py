"""The training step's wrapper: what of the plan happens at the step itself rather than at a hook."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, List, Optional, Sequence, Union

from lightning.pytorch import LightningModule

from lightning_ac._logging import rank_zero_info
from lightning_ac.budget import BudgetController
from lightning_ac.config import ActivationOffloadRequest, LayerOffloadRequest
from lightning_ac.offload.activations import ActivationOffloadRuntime
from lightning_ac.offload.weights import LayerWeightStreamer
from lightning_ac.train_mode import TrainModeGuard
from lightning_ac.verify import StepVerifier

__all__ = ["transferred", "verifier_for", "wrap_training_step"]


def wrap_training_step(
    module: LightningModule,
    trainer: Any,
    runtime: Optional[ActivationOffloadRuntime],
    verifier: Optional[StepVerifier],
    budget: Optional[BudgetController],
    guard: Optional[TrainModeGuard] = None,
) -> None:
    """What happens at the training step itself, not at ``on_train_batch_start`` (a LightningModule whose
    ``on_train_batch_start`` returns -1 skips the step and the rest of the epoch, and nothing of ours may stay
    hooked through ``on_train_epoch_end`` and validation; the module's own hooks have run by then; Lightning
    zeroes the gradients after this call, before backward, which is why verify mode compares at
    ``on_before_backward``):

    - the offload runtime's step starts (``offload.all``'s saved-tensor hooks); it ends at
      ``on_train_batch_end``, after backward and the optimizer step;
    - the memory budget counts what the step saves outside the decoder layers, while it measures (its step itself
      starts at ``on_train_batch_start``, as the memory measurements of the benchmark do: MemTracker's module
      hooks must see the wrapped module's whole forward under DDP);
    - in verify mode, the reference pass runs first, on the same arguments;
    - the train-mode guard acts inside the step only (a callback's forward after it is its own).

    The module's journal puts its own ``training_step`` back when the plan is removed.
    """
    if runtime is None and verifier is None and budget is None and guard is None:
        return
    original = module.training_step

    def step(*args: Any, **kwargs: Any) -> Any:
        if runtime is not None and not runtime.in_step:  # a closure an optimizer calls again (LBFGS): same step
            runtime.start_step()
        if budget is not None:
            with budget.meter.outside(module):  # what the step saves outside the layers, while measuring
                return original(*args, **kwargs)
        return original(*args, **kwargs)

    @functools.wraps(original)
    def training_step(*args: Any, **kwargs: Any) -> Any:
        with guard.step() if guard is not None else contextlib.nullcontext():
            if verifier is not None:
                verifier.reference_pass(trainer, module, step, args, kwargs)
            return step(*args, **kwargs)

    module.training_step = training_step  # type: ignore[method-assign]


def transferred(
    activation_offload: Optional[ActivationOffloadRuntime], weight_streamer: Optional[LayerWeightStreamer]
) -> List[str]:
    """What this run transfers, in verify mode's words: ``offload.<target>`` and ``layer offloading``."""
    targets = [f"offload.{t}" for t in activation_offload.targets] if activation_offload else []
    return targets + (["layer offloading"] if weight_streamer is not None else [])


def verifier_for(
    requests: Sequence[Union[ActivationOffloadRequest, LayerOffloadRequest]],
    transfers: List[str],
    trainer: Any,
    module: Any,
    reset_engines: Callable[[], None],
) -> Optional[StepVerifier]:
    """Verify mode for a run that trains, when a request asks for it and ``transfers`` is not empty (a line says so
    when there is nothing to verify); checked against the Trainer and module before it is built."""
    steps = max((r.verify_steps for r in requests), default=0)
    if not steps:
        return None
    if not transfers:
        rank_zero_info("verify mode: nothing is transferred in this run, so there is nothing to verify")
        return None
    StepVerifier.check(trainer, module)
    atol = max(r.verify_atol for r in requests)
    return StepVerifier(steps, atol, transfers, reset_engines)
