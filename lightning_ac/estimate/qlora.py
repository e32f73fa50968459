"""The QLoRA recipe's model, on the meta device and then on fake tensors: the decoder's linears in bitsandbytes 4-bit
as ``from_pretrained`` with a 4-bit ``BitsAndBytesConfig`` loads them (nf4 or fp4, with or without double
quantization), and, as the recipe trains it, after PEFT's ``prepare_model_for_kbit_training`` (every parameter that
is not 4-bit cast from bf16/fp16 to float32: the embeddings, the norms, the output head).

The recipe's ``prepare_model_for_kbit_training`` also turns on transformers' gradient checkpointing (reentrant, with
input gradients); here recompute is the mode's business, so the estimate prepares without it and each mode says what
recomputes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lightning_ac.estimate.errors import EstimateError
from lightning_ac.estimate.imports import import_bitsandbytes

__all__ = ["BLOCKSIZE", "NESTED_BLOCKSIZE", "four_bit_linears", "pack_four_bit", "prepare_for_kbit_training"]

BLOCKSIZE = 64  # bitsandbytes' 4-bit block: one absmax per 64 weights
NESTED_BLOCKSIZE = 256  # double quantization: the absmax quantized to 8 bits, one float32 absmax per 256 of them


def four_bit_linears(model: nn.Module, dtype: torch.dtype, device: Any, quant_type: str, double_quant: bool) -> None:
    """The decoder's linears as bitsandbytes ``Linear4bit``, as ``from_pretrained`` with a 4-bit
    ``BitsAndBytesConfig`` makes them (transformers' own replacement; the output head stays), still unquantized on
    meta: :func:`pack_four_bit` gives them their packed storage on fake tensors."""
    if str(device) != "meta":
        raise EstimateError(
            "qlora: the estimate builds the 4-bit base on the meta device only; a real 4-bit model is loaded with "
            "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))"
        )
    try:
        import_bitsandbytes()  # first, so that its import's log lines are held (lightning_ac.estimate.imports)
        from transformers import BitsAndBytesConfig
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    except ImportError as err:  # pragma: no cover - bitsandbytes is in the tests' extra
        raise EstimateError(f"--qlora needs bitsandbytes: pip install bitsandbytes ({err})") from err
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=dtype,
    )
    replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"], quantization_config=quantization)
    model.is_loaded_in_4bit = True  # what transformers sets on a 4-bit model, and PEFT reads to wrap Linear4bit


def prepare_for_kbit_training(model: nn.Module) -> None:
    """PEFT's ``prepare_model_for_kbit_training`` without its gradient checkpointing (see the module's docstring)."""
    from peft import prepare_model_for_kbit_training

    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def pack_four_bit(model: nn.Module, dtype: torch.dtype, quant_type: str = "nf4", double_quant: bool = False) -> None:
    """Inside the fake mode, after ``to_empty``: each ``Linear4bit``'s weight as bitsandbytes stores a quantized one,
    packed (two 4-bit values a byte, shape ``(n / 2, 1)``, uint8) with its quant state (an absmax per
    :data:`BLOCKSIZE` weights, float32, or with double quantization uint8 with a float32 absmax per
    :data:`NESTED_BLOCKSIZE` of them, their 256-value code and an offset; and the 16-value 4-bit code), which the
    estimate holds as buffers of the layer so that they are counted with the weights (bitsandbytes keeps them on the
    weight, where they are neither).
    """
    import_bitsandbytes()
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if not isinstance(module, Linear4bit):
            continue
        out_features, in_features = module.out_features, module.in_features
        n = out_features * in_features
        blocks = math.ceil(n / BLOCKSIZE)
        code = torch.empty(16, dtype=torch.float32)
        held = {"_estimate_code": code}
        if double_quant:
            nested_absmax = torch.empty(math.ceil(blocks / NESTED_BLOCKSIZE), dtype=torch.float32)
            nested_code = torch.empty(256, dtype=torch.float32)
            nested = QuantState(absmax=nested_absmax, code=nested_code, blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
            absmax = torch.empty(blocks, dtype=torch.uint8)
            offset = torch.empty((), dtype=torch.float32)
            state = QuantState(absmax=absmax, shape=torch.Size([out_features, in_features]), code=code,
                               blocksize=BLOCKSIZE, quant_type=quant_type, dtype=dtype, offset=offset,
                               state2=nested)  # fmt: skip
            held.update(_estimate_nested_absmax=nested_absmax, _estimate_nested_code=nested_code)
            held["_estimate_offset"] = offset
        else:
            absmax = torch.empty(blocks, dtype=torch.float32)
            state = QuantState(absmax=absmax, shape=torch.Size([out_features, in_features]), code=code,
                               blocksize=BLOCKSIZE, quant_type=quant_type, dtype=dtype)  # fmt: skip
        held["_estimate_absmax"] = absmax
        # a plain parameter: bitsandbytes' Params4bit cannot wrap a fake tensor, and Linear4bit reads only what is set
        weight = nn.Parameter(torch.empty((n + 1) // 2, 1, dtype=torch.uint8), requires_grad=False)
        weight.quant_state, weight.quant_type = state, quant_type
        weight.compress_statistics = double_quant
        weight.blocksize = BLOCKSIZE
        module.weight = weight
        for name, tensor in held.items():
            module.register_buffer(name, tensor, persistent=False)
