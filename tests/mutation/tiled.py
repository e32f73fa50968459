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
        "                        total.add_(g)",
        "                        grads[index] = g.float()",
        "the weights' gradients keep the last tile's only (a full fine-tune or LoRA on the MLP learns from one tile)",
        (T,),
    ),
    Mutant(
        FUNCTION,
        "grads[index] = g if len(ctx.tiles) == 1 or g.dtype == torch.float32 else g.float()",
        "grads[index] = g",
        "the tiles' gradients summed in the parameters' dtype (bf16: 6x the untiled rounding at 128 tiles)",
        (f"{T}::test_in_bf16_the_tiles_weight_gradients_round_as_the_untiled_ones_do",),
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
        "return min(tokens, max(MIN_AUTO_TILE_TOKENS, 1 << (fits.bit_length() - 1)))",
        "return min(tokens, 1 << (fits.bit_length() - 1))",
        "tile_tokens: auto goes below the floor where an intermediate is wide: matmuls too small to run at speed",
        (f"{T}::test_auto_tiles_keep_a_tiles_widest_intermediate_within_its_bytes",),
    ),
    Mutant(
        INSTALL,
        "return min(tokens, max(MIN_AUTO_TILE_TOKENS, 1 << (fits.bit_length() - 1)))",
        "return min(tokens, max(MIN_AUTO_TILE_TOKENS, 1 << fits.bit_length()))",
        "tile_tokens: auto takes twice the tokens whose intermediates fit its bytes",
        (f"{T}::test_auto_tiles_keep_a_tiles_widest_intermediate_within_its_bytes",),
    ),
    Mutant(
        INSTALL,
        "per_token = width * _compute_itemsize(x) if width else x.shape[-1] * 4",
        "per_token = x.shape[-1] * 4",
        "tile_tokens: auto sizes an MLP's tiles by its input (the hidden size), not its intermediate",
        (f"{T}::test_auto_tiles_are_sized_by_each_modules_own_intermediate",),
    ),
    Mutant(
        INSTALL,
        '                module.__dict__.pop("forward", None)',
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

MUTANTS += [
    Mutant(
        FUNCTION,
        "if x.requires_grad and not torch.compiler.is_compiling():",
        "if False:",
        "the function saves its own input, after the MLP ran: a recomputed layer runs the whole MLP once more",
        (f"{T}::test_a_recomputed_layer_runs_no_mlp_forward_of_its_own",),
    ),
    Mutant(
        FUNCTION,
        "                    tile = tile.view_as(tile)",
        "                    pass",
        "the backward's tiles are leaves: a module tracker's gradient hooks (FlopCounterMode's) fail inside it",
        (f"{T}::test_a_recomputed_layer_runs_no_mlp_forward_of_its_own",),
    ),
    Mutant(
        FUNCTION,
        "            out.view(-1, tile.shape[-1])[start:end] = tile",
        "            out.view(-1, tile.shape[-1])[start : start + 1] = tile[:1]",
        "the forward writes only each tile's first token into the output",
        (T,),
    ),
    Mutant(
        INSTALL,
        '    return ("layernorm" in name or "rmsnorm" in name) and (shape is None or len(tuple(shape)) == 1)',
        "    return False",
        "no norm is tiled: an RMSNorm's float32 copies stay the most a recomputed layer holds",
        (f"{T}::test_the_norms_tiled_are_each_layers_own_and_the_final_norm",),
    ),
    Mutant(
        INSTALL,
        "        norms += final_norms(layers.hf_models, layers.modules)",
        "",
        "the final norm is not tiled: its float32 backward holds the head's peak",
        (f"{T}::test_the_norms_tiled_are_each_layers_own_and_the_final_norm",),
    ),
    Mutant(
        "lightning_ac/config/block.py",
        "    return TiledMLPConfig(tile_tokens=tokens, norms=norms, mlp_modules=mlp_modules, budget_decides=decides)",
        "    return TiledMLPConfig(tile_tokens=tokens, mlp_modules=mlp_modules, budget_decides=decides)",
        "norms: false is ignored with a number of tile tokens",
        (f"{T}::test_a_sparse_mixture_of_experts_and_bad_values_are_refused",),
    ),
]

MUTANTS += [
    Mutant(
        INSTALL,
        "if name and not inside and any(fnmatch.fnmatchcase(name, pattern) for pattern in mlp_modules):",
        "if name and any(fnmatch.fnmatchcase(name, pattern) for pattern in mlp_modules):",
        "a glob matching an MLP and its submodules tiles both: the MLP's linears run tiled inside tiles",
        (f"{T}::test_a_plain_torch_layers_mlp_is_found_by_name_or_glob",),
    ),
]

EQUIVALENT: List[Equivalent] = [
    Equivalent(
        FUNCTION,
        "    if not torch.is_grad_enabled() or not (x.requires_grad or trainable) or x.shape[:-1].numel() == 0:\n"
        "        return mlp(x)",
        "    if not torch.is_grad_enabled() or x.shape[:-1].numel() == 0:\n        return mlp(x)",
        "with nothing that needs a gradient the function's output needs none: its backward never runs, and its "
        "forward's tiles give the untiled values (the early return only saves the tiling)",
    ),
]
