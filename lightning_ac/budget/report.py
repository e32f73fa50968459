"""What the memory budget says: its settled line, the per-layer report, the metrics the run logs, the summary the
main job writes, and the advice when nothing fits."""

from __future__ import annotations

from typing import Any, Dict, List

from lightning_ac._logging import rank_zero_warn
from lightning_ac.budget.choice import Choice
from lightning_ac.budget.settings import BudgetSettings
from lightning_ac.loss.install import MIN_AUTO_CHUNK_TOKENS
from lightning_ac.units import format_bytes

__all__ = ["BudgetReport", "HEAD_ADVICE_SHARE"]

# The nothing-fits advice names chunked_loss where the output head holds more than this share of the peak.
HEAD_ADVICE_SHARE = 0.25


class BudgetReport:
    """The reporting part of :class:`~lightning_ac.budget.controller.BudgetController` (a mixin over its state)."""

    choices: List[Choice]
    settings: BudgetSettings

    def _warn_over(self, peak: int, when: str) -> None:
        assert self.budget_bytes is not None
        rank_zero_warn(
            f"budget {format_bytes(self.budget_bytes)}: the step's activation peak is {format_bytes(peak)} {when}, "
            f"over the budget; training goes on recomputing every layer. To lower the peak further: {self._advice()}."
        )

    def _advice(self) -> str:
        """What lowers the activation peak below every layer recomputed, in this configuration. (Layer offloading
        is not among it: it moves weights, and its streamed copies add to the activations' peak.)"""
        ways = []
        big_head = self.head_bytes > HEAD_ADVICE_SHARE * (self.measured_peak or 0)
        loss = next((t for t in self.tools() if t.name == "chunked_loss"), None)
        chunks = loss.last_chunks if loss is not None else None
        if loss is not None and loss.active and not loss.chunked_calls and big_head:
            ways.append(
                "labels= in the model's training call (chunked_loss is on, but no training forward was given labels, "
                "so the loss was computed outside the model from whole logits, which hold "
                f"{format_bytes(self.head_bytes)} of the peak with their gradient)"
            )
        elif self.settings.head_chunkable and big_head:
            ways.append(
                f"chunked_loss: true (the output head's logits and their gradient hold {format_bytes(self.head_bytes)}"
                " of it; the loss a chunk of tokens at a time holds a chunk's)"
            )
        elif chunks is not None and chunks[0] >= chunks[1] and big_head:
            ways.append(
                f"chunked_loss.chunk_tokens below the step's {chunks[1]} tokens (the loss ran as one chunk of "
                f"{chunks[0]} tokens, whose logits and gradient hold {format_bytes(self.head_bytes)} of the peak; "
                f"chunk_tokens: auto takes at least {MIN_AUTO_CHUNK_TOKENS}, so give a number)"
            )
        host = self.settings.host_bytes
        inputs = sum(f.input_bytes for f in self.figures or [])
        if self.settings.copy_rates is not None and host is not None and inputs > host:
            ways.append(
                f"more host memory for the inputs offloaded (every layer's holds {format_bytes(inputs)}; the host had "
                f"room for {format_bytes(host)} at setup: ActivationOffload's host_reserve_bytes lowers the reserve)"
            )
        elif self.settings.copy_rates is None and self.device.type != "cpu" and self.settings.input_held:
            ways.append("offload.hidden_states: auto (each recomputed layer's input in host memory where needed)")
        ways.append("a smaller batch or shorter sequences (with gradient accumulation to keep the batch size)")
        return ", or ".join(ways)

    def _summary(self) -> str:
        choices = self.choices
        n = len(choices)
        kept = choices.count(Choice.keep)
        selective = choices.count(Choice.selective)
        recomputed = choices.count(Choice.recompute)
        offloaded = choices.count(Choice.offload)
        assert self.budget_bytes is not None
        estimated = self.estimated_peak
        figures = self.figures or []
        seconds = sum(f.cost(c)[2] for f, c in zip(figures, choices))
        share = f"{100 * seconds / self.full_seconds:.0f}%" if self.full_seconds else "n/a"
        parts = [f"keeping {kept}/{n} {self.noun}"]
        if selective:
            parts.append(f"selective in {selective}")
        parts.append(f"recomputing {recomputed}")
        if offloaded:
            host = sum(f.host_bytes(c) for f, c in zip(figures, choices))
            parts.append(f"recomputing {offloaded} with the input in host memory ({format_bytes(host)})")
        measured = f", measured {format_bytes(self.measured_peak)}" if self.measured_peak is not None else ""
        return (
            f"budget {format_bytes(self.budget_bytes)}: {', '.join(parts)} (estimated peak "
            f"{format_bytes(estimated or 0)}{measured}; recompute {share} of full's)"
        )

    def describe_layer(self, index: int) -> str:
        """The layer's choice and figures, for the per-layer report."""
        choice = self.switches[index].choice.value
        if self.figures is None:
            return f"{choice} (measuring)"
        f = self.figures[index]
        return f"{choice}: saves {format_bytes(f.saved_bytes)}, recompute {1000 * f.recompute_seconds:.1f} ms"

    def metrics(self) -> Dict[str, float]:
        """What the run logs each step."""
        found = {
            "lightning_ac/budget_bytes": float(self.budget_bytes or 0),
            "lightning_ac/budget_recomputed_layers": float(sum(c is not Choice.keep for c in self.choices)),
            "lightning_ac/budget_offloaded_layers": float(self.choices.count(Choice.offload)),
        }
        if self.estimated_peak is not None:
            found["lightning_ac/budget_estimated_peak_bytes"] = float(self.estimated_peak)
        if self.measured_peak is not None:
            found["lightning_ac/budget_measured_peak_bytes"] = float(self.measured_peak)
        return found

    def summary(self) -> Dict[str, Any]:
        """The plan as plain data (the main job's ``summary.json``)."""
        return {
            "budget_bytes": self.budget_bytes,
            "choices": [c.value for c in self.choices],
            "estimated_peak_bytes": self.estimated_peak,
            "measured_peak_bytes": self.measured_peak,
            "settled": self.settled,
            "corrections": self.corrections,
            "turned_on": list(self.turned_on),  # the tools the budget decides that are on, and those it weighed
            "weighed": sorted(self.weighed),
            "line": self._summary() if self.budget_bytes is not None else None,
        }
