"""What the memory budget is asked for, typed: the block's budget fields and what the rest of the plan does to
what the budget measures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from lightning_ac.budget.host import CopyRates
from lightning_ac.config import AUTO

__all__ = ["BudgetSettings"]


@dataclass(frozen=True)
class BudgetSettings:
    """The memory budget's settings, as the plan hands them to
    :class:`~lightning_ac.budget.controller.BudgetController`.

    Attributes:
        budget: The activation memory a step may use, in bytes, or ``"auto"``.
        first_plan: ``measure`` (the first step recomputes every layer and measures them) or ``estimate`` (a step
            on fake tensors before it does: :mod:`lightning_ac.budget.first_plan`).
        input_held: Whether a recomputed layer's input stays on the device (not when ``offload.hidden_states``
            moves it to host memory on an accelerator).
        rules_held: Whether what the save rules keep stays on the device (not when ``offload.selective`` moves it
            to host memory on an accelerator).
        head_chunkable: Whether the block's ``chunked_loss`` is off for a model with an output head: then, where
            the head holds a large share of the peak, the nothing-fits advice names it.
        copy_rates: With ``offload.hidden_states: auto`` on an asynchronous device, the host link's measured rates:
            then a layer can also be recomputed with its input in host memory (:class:`~lightning_ac.budget.choice.
            Choice` ``offload``); ``None``: it cannot.
        host_bytes: The host memory the offloaded inputs may hold (``MemAvailable`` less the offload's reserve, at
            setup); ``None``: unknown, no limit.
    """

    budget: Union[int, str]
    first_plan: str = "measure"
    input_held: bool = True
    rules_held: bool = True
    head_chunkable: bool = False
    copy_rates: Optional[CopyRates] = None
    host_bytes: Optional[int] = None

    @property
    def budget_bytes(self) -> Union[int, None]:
        """The budget in bytes, ``None`` for ``"auto"`` (decided at the first step, from the device)."""
        return None if self.budget == AUTO else int(self.budget)
