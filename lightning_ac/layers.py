"""Finding the decoder layers a plan acts on, their output heads, and whether they are compiled.

Hugging Face models (plain or wrapped by PEFT) are found automatically: their decoder layers are the
``GradientCheckpointingLayer`` instances inside the outermost ``PreTrainedModel``\\ s. Plain torch models name
their layers through ``layers=``: layer classes, or globs over module names. A string that imports as
``package.module.Class`` to an ``nn.Module`` subclass names that class (a YAML config cannot hold a class); any other
string is a glob.
"""

from __future__ import annotations

import fnmatch
import importlib
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Type, Union

from torch import nn

__all__ = [
    "DecoderLayers",
    "LayerSpec",
    "compiled_layers",
    "describe_compiled",
    "find_decoder_layers",
    "layer_class",
    "transformers_models",
]

LayerSpec = Union[str, Type[nn.Module]]
GLOB_CHARACTERS = "*?["


def layer_class(spec: str) -> Optional[Type[nn.Module]]:
    """The ``nn.Module`` subclass a ``layers=`` string names as a dotted class path
    (``"transformers.models.llama.modeling_llama.LlamaDecoderLayer"``), or ``None`` when it is a glob over module
    names: it has a glob character, is not a dotted path of identifiers, its module does not import, or what it names
    is not an ``nn.Module`` subclass (``"model.layers"`` in a model stays a module name)."""
    parts = spec.split(".")
    if any(c in spec for c in GLOB_CHARACTERS) or len(parts) < 2 or not all(p.isidentifier() for p in parts):
        return None
    try:
        module = importlib.import_module(".".join(parts[:-1]))
    except ImportError:
        return None
    found = getattr(module, parts[-1], None)
    return found if isinstance(found, type) and issubclass(found, nn.Module) else None


@dataclass
class DecoderLayers:
    """The decoder layers of one module tree.

    Attributes:
        layers: ``(qualified name, module)`` pairs in execution order.
        hf_models: The outermost transformers ``PreTrainedModel`` instances that own ``layers`` (empty for
            plain torch layers selected with ``layers=``).
        layer_types: Per-layer attention type (``full_attention``, ``sliding_attention``...) where the model
            publishes one, else ``None`` entries.
        owners: Per layer, the index in ``hf_models`` of the model it belongs to (``0`` for plain torch layers).
    """

    layers: List[Tuple[str, nn.Module]]
    hf_models: List[nn.Module] = field(default_factory=list)
    layer_types: List[Optional[str]] = field(default_factory=list)
    owners: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.owners:
            self.owners = [0] * len(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def modules(self) -> List[nn.Module]:
        """The layer modules, in execution order."""
        return [m for _, m in self.layers]

    @property
    def noun(self) -> str:
        """What the layers are, for log lines: ``decoder layers``, or ``encoder and decoder layers`` when a model
        is an encoder-decoder (T5, BART), whose encoder blocks are found too."""
        if any(getattr(getattr(m, "config", None), "is_encoder_decoder", False) for m in self.hf_models):
            return "encoder and decoder layers"
        return "decoder layers"

    def output_heads(self) -> List[nn.Module]:
        """The output heads (``lm_head``) of the transformers models that own the layers."""
        heads = [m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None for m in self.hf_models]
        return [h for h in heads if h is not None]


def _is_compiled(module: nn.Module) -> bool:
    """``torch.compile(module)`` (an OptimizedModule) or ``module.compile()``."""
    compiled_module = type(module).__name__ == "OptimizedModule" or hasattr(module, "_orig_mod")
    return compiled_module or getattr(module, "_compiled_call_impl", None) is not None


def compiled_layers(root: nn.Module, layers: DecoderLayers) -> Tuple[List[int], List[str]]:
    """What ``torch.compile`` wraps around the decoder layers of ``root``.

    Returns:
        The indices of compiled layers (compiled themselves, or replaced by a compiled wrapper, torchtitan's
        way: ``layers[i] = torch.compile(layers[i])``), and the names of compiled modules above them (the whole
        model: ``torch.compile(model)``, ``model.compile()``; ``""`` is ``root`` itself).
    """
    indices, above = [], []
    for index, (name, layer) in enumerate(layers.layers):
        parts = name.split(".") if name else []
        if parts and parts[-1] == "_orig_mod":  # the layer is the inside of a per-layer compiled wrapper
            parts = parts[:-1]
        if _is_compiled(layer) or _is_compiled(root.get_submodule(".".join(parts))):
            indices.append(index)
        for depth in range(len(parts)):
            prefix = ".".join(parts[:depth])
            if prefix not in above and _is_compiled(root.get_submodule(prefix)):
                above.append(prefix)
    return indices, above


def describe_compiled(indices: Sequence[int], above: Sequence[str]) -> Optional[str]:
    """What :func:`compiled_layers` found, as an error message's subject; ``None`` when nothing is compiled."""
    if above:
        names = ", ".join(repr(name) if name else "the module given to the Trainer" for name in above)
        return f"the model around the decoder layers ({names}) is compiled with torch.compile"
    if indices:
        return f"decoder layers {list(indices)} are compiled with torch.compile"
    return None


def _hf_classes():
    try:
        from transformers import PreTrainedModel
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None, None
    return PreTrainedModel, GradientCheckpointingLayer


def _layer_types(model: nn.Module, count: int) -> List[Optional[str]]:
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text_config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == count:
        return list(types)
    return [None] * count


def _matches(name: str, module: nn.Module, specs: Sequence[LayerSpec]) -> bool:
    for spec in specs:
        if isinstance(spec, type):
            if isinstance(module, spec):
                return True
        elif fnmatch.fnmatchcase(name, spec):
            return True
    return False


def transformers_models(root: nn.Module) -> List[str]:
    """Class names of the transformers models under ``root`` (for messages)."""
    PreTrainedModel, _ = _hf_classes()
    if PreTrainedModel is None:
        return []
    return sorted({type(m).__name__ for m in root.modules() if isinstance(m, PreTrainedModel)})


def find_decoder_layers(root: nn.Module, layers: Optional[Sequence[LayerSpec]] = None) -> DecoderLayers:
    """Find the decoder layers under ``root``.

    Args:
        root: The module to search (a LightningModule, a transformers model, a PEFT model...).
        layers: ``None`` to find transformers decoder layers automatically, or layer classes / globs over
            qualified module names (``"blocks.*"``) selecting the layers of a plain torch model. When both an
            outer and an inner module match, only the outer one is a layer.

    Returns:
        The layers found, possibly none.
    """
    PreTrainedModel, GradientCheckpointingLayer = _hf_classes()
    if layers is not None:
        found: List[Tuple[str, nn.Module]] = []
        for name, module in root.named_modules():
            if module is root or any(name.startswith(outer + ".") for outer, _ in found):
                continue
            if _matches(name, module, layers):
                found.append((name, module))
        return DecoderLayers(found, [], [None] * len(found))

    if PreTrainedModel is None:
        return DecoderLayers([])
    models: List[Tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if isinstance(module, PreTrainedModel) and not any(
            name == outer or name.startswith(outer + ".") or outer == "" for outer, _ in models
        ):
            models.append((name, module))
    found, owners, types, owner_of = [], [], [], []
    for prefix, model in models:
        model_layers = [
            (f"{prefix}.{n}" if prefix and n else prefix or n, m)
            for n, m in model.named_modules()
            if isinstance(m, GradientCheckpointingLayer)
        ]
        if not model_layers:
            continue
        owner_of.extend([len(owners)] * len(model_layers))
        owners.append(model)
        found.extend(model_layers)
        types.extend(_layer_types(model, len(model_layers)))
    return DecoderLayers(found, owners, types, owner_of)
