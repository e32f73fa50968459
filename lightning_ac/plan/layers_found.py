"""The error when the plan finds no decoder layer to act on: what it looked for, what the module holds, and how to
name the layers."""

from __future__ import annotations

from typing import List, Optional

from torch import nn

from lightning_ac.config import CheckpointingRequest, ConfigError, LayerOffloadRequest
from lightning_ac.layers import LayerSpec, transformers_models

__all__ = ["no_layers_error"]


def no_layers_error(
    module: nn.Module,
    layer_spec: Optional[List[LayerSpec]],
    checkpointing: Optional[CheckpointingRequest],
    layer_offload: Optional[LayerOffloadRequest],
) -> ConfigError:
    """The :class:`ConfigError` for a module in which no decoder layer was found.

    Args:
        module: The module the plan applies to.
        layer_spec: The layers the callbacks name (``layers=...``), ``None`` to find transformers' own.
        checkpointing: ``ActivationCheckpointing``'s request, if present.
        layer_offload: ``LayerOffload``'s request, if present.
    """
    where = type(module).__name__
    requests = (("ActivationCheckpointing", checkpointing), ("LayerOffload", layer_offload))
    if layer_spec is not None:
        # the callbacks the user gave layers= to (both only with the same value: decoder_layer_spec)
        givers = [name for name, request in requests if request is not None and request.layers is not None]
        shown = [s.__name__ if isinstance(s, type) else repr(s) for s in layer_spec]
        given = " and ".join(f"{name}(layers=[{', '.join(shown)}])" for name in givers)
        names = [n for n, _ in module.named_modules() if n and n.count(".") <= 2][:8]
        return ConfigError(
            f"{given} matched no module in {where}. A class matches its instances; a string that imports as "
            "package.module.Class to an nn.Module subclass names that class; any other string is a glob over "
            f"qualified module names, and the module names here start with: {', '.join(names) or '(no submodules)'}"
            ". Fix layers=..., e.g. layers=['<the layers container>.*'] (print(model) shows the names)."
        )
    name = " and ".join(name for name, request in requests if request is not None)
    models = transformers_models(module)
    if models:
        return ConfigError(
            f"{name} found no decoder layers in {where}: it contains the transformers model(s) "
            f"{', '.join(models)}, whose layers transformers cannot checkpoint (they are not "
            "GradientCheckpointingLayer instances), so they are not found on their own. Name them with "
            "layers=[<layer class>] or layers=['<module name glob>']."
        )
    return ConfigError(
        f"{name} found no decoder layers in {where}: it finds the layers of transformers models (plain or "
        "PEFT-wrapped) on its own, and this module holds none. For other models pass layers=[<layer class>] or "
        "layers=['<module name glob>'], e.g. layers=['model.blocks.*']."
    )
