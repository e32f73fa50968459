"""The main job's parts: a small transformers causal LM with LoRA, byte-level text data, the LightningModule."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Dict, Optional, Tuple

import lightning.pytorch as pl
import torch
from corpus import corpus_text, python_version
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset

log = logging.getLogger("train")


class ByteChunks(Dataset):
    """Non-overlapping windows of ``seq_len`` bytes of the corpus; token id = byte value."""

    def __init__(self, text: str, seq_len: int, vocab_size: int) -> None:
        data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
        if vocab_size < 256:
            raise ValueError(f"model.config.vocab_size must be >= 256 for byte tokens, got {vocab_size}")
        n = data.numel() // seq_len
        self.chunks = data[: n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return self.chunks.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.chunks[index]


def make_dataloader(data_cfg: DictConfig, vocab_size: int, seed: int) -> DataLoader:
    text = corpus_text()
    log.info(
        "corpus: %d characters, the docstrings of a fixed list of %s's standard-library names",
        len(text),
        python_version(),
    )
    dataset = ByteChunks(text, data_cfg.seq_len, vocab_size)
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=data_cfg.batch_size, shuffle=True, generator=generator, drop_last=True)


def build_model(model_cfg: DictConfig, lora_cfg: DictConfig) -> torch.nn.Module:
    """A transformers causal LM from a config (random init), wrapped with a PEFT LoRA adapter when enabled."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_kwargs: Dict[str, Any] = OmegaConf.to_container(model_cfg.config, resolve=True)  # type: ignore[assignment]
    config = AutoConfig.for_model(model_cfg.family, **config_kwargs)
    config._attn_implementation = model_cfg.attn_implementation
    model = AutoModelForCausalLM.from_config(config)
    if lora_cfg.enabled:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=lora_cfg.r,
                lora_alpha=lora_cfg.alpha,
                lora_dropout=lora_cfg.dropout,
                target_modules=list(lora_cfg.target_modules),
            ),
        )
    return model


class CausalLM(pl.LightningModule):
    """Next-token prediction with AdamW on the trainable parameters."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-3, weight_decay: float = 0.0) -> None:
        super().__init__()
        self.model = model
        self.lr, self.weight_decay = lr, weight_decay

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)


class LossPrinter(Callback):
    """Log the training loss every ``every`` steps, so a plain log shows it going down; with ``time_left``, also the
    time a step takes and the time left (the progress lines of a run without Lightning's progress bar)."""

    def __init__(self, every: int = 10, time_left: bool = False) -> None:
        self.every = every
        self.time_left = time_left
        self._start: Optional[Tuple[float, int]] = None  # when training started, and at which step
        self._last = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = (time.perf_counter(), trainer.global_step)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last:  # a micro-batch of a step already shown (gradient accumulation)
            return
        if step == 1 or step % self.every == 0 or step == trainer.max_steps:
            self._last = step
            loss = float(outputs["loss"] if isinstance(outputs, dict) else outputs)
            if not self.time_left:
                log.info("step %4d  loss %.4f", step, loss)
                return
            total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
            started, first = self._start or (time.perf_counter(), 0)
            per_step = (time.perf_counter() - started) / max(1, step - first)
            if math.isfinite(total):
                left = _duration(per_step * max(0, int(total) - step))
                log.info("step %4d/%d  loss %.4f  %.2f s a step, %s left", step, int(total), loss, per_step, left)
            else:
                log.info("step %4d  loss %.4f  %.2f s a step", step, loss, per_step)


def _duration(seconds: float) -> str:
    """``41 s``, ``3 min 05 s``, ``1 h 02 min``."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
