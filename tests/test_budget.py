"""The memory budget's exact per-layer choice: a pure function, checked against the test's own brute force.

The oracle here is written out from the model in :mod:`lightning_ac.budget.choice`'s docstring, apart from the
code under test: each choice's held bytes (until the layer's backward) and working bytes (while it runs), the peak
as the largest of ``outside + sum(held[:i]) + working[i]`` over the layers and ``outside + sum(held) + head``, and
every assignment of keep / selective / recompute enumerated.
"""

from __future__ import annotations

import itertools
import random
from typing import List, Optional, Sequence, Tuple

import pytest

from lightning_ac.budget import Choice, LayerFigures, choose, estimate
from lightning_ac.budget import choice as choice_module

# -- the oracle ----------------------------------------------------------------------------------------------------


def held_working_seconds(f: LayerFigures, letter: str) -> Tuple[int, int, float]:
    """One layer under ``letter`` (k, s, r). Kept: it holds what it saves, and its backward needs exactly that. A
    recomputed or selective layer holds its input (and, selective, what the save rules keep); its backward recreates
    what it saves next to its input, except the part of its input the forward saves itself (the same storage)."""
    rebuilt = f.input_bytes + f.saved_bytes - min(f.input_saved_bytes, f.input_bytes)
    if letter == "k":
        return f.saved_bytes, f.saved_bytes, 0.0
    if letter == "r":
        return f.input_bytes, rebuilt, f.recompute_seconds
    assert f.selective_bytes is not None and f.selective_seconds is not None
    return f.selective_bytes, rebuilt, f.selective_seconds


def offered(f: LayerFigures) -> str:
    """The letters on offer: selective only where measured, and faster than recomputing the whole layer."""
    fast = (
        f.selective_seconds is not None and f.selective_bytes is not None and f.selective_seconds < f.recompute_seconds
    )
    return "krs" if fast else "kr"


def oracle_peak(layers: Sequence[LayerFigures], plan: str, outside: int = 0, head: int = 0) -> int:
    costs = [held_working_seconds(f, letter) for f, letter in zip(layers, plan)]
    prefix = [outside + sum(held for held, _, _ in costs[:i]) for i in range(len(costs) + 1)]
    at_layers = [prefix[i] + working for i, (_, working, _) in enumerate(costs)]
    return max(at_layers + [prefix[-1] + head])


def oracle_seconds(layers: Sequence[LayerFigures], plan: str) -> float:
    return sum(held_working_seconds(f, letter)[2] for f, letter in zip(layers, plan))


def brute_force(layers: Sequence[LayerFigures], budget: int, outside: int = 0, head: int = 0) -> Optional[float]:
    """The least recompute time of any assignment whose peak is under ``budget``; ``None`` when none is."""
    times = [
        oracle_seconds(layers, plan)
        for plan in map("".join, itertools.product(*(offered(f) for f in layers)))
        if oracle_peak(layers, plan, outside, head) <= budget
    ]
    return min(times) if times else None


def letters(choices: Sequence[Choice]) -> str:
    """``(keep, recompute, selective)`` as ``"krs"``."""
    return "".join(c.value[0] for c in choices)


def _layers(seed: int, n: int, selective: bool = True) -> List[LayerFigures]:
    """Unlike layers: random sizes and times; most save their input (a part of it, all of it, or, where the input is
    offloaded, none of an input that holds nothing on the device), some do not."""
    rng = random.Random(seed)
    layers = []
    for index in range(n):
        saved = rng.randint(20, 100)
        inputs = rng.choice([0, rng.randint(1, 15), rng.randint(1, 15)]) if index else rng.randint(1, 15)
        seconds = rng.uniform(0.5, 2.0)
        layers.append(
            LayerFigures(
                saved_bytes=saved,
                input_bytes=inputs,
                recompute_seconds=seconds,
                selective_bytes=inputs + rng.randint(1, saved // 2) if selective else None,
                selective_seconds=seconds * rng.uniform(0.3, 1.2) if selective else None,
                # the first layer saves its input always (a decoder layer's first norm does)
                input_saved_bytes=rng.choice([inputs, rng.randint(0, inputs), inputs + rng.randint(1, 5)])
                if index == 0
                else rng.choice([0, inputs, rng.randint(0, inputs), inputs + rng.randint(1, 5)]),
            )
        )
    return layers


# -- the choice --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_the_choice_is_the_brute_force_optimum(seed):
    layers = _layers(seed, n=5, selective=seed % 2 == 0)
    outside, head = 7, 9
    keep_all = oracle_peak(layers, "kkkkk", outside, head)
    least = min(oracle_peak(layers, p, outside, head) for p in map("".join, itertools.product("kr", repeat=5)))
    rng = random.Random(seed)
    # budgets from nothing fitting to everything kept, and both edges of the least peak
    for budget in sorted({least - 1, least, rng.randint(least, keep_all), rng.randint(least, keep_all), keep_all}):
        best = brute_force(layers, budget, outside, head)
        plan = choose(layers, budget, outside_bytes=outside, head_bytes=head)
        chosen = letters(plan.choices)
        assert plan.fits == (best is not None), (budget, chosen)
        assert plan.peak_bytes == oracle_peak(layers, chosen, outside, head), (budget, chosen)
        assert plan.recompute_seconds == pytest.approx(oracle_seconds(layers, chosen))
        if best is None:
            assert chosen == "rrrrr" and plan.peak_bytes > budget
        else:
            assert plan.peak_bytes <= budget and plan.recompute_seconds == pytest.approx(best), (budget, chosen)


def test_a_budget_above_keeping_everything_recomputes_nothing():
    layers = _layers(0, n=4)
    plan = choose(layers, oracle_peak(layers, "kkkk"))
    assert plan.choices == (Choice.keep,) * 4 and plan.recompute_seconds == 0 and plan.fits


def test_a_budget_below_recomputing_everything_recomputes_everything_and_says_it_does_not_fit():
    layers = _layers(1, n=4)
    recompute_all = oracle_peak(layers, "rrrr")
    least = min(oracle_peak(layers, p) for p in map("".join, itertools.product(*(offered(f) for f in layers))))
    plan = choose(layers, least - 1)
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


def test_a_recomputed_layer_that_saves_its_input_holds_it_once():
    """A layer whose forward saves its own input (as a decoder layer's first norm does) holds, when recomputed, its
    input and the rest of what it saves: the input is not counted twice. Figures by hand: the first layer
    recomputed works in 10 + 200 - 10 = 200 bytes, the second kept then holds 10 + 50."""
    layers = [
        LayerFigures(saved_bytes=200, input_bytes=10, recompute_seconds=1.0, input_saved_bytes=10),
        LayerFigures(saved_bytes=50, input_bytes=10, recompute_seconds=1.0, input_saved_bytes=10),
    ]
    assert estimate(layers, [Choice.recompute, Choice.keep]) == (200, 1.0)
    assert estimate(layers, [Choice.recompute, Choice.recompute]) == (200, 2.0)
    assert estimate(layers, [Choice.keep, Choice.keep]) == (250, 0.0)
    plan = choose(layers, 200)  # exactly the recomputed layer's working set: it fits
    assert (letters(plan.choices), plan.peak_bytes, plan.recompute_seconds, plan.fits) == ("rk", 200, 1.0, True)
    assert not choose(layers, 199).fits
    # an input only part of which is on the device (4 bytes), saved whole by the forward (10): 4 + 100 - 4
    partly = LayerFigures(saved_bytes=100, input_bytes=4, recompute_seconds=1.0, input_saved_bytes=10)
    assert partly.cost(Choice.recompute) == (4, 100, 1.0)
    assert estimate([partly], [Choice.recompute], outside_bytes=3) == (103, 1.0)


def test_the_output_head_runs_its_backward_with_every_layers_bytes_held():
    """Keeping both layers holds 200 bytes, and the head's backward 50 more on top: over a budget of 200, although
    every layer's own backward fits it. Recomputing the cheaper first layer peaks at 10 + 100 + 50 = 160."""
    layers = [LayerFigures(100, 10, 1.0, input_saved_bytes=10), LayerFigures(100, 10, 2.0, input_saved_bytes=10)]
    plan = choose(layers, 200, head_bytes=50)
    assert (letters(plan.choices), plan.peak_bytes, plan.recompute_seconds, plan.fits) == ("rk", 160, 1.0, True)
    assert letters(choose(layers, 200, head_bytes=0).choices) == "kk"
    # 7 bytes saved outside the layers, held through all of it, and a head of 60: keeping the last layer ends at
    # 7 + 110 + 60 = 177 at the head, over 170; recomputing both peaks at the second one's backward, 7 + 10 + 100
    plan = choose(layers, 170, outside_bytes=7, head_bytes=60)
    assert (letters(plan.choices), plan.peak_bytes, plan.recompute_seconds, plan.fits) == ("rr", 117, 3.0, True)
    assert letters(choose(layers, 177, outside_bytes=7, head_bytes=60).choices) == "rk"
    assert not choose(layers, 116, outside_bytes=7, head_bytes=60).fits


@pytest.mark.parametrize("seed", range(30))
def test_the_choice_is_exact_at_the_edge_of_the_budget(seed):
    """At a budget of exactly the optimum's peak, and one byte more, the choice is the brute-force optimum and fits.
    (Rounding each layer's bytes up on its own chose twice the optimum's recompute here, or said nothing fits with a
    peak under the budget.) Byte counts of real sizes: rounding only shows where they are not multiples of it."""
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    layers = []
    for _ in range(n):
        inputs = rng.randint(10**4, 10**6)
        layers.append(
            LayerFigures(
                saved_bytes=rng.randint(10**6, 10**8),
                input_bytes=inputs,
                recompute_seconds=rng.uniform(0.5, 2.0),
                selective_bytes=rng.randint(10**6, 3 * 10**6) if seed % 3 == 0 else None,
                selective_seconds=rng.uniform(0.1, 0.6) if seed % 3 == 0 else None,
                input_saved_bytes=inputs if seed % 2 else 0,
            )
        )
    outside, head = rng.randint(0, 10**6), rng.randint(0, 10**7)
    plans = list(map("".join, itertools.product(*(offered(f) for f in layers))))
    peaks = sorted({oracle_peak(layers, p, outside, head) for p in plans})
    for optimum_peak in peaks[:-1]:  # every achievable peak but keeping everything (always exact)
        for budget in (optimum_peak, optimum_peak + 1):
            best = brute_force(layers, budget, outside, head)
            plan = choose(layers, budget, outside, head)
            assert plan.fits and plan.peak_bytes <= budget, (budget, plan)
            assert plan.peak_bytes == oracle_peak(layers, letters(plan.choices), outside, head)
            assert plan.recompute_seconds == pytest.approx(best, abs=1e-12), (budget, plan, best)


def test_a_plan_under_the_budget_is_said_to_fit():
    layers = [LayerFigures(1000, 3, 1.0), LayerFigures(1000, 3, 1.0), LayerFigures(1001, 7, 1.0)]
    for budget in range(1000, 3200):
        plan = choose(layers, budget)
        assert plan.fits == (plan.peak_bytes <= budget), budget


def test_the_search_stays_small_for_alike_layers():
    """80 alike layers (a 70B model's) with every choice on offer: a few ways to reach each layer, not 3**80 (a
    search that exploded would not return).

    The optimum by hand, in units of 10**7 bytes: a kept layer holds 100, a selective one 30 (0.4 s), a recomputed
    one 1 (1 s), and everything held must fit 4000 with the last layer kept (a recomputed or selective last layer
    works in 101 on top of the rest). All selective holds 2400; each of the other 1600 buys a kept layer for 70:
    22 kept and 58 selective (3940, 23.2 s). 23 kept leave 1700 for 57 layers: 56 selective and 1 recomputed
    (23.4 s); 21 kept: 59 selective (23.6 s)."""
    layers = [LayerFigures(10**9, 10**7, 1.0, selective_bytes=3 * 10**8, selective_seconds=0.4)] * 80
    plan = choose(layers, 40 * 10**9)
    chosen = letters(plan.choices)
    assert (chosen.count("k"), chosen.count("s"), chosen.count("r")) == (22, 58, 0), chosen
    assert chosen[-1] == "k" and plan.recompute_seconds == pytest.approx(23.2) and plan.fits
    assert plan.peak_bytes == oracle_peak(layers, chosen) <= 40 * 10**9


def test_thinning_the_ways_keeps_the_least_held_and_the_fastest(monkeypatch):
    """Past MAX_STATES ways to reach a layer, the slower ways are thinned: the least-held one (so that whatever fits
    still does) and the fastest one (the optimum, where the budget allows it) stay."""
    monkeypatch.setattr(choice_module, "MAX_STATES", 4)
    ways = [(held, 0, 10.0 - held, ()) for held in range(10)]  # each holds more and is faster than the one before
    ways += [(5, 0, 20.0, ("dominated",)), (3, 0, 7.0, ("equal",))]  # slower than a way that holds less, or as fast
    kept = choice_module._undominated(ways)
    assert len(kept) == 4 and kept == sorted(kept)
    assert kept[0] == (0, 0, 10.0, ()), "the least held"
    assert kept[-1] == (9, 0, 1.0, ()), "the fastest"
    assert all(way in ways[:10] for way in kept)


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
