"""The plot of activation memory against step time, its labels placed so that none overlaps another."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator, List, Sequence, Tuple

from lightning_ac.bench.modes import ALL_BUDGET_MODES, LAYER_OFFLOAD_MODES, budget_bounds
from lightning_ac.bench.run import Row

__all__ = ["label_offsets", "plot"]


Box = Tuple[float, float, float, float]  # x0, y0, x1, y1 in display pixels
Point = Tuple[float, float]


def _around(point: Point, half: float) -> Box:
    """The square of half side ``half`` centred on ``point``."""
    return point[0] - half, point[1] - half, point[0] + half, point[1] + half


def _overlaps(a: Box, b: Box) -> bool:
    """Whether two boxes share any area (touching edges do not count)."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _distance(point: Point, box: Box) -> float:
    """How far ``point`` lies from ``box`` (0 inside it)."""
    return math.hypot(max(box[0] - point[0], 0, point[0] - box[2]), max(box[1] - point[1], 0, point[1] - box[3]))


def _crosses(p: Point, q: Point, box: Box) -> bool:
    """Whether the segment from ``p`` to ``q`` passes through ``box`` (Liang-Barsky clipping)."""
    t0, t1 = 0.0, 1.0  # the part of the segment, as fractions of it, inside the box's slabs so far
    for start, delta, low, high in ((p[0], q[0] - p[0], box[0], box[2]), (p[1], q[1] - p[1], box[1], box[3])):
        if delta == 0:
            if not low < start < high:
                return False
            continue
        a, b = (low - start) / delta, (high - start) / delta
        t0, t1 = max(t0, min(a, b)), min(t1, max(a, b))
    return t0 < t1


def label_offsets(
    points: Sequence[Point],
    sizes: Sequence[Tuple[float, float]],
    area: Box,
    obstacles: Sequence[Box] = (),
    gap: float = 7.0,
    marker: float = 6.0,
    clear: float = 12.0,
    lead: float = 20.0,
    step: float = 4.0,
) -> List[Tuple[float, float, bool]]:
    """Places one label per point, greedily, so that no two labels overlap; all in display pixels.

    Each label in turn takes the first free spot of: next to its point on the right, next to it on the left, then
    rings of spots around the point at growing distances, from ``lead`` on so that its leader line shows. A spot is
    free when the label's box

    - lies inside ``area`` and covers no label placed before it, no obstacle and its own marker;
    - keeps ``clear`` away from the other points (room for their own labels and leader lines);
    - lies nearer its own point than any other (so that it reads as that point's label);

    and when neither its leader line (if it has moved) nor a leader line drawn before crosses another label or
    marker. The rings reach across the whole area, so a label finds a spot wherever there is room for it; where no
    spot meets the last two conditions, the first that meets the others is taken (the labels still never overlap).
    The order of the spots is fixed: the same input always gives the same placement.

    Args:
        points: Each label's point.
        sizes: Each label's ``(width, height)``, padding included.
        area: Where the labels must stay (the axes).
        obstacles: Boxes that no label or leader line may cover (the legend).
        gap: Distance from a point to the edge of a label next to it; more than ``marker``.
        marker: Half the side of the square taken as each point's marker.
        clear: Least distance from a label to the other points.
        lead: Least distance from a point to the edge of its label once the label has moved away from it.
        step: Distance between the rings of spots, and about the spacing of the spots along one.

    Returns:
        Per label, ``(dx, dy, moved)``: its centre's offset from its point, and whether it has moved away from
        its point (and needs a leader line). A label with no room anywhere stays on its point's right.
    """
    reach = max(area[2] - area[0], area[3] - area[1])  # no spot further out lies inside the area

    def spots(w: float, h: float) -> Iterator[Tuple[float, float, bool]]:
        """The candidate offsets of a ``w`` by ``h`` label's centre, in the order they are tried."""
        yield gap + w / 2, 0.0, False
        yield -gap - w / 2, 0.0, False
        for distance in range(int(lead), int(reach), max(1, int(step))):
            # centres on the rectangle that keeps the label's edges `distance` away from the point (sideways or
            # up and down), one per direction, starting on the right and going round anticlockwise
            half_w, half_h = w / 2 + distance, h / 2 + distance
            n = int(8 * (half_w + half_h) / step)  # twice the ring's length over `step`: no gaps along its sides
            for k in range(n):
                c, s = math.cos(2 * math.pi * k / n), math.sin(2 * math.pi * k / n)
                scale = min(half_w / abs(c) if c else math.inf, half_h / abs(s) if s else math.inf)
                yield c * scale, s * scale, True

    labels: List[Box] = []
    leaders: List[Tuple[Point, Point]] = []  # from a moved label's centre to its point
    placed = []
    for i, ((x, y), (w, h)) in enumerate(zip(points, sizes)):
        others = list(points[:i]) + list(points[i + 1 :])
        keep_off = [*labels, *obstacles, _around((x, y), marker), *(_around(p, clear) for p in others)]
        # a leader line ends on its point, so inside any marker drawn over that point: those do not count
        markers = [b for b in (_around(p, marker) for p in others) if not _overlaps(b, _around((x, y), 0.5))]
        line_off = [*labels, *obstacles, *markers]
        first_with_room = None
        for spot in spots(w, h):
            dx, dy, moved = spot
            box = (x + dx - w / 2, y + dy - h / 2, x + dx + w / 2, y + dy + h / 2)
            inside = area[0] <= box[0] and box[2] <= area[2] and area[1] <= box[1] and box[3] <= area[3]
            if not inside or any(_overlaps(box, b) for b in keep_off):
                continue  # no room for the label here
            first_with_room = first_with_room or spot
            # and it reads as its point's label: nearest that point, no leader line across another label or marker
            nearest = all(_distance((x, y), box) <= _distance(p, box) for p in others)
            led = not moved or not any(_crosses((x + dx, y + dy), (x, y), b) for b in line_off)
            if nearest and led and not any(_crosses(p, q, box) for p, q in leaders):
                break
        else:  # no spot reads clearly: the first with room, else (no room anywhere) the first of all
            spot = first_with_room or (gap + w / 2, 0.0, False)
        dx, dy, moved = spot
        labels.append((x + dx - w / 2, y + dy - h / 2, x + dx + w / 2, y + dy + h / 2))
        if moved:
            leaders.append(((x + dx, y + dy), (x, y)))
        placed.append((dx, dy, moved))
    return placed


def plot(rows: List[Row], path: Path) -> None:
    """Activation memory against step time, one point per mode, anchors marked, each point labelled.

    The labels are placed after the figure is laid out, from the renderer's measure of each one, so that none
    overlaps another or a marker, however close the points lie; one moved away from its point gets a leader line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # another model (LoRA) and another figure (the whole device peak) for the layer-offloading modes: their table
    shown = [
        r
        for r in rows
        if r.mode not in LAYER_OFFLOAD_MODES and r.peak_activation_bytes is not None and r.step_time_s is not None
    ]
    points = [(r.step_time_s, r.peak_activation_bytes / 2**20) for r in shown]  # type: ignore[operator]
    fig, ax = plt.subplots(figsize=(7, 5))
    for r, (x, y) in zip(shown, points):
        anchor, floor, budget = r.kind == "anchor", r.kind == "floor", r.mode in ALL_BUDGET_MODES
        color = "tab:gray" if anchor or floor else "tab:green" if budget else "tab:blue"
        marker = "s" if anchor else "^" if floor else "D" if budget else "o"
        ax.scatter(x, y, marker=marker, color=color, s=60, zorder=3)
    # each budget's frontier: full, the budget points by budget, off (with chunked_loss: their chunked rows)
    legend = None
    for ends in dict.fromkeys(budget_bounds(r.mode) for r in shown if r.mode in ALL_BUDGET_MODES):
        on_it = [r.mode in ends or (r.mode in ALL_BUDGET_MODES and budget_bounds(r.mode) == ends) for r in shown]
        frontier = sorted((p for p, yes in zip(points, on_it) if yes), key=lambda p: p[1])
        chunked = "full_chunked" in ends
        ax.plot(
            *zip(*frontier),
            color="tab:green",
            alpha=0.5,
            linestyle=":" if chunked else "--",
            zorder=2,
            label="memory budget, chunked_loss" if chunked else "memory budget",
        )
        legend = ax.legend(loc="upper right", fontsize=8)
    ax.margins(x=0.12, y=0.12)  # room for the labels of the outermost points
    ax.set_xlabel("median step time (s)")
    ax.set_ylabel("activation peak (MiB)")
    floor = ", the floor (triangle)" if any(r.kind == "floor" for r in shown) else ""
    ax.set_title(f"lightning_ac modes (circles), budgets (diamonds){floor} and anchors (squares)", fontsize=10)
    ax.grid(alpha=0.3)
    # Lay the figure out and fix the limits first: the labels sit a fixed number of points from their markers, so a
    # later change of scale would move the markers under them.
    fig.tight_layout()
    ax.set_xlim(ax.get_xlim())
    ax.set_ylim(ax.get_ylim())
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    pixels = renderer.points_to_pixels(1.0)
    sizes = []
    for r in shown:  # each label's size as drawn, with a little room around it
        probe = ax.text(0, 0, r.mode, fontsize=8)
        extent = probe.get_window_extent(renderer)
        probe.remove()
        sizes.append((extent.width + 3 * pixels, extent.height + 2 * pixels))
    offsets = label_offsets(
        [tuple(p) for p in ax.transData.transform(points)] if points else [],
        sizes,
        tuple(ax.bbox.extents),
        [tuple(legend.get_window_extent(renderer).extents)] if legend is not None else [],
        gap=5 * pixels,
        marker=4.5 * pixels,
        clear=9 * pixels,
        lead=14 * pixels,
        step=3 * pixels,
    )
    for r, (x, y), (dx, dy, moved) in zip(shown, points, offsets):
        leader = dict(arrowstyle="-", color="0.35", linewidth=0.6, shrinkA=0, shrinkB=5) if moved else None
        ax.annotate(
            r.mode,
            (x, y),
            xytext=(dx / pixels, dy / pixels),  # in points, as the offsets scale with the saved figure's dpi
            textcoords="offset points",
            ha="center",
            va="center",
            fontsize=8,
            arrowprops=leader,
            zorder=4,
        )
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The budget planner measures at the sequence length and at half of it; below this, fixed costs swamp the
# per-token terms it extrapolates.
