"""Running a step on fake tensors without anything leaking into the caller's process, and where fake tensors differ
from real ones, making them behave as a real step would.

Inside :func:`fake_session` (and put back as they were when it ends, whatever happens):

- transformers' ``masking_utils.find_packed_sequence_indices`` answers as for a real unpacked batch: it takes fake
  ``position_ids`` for tracing, assumes packed sequences and builds a B x 1 x S x S mask, which a real batch of
  one sequence per row never has (SDPA then loses ``is_causal`` and native GQA);
- a fake storage's ``data_ptr()`` is its storage's identity (``_cdata``): every fake storage's address is 0, and
  the suite's copy engines key storages by address (activation offloading would take every activation for a
  parameter, layer offloading every copy for one layer's);
- the copy engines move fake tensors as the plain tensors they stand for (they leave other tensor subclasses where
  they are);
- the host's free memory does not limit offloading: the host is the target machine's, not this one's;
- the random state (torch's CPU generator, Python's, NumPy's), the default dtype and device, the fake-tensor
  dispatch cache, the logging levels and warning filters of what the step touches are the caller's again.
"""

from __future__ import annotations

import contextlib
import logging
import random
import warnings
from typing import Any, Iterator, List, Optional, Tuple

import torch

__all__ = ["fake_mode", "fake_session", "patched"]

_QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_ac", "transformers")


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside; the original (or its absence) afterwards. What ``owner`` holds itself is
    put back, never what it finds elsewhere: an instance's method stays its class's, not a bound copy in the
    instance (which would outlive the patch, tie the instance to itself and hide later patches of the class)."""
    missing = object()
    own = getattr(owner, "__dict__", None)
    original = own.get(name, missing) if own is not None else getattr(owner, name, missing)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if original is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def _unpacked(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """``find_packed_sequence_indices`` for a batch of one sequence per row, as a real one answers."""
    return None


def _fake_aware_data_ptr(original: Any) -> Any:
    def data_ptr(self: torch.UntypedStorage) -> int:
        if self.device.type == "meta":  # a fake tensor's storage: its identity stands for its address
            return self._cdata
        return original(self)

    return data_ptr


def _random_state() -> Tuple[Any, ...]:
    state: List[Any] = [torch.get_rng_state(), random.getstate()]
    try:
        import numpy

        state.append(numpy.random.get_state())
    except ImportError:
        state.append(None)
    return tuple(state)


def _set_random_state(state: Tuple[Any, ...]) -> None:
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    if state[2] is not None:
        import numpy

        numpy.random.set_state(state[2])


@contextlib.contextmanager
def _caller_state() -> Iterator[None]:
    """The random state, default dtype and device, fake-tensor cache, log levels and warning filters put back."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rng = _random_state()
    dtype = torch.get_default_dtype()
    device = torch.get_default_device()
    device_context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    cached = set(FakeTensorMode.cache)
    loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        for key in [k for k in FakeTensorMode.cache if k not in cached]:
            del FakeTensorMode.cache[key]
        torch.set_default_dtype(dtype)
        if torch.get_default_device() != device:  # set inside (the model built on meta): the caller's context again
            torch.set_default_device(None)
            if device_context is not None:
                device_context.__enter__()
                torch._GLOBAL_DEVICE_CONTEXT.device_context = device_context
        _set_random_state(rng)


def fake_mode() -> Any:
    """A fake-tensor mode that takes meta and real tensors as inputs, and does not cache ops that take a storage
    (``set_(storage, ...)``): torch's dispatch cache keeps the storage in its key (a class attribute, for the life of
    the process), so a storage the engines view that way (the offload engine's byte copies) would never be freed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class _Mode(FakeTensorMode):
        def _cached_dispatch_impl(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
            if any(isinstance(a, torch.UntypedStorage) for a in args):
                return self._dispatch_impl(func, types, args, kwargs)
            return super()._cached_dispatch_impl(func, types, args, kwargs)

    return _Mode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def fake_session() -> Iterator[None]:
    """Where the estimate's fake steps run (see the module's docstring)."""
    import transformers.masking_utils as masking_utils
    from torch._subclasses.fake_tensor import FakeTensor

    from lightning_ac.offload.device import hold_copies_in_flight, standing_for_plain, unlimited_host

    with contextlib.ExitStack() as stack:
        stack.enter_context(_caller_state())
        stack.enter_context(patched(masking_utils, "find_packed_sequence_indices", _unpacked))
        storage = torch.UntypedStorage
        stack.enter_context(patched(storage, "data_ptr", _fake_aware_data_ptr(storage.data_ptr)))
        stack.enter_context(unlimited_host())
        stack.enter_context(hold_copies_in_flight())
        stack.enter_context(standing_for_plain(FakeTensor))
        yield
