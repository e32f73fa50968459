"""``tiled_mlp``: each decoder layer's MLP a tile of tokens at a time, for the run.

Each layer's ``mlp`` gets an instance ``forward`` (put back at removal) that runs
:func:`~lightning_ac.tiled_mlp.function.tiled_mlp` around the MLP's own forward in a training call (gradients on) of
one argument, and the MLP's own forward otherwise (evaluation, no gradients, extra arguments).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from lightning_ac.config import AUTO, ConfigError
from lightning_ac.tiled_mlp.function import tiled_mlp

__all__ = ["MIN_AUTO_TILE_TOKENS", "TiledMLP", "auto_tile_tokens", "install_tiled_mlp"]

# tile_tokens: auto never takes fewer tokens a tile: smaller matmuls run below speed
MIN_AUTO_TILE_TOKENS = 256
_MISSING = object()


def auto_tile_tokens(tokens: int, hidden_size: int) -> int:
    """``tile_tokens: auto``: the hidden size's worth of tokens, rounded up to a power of two and at least
    :data:`MIN_AUTO_TILE_TOKENS` (a tile's intermediates then hold about one MLP weight matrix's elements, at any
    length); never more than ``tokens``."""
    if tokens <= 0:
        return 1
    return min(tokens, max(MIN_AUTO_TILE_TOKENS, 1 << (max(1, hidden_size) - 1).bit_length()))


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

    Raises:
        ConfigError: If a layer has no ``mlp`` module, or its MLP is a sparse mixture of experts (its router and
            auxiliary loss are not tiled).
    """

    def __init__(self, tile_tokens: Any, layers: Sequence[nn.Module], noun: str = "decoder layers") -> None:
        self.tile_tokens = tile_tokens
        self.mlps = [self.find(layer, index) for index, layer in enumerate(layers)]
        self.noun = noun
        self._saved: Dict[int, Any] = {}
        self.tiled_calls = 0
        self.last_tiles: Any = None  # the last tiled call's (tokens a tile, tokens)

    @staticmethod
    def find(layer: nn.Module, index: int) -> nn.Module:
        """The MLP of ``layer`` (its ``mlp``), checked."""
        fix = "Set tiled_mlp: false."
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise ConfigError(
                f"activation_checkpointing.tiled_mlp: {type(layer).__name__} (layer {index}) has no mlp module to "
                f"tile (the suite finds a transformers layer's MLP as its `mlp`). {fix}"
            )
        if _sparse(mlp):
            raise ConfigError(
                f"activation_checkpointing.tiled_mlp: layer {index}'s mlp is a sparse mixture of experts "
                f"({type(mlp).__name__}): its router sends each token to some experts and adds an auxiliary loss, "
                f"which a tile at a time would not reproduce. {fix}"
            )
        return mlp

    def install(self) -> None:
        for mlp in self.mlps:
            self._saved[id(mlp)] = mlp.__dict__.get("forward", _MISSING)
            mlp.forward = self._forward_of(mlp, mlp.forward)  # type: ignore[method-assign]

    def remove(self) -> None:
        for mlp in self.mlps:
            saved = self._saved.pop(id(mlp), _MISSING)
            if saved is _MISSING:
                mlp.__dict__.pop("forward", None)
            else:
                mlp.forward = saved  # type: ignore[method-assign]

    def _forward_of(self, mlp: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs or not torch.is_grad_enabled() or not isinstance(x, torch.Tensor):
                return original(x, *args, **kwargs)
            tokens = x.shape[:-1].numel()
            tile = self.tile_tokens
            if tile == AUTO:
                tile = auto_tile_tokens(tokens, x.shape[-1])
            self.tiled_calls += 1
            self.last_tiles = (int(tile), tokens)
            return tiled_mlp(original, x, list(mlp.parameters()), int(tile))

        return forward

    def describe(self) -> str:
        tile = self.tile_tokens if self.tile_tokens != AUTO else "auto"
        return f"tiled MLP ({len(self.mlps)} {self.noun}, tile_tokens: {tile})"

    @property
    def modules(self) -> List[nn.Module]:
        return list(self.mlps)


def install_tiled_mlp(config: Any, layers: Any) -> Optional[TiledMLP]:
    """Each decoder layer's MLP tiled for the run; ``None`` when the block does not ask for it (``config``: its
    ``tiled_mlp``; ``layers``: the :class:`~lightning_ac.layers.DecoderLayers` found)."""
    if config is None:
        return None
    tiled = TiledMLP(config.tile_tokens, layers.modules, layers.noun)
    tiled.install()
    return tiled
