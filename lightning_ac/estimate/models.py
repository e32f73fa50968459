"""The model an estimate is for: its config (a preset, a config file, or a transformers model type with overrides),
built on the meta device, with LoRA or for a full fine-tune. Nothing is downloaded; no memory is allocated."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn

from lightning_ac.estimate.attention import FLASH_STAND_IN, attention_for
from lightning_ac.estimate.errors import EstimateError
from lightning_ac.estimate.imports import without_bitsandbytes
from lightning_ac.estimate.overrides import apply_overrides, check_heads, check_layers, padding_hint
from lightning_ac.estimate.qlora import four_bit_linears, prepare_for_kbit_training

__all__ = [
    "PRESETS_DIR",
    "EstimateError",
    "QUANT_TYPES",
    "Training",
    "fake_op_error",
    "build_model",
    "describe",
    "load_config",
    "parse_set",
    "presets",
]

PRESETS_DIR = Path(__file__).resolve().parent / "presets"


def presets() -> List[str]:
    """The names of the presets shipped with the package (``llama3-8b``...)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def parse_set(item: str) -> tuple:
    """``key=value`` from ``--set``: the value read as JSON where it is (``64``, ``1e-5``, ``true``, ``null``,
    ``[1, 2]``), else as text."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise EstimateError(f"--set {item!r}: expected key=value, e.g. --set num_hidden_layers=2")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    return key, value


def _read_json(path: Path, what: str) -> Dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise EstimateError(f"{what}: cannot read {path} as JSON ({err})") from err
    if not isinstance(data, dict) or "model_type" not in data:
        raise EstimateError(f"{what}: {path} holds no model_type; is it a transformers config.json?")
    return data


def _base_config(model: str) -> Dict[str, Any]:
    """The config a ``--model`` names, as a dict: a preset, a config file or model directory, or a model type."""
    preset = PRESETS_DIR / f"{model}.json"
    if preset.is_file():
        return {k: v for k, v in _read_json(preset, f"--model {model}").items() if not k.startswith("_")}
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise EstimateError(f"--model {model}: the directory holds no config.json")
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise EstimateError(f"--model {model}: no such file")
        data = _read_json(path, f"--model {model}")
        text = data.get("text_config")
        if isinstance(text, dict) and data.get("model_type", "").startswith("gemma3"):
            # a multimodal Gemma 3 checkpoint: its language model, which is what trains here
            data = {**text, "model_type": "gemma3_text"}
        return data
    from transformers import CONFIG_MAPPING

    if model in CONFIG_MAPPING:
        return {"model_type": model}
    raise EstimateError(
        f"--model {model}: not a preset ({', '.join(presets())}), a config.json or model directory, or a transformers "
        "model type (llama, qwen3, gemma3_text, ...)"
    )


def load_config(model: str, overrides: Mapping[str, Any] = (), attention: Optional[str] = None) -> Any:
    """The transformers config ``model`` names, with ``overrides`` applied
    (:func:`~lightning_ac.estimate.overrides.apply_overrides`: dotted keys reach nested configs, an undotted key on a
    multimodal config is its language model's). ``attention``: the attention implementation
    (:func:`~lightning_ac.estimate.attention.attention_for`; ``None``, the model's default). A multimodal config comes
    back as its language model's, which is what trains here."""
    from transformers import AutoConfig

    data = _base_config(model)
    overrides = dict(overrides)
    apply_overrides(data, overrides)
    model_type = data.pop("model_type")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype", "quantization_config"):
        data.pop(key, None)
    try:
        config = AutoConfig.for_model(model_type, **data)
    except Exception as err:  # ValueError, TypeError, huggingface_hub's StrictDataclassFieldValidationError...
        named = re.search(r"field '(\w+)'", str(err))
        field = named.group(1) if named else None
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        why = lines[-1] if lines else type(err).__name__
        # the key as the user gave it: "hidden_size" set on a multimodal config is text_config's, and named so
        given = next((key for key in overrides if field is not None and key.rsplit(".", 1)[-1] == field), None)
        if given is not None:
            raise EstimateError(f"--set {given}={overrides[given]!r}: transformers rejects it ({why})") from None
        raise EstimateError(f"--model {model}: transformers rejects the config ({why})") from None
    if not hasattr(config, "num_hidden_layers") and hasattr(config, "get_text_config"):
        # a multimodal model's config (gemma3, llama4): its language model is what trains here
        text = config.get_text_config()
        if text is not config and hasattr(text, "num_hidden_layers"):
            config = text
    check_heads(config, overrides)
    check_layers(config)
    config._attn_implementation = attention_for(config, attention)
    return config


def position_limit(model: nn.Module) -> Optional[int]:
    """The longest sequence a model with learned absolute positions (GPT-2's ``wpe``, OPT's and BART's
    ``embed_positions``) can embed; ``None`` for rotary and other positions, which take any length."""
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and leaf in ("wpe", "embed_positions", "position_embeddings"):
            return module.num_embeddings - int(getattr(module, "offset", 0) or 0)
    return None


LOSSES = ("causal_lm", "last_logit_mean")
QUANT_TYPES = ("nf4", "fp4")


ADAPTER_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Training:
    """What trains, and on what loss.

    Attributes:
        lora_rank: LoRA's rank; ``None`` trains every parameter (a full fine-tune).
        lora_targets: The modules LoRA adapts (PEFT's defaults for the model type when ``None``).
        qlora: The frozen base's decoder linears are bitsandbytes 4-bit, as ``BitsAndBytesConfig(load_in_4bit=True)``
            loads them, LoRA on top (:mod:`~lightning_ac.estimate.qlora`).
        loss: ``causal_lm`` (the model's own loss, ``labels=input_ids``) or ``last_logit_mean`` (``logits_to_keep=1``
            and ``logits.float().mean()``: a loss without the output head's full logits, as Axolotl's memory
            measurements use).
        first_step: The step is a run's first: no gradients or optimizer state exist before it (as after
            ``zero_grad(set_to_none=True)``); they are allocated in the step and counted in its device total, not as
            what exists before it. Otherwise the step is the one after a first.
        qlora_prepared: With ``qlora``: the model as the QLoRA recipe trains it, after PEFT's
            ``prepare_model_for_kbit_training`` (the embeddings, norms and output head cast to float32); ``False``:
            as loaded.
        double_quant: With ``qlora``: ``bnb_4bit_use_double_quant`` (the absmax quantized to 8 bits).
        quant_type: With ``qlora``: ``nf4`` or ``fp4`` (the same bytes).
        adapter_dtype: LoRA's adapters in this dtype (``bfloat16``, ``float16``, ``float32``); ``None``: as PEFT
            makes them (float32 adapters on a 4-bit or fp16/bf16 base: each adapted linear then saves a float32 copy
            of its input).
        lora_dropout: PEFT's ``lora_dropout``: each adapted linear drops its input apart and keeps the dropped copy
            and a mask, counted as the target keeps it (:mod:`~lightning_ac.estimate.dropout`).
    """

    lora_rank: Optional[int] = 16
    lora_targets: Optional[Sequence[str]] = None
    qlora: bool = False
    loss: str = "causal_lm"
    first_step: bool = False
    qlora_prepared: bool = True
    double_quant: bool = False
    quant_type: str = "nf4"
    adapter_dtype: Optional[str] = None
    lora_dropout: float = 0.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.lora_dropout, bool)
            or not isinstance(self.lora_dropout, (int, float))
            or not (0.0 <= self.lora_dropout < 1.0)
        ):
            raise EstimateError(f"--lora-dropout {self.lora_dropout!r}: expected a probability in [0, 1), as PEFT's")
        if self.loss not in LOSSES:
            raise EstimateError(f"--loss {self.loss}: choose from {', '.join(LOSSES)}")
        if self.quant_type not in QUANT_TYPES:
            raise EstimateError(f"--quant-type {self.quant_type}: choose from {', '.join(QUANT_TYPES)}")
        if not self.qlora and (self.double_quant or self.quant_type != "nf4"):
            raise EstimateError(
                "--double-quant and --quant-type describe the 4-bit base of a QLoRA run: add --qlora (or "
                "--qlora-as-loaded)"
            )
        if self.adapter_dtype is not None and self.adapter_dtype not in ADAPTER_DTYPES:
            raise EstimateError(f"--adapter-dtype {self.adapter_dtype}: choose from {', '.join(ADAPTER_DTYPES)}")
        if self.adapter_dtype is not None and self.full_finetune:
            raise EstimateError(
                "--adapter-dtype with --full-finetune: the adapters' dtype is LoRA's; a full fine-tune trains the "
                "weights in their own dtype. Use --lora R, or leave --adapter-dtype out."
            )
        if self.qlora and self.full_finetune:
            raise EstimateError(
                "--qlora with --full-finetune: QLoRA trains LoRA adapters on a frozen 4-bit base; a 4-bit weight "
                "cannot train. Use --qlora with --lora R, or --full-finetune without --qlora."
            )

    @property
    def full_finetune(self) -> bool:
        return self.lora_rank is None

    def describe(self, targets: Optional[Sequence[str]] = None) -> str:
        if self.full_finetune:
            text = "full fine-tune"
        else:
            shown = f" ({', '.join(targets)})" if targets else ""
            text = f"{self._qlora_text() if self.qlora else 'lora'} r={self.lora_rank}{shown}"
            text += f", adapters in {self.adapter_dtype}" if self.adapter_dtype else ""
            text += f", dropout {self.lora_dropout:g}" if self.lora_dropout else ""
        text = text if self.loss == "causal_lm" else f"{text}, loss {self.loss}"
        return f"{text}, a first step (no gradients before it)" if self.first_step else text

    def _qlora_text(self) -> str:
        base = self.quant_type + (" double-quant" if self.double_quant else "")
        how = "prepared for k-bit training" if self.qlora_prepared else "as loaded"
        return f"qlora ({base} base, {how})"


def lora_targets(config: Any, training: Training) -> List[str]:
    """The modules LoRA adapts: the given ones, else PEFT's default for the model type, else the attention's q and v
    projections where the model has them."""
    if training.lora_targets:
        return list(training.lora_targets)
    with without_bitsandbytes():  # importing PEFT imports bitsandbytes, which only a 4-bit run needs
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    found = DEFAULTS.get(config.model_type)
    if found:
        return list(found)
    return ["q_proj", "v_proj"]


def build_model(config: Any, dtype: torch.dtype, training: Training, device: Any = "meta") -> nn.Module:
    """The causal LM for ``config`` on ``device`` (the estimate's: meta) in ``dtype``, with LoRA adapters (PEFT,
    trainable, the rest frozen) or every parameter trainable. PEFT keeps fp16/bf16 adapters in float32, as it does by
    default, unless ``training.adapter_dtype`` says otherwise. The tests build the real model they measure with it, on
    the CPU."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, TypeError, AttributeError, IndexError, KeyError, RuntimeError, AssertionError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise EstimateError(
            f"--model {config.model_type}: transformers cannot build the model from this config "
            f"({type(err).__name__}: {first[:300]}). {padding_hint(config) or 'Check the --set values.'}"
        ) from err
    if training.qlora:
        four_bit_linears(model, dtype, device, training.quant_type, training.double_quant)
        if training.qlora_prepared:
            prepare_for_kbit_training(model)
    if training.full_finetune:
        model.requires_grad_(True)
        return model
    with without_bitsandbytes():  # importing PEFT imports bitsandbytes, which only a 4-bit run needs
        from peft import LoraConfig, get_peft_model

    targets: Any = lora_targets(config, training)
    if targets == ["all-linear"]:  # PEFT's own spelling, which it takes as a string only
        targets = "all-linear"
    lora = LoraConfig(
        r=training.lora_rank,
        lora_alpha=2 * training.lora_rank,
        lora_dropout=training.lora_dropout,
        target_modules=targets,
    )
    try:
        with torch.device(device), without_bitsandbytes():  # PEFT imports it to look for its layers
            return adapters_in(get_peft_model(model, lora), training.adapter_dtype)
    except ValueError as err:
        raise EstimateError(
            f"LoRA on {config.model_type}: {err}. Name the modules to adapt (lora_targets=[...], --lora-targets)"
        ) from err


def adapters_in(model: nn.Module, dtype: Optional[str]) -> nn.Module:
    """``model`` (a PEFT model, LoRA's adapters its only trainable parameters) with the adapters cast to ``dtype``
    (unchanged when ``None``)."""
    if dtype is not None:
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(getattr(torch, dtype))
    return model


def describe(config: Any, model: nn.Module) -> str:
    """The model's shape in one line."""
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    shown = "flash_attention_2 (counted as SDPA's flash kernel)" if attention == FLASH_STAND_IN else attention
    return (
        f"{config.model_type}: {count(params, 2)} parameters ({count(trainable, 1)} trainable), "
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, vocabulary {config.vocab_size}, "
        f"attention {shown}"
    )


def count(number: int, digits: int) -> str:
    """A count of parameters as people write it: ``8.04 B``, ``6.8 M``, ``41.0 K``, ``512``."""
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if round(number / scale, digits) >= 1:  # 999,999,999 is 1.00 B, not 1000.00 M
            return f"{number / scale:.{digits}f} {unit}"
    return str(number)


def fake_op_error(err: BaseException, mode: str, op: Any) -> Optional[EstimateError]:
    """An op fake tensors cannot run, as an error naming it and the mode; ``None`` for other errors."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, UnsupportedOperatorException):
        why = "has no fake (meta) implementation"
    elif isinstance(err, DynamicOutputShapeException):
        why = "has an output whose shape depends on the data"
    elif isinstance(err, DataDependentOutputException):
        why = "needs the values of a tensor (data-dependent control flow)"
    elif op is not None or "fake impl" in text:
        why = f"failed on fake tensors ({type(err).__name__}: {text[:300]})"
    else:
        return None
    op = getattr(err, "func", None) or op
    return EstimateError(
        f"mode {mode}: the op {op or 'a custom op'} {why}, so the step cannot run on fake tensors. A custom or Triton "
        "kernel needs a fake implementation (torch.library.register_fake); a model that branches on tensor values "
        "cannot be estimated this way."
    )
