"""The LightningModule the break-it tests of ``chunked_loss: auto`` and ``tiled_mlp: auto`` train: a tiny Llama whose
vocabulary of 8,000 makes the output head most of a step's activations (``tests/test_budget_tools_edge_*.py``), and
the pieces those tests build their runs from."""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from typing import Any, Iterator, List, Optional, Sequence

import lightning as L
import torch
from transformers import AutoModelForCausalLM, LlamaConfig


class VocabLM(L.LightningModule):
    """Four layers, hidden 64, a vocabulary of 8,000; batches of 2 x 128 tokens; the model's own loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(
            LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=8000,
            )
        )
        self.model.train()

    def training_step(self, b, i):
        return self.model(input_ids=b, labels=b).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return torch.utils.data.DataLoader(torch.randint(0, 8000, (16, 128), generator=g), batch_size=2)


def tiny_llama(vocab_size: int = 8000, intermediate_size: int = 128, hidden_size: int = 64, layers: int = 4):
    """A tiny Llama in training mode, from seed 0 (the break-it tests' models)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
    )
    return AutoModelForCausalLM.from_config(config).train()


class TinyLM(L.LightningModule):
    """``model`` trained on its own loss with SGD; the ``stall_at``-th call of ``training_step`` (1-based) sleeps
    ``stall`` seconds after its forward (a one-off cost such a step pays: a metric's lazy set-up, a warm-up)."""

    def __init__(self, model, stall_at: Optional[int] = None, stall: float = 0.0):
        super().__init__()
        self.model = model
        self.stall_at, self.stall = stall_at, stall
        self.calls = 0

    def training_step(self, b, i):
        out = self.model(input_ids=b, labels=b)
        self.calls += 1
        if self.calls == self.stall_at:
            time.sleep(self.stall)
        return out.loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def batches(lengths: Sequence[int], vocab_size: int, rows: int = 1) -> torch.utils.data.DataLoader:
    """One batch of ``rows`` x each of ``lengths`` random tokens, from seed 1."""
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(
        [torch.randint(0, vocab_size, (rows, s), generator=g) for s in lengths], batch_size=None
    )


def cpu_trainer(callbacks: List[L.Callback], steps: int, **kwargs: Any) -> L.Trainer:
    """A quiet CPU trainer of ``steps`` steps (no logger, checkpoints, progress bar or summary unless ``kwargs``
    says otherwise)."""
    options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(accelerator="cpu", max_steps=steps, callbacks=callbacks, **{**options, **kwargs})


@contextlib.contextmanager
def suite_lines() -> Iterator[List[str]]:
    """The suite's log lines while the block runs (warnings silenced)."""
    lines: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("lightning_ac")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield lines
    finally:
        log.removeHandler(handler)
