"""Behaviour mutants of the tiled MLP (tiled_mlp/function.py, tiled_mlp/install.py): see :mod:`tests.mutation`."""

from __future__ import annotations

from typing import List

from mutation import Equivalent, Mutant

FUNCTION = "lightning_ac/tiled_mlp/function.py"
INSTALL = "lightning_ac/tiled_mlp/install.py"
T = "tests/test_tiled_mlp.py"

MUTANTS: List[Mutant] = [
    Mutant(
        FUNCTION,
        "grads[index] = g if grads[index] is None else grads[index] + g",
        "grads[index] = g",
        "the weights' gradients keep the last tile's only (a full fine-tune or LoRA on the MLP learns from one tile)",
        (T,),
    ),
    Mutant(
        FUNCTION,
        "grad_x[start:end] = 0 if tile_grad is None else tile_grad",
        "grad_x[start:end] = 0",
        "the MLP's input gets no gradient: the layers below it stop learning",
        (T,),
    ),
    Mutant(
        FUNCTION,
        "for start, end in ctx.tiles:\n                tile = flat[start:end]",
        "for start, end in ctx.tiles[:1]:\n                tile = flat[start:end]",
        "the backward recomputes the first tile only: the other tokens' gradients are lost",
        (T,),
    ),
    Mutant(
        INSTALL,
        "return min(tokens, max(MIN_AUTO_TILE_TOKENS, 1 << (max(1, hidden_size) - 1).bit_length()))",
        "return min(tokens, 1 << (max(1, hidden_size) - 1).bit_length())",
        "tile_tokens: auto takes tiles of a small model's hidden size (64 tokens): matmuls too small to run at speed",
        (f"{T}::test_auto_tiles_hold_the_hidden_sizes_worth_of_tokens",),
    ),
    Mutant(
        INSTALL,
        "return min(tokens, max(MIN_AUTO_TILE_TOKENS, 1 << (max(1, hidden_size) - 1).bit_length()))",
        "return min(tokens, max(MIN_AUTO_TILE_TOKENS, 1 << max(1, hidden_size).bit_length()))",
        "tile_tokens: auto doubles a hidden size that is a power of two",
        (f"{T}::test_auto_tiles_hold_the_hidden_sizes_worth_of_tokens",),
    ),
    Mutant(
        INSTALL,
        '                mlp.__dict__.pop("forward", None)',
        "                pass",
        "the tiled forward stays on each MLP after the run (where no journal puts it back)",
        (f"{T}::test_remove_puts_back_each_mlps_forward_as_found",),
    ),
    Mutant(
        INSTALL,
        'return hasattr(mlp, "experts") or hasattr(mlp, "router") or "moe" in name or "sparse" in name',
        "return False",
        "a sparse mixture of experts is tiled (its router's choices and auxiliary loss not reproduced)",
        (f"{T}::test_a_sparse_mixture_of_experts_and_bad_values_are_refused",),
    ),
]

EQUIVALENT: List[Equivalent] = [
    Equivalent(
        FUNCTION,
        "    if not torch.is_grad_enabled() or not (x.requires_grad or trainable):\n        return mlp(x)",
        "    if not torch.is_grad_enabled():\n        return mlp(x)",
        "with nothing that needs a gradient the function's output needs none: its backward never runs, and its "
        "forward's tiles give the untiled values (the early return only saves the tiling)",
    ),
]
