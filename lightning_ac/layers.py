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
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type, Union

from torch import nn

__all__ = [
    "CompiledModules",
    "DecoderLayers",
    "LayerSpec",
    "compiled_function",
    "compiled_layers",
    "find_decoder_layers",
    "how_compiled",
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
        return [head for _, head in self.models_and_heads()]

    def models_and_heads(self) -> List[Tuple[nn.Module, nn.Module]]:
        """Each transformers model that owns the layers and has an output head, with that head."""
        heads = [m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None for m in self.hf_models]
        return [(m, h) for m, h in zip(self.hf_models, heads) if h is not None]


def compiled_function(fn: Any) -> bool:
    """Whether calling ``fn`` runs ``torch.compile``'s code: ``fn`` is what ``torch.compile`` returned for a function
    or a method (``model.forward = torch.compile(model.forward)``, ``@torch.compile`` on a method), or wraps one
    (``functools.wraps`` wrappers, bound methods of one). ``torch.compiler.disable``'s wrappers do not count."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        fn = getattr(fn, "__func__", fn)  # a bound method: its function
        # torch.compile's wrapper carries its own id; a functools.wraps copy of its attributes carries another's
        if getattr(fn, "_torchdynamo_wrapper_id", None) == id(fn) and not getattr(fn, "_torchdynamo_disable", False):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


# How a module can be compiled, as the messages name it (:func:`how_compiled`; ``{m}`` is the module's noun).
_WRAPPER = "torch.compile({m})"
_IN_PLACE = "{m}.compile()"
_LIGHTNING = "trainer.fit(torch.compile(lightning_module)), which Lightning turns into a compiled training_step"
# The methods whose compiled version puts the module's calls inside a compiled region (training_step: the
# LightningModule's, which Lightning's trainer calls).
_COMPILED_METHODS = ("forward", "training_step")


def how_compiled(module: nn.Module, noun: str = "module") -> Optional[str]:
    """How ``module`` is compiled, so that what it calls runs inside a compiled region, as a message says it (``noun``
    names the module there); ``None`` when it is not.

    The routes: ``torch.compile(module)`` (an ``OptimizedModule``), ``module.compile()``, Lightning's
    ``trainer.fit(torch.compile(lightning_module))`` (Lightning unwraps the ``OptimizedModule`` and compiles the
    LightningModule's step methods in place, leaving ``_compiler_ctx``), a compiled ``forward`` or ``training_step``
    on the instance (``model.forward = torch.compile(model.forward)``, as transformers' docs do) or in its class.
    """
    if type(module).__name__ == "OptimizedModule" or hasattr(module, "_orig_mod"):
        return _WRAPPER.format(m=noun)
    if getattr(module, "_compiled_call_impl", None) is not None:
        return _IN_PLACE.format(m=noun)
    if getattr(module, "_compiler_ctx", None) is not None:
        return _LIGHTNING
    for method in _COMPILED_METHODS:
        if compiled_function(module.__dict__.get(method)):
            return f"{noun}.{method} = torch.compile({noun}.{method})"
        if compiled_function(getattr(type(module), method, None)):
            return f"a compiled {method} in class {type(module).__name__}"
    return None


@dataclass
class CompiledModules:
    """What ``torch.compile`` wraps around the decoder layers of a module (:func:`compiled_layers`).

    Attributes:
        layers: The decoder layers compiled by themselves, by index: how (:func:`how_compiled`; a layer that a
            ``torch.compile`` wrapper holds, torchtitan's ``layers[i] = torch.compile(layers[i])``, counts).
        above: The compiled modules above the layers, by qualified name (``""`` is the root): how.
    """

    layers: Dict[int, str] = field(default_factory=dict)
    above: Dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.layers or self.above)

    def describe(self) -> Optional[str]:
        """What was found, as an error message's subject; ``None`` when nothing is compiled."""
        if self.above:
            names = ", ".join(repr(name) if name else "the module given to the Trainer" for name in self.above)
            routes = "; ".join(dict.fromkeys(self.above.values()))
            return f"the model around the decoder layers ({names}) is compiled with torch.compile ({routes})"
        if self.layers:
            routes = "; ".join(dict.fromkeys(self.layers.values()))
            return f"decoder layers {list(self.layers)} are compiled with torch.compile ({routes})"
        return None


def compiled_layers(root: nn.Module, layers: DecoderLayers) -> CompiledModules:
    """What ``torch.compile`` wraps around the decoder layers of ``root``: the layers compiled by themselves (or
    replaced by a compiled wrapper, torchtitan's way: ``layers[i] = torch.compile(layers[i])``), and the compiled
    modules above them (the whole model: ``torch.compile(model)``, ``model.compile()``, a compiled ``model.forward``;
    the LightningModule compiled by Lightning: ``trainer.fit(torch.compile(module))``), by every route
    :func:`how_compiled` knows."""
    found = CompiledModules()
    for index, (name, layer) in enumerate(layers.layers):
        parts = name.split(".") if name else []
        if parts and parts[-1] == "_orig_mod":  # the layer is the inside of a per-layer compiled wrapper
            parts = parts[:-1]
        how = how_compiled(layer, "layer") or how_compiled(root.get_submodule(".".join(parts)), "layer")
        if how is not None:
            found.layers[index] = how
        for depth in range(len(parts)):
            prefix = ".".join(parts[:depth])
            if prefix not in found.above:
                how = how_compiled(root.get_submodule(prefix), "model")
                if how is not None:
                    found.above[prefix] = how
    return found


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
