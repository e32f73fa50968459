"""The tools a memory budget turns on where its step needs them: ``chunked_loss: auto`` and ``tiled_mlp: auto``.

Recomputing a decoder layer is the budget's first means: per layer, keep, save selectively or recompute, for the least
recompute under the budget (:mod:`lightning_ac.budget.choice`). When even every layer recomputed is over the budget
(by the figures of the measuring step, or measured), what is left is what recompute cannot reach: the output head's
logits (the chunked loss) and a recomputed layer's own working set, its MLP's intermediates and its norms' float32
copies (the tiled MLP). A tool the block leaves to the budget is installed off, each model computing as it does; the
budget turns the first one still off on, in this order (the chunked loss first: on the measured CPU preset it steps no
slower, and the head is a long-context step's largest working set), and measures the step again, every layer
recomputed, as its first step did: the figures change with the tool (the head's bytes, each layer's working set),
and so does every choice measured before. A budget that fits without them turns none on, and the step is the plain
one.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from lightning_ac._logging import rank_zero_info
from lightning_ac.budget.phase import MEASURE

__all__ = ["BudgetTools"]


class BudgetTools:
    """The controller's part that turns on the tools the block leaves to the budget (mixed into
    :class:`~lightning_ac.budget.controller.BudgetController`).

    Attributes:
        tools: Returns the tools installed, in the order the budget turns them on; each has ``name``,
            ``budget_decides``, ``active`` and ``describe()`` (:class:`~lightning_ac.loss.install.ChunkedLoss`,
            :class:`~lightning_ac.tiled_mlp.install.TiledMLP`).
    """

    tools: Callable[[], Sequence[Any]] = staticmethod(lambda: ())  # type: ignore[assignment]
    turned_on: List[str]

    def _turn_on_a_tool(self, why: str) -> bool:
        """Turn on the first tool the budget decides that is still off, and measure again; ``False`` if none is
        left (``why``: the line's reason)."""
        tool = self._next_tool()
        if tool is None:
            return False
        tool.active = True
        self.turned_on.append(tool.name)
        rank_zero_info(f"budget: {why}: turning {tool.name} on, and measuring the step again ({tool.describe()})")
        self._measure_again()
        return True

    def _next_tool(self) -> Optional[Any]:
        return next((t for t in self.tools() if t.budget_decides and not t.active), None)

    def _measure_again(self) -> None:
        """The next step measures every layer recomputed, as the first did; what was measured before holds for a
        step without the tool, and is forgotten."""
        self.phase = MEASURE
        self.figures = None
        self._calibrations, self.calibration = {}, 0
        self._over, self._measured = set(), {}
        self.corrections = 0
