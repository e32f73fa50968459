"""``tiled_mlp``: each decoder layer's MLP a tile of tokens at a time (see docs/tiled-mlp.md).

:mod:`~lightning_ac.tiled_mlp.function` is the engine (the autograd function); :mod:`~lightning_ac.tiled_mlp.install`
puts it on each layer's ``mlp`` for the run.
"""

from lightning_ac.tiled_mlp.function import tiled_mlp
from lightning_ac.tiled_mlp.install import TiledMLP, auto_tile_tokens

__all__ = ["TiledMLP", "auto_tile_tokens", "tiled_mlp"]
