"""The modules a training step needs in training mode, checked at the step itself.

transformers recomputes a decoder layer only while the layer is in training mode, and torch's checkpoint around a
layer's forward (the ``torch`` and ``fsdp`` engines) follows the same rule; the chunked loss stands in for a model's
loss only in training forwards. ``from_pretrained`` returns models in eval mode, and Lightning 2.6 leaves the modes
of submodules as it finds them, so a model loaded that way would train with none of it, while the applied line says
otherwise. The step stops before it runs instead, naming the cause and the fix.
"""

from __future__ import annotations

from typing import List, Sequence

from torch import nn

__all__ = ["EvalModeError", "check_train_mode"]


class EvalModeError(RuntimeError):
    """A training step reached modules that the block acts on only in training mode, in eval mode."""


def check_train_mode(
    layers: Sequence[nn.Module], recomputed: Sequence[bool], models: Sequence[nn.Module], noun: str
) -> None:
    """Raise before a training step runs if what the plan applies would not run in it.

    Args:
        layers: The decoder layers, in order.
        recomputed: For each layer, whether the plan recomputes it (its recompute runs in training mode only).
        models: The transformers models whose loss the chunked loss computes (in training forwards only).
        noun: What the layers are called in messages ("decoder layers").

    Raises:
        EvalModeError: If a recomputed layer or a chunked-loss model is in eval mode.
    """
    idle: List[str] = []
    eval_layers = [i for i, (layer, on) in enumerate(zip(layers, recomputed)) if on and not layer.training]
    if eval_layers:
        shown = ", ".join(map(str, eval_layers[:8])) + (", ..." if len(eval_layers) > 8 else "")
        idle.append(f"{len(eval_layers)} of the recomputed {noun} ({shown}) would not be recomputed")
    eval_models = sorted({type(m).__name__ for m in models if not m.training})
    if eval_models:
        idle.append(f"the chunked loss would not run for {', '.join(eval_models)}")
    if not idle:
        return
    raise EvalModeError(
        f"lightning_ac: a training step reached modules in eval mode, so {' and '.join(idle)}: transformers "
        "recomputes a layer, and the chunked loss computes a loss, only in training mode. from_pretrained returns "
        "models in eval mode, and Lightning keeps the mode it finds. Call model.train() after loading it (e.g. "
        "AutoModelForCausalLM.from_pretrained(...).train(), in the LightningModule's __init__ or configure_model). "
        "To train without dropout, set the model's dropout probabilities to 0, or put only its nn.Dropout modules "
        "in eval mode."
    )
