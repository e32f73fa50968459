"""torch's ``ModTracker``, the module tracker under the ``MemTracker`` that measures a step's memory on the CPU
(:mod:`lightning_ac.memory`), adapted to a measured training step: it names apart the modules of one class that it
meets outside the model's tree, and it lets go of the step's autograd graph when the measurement ends."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, Iterator, List

import torch

__all__ = ["mod_tracker_class"]


@functools.cache
def mod_tracker_class() -> type:
    """torch's ModTracker with two changes; torch.distributed is imported on the first call (a measurement on the
    CPU), not with the package.

    - Names. ModTracker names a module by its path under the first module it saw called, and a module outside every
      tree it has seen by its class name alone. transformers >= 5.25 (through the ``kernels`` package) calls two such
      modules, one inside the other, in every attention's forward: the global ``apply_rotary_pos_emb`` wrapper, which
      hands the call on to the attention's private copy (held outside the module tree), both of class ``Func``.
      ModTracker saw the name ``Func`` entered while ``Func`` ran and printed "The module hierarchy tracking maybe be
      messed up" in every measured step (the main job's second step). The hierarchy was right; the names were the
      same. The activation peak never depended on them (MemTracker sums what activations and temporaries hold,
      whichever module allocated it): the second module of a class met outside every tree is named ``Func#2``, the
      third ``Func#3``.
    - The step's graph. ModTracker registers a multi-grad hook on each module's inputs, and drops its handle. Such a
      hook holds the grad_fn of the tensors it watches, and is held by them, a cycle partly in C++ that Python's
      cycle collector cannot see: every measured step's autograd graph stayed alive for good, and with it every
      trainable parameter the graph accumulates into (each benchmark mode's whole model copy). The hooks are
      removed when the tracker exits, after the step's backward.
    """
    from torch.distributed._tools import mod_tracker

    class ModTracking(mod_tracker.ModTracker):
        def __init__(self) -> None:
            super().__init__()
            self._roots_of_class: Dict[str, int] = {}
            self._grad_hooks: List[Any] = []

        def _get_mod_name(self, mod: torch.nn.Module) -> str:  # type: ignore[override]
            if mod not in self._known_modules:  # not under any module seen so far: ModTracker names it by its class
                name = type(mod).__name__
                count = self._roots_of_class[name] = self._roots_of_class.get(name, 0) + 1
                self._known_modules[mod] = name if count == 1 else f"{name}#{count}"
            return super()._get_mod_name(mod)

        def _fw_pre_hook(self, mod: torch.nn.Module, input: Any) -> None:  # type: ignore[override]
            with self._keeping_grad_hooks():
                super()._fw_pre_hook(mod, input)

        def _fw_post_hook(self, mod: torch.nn.Module, input: Any, output: Any) -> None:  # type: ignore[override]
            with self._keeping_grad_hooks():
                super()._fw_post_hook(mod, input, output)

        @contextlib.contextmanager
        def _keeping_grad_hooks(self) -> Iterator[None]:
            """Keep the handles of the multi-grad hooks ModTracker registers inside (it looks the function up in its
            module at each call: it is swapped there for the length of this one synchronous hook call)."""
            register = getattr(mod_tracker, "register_multi_grad_hook", None)
            if register is None:  # a torch that registers them otherwise: nothing to keep
                yield
                return

            def keeping(*args: Any, **kwargs: Any) -> Any:
                handle = register(*args, **kwargs)
                self._grad_hooks.append(handle)
                return handle

            mod_tracker.register_multi_grad_hook = keeping
            try:
                yield
            finally:
                mod_tracker.register_multi_grad_hook = register

        def __exit__(self, *args: Any) -> None:
            super().__exit__(*args)
            hooks, self._grad_hooks = self._grad_hooks, []
            for handle in hooks:
                handle.remove()

    return ModTracking
