"""The modules a training step needs in training mode, checked where the step reaches them.

transformers recomputes a decoder layer only while the layer is in training mode, and torch's checkpoint around a
layer's forward (the ``torch`` and ``fsdp`` engines) follows the same rule; the chunked loss stands in for a model's
loss only in training forwards. ``from_pretrained`` returns models in eval mode, and Lightning 2.6 leaves the modes
of submodules as it finds them, so a model loaded that way would train with none of it, while the applied line says
otherwise. The step stops instead, naming the cause, the model and the fix.

What counts is what a training step would lose: a recomputed layer whose forward records a graph (gradients enabled, and
a parameter or an input that needs a gradient), or a chunked-loss model computing a loss with a graph from ``labels``,
called in eval mode inside the LightningModule's ``training_step``. A frozen reference model or teacher in eval mode
beside a policy in training mode (DPO, distillation, RLHF) is left alone, under ``no_grad`` or not; so is a callback's
own forward and backward outside the step (a gradient probe), and a module that calls ``.train()`` in its own training
step: the modes are read at the call, not at the batch's start. Under ``torch.compile`` the hooks are traced, not run,
so a compiled model is checked once, eagerly, as its first training step begins: what is in eval mode then and has
parameters to train.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from lightning_ac.layers import how_compiled

__all__ = ["EvalModeError", "TrainModeGuard"]


class EvalModeError(RuntimeError):
    """A training step reached modules that the block acts on only in training mode, in eval mode."""


class TrainModeGuard:
    """Forward pre-hooks on the recomputed decoder layers and the chunked-loss models: a training step's call that
    would lose what the block does raises :class:`EvalModeError` before it runs.

    Args:
        root: The module the plan applies to (names are its attribute paths when the error is raised).
        layers: The decoder layers found (:class:`~lightning_ac.layers.DecoderLayers`).
        recomputed: Returns, for each layer, whether the plan recomputes it now (the budget may change it).
        models: The transformers models whose loss the chunked loss computes (in training forwards only).
    """

    def __init__(
        self, root: nn.Module, layers: Any, recomputed: Callable[[], Sequence[bool]], models: Sequence[nn.Module]
    ) -> None:
        self.root, self.layers, self.recomputed, self.models = root, layers, recomputed, list(models)
        self._handles: List[Any] = []
        self._in_step = 0
        self._compiled_checked = False

    @classmethod
    def install_on(
        cls,
        root: nn.Module,
        layers: Any,
        recomputed: Callable[[], Sequence[bool]],
        chunked_loss: Any,
        stepped: type,
    ) -> TrainModeGuard:
        """A guard installed on ``layers`` and the models of ``chunked_loss`` (``None``: no chunked loss). On a root
        of the class ``stepped`` (a LightningModule, whose ``training_step`` runs inside :meth:`step`) it acts
        inside :meth:`step` only; on any other root, at every call."""
        guard = cls(root, layers, recomputed, chunked_loss.models if chunked_loss is not None else [])
        guard._in_step = 0 if isinstance(root, stepped) else 1
        guard.install()
        return guard

    def install(self) -> None:
        for index, layer in enumerate(self.layers.modules):
            self._handles.append(layer.register_forward_pre_hook(self._layer_hook(index), with_kwargs=True))
        for model in self.models:
            self._handles.append(model.register_forward_pre_hook(self._model_hook, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The training step runs inside: the hooks act there (not in a callback's forward after it, nor in
        validation), and a compiled model is checked as its first step begins."""
        if not self._compiled_checked:
            self._compiled_checked = True
            if any(how_compiled(m) is not None for m in self.root.modules()):
                self._check_compiled()
        self._in_step += 1
        try:
            yield
        finally:
            self._in_step -= 1

    def _check_compiled(self) -> None:
        """What the hooks cannot check under torch.compile, checked eagerly: the recomputed layers and chunked-loss
        models in eval mode that have parameters to train."""
        recomputed = self.recomputed()
        for index, layer in enumerate(self.layers.modules):
            if index < len(recomputed) and recomputed[index] and not layer.training and _trains(layer):
                self._raise(self._idle_layers(index, recomputed), self._name(layer))
        for model in self.models:
            if not model.training and _trains(model):
                self._raise_for_loss(model)

    def _reached(self, module: nn.Module) -> bool:
        """A training step's forward reached ``module`` in eval mode with gradients on (not a recompute in
        backward; under torch.compile the step was checked as it began)."""
        if module.training or not self._in_step or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return False  # (a query below would break torch.compile's graph)
        return torch._C._current_graph_task_id() == -1

    def _layer_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Dict[str, Any]) -> None:
            if not self._reached(module) or not (_trains(module) or _needs_grad(args, kwargs)):
                return  # no graph recorded (a frozen teacher): nothing to recompute
            recomputed = self.recomputed()
            if index < len(recomputed) and recomputed[index]:
                self._raise(self._idle_layers(index, recomputed), self._name(module))

        return hook

    def _model_hook(self, module: nn.Module, args: Any, kwargs: Dict[str, Any]) -> None:
        if not self._reached(module) or _labels(module, args, kwargs) is None:
            return
        if _trains(module) or _needs_grad(args, kwargs):  # a loss with a graph (a frozen teacher's has none)
            self._raise_for_loss(module)

    def _raise_for_loss(self, model: nn.Module) -> None:
        name = self._name(model)
        self._raise(f"the chunked loss would not run for {name} ({type(model).__name__})", name)

    def _idle_layers(self, reached: int, recomputed: Sequence[bool]) -> str:
        """The recomputed layers in eval mode of the model the layer ``reached`` belongs to."""
        owners, modules = self.layers.owners, self.layers.modules
        idle = [
            i
            for i, (layer, on) in enumerate(zip(modules, recomputed))
            if on and not layer.training and owners[i] == owners[reached]
        ]
        shown = ", ".join(map(str, idle[:8])) + (", ..." if len(idle) > 8 else "")
        models = self.layers.hf_models
        where = f" of {self._name(models[owners[reached]])}" if owners[reached] < len(models) else ""
        return f"{len(idle)} of the recomputed {self.layers.noun}{where} ({shown}) would not be recomputed"

    def _name(self, module: nn.Module) -> str:
        """``module``'s path in the root now (a model wrapped since the plan applied, by PEFT, has new paths)."""
        return next((name for name, m in self.root.named_modules() if m is module and name), type(module).__name__)

    @staticmethod
    def _raise(idle: str, reached: Optional[str]) -> None:
        raise EvalModeError(
            f"lightning_ac: a training step reached {reached} in eval mode with gradients enabled, so {idle}: "
            "transformers recomputes a layer, and the chunked loss computes a loss, only in training mode. "
            "from_pretrained returns models in eval mode, and Lightning keeps the mode it finds. Call model.train() "
            "after loading it (e.g. AutoModelForCausalLM.from_pretrained(...).train(), in the LightningModule's "
            "__init__ or configure_model). To train without dropout, set the model's dropout probabilities to 0, or "
            "put only its nn.Dropout modules in eval mode. A frozen model in eval mode (a reference model, a "
            "teacher) is left alone: its forward records no graph."
        )


def _trains(module: nn.Module) -> bool:
    """``module`` has a parameter that needs a gradient."""
    return any(p.requires_grad for p in module.parameters())


def _needs_grad(args: Any, kwargs: Dict[str, Any]) -> bool:
    """An input tensor needs a gradient (the forward records a graph even with every parameter frozen)."""
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in (*args, *kwargs.values()))


def _labels(model: nn.Module, args: Any, kwargs: Dict[str, Any]) -> Any:
    """The ``labels`` a forward call was given, by keyword or by position (``None``: no loss from labels)."""
    if "labels" in kwargs or not args:
        return kwargs.get("labels")
    try:
        return inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments.get("labels")
    except TypeError:
        return None
