"""The memory budget's first plan from the run's own training step on fake tensors, before the first real step.

With ``budget_first_plan: estimate``, at the first training batch and before its step runs, the LightningModule's
``training_step`` runs once with its parameters and buffers swapped for fake tensors (torch's ``FakeTensorMode``:
shapes, dtypes and devices, no memory) on the batch, faked at its shape, and backward runs on its loss. The budget's
controller measures that step as it measures a first real one (every layer recomputed: each layer's figures, what
is saved outside them, the output head's working set; its meter tells storages apart by identity, which fake ones
have) and makes its first plan from it. So the first real step already runs the plan instead of recomputing every
layer, and the closed loop checks it against that step's measured peak and corrects it as after any choice.

The step runs in the trainer's precision (a ``*-mixed`` precision's autocast), as Lightning runs it. It changes
nothing of the run: the real parameters get no gradients, no optimizer steps, nothing is logged (``self.log`` inside
it is a no-op), what it binds to the modules' attributes or appends to their lists is taken back, and the random
state, default dtype and device and torch's fake-tensor caches are put back (:func:`lightning_ac.fake.fake_session`).
What it changes elsewhere (a global, an object outside the module) it changes: a step with such side effects is best
run with ``budget_first_plan: measure``.

What it does not give: time. The layers' recompute seconds are the fake ops' wall time on the host, which ranks
alike layers alike and only decides between choices that both fit; the save rules' time is measured in the real
step that first runs them, as after a measured first step. A step that cannot run on fake tensors (an op with no
fake implementation, control flow on a tensor's value such as ``loss.item()`` in ``training_step``) is said in a
warning, and the first real step measures instead: nothing is lost but the step the estimate would have saved.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Tuple

import lightning.pytorch as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_ac._logging import rank_zero_info, rank_zero_warn
from lightning_ac.config import ConfigError

__all__ = ["check_first_plan", "plan_from_fake_step"]

FIELD = "activation_checkpointing.budget_first_plan"


def check_first_plan(pl_module: pl.LightningModule, offloads_activations: bool, offloads_layers: bool) -> None:
    """At setup: what a fake training step cannot run.

    Raises:
        ConfigError: Under manual optimization (the step runs the optimizers itself), or with activation or layer
            offloading (their copy engines' streams and pinned host buffers need real memory).
    """
    if not pl_module.automatic_optimization:
        raise ConfigError(
            f"{FIELD}: estimate runs the training step once on fake tensors before the first real step, but "
            f"{type(pl_module).__name__} uses manual optimization (automatic_optimization is False): its "
            "training_step steps the optimizers itself. Set budget_first_plan: measure (the first step measures)."
        )
    what = "activation offloading (offload.*)" if offloads_activations else "layer offloading"
    if offloads_activations or offloads_layers:
        raise ConfigError(
            f"{FIELD}: estimate runs the training step once on fake tensors, where {what} cannot run: its copy "
            "engines need real streams and host buffers. Set budget_first_plan: measure, or remove the offloading."
        )


def _fake_tensors(fake: Any, module: torch.nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module``, as a fake tensor of its shape, dtype, device and ``requires_grad``
    (a tied weight once: the swap ties its other names to it)."""
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        faked = fake.from_tensor(tensor)
        yield name, faked


@contextlib.contextmanager
def _attributes_kept(pl_module: pl.LightningModule) -> Iterator[None]:
    """What the step keeps beside the parameters and buffers is put back after it: tensors it binds to a module's
    attributes (a running sum), and the contents of lists (each step's loss appended, as Lightning's docs suggest in
    place of ``training_epoch_end``); what it adds is taken away. Else a fake tensor would stay in the real run."""
    saved = []
    for module in pl_module.modules():
        kept = {k: v for k, v in vars(module).items() if isinstance(v, (torch.Tensor, list))}
        saved.append((module, kept, {k: list(v) for k, v in kept.items() if isinstance(v, list)}))
    try:
        yield
    finally:
        for module, kept, contents in saved:
            for name, value in list(vars(module).items()):
                if name in kept:
                    if value is not kept[name]:
                        setattr(module, name, kept[name])
                    if name in contents:
                        kept[name][:] = contents[name]
                elif isinstance(value, (torch.Tensor, list)):
                    delattr(module, name)


def _loss_of(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise RuntimeError(
            f"training_step returned {type(output).__name__}, which holds no loss tensor: there is no backward to "
            "measure"
        )
    return loss


def _nothing(*args: Any, **kwargs: Any) -> None:
    """``self.log`` in the fake step: Lightning's metric states copy values, which fake tensors have none of."""


def plan_from_fake_step(controller: Any, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> bool:
    """Run ``pl_module``'s training step on ``batch`` on fake tensors as the budget's measuring step, and let
    ``controller`` make its first plan from it.

    Returns:
        Whether the plan was made; ``False`` when the step could not run on fake tensors (warned), or when it turned
        on a tool the block leaves to the budget (said: :mod:`lightning_ac.budget.tools`): then the first real step
        measures, as with ``budget_first_plan: measure``.
    """
    from torch.nn.utils.stateless import _reparametrize_module

    from lightning_ac.fake import fake_mode, fake_session, patched

    shape = _batch_shape(batch)
    tools_before = len(controller.turned_on)
    try:
        with fake_session():
            fake = fake_mode()
            tensors = dict(_fake_tensors(fake, pl_module))
            fake_batch = apply_to_collection(batch, torch.Tensor, fake.from_tensor)
            with fake, _reparametrize_module(pl_module, tensors, tie_weights=True), _attributes_kept(pl_module):
                with patched(pl_module, "log", _nothing), patched(pl_module, "log_dict", _nothing):
                    controller.begin_step(pl_module, [], fake=True)
                    try:
                        # in the trainer's precision, as Strategy.training_step runs it (a *-mixed precision's
                        # autocast: without it, the step would measure fp32 activations); backward outside it
                        with pl_module.trainer.precision_plugin.train_step_context():
                            output = pl_module.training_step(fake_batch, batch_idx)
                        loss = _loss_of(output)
                        controller.before_backward()
                        loss.backward()
                    except BaseException:
                        controller.abort_step()
                        raise
                    controller.end_step()
    except Exception as err:  # the step's own failure on fake tensors: the first real step measures instead
        controller.estimate_failed()
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        rank_zero_warn(
            f"{FIELD}: estimate: the training step could not run on fake tensors ({type(err).__name__}: "
            f"{first[:300]}), so the first step measures instead (every layer recomputed). An op with no fake "
            "implementation needs torch.library.register_fake; a step that reads a tensor's value (loss.item(), "
            "control flow on data) cannot run on fake tensors."
        )
        return False
    turned_on = controller.turned_on[tools_before:]
    if turned_on:  # said here: the session keeps the suite's log quiet while the fake step runs
        rank_zero_info(
            f"budget: by the training step on fake tensors at {shape}, every {controller.noun[:-1]} recomputed is over "
            f"the budget: turning {' and '.join(turned_on)} on; the first step measures again, every layer recomputed"
        )
        return False
    line = controller.plan_line()
    rank_zero_info(f"budget: the first plan, from the training step on fake tensors at {shape}: {line}; checked next")
    return True


def _batch_shape(batch: Any) -> str:
    """The batch's tensors' shapes, for the log line."""
    shapes = []
    apply_to_collection(batch, torch.Tensor, lambda t: shapes.append("x".join(map(str, t.shape))))
    return "the first batch's shape (" + ", ".join(shapes[:4]) + (", ..." if len(shapes) > 4 else "") + ")"
