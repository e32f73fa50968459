"""`selective: {save: [attention]}` under each SDPA backend the CPU runs: its kernel saved, or under the math
backend (aten ops, no kernel) the attention's output matmul; gradients bit-identical to an unmodified run."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import clone, fit, tiny_model
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_ac import ActivationCheckpointing, SelectiveCheckpointingWarning
from lightning_ac.selective.ops import MATH_ATTENTION_OUTPUT, MATH_ATTENTION_SOFTMAX, is_attention

CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"
BMM = "aten.bmm"
SOFTMAX = "aten._safe_softmax"  # SDPA's math backend's softmax (eager attention's is _softmax)
LAYERS = 4


def fits(base, backend):
    """An unmodified run, full recompute and `save: [attention]`, all with SDPA held to ``backend``; the warnings
    the selective run's diagnostics gave."""
    with sdpa_kernel(backend):
        reference = fit(clone(base))
        full = fit(clone(base), [ActivationCheckpointing()])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            selective = fit(clone(base), [ActivationCheckpointing(selective={"save": ["attention"]})])
    problems = [str(w.message) for w in caught if issubclass(w.category, SelectiveCheckpointingWarning)]
    return reference, full, selective, problems


def replayed(run, reference, op):
    """How many more times ``op`` ran in ``run``'s backward than in the unmodified one's: the recompute's calls."""
    return run.backward_ops.get(op, 0) - reference.backward_ops.get(op, 0)


def assert_same_grads(reference, run):
    assert reference.losses == run.losses
    assert reference.grads.keys() == run.grads.keys()
    for name, grad in reference.grads.items():
        assert torch.equal(grad, run.grads[name]), name


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")  # grouped-query heads (4 query, 2 key/value), as on the GPU run that found this


def test_cpu_flash_kernel_saved(llama):
    reference, full, selective, problems = fits(llama, SDPBackend.FLASH_ATTENTION)
    assert_same_grads(reference, selective)
    assert full.backward_ops[CPU_FLASH] == LAYERS, "full recompute replays the kernel once per layer"
    assert selective.backward_ops.get(CPU_FLASH, 0) == 0
    assert replayed(selective, reference, BMM) == 0
    assert problems == []


def test_math_backend_saves_the_attention_output(llama):
    # float32 on CUDA with grouped-query heads runs this backend (flash and cuDNN take half precision only, the
    # efficient kernel refuses enable_gqa): no kernel, but QK^T (bmm), _safe_softmax, probs @ V (bmm)
    reference, full, selective, problems = fits(llama, SDPBackend.MATH)
    assert CPU_FLASH not in full.backward_ops
    assert replayed(full, reference, BMM) == 2 * LAYERS, "full recompute replays QK^T and probs @ V"
    assert replayed(full, reference, SOFTMAX) == LAYERS
    assert_same_grads(reference, selective)
    # the output is saved; QK^T and the softmax are replayed, as the backward needs the probabilities (seq x seq)
    assert replayed(selective, reference, BMM) == LAYERS
    assert replayed(selective, reference, SOFTMAX) == LAYERS
    assert len(problems) == 1 and "math backend" in problems[0] and "bfloat16" in problems[0], problems


def test_math_backend_in_sliding_window_layers_recomputes_attention():
    base = tiny_model("qwen3")  # layer_types: full, full, sliding, sliding
    reference, full, selective, _ = fits(base, SDPBackend.MATH)
    assert_same_grads(reference, selective)
    assert replayed(full, reference, BMM) == 2 * LAYERS
    # the two full-attention layers save their output matmul; the sliding layers recompute both matmuls
    assert replayed(selective, reference, BMM) == 2 + 2 * 2


def test_the_cpu_has_no_other_backend(llama):
    # the efficient and cuDNN kernels are CUDA's: forcing them on the CPU finds no backend (tests/test_gpu.py covers
    # them); were one to come to the CPU, it would need its case above
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        q = torch.randn(1, 2, 8, 16)
        with sdpa_kernel(backend), pytest.raises(RuntimeError, match="No viable backend"):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_every_sdpa_kernel_of_this_torch_is_named():
    # the ops SDPA's backends dispatch (SDPBackend: flash, flash for CPU, efficient, cuDNN, overrideable, MPS's math);
    # a CompositeImplicitAutograd op (SDPA itself, the math backend) decomposes before the policy sees it
    kernels = {
        name.split(".")[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::_scaled_dot_product_")
        and "backward" not in name
        and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
    }
    assert {"aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention"} <= kernels
    assert {name for name in kernels if not is_attention(name)} == set()
    assert not is_attention(MATH_ATTENTION_SOFTMAX) and not is_attention(MATH_ATTENTION_OUTPUT)
