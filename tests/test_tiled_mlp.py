"""The tiled MLP's engine (lightning_ac.tiled_mlp.function): a decoder layer's MLP a tile of tokens at a time trains
as the untiled MLP does, within float rounding (the CPU's matmuls block rows by their count)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from lightning_ac.tiled_mlp.function import tiled_mlp


@pytest.mark.parametrize("lora", [False, True], ids=["full_finetune", "lora"])
@pytest.mark.parametrize("tile", [1, 16, 37, 74, 1000])
def test_the_tiled_mlp_trains_as_the_untiled_one(lora, tile):
    model = tiny_model("llama", lora=lora)
    mlp = (model.get_base_model() if lora else model).model.layers[0].mlp
    params = list(mlp.parameters())
    x = torch.randn(2, 37, 64, requires_grad=True, generator=torch.Generator().manual_seed(0))
    want = mlp(x)
    g = torch.randn_like(want)
    want.backward(g)
    want_x, want_p = x.grad.clone(), [p.grad.clone() if p.grad is not None else None for p in params]
    x.grad = None
    for p in params:
        p.grad = None
    got = tiled_mlp(mlp.forward, x, params, tile)
    got.backward(g)
    assert torch.allclose(got, want, rtol=0, atol=1e-7)
    assert torch.allclose(x.grad, want_x, rtol=0, atol=1e-7)
    for p, w in zip(params, want_p):
        assert (p.grad is None) == (w is None) and (w is None or torch.allclose(p.grad, w, rtol=1e-5, atol=1e-6))
    assert sum(p.requires_grad for p in params) == (6 if lora else 3)
