"""Peak memory and step time of training steps, measured the same way for the main job and the benchmark
(:mod:`lightning_ac.memory`, which the memory budget uses too). MemTracker slows the step it watches, so that step
is left out of the step times.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_ac._logging import rank_zero_warn
from lightning_ac.memory import MemoryPeak, StepMeasurement, measure_step

__all__ = ["MemoryPeak", "StepMetrics", "measure_step"]


@dataclass
class StepMetrics(Callback):
    """Record training step times and measure the memory peak of one step.

    Args:
        measure_step: The training step (0-based) whose memory is measured; earlier steps warm up.
        warmup_steps: Steps left out of the step-time median.

    Attributes:
        step_times: Wall time of each timed step (seconds).
        losses: The training loss of each step.
        peak: The measured :class:`MemoryPeak`, once the measured step ran.
        warmup_times: Wall time of each step left out of the step times (a compiled model compiles in them).
    """

    measure_step: int = 1
    warmup_steps: int = 2
    step_times: List[float] = field(default_factory=list)
    losses: List[float] = field(default_factory=list)
    peak: Optional[MemoryPeak] = None
    warmup_times: List[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()
        self._start = 0.0
        self._measurement: Optional[StepMeasurement] = None

    @property
    def median_step_time(self) -> Optional[float]:
        """Median wall time of the timed steps, ``None`` before any."""
        return statistics.median(self.step_times) if self.step_times else None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.measure_step and self.peak is None:
            measurement = measure_step([pl_module], list(trainer.optimizers), pl_module.device)
            try:
                measurement.__enter__()
                self._measurement = measurement
            except Exception as err:  # MemTracker is private torch API: never let it stop training
                rank_zero_warn(f"memory measurement unavailable ({type(err).__name__}: {err})")
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        elapsed = time.perf_counter() - self._start
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(float(loss.detach()))
        if self._measurement is not None:
            measurement, self._measurement = self._measurement, None
            try:
                measurement.__exit__(None, None, None)
                self.peak = measurement.result
            except Exception as err:
                rank_zero_warn(f"memory measurement failed ({type(err).__name__}: {err})")
        elif trainer.global_step > self.warmup_steps:
            self.step_times.append(elapsed)
            return
        self.warmup_times.append(elapsed)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._measurement is not None:
            self._measurement.__exit__(type(exception), exception, None)
            self._measurement = None
