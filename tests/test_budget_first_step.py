"""What a budget bounds in the first step, and where the libraries' one-time allocations are counted instead.

A budget bounds a step's activations, the first step's too. What a library allocates once, on its first use, and keeps
(cuBLAS's workspaces: one per handle and stream, a handle per thread, so the forward's and the backward's: 68,039,168
bytes of a tiny model's first step on the H200 against its 885,504-byte budget) is allocated before a step is measured
(``lightning_ac.memory.warm_up_libraries``), and counted where the parameters are: in the estimator's device total.
The CUDA allocator's side runs in tests/test_gpu.py; here, on the CPU, the same code.
"""

from __future__ import annotations

import torch
from conftest import tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ac.estimate.models import Training
from lightning_ac.estimate.modes import resolve_modes
from lightning_ac.estimate.step import fake_step
from lightning_ac.estimate.workspaces import DEFAULT_WORKSPACE_BYTES, cublas_workspace_bytes
from lightning_ac.memory import first_matmuls

MiB = 2**20


class _Matmuls(TorchDispatchMode):
    """Each matmul run: (its dtype, whether it ran in a backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.seen.add((args[0].dtype, torch._C._current_graph_task_id() != -1))
        return func(*args, **(kwargs or {}))


def test_the_warm_up_runs_each_dtypes_matmuls_in_a_backward_too_past_the_hooks_in_force():
    """The backward's matmuls run on autograd's thread for the device, whose cuBLAS handle (and workspace) is not the
    caller's: a warm-up of forward matmuls alone left the backward's 32 MiB to the first measured step. What it saves
    goes past the hooks in force (the budget's counting, an offload's packing) and it ignores autocast."""
    packed = []
    with _Matmuls() as matmuls, torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            first_matmuls(torch.device("cpu"))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert (dtype, False) in matmuls.seen and (dtype, True) in matmuls.seen, (dtype, matmuls.seen)
    assert packed == [], "nothing of the warm-up's graph went through the step's saved-tensor hooks"


def test_cublas_workspace_size_as_torch_reads_it():
    assert cublas_workspace_bytes("") == DEFAULT_WORKSPACE_BYTES == 32 * MiB  # Hopper's and Blackwell's default
    assert cublas_workspace_bytes(":4096:2:16:8") == 8 * MiB + 128 * 1024  # the older GPUs' default, as written
    assert cublas_workspace_bytes(":16:8") == 128 * 1024 and cublas_workspace_bytes(":0:0") == 0
    assert cublas_workspace_bytes("garbage") == DEFAULT_WORKSPACE_BYTES  # torch warns and takes its default


def test_the_estimators_device_total_counts_the_cublas_workspaces_on_a_cuda_target(monkeypatch):
    """Two workspaces (the forward's thread's and the backward's) on a CUDA target, in the device total and the budget
    plan's fixed bytes, not in the activations; none on the CPU; CUBLAS_WORKSPACE_CONFIG sizes them."""
    from lightning_ac.estimate.budget import measure

    config, mode = tiny_config("llama"), resolve_modes(["full"], False)[0]
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cuda = fake_step(config, torch.float32, Training(None, None), mode, 32, 2, "adamw", target="cuda")
    cpu = fake_step(config, torch.float32, Training(None, None), mode, 32, 2, "adamw", target="cpu")
    assert cuda.workspace_bytes == 2 * 32 * MiB and cpu.workspace_bytes == 0
    own = cuda.device_total_bytes - cuda.workspace_bytes  # the step's tensors: a tiny model's, a few MiB
    assert 0 < own < 16 * MiB and own >= cpu.device_total_bytes  # a CUDA target rounds each allocation up
    assert cuda.activation_peak_bytes < own, "the workspaces are not activations"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    step, figures = measure("budget", config, torch.float32, Training(None, None), 32, 2, "adamw", "cuda")
    assert step.workspace_bytes == 2 * (8 * MiB + 128 * 1024)
    assert figures.fixed_bytes >= step.parameter_bytes + step.gradient_bytes + step.workspace_bytes
