"""Shared test helpers: tiny real transformers models, a real Trainer run, and an op counter."""

from __future__ import annotations

import copy
import os
import warnings
from collections import Counter
from typing import Any, Callable, Dict, List, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*litlogger.*")

VOCAB = 128
SEQ = 32
BATCH = 2


def tiny_config(family: str = "llama", **overrides: Any):
    from transformers import AutoConfig

    kwargs: Dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if family == "qwen3":
        kwargs.update(head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    if family == "gemma3_text":
        kwargs.update(head_dim=16, sliding_window=8, sliding_window_pattern=2)
    kwargs.update(overrides)
    config = AutoConfig.for_model(family, **kwargs)
    config._attn_implementation = "sdpa"
    return config


def tiny_model(family: str = "llama", seed: int = 0, lora: bool = False, **overrides: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    lora_dropout = overrides.pop("lora_dropout", 0.0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=4,
                lora_alpha=8,
                lora_dropout=lora_dropout,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            ),
        )
    return model


ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_qlora_model(
    tmp_dir: str, double_quant: bool = False, seed: int = 0, targets=ALL_LINEARS, train: bool = True
) -> torch.nn.Module:
    """A tiny Llama whose decoder linears are bitsandbytes ``Linear4bit`` (nf4), with LoRA on ``targets``: built from
    a config, saved, and loaded back quantized, as users load a QLoRA base; in train mode unless ``train=False``
    (``from_pretrained`` leaves it in eval mode)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_dir)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=double_quant,
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_dir, device_map="cpu", quantization_config=quantization)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets)))
    return model.train() if train else model


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops by overload packet name (``aten.mm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class LM(pl.LightningModule):
    """Causal LM training step that records the first step's loss, gradients and backward op counts."""

    def __init__(self, model: torch.nn.Module, lr: float = 0.1) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.losses: List[float] = []
        self.grads: Optional[Dict[str, torch.Tensor]] = None
        self.backward_ops: Optional[Counter] = None
        self._counter: Optional[OpCounter] = None

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(float(loss.detach()))
        return loss

    def on_before_backward(self, loss):
        if self.backward_ops is None:
            self._counter = OpCounter()
            self._counter.__enter__()

    def on_after_backward(self):
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.backward_ops, self._counter = self._counter.counts, None
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None}

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def assert_same_training(reference: LM, run: LM) -> None:
    """Same losses and bit-identical gradients of the first step."""
    assert reference.losses == run.losses
    assert reference.grads.keys() == run.grads.keys()
    for name, grad in reference.grads.items():
        assert torch.equal(grad, run.grads[name]), name


def batches(n: int = 4, seed: int = 1, seq: int = SEQ) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n * BATCH, seq), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=BATCH)


def make_trainer(callbacks=(), max_steps: int = 1, **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("logger", False)
    kwargs.setdefault("accelerator", "cpu")
    return pl.Trainer(
        devices=1,
        max_steps=max_steps,
        callbacks=list(callbacks),
        enable_checkpointing=kwargs.pop("enable_checkpointing", False),
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def fit(model: torch.nn.Module, callbacks=(), max_steps: int = 1, module_cls: Callable = LM, **kwargs: Any) -> LM:
    module = module_cls(model)
    make_trainer(callbacks, max_steps=max_steps, **kwargs).fit(module, batches())
    return module


def model_fingerprint(root: torch.nn.Module) -> Dict[str, Any]:
    """Everything a plan may touch: instance attributes, hooks, state_dict keys."""
    snap: Dict[str, Any] = {"state_dict": sorted(root.state_dict().keys())}
    for name, m in root.named_modules():
        snap[name] = (
            sorted(
                k for k in m.__dict__ if not k.startswith("_") or k.startswith("_gradient") or k.startswith("_require")
            ),
            {k: v for k, v in m.__dict__.items() if k in ("gradient_checkpointing",)},
            "forward" in m.__dict__,
            "configure_model" in m.__dict__,
            *(
                len(getattr(m, d))
                for d in (
                    "_forward_hooks",
                    "_forward_pre_hooks",
                    "_backward_hooks",
                    "_backward_pre_hooks",
                    "_state_dict_hooks",
                    "_load_state_dict_pre_hooks",
                )
            ),
        )
    return snap


@pytest.fixture
def llama():
    return tiny_model("llama")


@pytest.fixture(params=["host", pytest.param("simulated", marks=pytest.mark.simulated)])
def transfer(request):
    """Where offload copies run: ``host``, the synchronous ``copy_on_host`` branch; ``simulated``, the
    accelerator branch on the simulated asynchronous device (deferred copies, poison, release checks)."""
    if request.param == "host":
        yield None
        return
    from lightning_ac.testing.simulated import SimulatedDevice

    with SimulatedDevice() as sim:
        yield sim


@pytest.fixture(autouse=True)
def _capture_suite_log(caplog):
    caplog.set_level("INFO", logger="lightning_ac")


@pytest.fixture(autouse=True)
def _no_dispatch_mode_left():
    """A test whose step raised between ``on_before_backward`` and ``on_after_backward`` (a callback raising there:
    Lightning calls the callbacks' hook before the module's) leaves :class:`LM`'s :class:`OpCounter` entered; every
    later test in the process would run under it, and dynamo runs nothing compiled under a dispatch mode (a compiled
    layer's backward graph never traced). What a test leaves on the stack is exited after it."""
    yield
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, OpCounter):
            mode.__exit__(None, None, None)


def clone(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def shard_once(module: pl.LightningModule) -> None:
    """FSDP2 in ``configure_model``: ``fully_shard`` each decoder layer and then the model, once per module."""
    from torch.distributed.fsdp import fully_shard

    if getattr(module, "_sharded", False):
        return
    module._sharded = True
    for layer in module.model.model.layers:
        fully_shard(layer, mesh=module.device_mesh["data_parallel"])
    fully_shard(module.model, mesh=module.device_mesh["data_parallel"])
