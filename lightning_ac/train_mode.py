"""The modules a training step needs in training mode, checked where the step reaches them.

transformers recomputes a decoder layer only while the layer is in training mode, and torch's checkpoint around a
layer's forward (the ``torch`` and ``fsdp`` engines) follows the same rule; the chunked loss stands in for a model's
loss only in training forwards. ``from_pretrained`` returns models in eval mode, and Lightning 2.6 leaves the modes
of submodules as it finds them, so a model loaded that way would train with none of it, while the applied line says
otherwise. The step stops instead, naming the cause, the model and the fix.

What counts is what the step reaches: a recomputed layer or a chunked-loss model called in eval mode *with gradients
enabled*. A frozen reference model or teacher in eval mode, called under ``no_grad`` beside a policy in training mode
(DPO, distillation, RLHF), is left alone, and so is a module that calls ``.train()`` in its own training step: the
modes are read at the call, not at the batch's start.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

__all__ = ["EvalModeError", "TrainModeGuard"]


class EvalModeError(RuntimeError):
    """A training step reached modules that the block acts on only in training mode, in eval mode."""


class TrainModeGuard:
    """Forward pre-hooks on the recomputed decoder layers and the chunked-loss models: a call with gradients enabled
    on one in eval mode raises :class:`EvalModeError` before it runs.

    Args:
        root: The module the plan applies to (names are its attribute paths).
        layers: The decoder layers found (:class:`~lightning_ac.layers.DecoderLayers`).
        recomputed: Returns, for each layer, whether the plan recomputes it now (the budget may change it).
        models: The transformers models whose loss the chunked loss computes (in training forwards only).
    """

    def __init__(
        self, root: nn.Module, layers: Any, recomputed: Callable[[], Sequence[bool]], models: Sequence[nn.Module]
    ) -> None:
        self.layers, self.recomputed, self.models = layers, recomputed, list(models)
        self._names: Dict[int, str] = {id(m): name for name, m in root.named_modules() if name}
        self._handles: List[Any] = []

    @classmethod
    def install_on(
        cls, root: nn.Module, layers: Any, recomputed: Callable[[], Sequence[bool]], chunked_loss: Any, trainer: Any
    ) -> TrainModeGuard:
        """A guard installed on ``layers`` and the models of ``chunked_loss`` (``None``: no chunked loss), acting
        while ``trainer`` trains (its validation steps are left alone)."""
        guard = cls(root, layers, recomputed, chunked_loss.models if chunked_loss is not None else [])
        guard.training = lambda: bool(getattr(trainer, "training", True))  # type: ignore[method-assign]
        guard.install()
        return guard

    def install(self) -> None:
        for index, layer in enumerate(self.layers.modules):
            self._handles.append(layer.register_forward_pre_hook(self._layer_hook(index)))
        for model in self.models:
            self._handles.append(model.register_forward_pre_hook(self._model_hook))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    training: Callable[[], bool] = staticmethod(lambda: True)  # type: ignore[assignment]

    def _reached(self, module: nn.Module) -> bool:
        """A training step's forward reached ``module`` in eval mode with gradients on (not a validation step that
        enabled gradients, not a recompute in backward)."""
        if module.training or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return False  # (traced by torch.compile: checked in eager steps; a query here would break its graph)
        return torch._C._current_graph_task_id() == -1 and self.training()

    def _layer_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if not self._reached(module):
                return
            recomputed = self.recomputed()
            if index < len(recomputed) and recomputed[index]:
                self._raise(self._idle_layers(index, recomputed), self._name(module))

        return hook

    def _model_hook(self, module: nn.Module, args: Any) -> None:
        if self._reached(module):
            name = self._name(module)
            self._raise(f"the chunked loss would not run for {name} ({type(module).__name__})", name)

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
        return self._names.get(id(module), type(module).__name__)

    @staticmethod
    def _raise(idle: str, reached: Optional[str]) -> None:
        raise EvalModeError(
            f"lightning_ac: a training step reached {reached} in eval mode with gradients enabled, so {idle}: "
            "transformers recomputes a layer, and the chunked loss computes a loss, only in training mode. "
            "from_pretrained returns models in eval mode, and Lightning keeps the mode it finds. Call model.train() "
            "after loading it (e.g. AutoModelForCausalLM.from_pretrained(...).train(), in the LightningModule's "
            "__init__ or configure_model). To train without dropout, set the model's dropout probabilities to 0, or "
            "put only its nn.Dropout modules in eval mode. A frozen model in eval mode (a reference model, a "
            "teacher) is left alone when it runs under torch.no_grad()."
        )
