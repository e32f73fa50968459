"""The budget's choice with offloading as a fourth option (``offload.hidden_states: auto``), against the test's own
brute force under a host limit.

The oracle is written out from the model in :mod:`lightning_ac.budget.choice`'s docstring, apart from the code under
test: an offloaded layer holds nothing on the device until its backward, works in what a recomputed one does (its input
reloaded, its saves recreated), costs its ``offload_seconds`` and holds its input in host memory; the offloaded
layers' inputs together must fit the host's room. Of the assignments under the budget and the host's room, the choice
must take the least time and, at that time, the fewest host bytes (the fewest inputs offloaded).
"""

from __future__ import annotations

import itertools
import random
from typing import List, Optional, Sequence, Tuple

import pytest

from lightning_ac.budget import Choice, LayerFigures, choose
from lightning_ac.budget.choice import least_memory

LETTERS = {"k": Choice.keep, "r": Choice.recompute, "s": Choice.selective, "o": Choice.offload}


def cost(f: LayerFigures, letter: str) -> Tuple[int, int, float, int]:
    """(held on the device, working at its backward, seconds, held on the host)."""
    rebuilt = f.input_bytes + f.saved_bytes - min(f.input_saved_bytes, f.input_bytes)
    if letter == "k":
        return f.saved_bytes, f.saved_bytes, 0.0, 0
    if letter == "r":
        return f.input_bytes, rebuilt, f.recompute_seconds, 0
    if letter == "o":
        assert f.offload_seconds is not None
        return 0, rebuilt, f.offload_seconds, f.input_bytes
    assert f.selective_bytes is not None and f.selective_seconds is not None
    return f.selective_bytes, rebuilt, f.selective_seconds, 0


def offered(f: LayerFigures) -> str:
    letters = "kr"
    if f.selective_seconds is not None and f.selective_bytes is not None and f.selective_seconds < f.recompute_seconds:
        letters += "s"
    return letters + ("o" if f.offload_seconds is not None else "")


def peak(layers: Sequence[LayerFigures], plan: str, outside: int, head: int) -> int:
    costs = [cost(f, letter) for f, letter in zip(layers, plan)]
    held = outside
    top = 0
    for layer_held, working, _, _ in costs:
        top = max(top, held + working)
        held += layer_held
    return max(top, held + head)


def brute_force(
    layers: Sequence[LayerFigures], budget: int, host: Optional[int], outside: int, head: int
) -> Optional[Tuple[float, int]]:
    """(least seconds, fewest host bytes at that time) over every assignment that fits; ``None`` when none does."""
    found = []
    for plan in map("".join, itertools.product(*(offered(f) for f in layers))):
        on_host = sum(cost(f, letter)[3] for f, letter in zip(layers, plan))
        if peak(layers, plan, outside, head) <= budget and (host is None or on_host <= host):
            found.append((round(sum(cost(f, letter)[2] for f, letter in zip(layers, plan)), 9), on_host))
    return min(found) if found else None


def random_layers(seed: int, n: int) -> List[LayerFigures]:
    rng = random.Random(seed)
    layers = []
    for _ in range(n):
        saved, inputs, seconds = rng.randint(30, 100), rng.randint(5, 20), rng.uniform(0.5, 2.0)
        selective = rng.random() < 0.5
        layers.append(
            LayerFigures(
                saved_bytes=saved,
                input_bytes=inputs,
                recompute_seconds=seconds,
                selective_bytes=inputs + rng.randint(1, saved // 2) if selective else None,
                selective_seconds=seconds * rng.uniform(0.3, 1.2) if selective else None,
                input_saved_bytes=rng.choice([0, inputs]),
                # copies fully hidden (the recompute alone), or partly exposed
                offload_seconds=seconds + rng.choice([0.0, rng.uniform(0.0, 1.0)]),
            )
        )
    return layers


@pytest.mark.parametrize("seed", range(40))
def test_the_choice_with_offloading_is_the_brute_force_optimum_under_a_host_limit(seed):
    rng = random.Random(seed)
    layers = random_layers(seed, n=5)
    outside, head = 7, 9
    keep_all = peak(layers, "kkkkk", outside, head)
    all_inputs = sum(f.input_bytes for f in layers)
    least = peak(layers, "ooooo", outside, head)
    budgets = sorted({least - 1, least, rng.randint(least, keep_all), rng.randint(least, keep_all), keep_all - 1})
    for budget, host in itertools.product(budgets, [None, 0, rng.randint(1, all_inputs), all_inputs]):
        best = brute_force(layers, budget, host, outside, head)
        plan = choose(layers, budget, outside_bytes=outside, head_bytes=head, host_bytes=host)
        chosen = "".join(c.value[0] for c in plan.choices)
        assert plan.fits == (best is not None), (budget, host, chosen, best)
        on_host = sum(cost(f, letter)[3] for f, letter in zip(layers, chosen))
        assert plan.host_bytes == on_host, chosen
        assert plan.peak_bytes == peak(layers, chosen, outside, head), chosen
        if best is not None:
            assert plan.peak_bytes <= budget and (host is None or on_host <= host), (budget, host, chosen)
            assert (round(plan.recompute_seconds, 9), on_host) == best, (budget, host, chosen)


def test_fully_hidden_copies_offload_only_the_inputs_the_budget_needs():
    """Ten alike layers whose copies the compute hides (offloading costs what recomputing does), and a head whose
    backward rules out keeping a layer: a budget that recomputing every layer misses by three inputs' bytes offloads
    three inputs, not ten."""
    layer = LayerFigures(saved_bytes=1000, input_bytes=10, recompute_seconds=1.0, offload_seconds=1.0)
    layers = [layer] * 10
    recompute_all = peak(layers, "r" * 10, 0, 100)  # nine inputs held, the last layer's working set: 1,100
    plan = choose(layers, recompute_all - 30, head_bytes=100)
    assert plan.fits and plan.choices.count(Choice.offload) == 3 and plan.host_bytes == 30, plan
    assert plan.choices.count(Choice.recompute) == 7 and plan.peak_bytes == recompute_all - 30
    # the same budget with room on the host for two inputs only: nothing fits, and the least memory the host allows
    # is every layer recomputed
    plan = choose(layers, recompute_all - 30, head_bytes=100, host_bytes=20)
    assert not plan.fits and plan.choices == (Choice.recompute,) * 10


def test_the_least_memory_offloads_every_input_only_where_the_host_holds_them_all():
    layers = [LayerFigures(100, 10, 1.0, offload_seconds=1.5)] * 4
    assert least_memory(layers) == (Choice.offload,) * 4
    assert least_memory(layers, host_bytes=40) == (Choice.offload,) * 4
    assert least_memory(layers, host_bytes=39) == (Choice.recompute,) * 4
    assert least_memory([LayerFigures(100, 10, 1.0)] * 4) == (Choice.recompute,) * 4


def test_offloading_is_not_offered_without_its_seconds():
    assert Choice.offload not in LayerFigures(100, 10, 1.0).options()
    assert LayerFigures(100, 10, 1.0, offload_seconds=1.2).options()[Choice.offload] == (0, 110, 1.2)
    with pytest.raises(ValueError, match="not offered"):
        LayerFigures(100, 10, 1.0).cost(Choice.offload)
