"""What each decoder layer measures in a training step: the bytes its forward saves for backward, the bytes of its
input, and the time its forward takes (a recompute runs the forward once more).

Saved bytes are counted where autograd saves them: a saved-tensor hook pushed inside the layer's call counts each
tensor and hands it on to the hooks that were in force (torch's checkpoint packs it into its frame and drops it, so
the count costs no memory). Parameters, and views of them, are not activations and are left out; a storage saved
twice in a step (two views of it, or the rotary tables every layer saves) counts once. Storages are told apart by
identity (the one Python object torch keeps per storage; never ``data_ptr()``, which is 0 for every fake tensor) and
a weak reference: a dropped storage's identity can be handed to the next one.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set

import torch
from torch import nn

from lightning_ac.budget.choice import LayerFigures

__all__ = ["LayerMeter", "LayerReading", "held_bytes", "shape_of_work"]


def _identity(tensor: Any) -> Any:
    return tensor


def _storage_key(tensor: torch.Tensor) -> Optional[int]:
    """The identity of ``tensor``'s storage while it lives (torch keeps one Python object per storage for as long
    as the storage exists), not its address: every fake tensor's ``data_ptr()`` is 0, so addresses would take every
    activation of a fake step (the estimate's) for one storage, or for a parameter."""
    try:
        return id(tensor.untyped_storage())
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage of their own
        return None


def _bound_tensors(function: Callable[..., Any]) -> List[torch.Tensor]:
    """The tensors bound into a layer call's ``functools.partial`` (its keyword arguments), tuples included."""
    found: List[torch.Tensor] = []
    values = list(getattr(function, "keywords", {}).values()) + list(getattr(function, "args", ()))
    while values:
        value = values.pop()
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            values.extend(value)
    return found


def shape_of_work(function: Callable[..., Any], args: Sequence[Any]) -> tuple:
    """What a layer call's memory depends on besides its token count: which inputs it gets, and of what kind (an
    attention mask appears with padded batches, and with packed documents, whose position ids restart; another
    precision; a cache). Sizes are left out: more tokens are planned for by scaling the figures."""

    def kind(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", str(value.dtype), value.dim(), value.device.type)
        if isinstance(value, (tuple, list)):
            return tuple(kind(v) for v in value)
        if value is None or isinstance(value, (bool, str)):
            return value
        return type(value).__name__

    keywords = getattr(function, "keywords", None) or {}
    return tuple(kind(a) for a in args) + tuple((name, kind(keywords[name])) for name in sorted(keywords))


def held_bytes(function: Callable[..., Any], args: Sequence[Any], device: torch.device) -> int:
    """The bytes of a layer call's tensors on ``device`` (its inputs, and what is bound into it: the mask, the rotary
    tables), each storage once: what exists before the first layer runs and stays through the step."""
    seen: Dict[int, int] = {}
    for tensor in [a for a in args if isinstance(a, torch.Tensor)] + _bound_tensors(function):
        if tensor.device == device:
            seen.setdefault(id(tensor.untyped_storage()), _nbytes(tensor))
    return sum(seen.values())


def _parameter_storages(module: nn.Module, device: torch.device) -> Set[int]:
    """The storage identities of ``module``'s parameters on ``device``."""
    return {key for p in module.parameters() if p.device == device and (key := _storage_key(p)) is not None}


class _Storages:
    """The storages seen in a step, by identity, each with a weak reference that tells a reused identity apart."""

    def __init__(self) -> None:
        self._seen: Dict[int, Any] = {}

    def first_sight(self, tensor: torch.Tensor) -> Optional[int]:
        """The storage's identity if it was not seen alive before, else ``None``."""
        key = _storage_key(tensor)
        if key is None:
            return None
        storage = tensor.untyped_storage()
        known = self._seen.get(key)
        if known is not None and known() is storage:
            return None
        self._seen[key] = weakref.ref(storage)
        return key


def _nbytes(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return tensor.numel() * tensor.element_size()


class _CountingHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that count what is saved and pass it on to the hooks in force when they were made.

    ``torch._C._autograd._top_saved_tensors_default_hooks`` is private, and present in every torch we support
    (2.9.1 to 2.15): it is how torch's own checkpoint finds out whether hooks are in force.
    """

    def __init__(self, count: Callable[[torch.Tensor], None]) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pack, unpack = top if top is not None else (_identity, _identity)

        def counting_pack(tensor: torch.Tensor) -> Any:
            count(tensor)
            return pack(tensor)

        super().__init__(counting_pack, unpack)


@dataclass
class LayerReading:
    """What one decoder layer measured in one step.

    Attributes:
        saved_bytes: What its forward saved for backward through autograd's saved-tensor hooks (everything, when
            it is recomputed whole or kept; under the save rules, what they do not keep).
        input_bytes: Its input's.
        input_saved_bytes: The part of ``saved_bytes`` that is its input.
        rule_bytes: What the save rules keep (or would keep, in a call that ran without them).
        forward_seconds: The forward call's time.
        recompute_seconds: The recompute's time (in backward), if it was recomputed.
        calls: Calls seen (forwards, then recomputes).

    A step may call the model more than once before its backward (chosen and rejected halves, R-Drop, two views):
    every forward call holds what it saves until the backward, so the figures add up over the step's forward calls.
    """

    saved_bytes: int = 0
    input_bytes: int = 0
    input_saved_bytes: int = 0
    rule_bytes: int = 0
    forward_seconds: float = 0.0
    recompute_seconds: float = 0.0
    calls: int = 0
    forwards_without_grad: int = 0  # a reentrant checkpoint's forwards: their graph is built by the recompute
    counted: int = 0  # the calls whose saves were counted
    under_rules: bool = False

    def figures(self, input_held: bool, rules_held: bool, selective: bool) -> LayerFigures:
        """As the planner takes them, from a step that recomputed the layer whole. ``input_held=False`` when
        ``offload.hidden_states`` moves the input off the device (a recomputed layer then holds nothing there),
        ``rules_held=False`` when ``offload.selective`` moves what the save rules keep; ``selective`` when the step
        measured what they would keep (the selective time is measured later, in a step that runs them)."""
        inputs = self.input_bytes if input_held else 0
        return LayerFigures(
            saved_bytes=self.saved_bytes,
            input_bytes=inputs,
            recompute_seconds=self.forward_seconds,
            input_saved_bytes=self.input_saved_bytes if input_held else 0,
            selective_bytes=inputs + (self.rule_bytes if rules_held else 0) if selective else None,
        )


class _Timer:
    """Wall time on the CPU; device events on an accelerator, read once at the end of the step (a read waits for the
    device, so it is not done per layer)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: List[tuple] = []

    def start(self) -> Any:
        if self.device.type == "cpu":
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def stop(self, started: Any, reading: LayerReading, field: str) -> None:
        if self.device.type == "cpu":
            setattr(reading, field, getattr(reading, field) + time.perf_counter() - started)
            return
        end = torch.Event(device=self.device, enable_timing=True)
        end.record()
        self._pending.append((started, end, reading, field))

    def collect(self) -> None:
        """Add the device time of every timed call to its reading."""
        if self._pending:
            self._pending[-1][1].synchronize()  # the last event recorded: every earlier one has completed too
        for started, end, reading, field in self._pending:
            setattr(reading, field, getattr(reading, field) + started.elapsed_time(end) / 1000.0)
        self._pending = []


class LayerMeter:
    """Measures each decoder layer's calls while it is started (one step at a time).

    Args:
        layers: The decoder layers, in order.
        device: The device the step computes on: only tensors there are counted.
        dry_run: With ``selective`` set: the policy's :meth:`~lightning_ac.selective.policy.SelectivePolicy.dry_run`,
            which adds up, in a call that runs without the save rules, what they would keep.
        rule_bytes: With ``selective`` set: what the save rules kept in each layer's last forward under them.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        device: torch.device,
        dry_run: Optional[Callable[[int], Any]] = None,
        rule_bytes: Optional[Callable[[int], Optional[int]]] = None,
    ) -> None:
        self.layers = list(layers)
        self.device = device
        self.dry_run = dry_run
        self.rule_bytes = rule_bytes
        self.dry = False  # run the policy's dry run in the calls without the save rules
        # called once a step, when backward reaches the layers (the first recompute): the output head's backward is
        # done by then
        self.on_first_recompute: Optional[Callable[[], None]] = None
        # called after each forward call of the last layer: what follows until backward is the output head's forward
        # (with the loss chunked, its whole working set: each chunk's logits and their gradient, computed there)
        self.on_last_forward: Optional[Callable[[], None]] = None
        self._recomputed = False
        self.outside_bytes = 0
        self.head_bytes = 0
        self._depth = 0
        self.active = False
        self.readings: List[LayerReading] = []
        self.tokens = 0
        self._parameters: Set[int] = set()
        self.timer = _Timer(device)

    def start(self, host_clock: bool = False) -> None:
        """Measure the calls from now on (until :meth:`stop`). ``host_clock``: time them on the host's clock, not the
        device's (a step on fake tensors, whose ops run no device work to time)."""
        self.timer = _Timer(torch.device("cpu") if host_clock else self.device)
        self.active = True
        self.readings = [LayerReading() for _ in self.layers]
        self.tokens = 0
        self.outside_bytes = 0
        self.head_bytes = 0
        self._depth = 0
        self._recomputed = False
        self._storages = _Storages()
        # storages of parameters (re-read each time: layer offloading moves them between steps)
        self._parameters = set().union(*(_parameter_storages(layer, self.device) for layer in self.layers))

    def stop(self) -> List[LayerReading]:
        """Stop measuring; each layer's reading of the calls since :meth:`start`."""
        self.timer.collect()
        for index, reading in enumerate(self.readings):
            if reading.under_rules and self.rule_bytes is not None:
                reading.rule_bytes = self.rule_bytes(index) or 0
        self.active = False
        return self.readings

    @contextlib.contextmanager
    def outside(self, root: nn.Module) -> Iterator[None]:
        """Around a training step's forward, while started: counts what is saved outside the decoder layers, before
        the last one has run (``outside_bytes``: the embeddings', held through every layer's backward) and after it
        (``head_bytes``: the output head's and the loss's, held until their backward)."""
        if not self.active:
            yield
            return
        parameters = _parameter_storages(root, self.device)
        last = self.readings[-1] if self.readings else None

        def count(tensor: torch.Tensor) -> None:
            if self._depth or self._new_activation(tensor, parameters) is None:
                return  # inside a layer (its own count sees it), or not a new activation
            if last is not None and last.calls:
                self.head_bytes += _nbytes(tensor)
            else:
                self.outside_bytes += _nbytes(tensor)

        with _CountingHooks(count):
            yield

    def wrap(self, index: int, function: Callable[..., Any], under_rules: bool = False) -> Callable[..., Any]:
        """``function`` (one call of layer ``index``, as its checkpoint function receives it), measured;
        ``under_rules`` when the save rules apply to it."""
        if not self.active:
            return function
        reading = self.readings[index]

        def measured(*args: Any) -> Any:
            reading.calls += 1
            # a recompute runs inside the backward's graph task; every other call is a forward of the step
            in_backward = torch._C._current_graph_task_id() != -1
            field = "recompute_seconds" if in_backward else "forward_seconds"
            if in_backward and not self._recomputed:
                self._recomputed = True
                if self.on_first_recompute is not None:
                    self.on_first_recompute()
            # Count where the graph is built: each forward, or the recompute of a reentrant checkpoint (whose
            # forward runs without grad), once per forward; never in a non-reentrant recompute too.
            if in_backward:
                count = torch.is_grad_enabled() and reading.counted < reading.forwards_without_grad
            else:
                count = torch.is_grad_enabled()
                reading.forwards_without_grad += not count
            out = self._measured_call(index, reading, function, args, field, under_rules, count)
            if not in_backward and index == len(self.layers) - 1 and self.on_last_forward is not None:
                self.on_last_forward()
            return out

        return measured

    @contextlib.contextmanager
    def in_layer(self) -> Iterator[None]:
        """Around a layer's whole call (its checkpoint included, which saves the layer's input for the recompute):
        what is saved there is the layer's, not the step's outside the layers."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def _measured_call(
        self,
        index: int,
        reading: LayerReading,
        function: Callable[..., Any],
        args: tuple,
        field: str,
        rules: bool,
        count_saves: bool,
    ) -> Any:
        if not count_saves:
            started = self.timer.start()
            try:
                return function(*args)
            finally:  # a recompute that stops early raises out of the function
                self.timer.stop(started, reading, field)
        reading.counted += 1
        inputs = self._input_storages(args)
        reading.input_bytes += sum(inputs.values())
        for tensor in _bound_tensors(function):  # held by the call either way (the rotary tables, the mask)
            self._storages.first_sight(tensor)

        def count(tensor: torch.Tensor) -> None:
            key = self._new_activation(tensor, self._parameters)
            if key is None:
                return
            size = _nbytes(tensor)
            reading.saved_bytes += size
            if key in inputs:
                reading.input_saved_bytes += size

        dry = self.dry_run(index) if self.dry and self.dry_run is not None and not rules else None
        started = self.timer.start()
        with _CountingHooks(count), dry if dry is not None else contextlib.nullcontext() as region:
            out = function(*args)
        self.timer.stop(started, reading, field)
        if region is not None:
            reading.rule_bytes += region.saved_bytes
        reading.under_rules = rules  # what the rules kept is known once the checkpoint's call ends (stop)
        return out

    def note_tokens(self, args: Sequence[Any]) -> int:
        """The tokens of a layer call (its first tensor argument's size without the last dim), kept as the most
        seen while started."""
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        tokens = int(first.shape[:-1].numel()) if first is not None and first.dim() > 0 else 0
        if self.active:
            self.tokens = max(self.tokens, tokens)
        return tokens

    def _new_activation(self, tensor: torch.Tensor, parameters: Set[int]) -> Optional[int]:
        """The storage identity of ``tensor`` if it is an activation on the device not seen alive yet this step (not a
        parameter, nor a view of one), else ``None``."""
        if tensor.device != self.device or isinstance(tensor, nn.Parameter):
            return None
        if isinstance(getattr(tensor, "_base", None), nn.Parameter) or _storage_key(tensor) in parameters:
            return None
        return self._storages.first_sight(tensor)

    def _input_storages(self, args: Sequence[Any]) -> Dict[int, int]:
        found: Dict[int, int] = {}
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.device == self.device and arg.is_floating_point():
                key = _storage_key(arg)
                if key is not None:
                    found[key] = _nbytes(arg)
        return found
