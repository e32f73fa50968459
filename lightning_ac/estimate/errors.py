"""The estimator's one error: an estimate that cannot be made as asked."""

__all__ = ["EstimateError"]


class EstimateError(ValueError):
    """An estimate that cannot be made as asked: the message names what, and what to do instead."""
