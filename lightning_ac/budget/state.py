"""The memory budget's checkpointed state: the settled plan and what it was chosen from, for a resumed run to start
from (the keys are stable: checkpoints saved before still load)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from lightning_ac._logging import rank_zero_info
from lightning_ac.budget.choice import Choice, LayerFigures
from lightning_ac.budget.phase import CHECK
from lightning_ac.budget.settings import BudgetSettings
from lightning_ac.config import AUTO

__all__ = ["SavedPlan"]


class SavedPlan:
    """The ``state_dict`` part of :class:`~lightning_ac.budget.controller.BudgetController` (a mixin over its
    state)."""

    figures: Optional[List[LayerFigures]]
    choices: List[Choice]
    settings: BudgetSettings

    def state_dict(self) -> Dict[str, Any]:
        """The settled plan and what it was chosen from, for a resumed run to start from."""
        return {
            "budget_bytes": self.budget_bytes,
            "layers": len(self.switches),
            "tokens": self.tokens,
            "calibration": self.calibration,
            "outside_bytes": self.outside_bytes,
            "head_bytes": self.head_bytes,
            "full_seconds": self.full_seconds,
            "figures": [dataclasses.asdict(f) for f in self.figures] if self.figures is not None else None,
            "choices": [c.value for c in self.choices],
            "settled": self.settled,
            "turned_on": list(self.turned_on),
            # why each is on (its error notes say it), and what was weighed: a resumed run weighs none again
            "turned_on_because": {t.name: t.turned_on_because for t in self.tools() if t.name in self.turned_on},
            "weighed": sorted(self.weighed),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Start from a saved plan, unless it was made for another number of layers or another budget (then measure
        again). The resumed run's first step is measured and checks the plan like any choice: what the saved figures
        cannot see (another precision, other save rules, another model of as many layers) corrects it there."""
        requested = self.budget_bytes if self.settings.budget != AUTO else state.get("budget_bytes")
        if state.get("layers") != len(self.switches) or state.get("budget_bytes") != requested:
            rank_zero_info(
                f"budget: the checkpoint's plan was made for {state.get('layers')} {self.noun} and a budget of "
                f"{state.get('budget_bytes')} bytes; this run has {len(self.switches)} and {requested}: measuring "
                "again"
            )
            return
        tools = {t.name: t for t in self.tools() if t.budget_decides}
        if any(name not in tools for name in state.get("turned_on", [])):
            rank_zero_info(
                f"budget: the checkpoint's plan was made with {', '.join(state['turned_on'])} on, which this run does "
                "not leave to the budget: measuring again"
            )
            return
        for name in state.get("turned_on", []):
            tools[name].active = True  # what was over the budget without it stays so: on from the first step
            tools[name].turned_on_because = state.get("turned_on_because", {}).get(name, "needed")
        self.turned_on = list(state.get("turned_on", []))
        self.weighed = set(state.get("weighed", self.turned_on))
        if not state.get("settled") or state.get("figures") is None:
            return  # saved before it settled: measuring again costs one step
        self.budget_bytes = state["budget_bytes"]
        self.figures = [LayerFigures(**f) for f in state["figures"]]
        self.tokens = int(state["tokens"])
        self.calibration = int(state["calibration"])
        self.outside_bytes, self.head_bytes = int(state["outside_bytes"]), int(state["head_bytes"])
        self._set([Choice(c) for c in state["choices"]])
        self.phase, self._resumed = CHECK, True
        rank_zero_info(f"budget: resuming with the checkpoint's plan ({self._summary()}); its first step checks it")
