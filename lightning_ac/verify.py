"""Verify mode: the first optimizer steps run twice, and the offloaded run must match synchronous transfers.

For each micro-batch of the first ``verify_steps`` optimizer steps, just before Lightning's call of
``training_step`` (after its hooks and the optimizer's zero_grad), the training step runs once more on the same
arguments, from the same parameters, gradients, buffers and RNG state, as a reference: the same code path with every
transfer synchronous at the device seam (:func:`~lightning_ac.offload.device.synchronous_transfers`). Its loss and
gradients go to host memory, and everything it touched is put back (gradients, buffers, RNG state, the engines' step
figures), so that the real micro-batch runs exactly as it would have. The real loss is compared in
``on_before_backward`` and the real gradients in ``on_after_backward``, both before the optimizer steps; a
difference raises :class:`OffloadVerificationError`.

The reference pass calls ``training_step`` and backward directly: Lightning's hooks, loggers (``self.log`` is
muted), progress bar and LR schedulers do not see it; under DDP it runs inside ``no_sync`` (DDP's gradient all-reduce
runs once, in the real pass) and its gradients are all-reduced the way DDP reduces them before comparing.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from torch import nn

from lightning_ac._logging import rank_zero_info, rank_zero_warn
from lightning_ac.config import ConfigError
from lightning_ac.offload.device import synchronous_transfers
from lightning_ac.units import format_bytes

__all__ = ["OffloadVerificationError", "StepVerifier"]


class OffloadVerificationError(RuntimeError):
    """A verified step's loss or gradients differ from the same step with synchronous transfers: the offload
    copies raced on this machine. Raised before the optimizer steps."""


class StepVerifier:
    """Runs and checks the reference pass of each micro-batch of the first ``steps`` optimizer steps.

    Args:
        steps: How many optimizer steps to verify.
        atol: The largest absolute difference accepted (``0``: bit for bit).
        targets: The transfers in force, as messages name them (``offload.hidden_states``, ``layer offloading``).
        reset_engines: Called after the reference pass: the engines forget its figures and state.
    """

    def __init__(self, steps: int, atol: float, targets: List[str], reset_engines: Any) -> None:
        self.steps, self.atol, self.targets = steps, atol, targets
        self.reset_engines = reset_engines
        self.verified = 0  # optimizer steps verified so far
        self.host_bytes = 0  # most host memory the reference figures took at once
        self._contribution: Optional[List[Optional[torch.Tensor]]] = None  # the reference's gradients, on the host
        self._expected: Optional[List[Optional[torch.Tensor]]] = None  # per trainable parameter, on the host
        self._loss: Optional[torch.Tensor] = None
        self._step = -1  # the optimizer step being verified
        self._first: Optional[int] = None  # the run's first optimizer step (a resumed run starts past 0)

    @staticmethod
    def check(trainer: Any, module: nn.Module) -> None:
        """What verify mode cannot promise, refused before training."""
        where = "ActivationOffload/LayerOffload(verify_steps=...)"
        if not getattr(module, "automatic_optimization", True):
            raise ConfigError(
                f"{where}: verify mode re-runs Lightning's automatic optimization step, but this LightningModule "
                "optimizes manually (automatic_optimization = False), where the step's backward and optimizer calls "
                "are yours. Set verify_steps=0."
            )
        strategy = trainer.strategy
        # DeepSpeed's strategy is a DDPStrategy, but its engine runs backward and accumulation itself
        if isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            raise ConfigError(
                f"{where}: verify mode compares whole gradients on one device or under DDP, but the Trainer uses "
                f"{type(strategy).__name__}. Set verify_steps=0, or verify on a single device first."
            )
        if "dataloader_iter" in inspect.signature(module.training_step).parameters:
            raise ConfigError(
                f"{where}: verify mode runs the training step twice on the same batch, but this training_step takes "
                "dataloader_iter and fetches its own batches. Set verify_steps=0."
            )
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ConfigError(
                f"{where}: under {trainer.precision} precision the gradient scaler may skip or rescale a step, "
                "which the reference pass cannot reproduce. Verify under bf16-mixed or 32-true, or set verify_steps=0."
            )

    def verifying(self, trainer: Any) -> bool:
        """Whether this micro-batch belongs to the first ``steps`` optimizer steps of this run, counted from where
        the run starts (a resumed run, or a second fit, starts past step 0)."""
        if self._first is None:
            self._first = trainer.global_step
        return trainer.global_step < self._first + self.steps

    def announce(self) -> None:
        """The log line that says verify mode is on, and what it compares."""
        exact = "bit for bit" if self.atol == 0 else f"within {self.atol:g}"
        rank_zero_info(
            f"verify mode: each micro-batch of the first {self.steps} optimizer step{'s' if self.steps > 1 else ''} "
            f"runs twice, first with synchronous transfers ({', '.join(self.targets)}); compared {exact}"
        )
        if self.atol == 0 and torch.cuda.is_available() and not torch.are_deterministic_algorithms_enabled():
            rank_zero_warn(
                "verify mode compares bit for bit, but torch.use_deterministic_algorithms is off: a CUDA kernel that "
                "is not deterministic (some attention and embedding backward kernels) would show as a difference. "
                "Call torch.use_deterministic_algorithms(True) for the verified steps, or set verify_atol."
            )

    # -- the reference pass -----------------------------------------------------------------------------------

    def reference_pass(self, trainer: Any, module: nn.Module, step: Callable[..., Any], args: Any, kwargs: Any) -> None:
        """Run ``step`` (the training step as Lightning is about to call it, on the same arguments) with synchronous
        transfers and keep its loss and gradients on the host; leave the module, its gradients, buffers and the
        RNG streams as they were.

        Called from inside the training step, just before the real one, so that Lightning's hooks have run. The
        gradients the real backward adds to are known only once Lightning has zeroed them (or not: accumulation,
        an optimizer over some parameters, an ``optimizer_zero_grad`` of the user's), at ``on_before_backward``:
        this pass keeps its own contribution, computed from no gradients, and :meth:`check_loss` adds it to them.
        """
        self._loss = self._expected = self._contribution = None
        if not self.verifying(trainer):
            return
        self._step = trainer.global_step
        params = _trainable(module)
        rng = _collect_rng_states(include_cuda=torch.cuda.is_available())
        buffers = [(m, name, b, b.detach().to("cpu", copy=True)) for m in module.modules() for name, b in
                   m._buffers.items() if b is not None]  # fmt: skip
        earlier = [_to_host(p.grad) for p in params]  # moved out while the reference pass runs
        for p in params:
            p.grad = None
        log, log_dict = module.__dict__.get("log"), module.__dict__.get("log_dict")
        module.log = module.log_dict = _muted  # type: ignore[method-assign]
        loss: Optional[torch.Tensor] = None
        try:
            with synchronous_transfers(), _no_sync(trainer):
                output = step(*args, **kwargs)
                loss = output.get("loss") if isinstance(output, dict) else output
                if loss is not None:
                    closure_loss = loss / trainer.accumulate_grad_batches  # what Lightning's closure backpropagates
                    closure_loss.backward()
                    self._loss = closure_loss.detach().to("cpu", copy=True)
                    grads = [_to_host(p.grad) for p in params]
        finally:
            for name, value in (("log", log), ("log_dict", log_dict)):
                if value is None:
                    module.__dict__.pop(name, None)
                else:
                    setattr(module, name, value)
            for p, grad in zip(params, earlier):
                p.grad = grad.to(p.device) if grad is not None else None
            with torch.no_grad():
                for owner, name, buffer, saved in buffers:
                    owner._buffers[name] = buffer  # the same tensor, even if the step assigned a new one
                    buffer.copy_(saved)
            _set_rng_states(rng)
            self.reset_engines()
        if loss is None:
            return  # the step skips itself (training_step returned None): Lightning runs no backward to compare
        self._contribution = grads

    # -- the checks -------------------------------------------------------------------------------------------

    def check_loss(self, trainer: Any, module: nn.Module, loss: torch.Tensor) -> None:
        """At ``on_before_backward``: the real loss against the reference's; and what the real gradients must be
        after this backward: the gradients now (zeroed or accumulated, as Lightning left them) plus the
        reference's contribution (all-reduced as DDP does when this backward synchronizes)."""
        if self._loss is None or self._contribution is None:
            return
        expected, self._loss = self._loss, None
        real = loss.detach().to("cpu")
        if not self._same(real, expected):
            what = f"the loss is {real.item()!r}, {expected.item()!r} with synchronous transfers"
            raise self._diverged(trainer, what) if not torch.isfinite(expected).all() else self._error(trainer, what)
        params = _trainable(module)
        base = [_to_host(p.grad) for p in params]
        self._expected = [_sum(b, c) for b, c in zip(base, self._contribution)]
        if _syncs_gradients(trainer):
            self._expected = _all_reduced_like_ddp(self._expected, params)
        self.host_bytes = max(self.host_bytes, _bytes(self._expected) + _bytes(self._contribution))
        self._contribution = None

    def check_gradients(self, trainer: Any, module: nn.Module) -> None:
        if self._expected is None:
            return
        expected, self._expected = self._expected, None
        first: Optional[Tuple[str, float]] = None
        largest = 0.0
        for (name, p), want in zip(_named_trainable(module), expected):
            got = _to_host(p.grad)
            if got is None and (want is None or not want.any()):
                continue  # no gradient, or (DDP with unused parameters) a reduced zero one
            if got is None or want is None or got.shape != want.shape:
                first = first or (name, float("inf"))
                largest = float("inf")
                continue
            difference = _largest_difference(got, want)
            if not self._same(got, want):
                first = first or (name, difference)
            largest = max(largest, difference)
        if first is not None:
            what = (
                f"the gradient of {first[0]} differs by up to {first[1]:.3e} (the largest difference over all "
                f"parameters: {largest:.3e})"
            )
            finite = all(w is None or bool(torch.isfinite(w).all()) for w in expected)
            raise self._error(trainer, what) if finite else self._diverged(trainer, what)

    def step_done(self, trainer: Any) -> None:
        """After each micro-batch: once the last verified optimizer step is complete, say so."""
        if self._step < 0 or trainer.global_step == self._step or self.verified == self.steps:
            return
        self.verified = trainer.global_step - (self._first or 0)
        if self.verified >= self.steps:
            self.verified = self.steps
            exact = "bit-identical" if self.atol == 0 else f"within {self.atol:g}"
            rank_zero_info(
                f"verified {self.steps} step{'s' if self.steps > 1 else ''}: gradients {exact} to synchronous "
                f"transfers ({', '.join(self.targets)}); the reference held {format_bytes(self.host_bytes)} of "
                "host memory"
            )

    def _same(self, got: torch.Tensor, want: torch.Tensor) -> bool:
        if self.atol == 0:  # bit for bit: identical NaNs match too (torch.equal says NaN differs from itself)
            return got.dtype == want.dtype and torch.equal(_bits(got), _bits(want))
        return bool(torch.allclose(got, want, rtol=0.0, atol=self.atol, equal_nan=True))

    def _diverged(self, trainer: Any, what: str) -> OffloadVerificationError:
        """A mismatch where the synchronous reference itself is not finite: the model diverged, and a NaN's bits
        tell nothing about the transfers."""
        return OffloadVerificationError(
            f"verify: optimizer step {self._step} (batch {trainer.fit_loop.epoch_loop.batch_idx}): {what}; the "
            "reference with synchronous transfers is not finite itself, so the training diverged (a learning rate "
            "too high, a loss over an empty batch, an overflow in half precision) and the comparison cannot tell "
            "whether the transfers are exact. Fix the NaN or inf first (torch.autograd.set_detect_anomaly(True) "
            "finds the op), then verify again."
        )

    def _error(self, trainer: Any, what: str) -> OffloadVerificationError:
        targets = ", ".join(self.targets)
        return OffloadVerificationError(
            f"verify: optimizer step {self._step} (batch {trainer.fit_loop.epoch_loop.batch_idx}): {what}, with "
            f"{targets} in force. The transfers raced on this machine (GPU, driver and torch version): please "
            "report it at https://github.com/lightning-ac/lightning_ac/issues with this message, and train with "
            f"{targets} off meanwhile."
        )


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A floating tensor's bits as integers of its size (so that comparing them is bit for bit); others as they are."""
    ints = _SAME_SIZE_INTS.get(tensor.element_size()) if tensor.is_floating_point() else None
    return tensor.contiguous().view(ints) if ints is not None else tensor


def _muted(*args: Any, **kwargs: Any) -> None:
    """``self.log`` during the reference pass: its values are not the step's."""


def _trainable(module: nn.Module) -> List[nn.Parameter]:
    return [p for _, p in _named_trainable(module)]


def _named_trainable(module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _to_host(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return tensor.detach().to("cpu", copy=True) if tensor is not None else None


def _sum(earlier: Optional[torch.Tensor], grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """What autograd's accumulation makes of ``earlier`` and this micro-batch's ``grad``."""
    if earlier is None:
        return grad
    if grad is None:
        return earlier
    return earlier + grad


def _bytes(tensors: List[Optional[torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _largest_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.numel() == 0:
        return 0.0
    difference = (got.double() - want.double()).abs()
    return float(difference.nan_to_num(nan=float("inf")).max())


@contextlib.contextmanager
def _no_sync(trainer: Any) -> Any:
    """DDP's ``no_sync``: the reference pass's backward must not all-reduce."""
    model = trainer.strategy.model
    with model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext():
        yield


def _syncs_gradients(trainer: Any) -> bool:
    """Whether the real micro-batch's backward all-reduces (DDP, at the last micro-batch of an optimizer step)."""
    if not isinstance(trainer.strategy, DDPStrategy) or not (dist.is_available() and dist.is_initialized()):
        return False
    # Lightning's own test for "this micro-batch accumulates" (it runs those backward passes under no_sync)
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def _all_reduced_like_ddp(
    grads: List[Optional[torch.Tensor]], params: List[nn.Parameter]
) -> List[Optional[torch.Tensor]]:
    """DDP's reduction of local gradients: each divided by the world size, then summed over the processes (through
    the device on backends that need device tensors). Every process reduces every parameter, in the same order:
    one without a gradient here (unused on this process) takes part with zeros, as in DDP."""
    world = dist.get_world_size()
    reduced: List[Optional[torch.Tensor]] = []
    for grad, param in zip(grads, params):
        local = grad if grad is not None else torch.zeros(param.shape, dtype=param.dtype)
        staged = (local / world).to(param.device)
        dist.all_reduce(staged)
        reduced.append(staged.to("cpu"))
    return reduced
