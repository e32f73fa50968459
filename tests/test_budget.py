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


@pytest.mark.parametrize("seed", range(30))
def test_the_choice_is_exact_at_the_edge_of_the_budget(seed):
    """At a budget of exactly the optimum's peak, and one byte more, the choice is the brute-force optimum and fits.
    (Rounding each layer's bytes up on its own chose twice the optimum's recompute here, or said nothing fits with a
    peak under the budget.) Byte counts of real sizes: rounding only shows where they are not multiples of it."""
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    layers = [
        LayerFigures(
            saved_bytes=rng.randint(10**6, 10**8),
            input_bytes=rng.randint(10**4, 10**6),
            recompute_seconds=rng.uniform(0.5, 2.0),
            selective_bytes=rng.randint(10**6, 3 * 10**6) if seed % 3 == 0 else None,
            selective_seconds=rng.uniform(0.1, 0.6) if seed % 3 == 0 else None,
        )
        for _ in range(n)
    ]
    outside, head = rng.randint(0, 10**6), rng.randint(0, 10**7)
    peaks = sorted({estimate(layers, c, outside, head)[0] for c in itertools.product(*(f.options() for f in layers))})
    for optimum_peak in peaks[:-1]:  # every achievable peak but keeping everything (always exact)
        for budget in (optimum_peak, optimum_peak + 1):
            best = _brute_force(layers, budget, outside, head)
            plan = choose(layers, budget, outside, head)
            assert plan.fits and plan.peak_bytes <= budget, (budget, plan)
            assert plan.recompute_seconds == pytest.approx(best[0], abs=1e-12), (budget, plan, best)


def test_a_plan_under_the_budget_is_said_to_fit():
    layers = [LayerFigures(1000, 3, 1.0), LayerFigures(1000, 3, 1.0), LayerFigures(1001, 7, 1.0)]
    for budget in range(1000, 3200):
        plan = choose(layers, budget)
        assert plan.fits == (plan.peak_bytes <= budget), budget


def test_the_search_stays_small_for_alike_layers():
    """80 alike layers (a 70B model's) with every choice on offer: a few ways to reach each layer, not 3**80 (a
    search that exploded would not return)."""
    layers = [LayerFigures(10**9, 10**7, 1.0, selective_bytes=3 * 10**8, selective_seconds=0.4)] * 80
    plan = choose(layers, 40 * 10**9)
    assert plan.fits and plan.peak_bytes <= 40 * 10**9
    # the optimum: a kept layer costs nothing and holds the most, so the last layers (backward's first) are kept
    assert plan.choices[-1] is Choice.keep and plan.choices[0] is not Choice.keep


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
        (1e9, 10**9),  # how YAML and Hydra read budget=1e9
        (2.0**31, 2**31),
    ],
)
def test_a_size_is_bytes_or_text_with_a_unit(value, size):
    from lightning_ac.config import parse_size

    assert parse_size(value, "activation_checkpointing.budget") == size


@pytest.mark.parametrize(
    "value", [0, -1, True, False, "0GiB", "-3GiB", "12", "12 parsecs", "GiB", 1.5, None, "auto", float("inf"), -1e9]
)
def test_anything_else_is_a_config_error_naming_field_value_and_fix(value):
    from lightning_ac.config import ConfigError, parse_size

    with pytest.raises(ConfigError, match=r"activation_checkpointing.budget: expected a size: .*got .*\. \w"):
        parse_size(value, "activation_checkpointing.budget")


def test_numpy_numbers_are_sizes_when_whole():
    numpy = pytest.importorskip("numpy")
    from lightning_ac.config import ConfigError, parse_config, parse_size

    assert parse_size(numpy.int64(2**30), "activation_checkpointing.budget") == 2**30
    assert parse_size(numpy.float64(1e9), "activation_checkpointing.budget") == 10**9
    assert type(parse_config({"budget": numpy.int32(4096)}).budget) is int
    whole = r"budget: expected a size: a positive whole number of bytes.*got np\.float64\(1500000000\.5\).*whole number"
    with pytest.raises(ConfigError, match=whole):
        parse_size(numpy.float64(1.5e9 + 0.5), "activation_checkpointing.budget")
