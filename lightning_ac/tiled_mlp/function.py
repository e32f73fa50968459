"""A decoder layer's MLP a tile of tokens at a time: the full sequence's intermediates never exist.

The forward runs the MLP on each tile of tokens without recording a graph and saves only its input. The backward
recomputes one tile at a time with gradients on and backpropagates it at once, so that a tile's intermediates (gate,
up, their product, and their gradients: each ``tile x intermediate_size``) are the most that exist, never the whole
sequence's. The trainable parameters' gradients (the MLP's weights in a full fine-tune, LoRA's adapters on its
projections) are summed over the tiles in float32, in place (as the chunked loss sums its chunks: in bf16 a sum of
hundreds of tiles rounds at each step), and returned to autograd in the parameters' dtype as the function's own, so
that they reach their parameters as any other gradient does (accumulation, hooks, DDP's and FSDP's reductions).

The recompute runs under the forward's autocast state and random state (a dropout draws the same masks, tile after
tile in the same order). Each output row depends on its own token only, so the forward's output is bit-identical to
the untiled MLP's wherever the kernels compute a row alike at any number of rows; the input's gradient likewise; the
parameters' gradients are sums over tiles instead of one matmul over all tokens: equal within float rounding.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

__all__ = ["tiled_mlp"]


def _tiles(tokens: int, tile_tokens: int) -> List[Tuple[int, int]]:
    return [(start, min(start + tile_tokens, tokens)) for start in range(0, tokens, tile_tokens)]


class _SavedInput(torch.autograd.Function):
    """``x`` as it is, saved: the tiled MLP's input, saved before the MLP runs.

    Under non-reentrant checkpointing a recomputed layer stops at the last saved tensor its backward needs. Saved
    here, before the tiles run, the MLP's input is that tensor in a layer whose MLP is its last saving op (Llama's,
    Qwen's: a residual add follows), so the recompute stops before the MLP: a recomputed layer runs no MLP forward
    but the one a tile at a time in the backward. (A function saving its own input saves it after its forward ran:
    the whole MLP would run once more in each recompute, its output thrown away.)"""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad  # its saved input is read (once) by the tiled MLP's backward


class _TiledMLP(torch.autograd.Function):
    """``forward(mlp, tile_tokens, saved, x, *trainable)``: the trainable parameters are inputs, so that their
    gradients are the function's outputs; ``saved`` is the :class:`_SavedInput` node that holds ``x`` (``None``:
    this function saves ``x`` itself). A Function's forward runs without recording a graph."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        mlp: Callable[[torch.Tensor], torch.Tensor],
        tile_tokens: int,
        saved: Any,
        x: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        # detached: the tiles are plain tensors to whatever watches the MLP's calls (a module tracker's hooks)
        flat = x.detach().reshape(-1, x.shape[-1])
        ctx.mlp, ctx.params = mlp, params  # parameters are leaves: held, not saved activations
        ctx.tiles = _tiles(flat.shape[0], tile_tokens)
        ctx.autocast = _autocast_state(x.device.type)
        ctx.rng = _random_state(x)
        ctx.saved = saved
        if saved is None:
            ctx.save_for_backward(x)
        if len(ctx.tiles) == 1:
            # the MLP's own output, in the input's shape: never a view made here (a model may edit the output in
            # place, as Falcon adds attention's output to it, which autograd forbids on a Function's view)
            return mlp(x.detach())
        out: Any = None
        for start, end in ctx.tiles:
            tile = mlp(flat[start:end])
            if out is None:
                # each tile is written into the output as it comes (a list of tiles joined at the end would hold the
                # output twice), allocated in the input's shape: what is returned is no view
                out = tile.new_empty((*x.shape[:-1], tile.shape[-1]))
            out.view(-1, tile.shape[-1])[start:end] = tile
            del tile
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors if ctx.saved is None else ctx.saved.saved_tensors
        flat = x.detach().reshape(-1, x.shape[-1])
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        want_x = ctx.needs_input_grad[3]
        grad_x = torch.empty_like(flat) if want_x else None
        grads: List[Optional[torch.Tensor]] = [None] * len(ctx.params)
        with _RandomState(ctx.rng, x), torch.autocast(**ctx.autocast), torch.enable_grad():
            for start, end in ctx.tiles:
                tile = flat[start:end].detach().requires_grad_(want_x)
                if want_x:
                    # not a leaf: a module tracker's gradient hooks on the MLP's input (FlopCounterMode's) cannot
                    # take a leaf inside autograd.grad
                    tile = tile.view_as(tile)
                out = ctx.mlp(tile)
                wanted = ([tile] if want_x else []) + list(ctx.params)
                found = list(torch.autograd.grad(out, wanted, grad_flat[start:end], allow_unused=True))
                if grad_x is not None:
                    tile_grad = found.pop(0)
                    grad_x[start:end] = 0 if tile_grad is None else tile_grad
                for index, g in enumerate(found):
                    if g is None:
                        continue
                    total = grads[index]
                    if total is None:
                        # a sum of several tiles in float32 (autograd.grad's result is the function's own to add to)
                        grads[index] = g if len(ctx.tiles) == 1 or g.dtype == torch.float32 else g.float()
                    else:
                        total.add_(g)
                del out, found
        summed = [None if g is None else g.to(p.dtype) for g, p in zip(grads, ctx.params)]
        return (None, None, None, None if grad_x is None else grad_x.reshape(x.shape), *summed)


def _autocast_state(device_type: str) -> dict:
    enabled = torch.is_autocast_enabled(device_type)
    return {
        "device_type": device_type,
        "dtype": torch.get_autocast_dtype(device_type),
        "enabled": enabled,
        "cache_enabled": torch.is_autocast_cache_enabled(),
    }


def _random_state(x: torch.Tensor) -> Any:
    from torch.utils.checkpoint import get_device_states

    return torch.get_rng_state(), get_device_states(x)


class _RandomState:
    """Inside: the random state the forward started from (the CPU's and the input's device's), the caller's after."""

    def __init__(self, state: Any, x: torch.Tensor) -> None:
        self.state, self.x = state, x

    def __enter__(self) -> None:
        from torch.utils.checkpoint import get_device_states, set_device_states

        self.outer = (torch.get_rng_state(), get_device_states(self.x))
        cpu, (devices, states) = self.state
        torch.set_rng_state(cpu)
        set_device_states(devices, states)

    def __exit__(self, *exc: Any) -> None:
        from torch.utils.checkpoint import set_device_states

        cpu, (devices, states) = self.outer
        torch.set_rng_state(cpu)
        set_device_states(devices, states)


def tiled_mlp(
    mlp: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor], tile_tokens: int
) -> torch.Tensor:
    """``mlp(x)``, a tile of ``tile_tokens`` tokens at a time, saving only ``x`` (see the module's docstring); as
    ``mlp(x)`` where no gradient is wanted.

    Args:
        mlp: The MLP's computation of a ``(tokens, hidden)`` tile (its original ``forward``).
        x: The MLP's input, ``(..., hidden)``.
        params: The parameters ``mlp`` uses (its own, LoRA's): the gradients of those that need one are summed over
            the tiles.
        tile_tokens: Tokens a tile (``>= 1``).
    """
    trainable = [p for p in params if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or trainable) or x.shape[:-1].numel() == 0:
        return mlp(x)
    if x.requires_grad and not torch.compiler.is_compiling():
        # traced by torch.compile, a node's saved tensors are the compiled graph's: the function then saves its
        # input itself
        x = _SavedInput.apply(x)
        return _TiledMLP.apply(mlp, int(tile_tokens), x.grad_fn, x, *trainable)
    return _TiledMLP.apply(mlp, int(tile_tokens), None, x, *trainable)
