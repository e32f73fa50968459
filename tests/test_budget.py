"""The memory budget's exact per-layer choice: a pure function, checked against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_ac.budget import Choice, LayerFigures, choose, estimate


def _layers(seed: int, n: int, selective: bool = True):
    rng = random.Random(seed)
    layers = []
    for _ in range(n):
        saved = rng.randint(20, 100)
        inputs = rng.randint(1, 10)
        seconds = rng.uniform(0.5, 2.0)
        layers.append(
            LayerFigures(
                saved_bytes=saved,
                input_bytes=inputs,
                recompute_seconds=seconds,
                selective_bytes=inputs + rng.randint(1, saved // 2) if selective else None,
                selective_seconds=seconds * rng.uniform(0.3, 1.2) if selective else None,
            )
        )
    return layers


def _brute_force(layers, budget, outside, head):
    best = None
    for choices in itertools.product(*(list(f.options()) for f in layers)):
        peak, seconds = estimate(layers, choices, outside, head)
        if peak <= budget and (best is None or seconds < best[0] - 1e-12):
            best = (seconds, choices)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_choice_is_the_brute_force_optimum(seed):
    layers = _layers(seed, n=5, selective=seed % 2 == 0)
    keep_all = estimate(layers, [Choice.keep] * 5, 7, 9)[0]
    recompute_all = estimate(layers, [Choice.recompute] * 5, 7, 9)[0]
    budget = random.Random(seed).randint(recompute_all, keep_all)
    plan = choose(layers, budget, outside_bytes=7, head_bytes=9)
    best = _brute_force(layers, budget, 7, 9)
    assert plan.fits and best is not None
    assert plan.peak_bytes <= budget
    assert plan.recompute_seconds == pytest.approx(best[0])
    assert (plan.peak_bytes, plan.recompute_seconds) == estimate(layers, plan.choices, 7, 9)


def test_a_budget_above_keeping_everything_recomputes_nothing():
    layers = _layers(0, n=4)
    keep_all = estimate(layers, [Choice.keep] * 4)[0]
    plan = choose(layers, keep_all)
    assert plan.choices == (Choice.keep,) * 4 and plan.recompute_seconds == 0 and plan.fits


def test_a_budget_below_recomputing_everything_recomputes_everything_and_says_it_does_not_fit():
    layers = _layers(1, n=4)
    recompute_all = estimate(layers, [Choice.recompute] * 4)[0]
    plan = choose(layers, recompute_all - 1)
    assert plan.choices == (Choice.recompute,) * 4 and not plan.fits and plan.peak_bytes == recompute_all


def test_selective_is_offered_only_where_it_measured_faster_than_recompute():
    slow = LayerFigures(100, 10, recompute_seconds=1.0, selective_bytes=30, selective_seconds=1.0)
    fast = LayerFigures(100, 10, recompute_seconds=1.0, selective_bytes=30, selective_seconds=0.4)
    assert Choice.selective not in slow.options() and Choice.selective in fast.options()
    # 150 bytes: the last layer kept (its backward runs first), the first one selective where that is faster
    assert choose([fast, fast], 150).choices == (Choice.selective, Choice.keep)
    assert choose([slow, slow], 150).choices == (Choice.recompute, Choice.keep)


def test_the_peak_is_taken_where_it_happens_not_as_a_sum():
    """The last layer's backward materialises its saves while every earlier layer still holds its bytes: keeping the
    first layer and recomputing the last holds 110 bytes, but peaks at 210."""
    layers = [LayerFigures(100, 10, 1.0), LayerFigures(100, 10, 1.0)]
    assert estimate(layers, [Choice.keep, Choice.recompute]) == (210, 1.0)
    assert estimate(layers, [Choice.recompute, Choice.keep]) == (110, 1.0)
    assert choose(layers, 200).choices == (Choice.keep, Choice.keep)
    assert choose(layers, 199).choices == (Choice.recompute, Choice.keep)
    assert not choose(layers, 109).fits


def test_a_coarse_resolution_only_overestimates():
    layers = _layers(3, n=6)
    keep_all = estimate(layers, [Choice.keep] * 6)[0]
    recompute_all = estimate(layers, [Choice.recompute] * 6)[0]
    for budget in range(recompute_all, keep_all + 1, 7):
        plan = choose(layers, budget, resolution=16)
        assert not plan.fits or plan.peak_bytes <= budget
        quantum = -(-budget // 16)
        if budget >= recompute_all + quantum * (len(layers) + 2):  # room for every rounding
            assert plan.fits


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        choose([LayerFigures(1, 1, 1.0)], 0)


@pytest.mark.parametrize(
    "value, size",
    [
        (1, 1),
        (3 * 2**30, 3 * 2**30),
        ("24GiB", 24 * 2**30),
        ("512MiB", 512 * 2**20),
        ("20GB", 20 * 10**9),
        ("300 MB", 300 * 10**6),
        ("1.5 gib", int(1.5 * 2**30)),
        (" 64kb ", 64_000),
        ("7B", 7),
    ],
)
def test_a_size_is_bytes_or_text_with_a_unit(value, size):
    from lightning_ac.config import parse_size

    assert parse_size(value, "activation_checkpointing.budget") == size


@pytest.mark.parametrize("value", [0, -1, True, False, "0GiB", "-3GiB", "12", "12 parsecs", "GiB", 1.5, None, "auto"])
def test_anything_else_is_a_config_error_naming_field_value_and_fix(value):
    from lightning_ac.config import ConfigError, parse_size

    with pytest.raises(ConfigError, match=r"activation_checkpointing.budget: expected a size: .*got .*\. \w"):
        parse_size(value, "activation_checkpointing.budget")
