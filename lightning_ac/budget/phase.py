"""The memory budget's phases: the measuring step (every layer recomputed and measured), checking a choice against
the next measured peak, and settled. The controller's tests and checkpoints name them as these strings."""

__all__ = ["CHECK", "MEASURE", "SETTLED"]

MEASURE, CHECK, SETTLED = "measure", "check", "settled"
