"""The per-layer table: rows that the plan assembles from the engines' own descriptions, rendered with rich
when installed and as plain text otherwise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

__all__ = ["LayerRow", "render_layer_table"]

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

        table = Table()
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
