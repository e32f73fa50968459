"""``tiled_mlp``: each decoder layer's MLP a tile of tokens at a time, for the run; and with ``norms: true`` (the
default) the layers' norms and the final norm too.

Each tiled module gets an instance ``forward`` (put back at removal) that runs
:func:`~lightning_ac.tiled_mlp.function.tiled_mlp` around the module's own forward in a training call (gradients on)
of one argument, and the module's own forward otherwise (evaluation, no gradients, extra arguments).

Why the norms: once the MLP is tiled, a layer's norms are what holds most at long context. An RMSNorm computes in
float32 whatever the model's dtype, saves the float32 copy of its input, and its backward makes about six float32
tensors of the input's shape: at 4,096 hidden that is 96 KiB a token in the backward of a recomputed layer (and of the
final norm, after the head), against 8 KiB for the bf16 hidden states. A norm is computed per token as an MLP is, so
it tiles the same way and saves only its (bf16) input.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from lightning_ac.config import AUTO, ConfigError
from lightning_ac.tiled_mlp.function import tiled_mlp

__all__ = [
    "AUTO_TILE_BYTES",
    "MIN_AUTO_TILE_TOKENS",
    "TiledMLP",
    "auto_tile_tokens",
    "final_norms",
    "find_mlps",
    "install_tiled_mlp",
    "is_norm",
    "layer_norms",
]

# tile_tokens: auto never takes fewer tokens a tile: smaller matmuls run below speed, and a step runs more tiles'
# autograd calls (cpu-vocab, hidden 256: tiles of 256 tokens stepped at 1.08x full_chunked's time, of 1024 at 0.98x,
# with the same activation peak)
MIN_AUTO_TILE_TOKENS = 1024
# ... and takes as many tokens as keep one of a tile's widest intermediates (an MLP's gate or up projection, a norm's
# float32 copy) within this, as chunk_tokens: auto bounds a chunk's logits: few large tiles, whose matmuls a GPU runs
# at full speed (the H200 stepped 4,096-token tiles of Llama-3-8B's MLP at 1.14x the untiled step)
AUTO_TILE_BYTES = 256 * 2**20
_MISSING = object()


def auto_tile_tokens(tokens: int, bytes_per_token: int) -> int:
    """``tile_tokens: auto``: the most tokens, a power of two, whose widest intermediate (``bytes_per_token`` each)
    fits :data:`AUTO_TILE_BYTES`, and at least :data:`MIN_AUTO_TILE_TOKENS`; never more than ``tokens`` (8,192 for
    Llama-3-8B's MLP in bf16: 14,336 x 2 bytes a token)."""
    if tokens <= 0:
        return 1
    fits = max(1, AUTO_TILE_BYTES // max(1, bytes_per_token))
    return min(tokens, max(MIN_AUTO_TILE_TOKENS, 1 << (fits.bit_length() - 1)))


def widest_output(module: nn.Module) -> int:
    """The widest output of ``module``'s linear layers (``out_features``: an MLP's intermediate size, a 4-bit layer's
    too; ``nf``: GPT-2's ``Conv1D``), ``0`` where it has none (a norm)."""
    widths = (getattr(m, "out_features", None) or getattr(m, "nf", None) or 0 for m in module.modules())
    return max((int(w) for w in widths), default=0)


def _compute_itemsize(x: torch.Tensor) -> int:
    """The bytes of an element the MLP's matmuls write: autocast's dtype where it is on (bf16-mixed), else the
    input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.empty((), dtype=torch.get_autocast_dtype(x.device.type)).element_size()
    return x.element_size()


def is_norm(module: nn.Module) -> bool:
    """A per-token norm (``LayerNorm``, an ``RMSNorm`` of any model): it normalises each token over the last
    dimension, so a tile of tokens at a time computes the same rows."""
    name = type(module).__name__.lower()
    shape = getattr(module, "normalized_shape", None)  # torch's norms: over the last dimension only
    return ("layernorm" in name or "rmsnorm" in name) and (shape is None or len(tuple(shape)) == 1)


def layer_norms(layer: nn.Module) -> List[nn.Module]:
    """The norms a decoder layer holds directly (``input_layernorm``, ``post_attention_layernorm``, Gemma's
    pre- and post-feedforward norms); a norm inside attention (Qwen3's per-head ``q_norm``) is left alone."""
    return [child for child in layer.children() if is_norm(child)]


def final_norms(models: Sequence[nn.Module], layers: Sequence[nn.Module]) -> List[nn.Module]:
    """The norms beside each model's list of decoder layers (``model.norm``: the last hidden states' norm, before
    the output head)."""
    ids = {id(layer) for layer in layers}
    found: List[nn.Module] = []
    for model in models:
        for module in model.modules():
            children = list(module.children())
            if any(isinstance(c, nn.ModuleList) and any(id(m) in ids for m in c) for c in children):
                found.extend(c for c in children if is_norm(c) and all(c is not f for f in found))
    return found


def find_mlps(layer: nn.Module, index: int, mlp_modules: Optional[Sequence[str]] = None) -> List[nn.Module]:
    """The MLPs of ``layer`` to tile, checked: its ``mlp`` (transformers' layers), or with ``mlp_modules`` each of its
    submodules whose name relative to the layer matches one of those names or globs (``ffn``, ``*.feed_forward``);
    a match inside another match is left to it."""
    field = "activation_checkpointing.tiled_mlp"
    if mlp_modules is None:
        mlp = getattr(layer, "mlp", None)
        found = [("mlp", mlp)] if isinstance(mlp, nn.Module) else []
        where = "the suite finds a transformers layer's MLP as its `mlp`"
    else:
        found = []
        for name, module in layer.named_modules():
            inside = any(name.startswith(f"{outer}.") for outer, _ in found)
            if name and not inside and any(fnmatch.fnmatchcase(name, pattern) for pattern in mlp_modules):
                found.append((name, module))
        where = f"mlp_modules: {list(mlp_modules)} matched none of its submodules"
    if not found:
        moe = next(((name, child) for name, child in layer.named_children() if _sparse(child)), None)
        if moe is not None:  # the real reason first: naming it with mlp_modules would only be refused next
            found = [moe]
    if not found:
        names = ", ".join(name for name, _ in layer.named_children())
        raise ConfigError(
            f"{field}: {type(layer).__name__} (layer {index}) has no MLP to tile ({where}; its children: {names}). "
            "Name the MLP with tiled_mlp: {mlp_modules: [NAME]} (a name or glob relative to the layer), or set "
            "tiled_mlp: false."
        )
    for name, mlp in found:
        extra = _inputs_beyond_the_first(mlp)
        if extra:
            raise ConfigError(
                f"{field}: layer {index}'s {name} ({type(mlp).__name__}) takes {', '.join(extra)} besides its input, "
                "and tiled_mlp tiles an MLP called with its input alone (a tile of the other arguments would have to "
                "match each tile of tokens). Set tiled_mlp: false, or name with mlp_modules the modules inside it "
                "that take the hidden states alone."
            )
        if _sparse(mlp):
            raise ConfigError(
                f"{field}: layer {index}'s {name} is a sparse mixture of experts ({type(mlp).__name__}): its router "
                "sends each token to some experts and adds an auxiliary loss, which a tile at a time would not "
                "reproduce. Set tiled_mlp: false."
            )
    return [mlp for _, mlp in found]


def _inputs_beyond_the_first(module: nn.Module) -> List[str]:
    """The arguments ``module``'s forward requires besides its first (Bloom's and MPT's MLPs take the residual)."""
    import inspect

    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature: taken as one argument
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty]
    return required[1:]


def _sparse(mlp: nn.Module) -> bool:
    """A sparse mixture of experts: a router sends each token to some experts (and adds an auxiliary loss)."""
    name = type(mlp).__name__.lower()
    return hasattr(mlp, "experts") or hasattr(mlp, "router") or "moe" in name or "sparse" in name


class TiledMLP:
    """Runs each decoder layer's MLP a tile of tokens at a time, for the run.

    Args:
        tile_tokens: Tokens per tile, or ``"auto"`` (:func:`auto_tile_tokens`, per call).
        layers: The decoder layers, each with its MLP as ``mlp``.
        noun: What the layers are called in messages (``decoder layers``).
        norms: The norms to tile too (:func:`layer_norms`, :func:`final_norms`).
        mlp_modules: The names or globs of each layer's MLP modules, relative to the layer (:func:`find_mlps`);
            ``None``: the layer's ``mlp``.
        budget_decides: Off until the memory budget turns it on (``tiled_mlp: auto``): each module runs its own
            forward meanwhile.

    Raises:
        ConfigError: If a layer has no MLP to tile, or its MLP is a sparse mixture of experts (its router and
            auxiliary loss are not tiled).
    """

    def __init__(
        self,
        tile_tokens: Any,
        layers: Sequence[nn.Module],
        noun: str = "decoder layers",
        norms: Sequence[nn.Module] = (),
        mlp_modules: Optional[Sequence[str]] = None,
        budget_decides: bool = False,
    ) -> None:
        self.tile_tokens = tile_tokens
        self.budget_decides = budget_decides
        self.active = not budget_decides  # the budget turns it on where its step needs it
        self.turned_on_because = ""  # the budget's reason: "weighing", "faster" or "needed"
        self.mlps = [mlp for index, layer in enumerate(layers) for mlp in find_mlps(layer, index, mlp_modules)]
        self.layers = len(layers)
        self.norms = list(norms)
        self.noun = noun
        self._saved: Dict[int, Any] = {}

    def install(self) -> None:
        for module in self.modules:
            self._saved[id(module)] = module.__dict__.get("forward", _MISSING)
            module.forward = self._forward_of(module, module.forward)  # type: ignore[method-assign]

    def remove(self) -> None:
        for module in self.modules:
            saved = self._saved.pop(id(module), _MISSING)
            if saved is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = saved  # type: ignore[method-assign]

    def _forward_of(self, module: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
        # The widest intermediate: the MLP's linear outputs in the dtype they compute in; a norm's float32 copy of
        # its input. The parameters are looked up at each call: FSDP2 swaps its unsharded parameters in at each
        # forward, and LoRA added after install brings new ones.
        width = widest_output(module)

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self.active or args or kwargs or not torch.is_grad_enabled() or not isinstance(x, torch.Tensor):
                return original(x, *args, **kwargs)
            tile = self.tile_tokens
            if tile == AUTO:
                per_token = width * _compute_itemsize(x) if width else x.shape[-1] * 4
                tile = auto_tile_tokens(x.shape[:-1].numel(), per_token)
            return tiled_mlp(original, x, list(module.parameters()), int(tile))

        return forward

    name = "tiled_mlp"

    def describe_layer(self) -> str:
        """What a layer's tiled parts save, for the per-layer table."""
        tile = "auto" if self.tile_tokens == AUTO else self.tile_tokens
        norms = " and norms" if self.norms else ""
        return f"MLP{norms} tiled ({tile} tokens a tile): their inputs only"

    def describe(self) -> str:
        tile = self.tile_tokens if self.tile_tokens != AUTO else "auto"
        norms = f", and {len(self.norms)} norms" if self.norms else ""
        modules = f": {len(self.mlps)} MLP modules" if len(self.mlps) != self.layers else ""
        where = "" if self.active else "; where the budget needs it, not so far"
        return f"tiled MLP ({self.layers} {self.noun}{modules}{norms}, tile_tokens: {tile}{where})"

    @property
    def modules(self) -> List[nn.Module]:
        """The tiled modules: the MLPs, then the norms."""
        return list(self.mlps) + list(self.norms)


def install_tiled_mlp(config: Any, layers: Any) -> Optional[TiledMLP]:
    """Each decoder layer's MLP tiled for the run; ``None`` when the block does not ask for it (``config``: its
    ``tiled_mlp``; ``layers``: the :class:`~lightning_ac.layers.DecoderLayers` found)."""
    if config is None:
        return None
    norms: List[nn.Module] = []
    if config.norms:
        norms = [norm for layer in layers.modules for norm in layer_norms(layer)]
        norms += final_norms(layers.hf_models, layers.modules)
    tiled = TiledMLP(config.tile_tokens, layers.modules, layers.noun, norms, config.mlp_modules, config.budget_decides)
    tiled.install()
    return tiled
