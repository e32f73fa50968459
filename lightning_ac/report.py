"""What the suite did to each decoder layer: computed apart from rendering, rich when installed, plain otherwise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

from lightning_ac.config import Placement

if TYPE_CHECKING:
    from lightning_ac.plan import Plan

__all__ = ["LayerRow", "layer_rows", "render_layer_table"]

COLUMNS = ("#", "layer", "type", "recomputed", "SAC saves", "offloaded")


@dataclass
class LayerRow:
    """One decoder layer as the plan left it."""

    index: int
    name: str
    layer_type: str
    recomputed: bool
    saves: str
    offloaded: str

    def cells(self) -> List[str]:
        return [
            str(self.index),
            self.name,
            self.layer_type,
            "yes" if self.recomputed else "no",
            self.saves,
            self.offloaded,
        ]


def _saves(plan: Plan, index: int, layer_type: Optional[str], recomputed: bool) -> str:
    cfg = plan.config.selective
    policy = plan.selective
    if cfg is None or policy is None or not recomputed:
        return "—"
    parts = []
    for entry in cfg.save:
        if entry == "attention" and not cfg.save_sliding_window and layer_type in cfg.recompute_layer_types:
            parts.append(f"attention recomputed ({layer_type})")
        else:
            parts.append(entry)
    layer = policy.layers[index]
    inside = {id(m) for m in layer.modules()}
    for entry, modules in policy.matched_modules.items():
        count = sum(id(m) in inside for m in modules)
        if count:
            parts.append(f"{entry} ({count} module{'s' if count > 1 else ''})")
    if cfg.save_matmul_min_k:
        parts.append(f"matmuls K >= {cfg.save_matmul_min_k}")
    saved = policy.report().get(index)
    if saved is not None:
        parts.append(f"last step: {sum(saved.values())} outputs")
    return ", ".join(parts) or "registered ops only"


def _offloaded(plan: Plan, index: int, recomputed: bool) -> str:
    parts = []
    streamer = plan.layer_streamer
    if streamer is not None and index < len(streamer.layers) and streamer.layers[index].params:
        frozen = sum(p.numel() * p.element_size() for p in streamer.layers[index].params)
        parts.append(f"frozen params ({frozen / 2**20:.1f} MiB) ↔ cpu")
    if plan.offload is None:
        return ", ".join(parts) or "—"
    off = plan.config.offload
    if off.hidden_states != Placement.none and recomputed:
        parts.append("input → cpu")
    if off.all != Placement.none:
        parts.append("input → cpu" if recomputed else "saved activations → cpu")
    if off.selective != Placement.none and recomputed and plan.config.selective is not None:
        parts.append("SAC saves → cpu")
    return ", ".join(parts) or "—"


def layer_rows(plan: Plan) -> List[LayerRow]:
    """One row per decoder layer of an applied plan."""
    if plan.layers is None:
        return []
    rows = []
    for index, (name, _) in enumerate(plan.layers.layers):
        recomputed = bool(plan.checkpointed[index]) if index < len(plan.checkpointed) else False
        layer_type = plan.layers.layer_types[index] if index < len(plan.layers.layer_types) else None
        rows.append(
            LayerRow(
                index,
                name,
                layer_type or "—",
                recomputed,
                _saves(plan, index, layer_type, recomputed),
                _offloaded(plan, index, recomputed),
            )
        )
    return rows


def render_layer_table(rows: List[LayerRow], use_rich: Optional[bool] = None) -> str:
    """The rows as a table: rich's when installed (or asked for), aligned plain text otherwise."""
    if use_rich is None:
        try:
            import rich  # noqa: F401

            use_rich = True
        except ImportError:
            use_rich = False
    if use_rich:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="lightning_ac: decoder layers")
        for column in COLUMNS:
            table.add_column(column)
        for row in rows:
            table.add_row(*row.cells())
        console = Console(width=160, record=True)
        with console.capture() as capture:
            console.print(table)
        return capture.get().rstrip()
    cells = [list(COLUMNS), *(row.cells() for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
