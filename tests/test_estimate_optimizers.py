"""The estimate's optimizers as users build them: fused AdamW makes no parameter-sized temporary, bitsandbytes'
8-bit AdamW holds its own state layout, the step counters torch keeps on the host are counted there, and any
torch.optim class can be named in Python. (The fake steps against real CPU steps: tests/test_estimate.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from lightning_ac.estimate import EstimateError, estimate
from lightning_ac.estimate.models import Training
from lightning_ac.estimate.modes import resolve_modes
from lightning_ac.estimate.optimizers import OPTIMIZERS, optimizer_choice, state_on_host
from lightning_ac.estimate.step import fake_step

FULL = Training(None)


def _step(optimizer, target="cuda", dtype=torch.float32, training=FULL):
    (mode,) = resolve_modes(["full"], training.full_finetune)
    return fake_step(tiny_config("llama"), dtype, training, mode, 32, 2, optimizer, target)


def _trainable_bytes(dtype=torch.float32):
    from lightning_ac.estimate.models import build_model

    model = build_model(tiny_config("llama"), dtype, FULL, "cpu")
    return [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]


def test_fused_adamw_makes_no_parameter_sized_temporary():
    """Foreach AdamW's step makes temporaries the size of the parameters (the largest at least one parameter's
    worth); the fused kernel updates in place: the same state, a lower device total."""
    foreach, fused = _step("adamw"), _step("adamw_fused")
    assert fused.optimizer_bytes >= foreach.optimizer_bytes  # the same moments; fused keeps its step counters here
    assert foreach.device_total_bytes - fused.device_total_bytes >= max(_trainable_bytes())


def test_the_step_counters_are_host_memory_on_cuda_unless_fused():
    sizes = _trainable_bytes()
    foreach, fused = _step("adamw"), _step("adamw_fused")
    # one 0-dim float32 counter per trainable tensor, each storage counted in the CUDA estimate's 512-byte blocks: on
    # the device only for the fused optimizer
    assert fused.optimizer_bytes - foreach.optimizer_bytes == 512 * len(sizes)
    assert foreach.host_bytes == 512 * len(sizes) and fused.host_bytes == 0
    # a CPU estimate counts exact bytes, where the host is the device
    assert _step("adamw", target="cpu").host_bytes == 0


def test_state_on_host_follows_torch():
    """torch keeps a non-fused, non-capturable AdamW's step counter on the CPU whatever the parameters' device (here
    the meta device stands for an accelerator); fused and capturable ones put it beside the parameter."""
    p = torch.nn.Parameter(torch.zeros(4, device="meta"))
    p.grad = torch.zeros(4, device="meta")
    optimizer = torch.optim.AdamW([p], foreach=False)
    optimizer.step()
    state = optimizer.state[p]
    assert state["step"].device.type == "cpu" and state["exp_avg"].device.type == "meta"
    assert state_on_host(optimizer, "step", state["step"])
    assert not state_on_host(optimizer, "exp_avg", state["exp_avg"])
    for kwargs in ({"fused": True}, {"capturable": True}):
        assert not state_on_host(torch.optim.AdamW([p], **kwargs), "step", state["step"]), kwargs
    assert not state_on_host(object(), "step", state["step"])  # not a torch optimizer: bitsandbytes counts ints


def test_the_8bit_state_is_bitsandbytes_own():
    """The fake step's AdamW8bit allocates what bitsandbytes' own AdamW8bit holds after a real step on the CPU:
    uint8 moments, a float32 absmax per 256 elements, 32-bit moments for tensors under 4096 elements, the two
    256-value maps shared by every tensor."""
    bnb = pytest.importorskip("bitsandbytes")

    def state_bytes(cls):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (4096, 1000, 70000)]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = cls(params, lr=1e-3)
        optimizer.step()
        seen = {}
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    seen.setdefault(id(value.untyped_storage()), (value.dtype, value.untyped_storage().nbytes()))
        return sorted(seen.values(), key=str)

    ours = optimizer_choice("adamw_8bit").cls
    assert state_bytes(ours) == state_bytes(bnb.optim.AdamW8bit)


def test_the_8bit_state_is_about_a_quarter_of_adamws():
    adamw, eight = _step("adamw", dtype=torch.bfloat16), _step("adamw_8bit", dtype=torch.bfloat16)
    assert 0.25 < eight.optimizer_bytes / adamw.optimizer_bytes < 0.75  # uint8 against bf16 moments, plus absmax


def test_sgd_momentum_keeps_one_buffer_per_parameter():
    sizes = _trainable_bytes()
    assert _step("sgd").optimizer_bytes == 0
    assert _step("sgd_momentum", target="cpu").optimizer_bytes == sum(sizes)


def test_any_torch_optimizer_with_its_arguments():
    result = estimate(
        "llama",
        32,
        overrides=tiny_config("llama").to_diff_dict(),
        full_finetune=True,
        modes=["off"],
        optimizer=(torch.optim.Adam, {"betas": (0.9, 0.95), "foreach": False}),
    )
    assert result.optimizer == "Adam(betas=(0.9, 0.95), foreach=False)"
    assert result.steps[0].optimizer_bytes > 0
    # a class on a CUDA target runs foreach, torch's default there, unless its arguments say otherwise
    assert optimizer_choice(torch.optim.AdamW).kwargs["foreach"] is True
    assert "foreach" not in optimizer_choice(torch.optim.AdamW, "cpu").kwargs
    assert "foreach" not in optimizer_choice((torch.optim.AdamW, {"fused": True})).kwargs
    assert optimizer_choice(torch.optim.AdamW).name == "AdamW()"
    assert estimate("llama", 32, overrides=tiny_config("llama").to_diff_dict(), modes=["off"],
                    optimizer=torch.optim.Adagrad).optimizer == "Adagrad()"  # fmt: skip


@pytest.mark.parametrize("bad", ["adam", torch.nn.Linear, (torch.optim.Adam, ["betas"])])
def test_an_unknown_optimizer_is_refused_before_any_step(bad):
    with pytest.raises(EstimateError, match="optimizer"):
        estimate("llama", 32, optimizer=bad)


def test_every_name_builds():
    params = [torch.nn.Parameter(torch.zeros(8))]
    for name in OPTIMIZERS:
        built = optimizer_choice(name).build(params)
        assert (built is None) == (name == "none"), name
