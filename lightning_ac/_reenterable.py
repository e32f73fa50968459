"""A context manager that can be entered again after it exits."""

from __future__ import annotations

from typing import Any, Callable, ContextManager, List


class Reenterable:
    """Enters a fresh context from ``make`` each time it is entered.

    torch's non-reentrant checkpoint enters a region's recompute context on every backward through the region;
    a ``contextlib.contextmanager`` object can be entered only once, so a second backward (``retain_graph=True``)
    would fail inside contextlib instead of reaching torch's own, clear error.
    """

    def __init__(self, make: Callable[[], ContextManager[Any]]) -> None:
        self._make = make
        self._open: List[ContextManager[Any]] = []

    def __enter__(self) -> Any:
        context = self._make()
        value = context.__enter__()
        self._open.append(context)
        return value

    def __exit__(self, *exc_info: Any) -> Any:
        return self._open.pop().__exit__(*exc_info)
