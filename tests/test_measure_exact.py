"""What the memory budget measures, against byte counts written out here from tensor shapes: each layer's saved and
input bytes (:class:`~lightning_ac.budget.measure.LayerMeter`) over several forwards, with an input the layer saves
and a weight it saves as a detached alias, and a measuring step's peak across a restart
(:func:`~lightning_ac.memory.measure_step`)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_ac.budget.measure import LayerMeter, held_bytes, shape_of_work
from lightning_ac.memory import measure_step

CPU = torch.device("cpu")
MiB = 2**20
FLOAT = 4


class TanhLayer(nn.Module):
    """Saves its input (the linear's weight gradient needs it) and its output (tanh's gradient needs it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class AliasLayer(nn.Module):
    """Saves a detached alias of its weight (``x * w.detach()`` keeps ``w.detach()`` for ``x``'s gradient): the
    weight's bytes, not an activation's."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.detach()


def _readings(layer: nn.Module, *inputs: torch.Tensor):
    meter = LayerMeter([layer], CPU)
    meter.start()
    call = meter.wrap(0, layer)
    outputs = [call(x) for x in inputs]
    readings = meter.stop()
    return readings[0], outputs


def test_a_layer_called_twice_before_backward_holds_both_forwards_saves():
    """Every forward call holds what it saves until the backward: the figures add up over the step's calls."""
    layer = TanhLayer()
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)  # 4 x 8 float32: 128 bytes each
    one, _ = _readings(layer, x1)
    assert (one.saved_bytes, one.input_bytes, one.input_saved_bytes) == (2 * 128, 128, 128)  # input and tanh's output
    two, _ = _readings(layer, x1, x2)
    assert (two.saved_bytes, two.input_bytes, two.input_saved_bytes, two.calls) == (4 * 128, 256, 256, 2)
    # as the planner takes them: with the input on the device, and with offload.hidden_states moving it off
    held = two.figures(input_held=True, rules_held=True, selective=True)
    assert (held.saved_bytes, held.input_bytes, held.input_saved_bytes, held.selective_bytes) == (512, 256, 256, 256)
    moved = two.figures(input_held=False, rules_held=True, selective=False)
    assert (moved.saved_bytes, moved.input_bytes, moved.input_saved_bytes, moved.selective_bytes) == (512, 0, 0, None)


def test_a_weight_saved_as_a_detached_alias_is_not_an_activation():
    layer = AliasLayer()
    x = torch.randn(4, 8, requires_grad=True)
    reading, (out,) = _readings(layer, x)
    assert out.grad_fn is not None
    assert (reading.saved_bytes, reading.input_bytes, reading.input_saved_bytes) == (0, 4 * 8 * FLOAT, 0)


def test_a_storage_saved_twice_counts_once():
    """``x * x`` saves its input twice (once per operand): one storage, counted once."""
    square = nn.Module()
    square.forward = lambda x: x * x  # type: ignore[method-assign]
    x = torch.randn(4, 8, requires_grad=True)
    reading, _ = _readings(square, x)
    assert (reading.saved_bytes, reading.input_saved_bytes) == (128, 128)


def test_held_bytes_count_each_storage_of_the_call_once():
    x = torch.randn(4, 8)
    mask = torch.ones(4, 4)

    def layer(hidden: torch.Tensor, attention_mask: torch.Tensor = mask) -> torch.Tensor:
        return hidden

    import functools

    bound = functools.partial(layer, attention_mask=mask)
    assert held_bytes(bound, (x, x[:2]), CPU) == 4 * 8 * FLOAT + 4 * 4 * FLOAT  # x's storage once, the mask


def test_the_shape_of_work_tells_a_mask_and_a_precision_apart_but_not_a_length():
    import functools

    def layer(hidden, attention_mask=None):
        return hidden

    plain = shape_of_work(layer, (torch.randn(2, 8, 4),))
    longer = shape_of_work(layer, (torch.randn(2, 16, 4),))
    masked = shape_of_work(functools.partial(layer, attention_mask=torch.ones(2, 1, 8, 8)), (torch.randn(2, 8, 4),))
    halved = shape_of_work(layer, (torch.randn(2, 8, 4, dtype=torch.bfloat16),))
    assert plain == longer
    assert len({plain, masked, halved}) == 3


def test_a_restart_reads_what_follows_and_the_result_keeps_the_whole_peak():
    """The budget restarts the peak before the output head's backward; the step's result is still its whole peak."""
    with measure_step([], [], CPU) as measurement:
        first = torch.empty(MiB // FLOAT)
        assert measurement.peak_so_far() == MiB
        del first
        measurement.restart_peak()
        assert measurement.peak_so_far() == 0
        second = torch.empty(MiB // 2 // FLOAT)
        assert measurement.peak_so_far() == MiB // 2
        measurement.add_held(1000)
        measurement.add_held(24)
        assert measurement.peak_so_far() == MiB // 2 + 1024
        del second
    assert measurement.result.activation_bytes == MiB


def test_bytes_held_from_before_the_measurement_add_to_its_peak():
    with measure_step([], [], CPU, inside_forward=True) as measurement:
        measurement.add_held(4096)
        block = torch.empty(MiB // FLOAT)
        del block
    assert measurement.result.activation_bytes == MiB + 4096
