"""The estimator's arithmetic, judged by figures written out by hand or found by a search of the test's own: the
margin and what a device leaves, the allocator's rounding at exact multiples, the longest-length search on staircase
curves (every candidate length scanned), the budget's plan for a device, the units of the table, the 4-bit weights'
packing and the mode table. Pure functions and a tiny model: each test takes at most a few seconds."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_config
from torch import nn

import lightning_ac.estimate.budget as budget_module
from lightning_ac.budget.choice import LayerFigures
from lightning_ac.estimate.budget import BudgetFigures, BudgetPlan, budget_plans, measure, usable_bytes
from lightning_ac.estimate.fit import fits, longest_fit, margin_bytes
from lightning_ac.estimate.models import Training, build_model
from lightning_ac.estimate.modes import Mode, default_modes, resolve_modes
from lightning_ac.estimate.render import gib, markdown
from lightning_ac.estimate.results import Estimate, StepEstimate
from lightning_ac.estimate.tracker import Kind, MemoryTracker

GiB, MiB = 2**30, 2**20
CONTEXT = 2**30  # the margin's fixed part, written out: 1 GiB


def _needed(total: int) -> int:
    """What a device must have for ``total`` allocated bytes, by the stated margin written out: 1 GiB and 5% of the
    total, rounded down (``total // 20``: exact integer arithmetic, no float)."""
    return total + CONTEXT + total // 20


def _line(seq: int, total: int) -> StepEstimate:
    return StepEstimate("m", seq, 1, 0, 0, 0, 0, 0, "forward", 0, [], 0, 0, 0, 0, total, total, {}, 0.0)


# -- the margin and what a device leaves -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "total, margin",
    [
        (0, GiB),  # the context alone
        (19, GiB),  # 5% of 19 bytes is 0.95: rounded down
        (20, GiB + 1),  # an exact multiple of 20: one byte more
        (20 * GiB, 2 * GiB),  # the proportional part equals the context
        (100 * GiB, 6 * GiB),  # the proportional part dominates: 1 + 5 GiB
        (80 * GiB + 19, 5 * GiB),  # 4 GiB + 0.95 bytes, rounded down
        (80 * GiB + 20, 5 * GiB + 1),
    ],
)
def test_the_margin_is_a_gib_and_five_percent_of_the_total_rounded_down(total, margin):
    assert margin_bytes(total) == margin


def test_a_step_fits_a_device_of_exactly_its_total_and_margin_and_not_one_byte_less():
    total = 40 * GiB + 7  # margin: 1 GiB + 2 GiB (5% of 40 GiB) + 0 (5% of 7 bytes, rounded down)
    exactly = total + 3 * GiB
    assert fits(_line(512, total), exactly)
    assert not fits(_line(512, total), exactly - 1)
    assert fits(_line(512, total - 1), exactly - 1)


def _usable_by_hand(device: int) -> int:
    """The most allocated bytes T with T + 1 GiB + T // 20 <= device: write T = 20 q + r (0 <= r < 20), so that
    T + T // 20 = 21 q + r must be at most R = device - 1 GiB; the most is q = R // 21, r = min(R % 21, 19)."""
    rest = device - CONTEXT
    return 20 * (rest // 21) + min(rest % 21, 19)


@pytest.mark.parametrize(
    "device, usable",
    [
        (CONTEXT, 0),  # the context alone: nothing is left
        (CONTEXT + 20, 19),  # 20 bytes would need 21
        (CONTEXT + 21, 20),
        (int(1.1 * GiB), 102261126),  # R = 107374182 = 21 * 5113056 + 6: 20 * 5113056 + 6
        (12 * GiB, 11248723871),  # R = 11811160064 = 21 * 562436193 + 11
        (80 * GiB, 80786289616),  # R = 84825604096 = 21 * 4039314480 + 16
    ],
)
def test_what_a_device_leaves_is_the_most_that_fits_it(device, usable):
    """``usable_bytes`` (what the budget's plan is made for) is the inverse of ``fits``, to the byte: hand-computed
    figures, and the byte after them does not fit."""
    assert _usable_by_hand(device) == usable  # the hand derivation agrees with the figures written out
    assert usable_bytes(device) == usable
    assert _needed(usable) <= device < _needed(usable + 1)


def test_what_a_device_leaves_inverts_the_margin_at_any_size():
    rng = random.Random(40)
    for device in [rng.randrange(CONTEXT, 200 * GiB) for _ in range(300)]:
        assert usable_bytes(device) == _usable_by_hand(device), device


# -- the budget's plan for a device ------------------------------------------------------------------------------


def test_the_budgets_plan_is_made_for_what_the_device_leaves_after_the_margin_and_the_fixed_bytes(monkeypatch):
    """The plan for each device is made under ``usable - fixed``: hand-computed, and the plan it makes is the one
    those bytes allow (a plan for the device's whole size, or without the weights, keeps every layer)."""
    layers = [LayerFigures(400 * MiB, 40 * MiB, 1.0), LayerFigures(400 * MiB, 40 * MiB, 1.0)]
    fixed = 10 * GiB
    figures = BudgetFigures(layers, outside_bytes=0, head_bytes=0, fixed_bytes=fixed, all_recompute_seconds=2.0)
    monkeypatch.setattr(budget_module, "measure", lambda *args, **kwargs: (_line(64, 0), figures))
    _, (roomy, tight) = budget_plans("budget", None, torch.bfloat16, Training(), 64, 1, "adamw", "cuda",
                                     [80 * GiB, 12 * GiB])  # fmt: skip
    assert (roomy.device_memory_bytes, tight.device_memory_bytes) == (80 * GiB, 12 * GiB)
    assert roomy.budget_bytes == 80786289616 - fixed  # the figure of test_what_a_device_leaves_is_the_most_that_fits_it
    assert roomy.layers == "kk" and roomy.estimated_peak_bytes == 800 * MiB and roomy.fits
    assert roomy.device_total_bytes == fixed + 800 * MiB and roomy.recompute_share == 0.0
    assert tight.budget_bytes == 11248723871 - fixed  # 511305631 bytes: 487.6 MiB
    # under 487.6 MiB both layers cannot be kept (800 MiB); recomputing the first holds its input (40 MiB) and
    # peaks at its recompute (40 + 400 MiB), then at the second's forward kept (40 + 400 MiB)
    assert tight.layers == "rk" and tight.estimated_peak_bytes == 440 * MiB and tight.fits
    assert tight.device_total_bytes == fixed + 440 * MiB and tight.recompute_share == 0.5
    assert tight.setting == "487MiB"


@pytest.mark.parametrize(
    "budget, setting",
    [(-5, "none"), (0, "none"), (MiB - 1, "none"), (MiB, "1MiB"), (2 * MiB - 1, "1MiB"), (2 * MiB, "2MiB")],
)
def test_the_budget_setting_is_whole_mib_rounded_down(budget, setting):
    assert BudgetPlan("budget", 64, 1, 80 * GiB, budget).setting == setting


def test_the_fixed_bytes_are_weights_gradients_optimizer_state_and_the_batch():
    """The budget's measuring step's fixed bytes, against a real model and a real AdamW step of the same shape (CPU
    target: exact bytes) and the batch's int64 ids."""
    config, training, seq, batch = tiny_config("llama"), Training(4, ("q_proj", "v_proj")), 32, 2
    _, figures = measure("budget", config, torch.float32, training, seq, batch, "adamw", "cpu", block={})
    torch.manual_seed(0)
    model = build_model(config, torch.float32, training, "cpu")
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(trainable, lr=1e-6, foreach=False)
    optimizer.step()
    weights = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    gradients = sum(p.grad.nbytes for p in trainable)
    state = sum(v.nbytes for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    assert state == 2 * gradients + 4 * len(trainable)  # exp_avg, exp_avg_sq, and a float32 step each
    assert figures.fixed_bytes == weights + gradients + state + batch * seq * 8


# -- the allocator's rounding -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nbytes, counted", [(0, 0), (1, 512), (511, 512), (512, 512), (513, 1024), (1024, 1024), (1025, 1536)]
)
def test_each_storage_is_rounded_up_to_the_cuda_block(nbytes, counted):
    """Exact multiples of 512 bytes stay as they are; one byte over takes another block; nothing takes nothing."""
    tracker = MemoryTracker(round_to=512)
    with tracker:
        tensor = torch.empty(nbytes, dtype=torch.uint8)
    assert tracker.live[Kind.ACTIVATION] == tracker.activation_peak == counted
    exact = MemoryTracker(round_to=1)
    with exact:
        same = torch.empty(nbytes, dtype=torch.uint8)
    assert exact.live[Kind.ACTIVATION] == nbytes
    del tensor, same


def test_the_device_peak_holds_every_device_kind_and_not_the_host():
    """Parameters, gradients, optimizer state and activations, each storage rounded to 512 bytes, make the device
    peak; host memory its own."""
    torch.manual_seed(0)
    linear = nn.Linear(4, 4, bias=False)  # 64 bytes: one block
    linear.weight.grad = torch.zeros_like(linear.weight)  # one block
    optimizer = torch.optim.Adam(linear.parameters(), foreach=False)
    optimizer.step()  # exp_avg, exp_avg_sq (64 bytes each), step (4 bytes): three blocks
    host = torch.empty(2000, dtype=torch.uint8)  # four blocks of host memory
    tracker = MemoryTracker(round_to=512)
    tracker.track_external([linear], [optimizer], host=(host,))
    assert [tracker.live[k] for k in (Kind.PARAMETER, Kind.GRADIENT, Kind.OPTIMIZER, Kind.HOST)] == [
        512,
        512,
        1536,
        2048,
    ]
    with tracker:
        a = torch.empty(128, dtype=torch.float32)  # 512 bytes: one block
        b = torch.empty(129, dtype=torch.float32)  # 516 bytes: two blocks
        del b
        c = torch.empty(1, dtype=torch.float32)  # one block
    assert tracker.activation_peak == 1536 and tracker.live[Kind.ACTIVATION] == 1024
    assert tracker.device_peak == 512 + 512 + 1536 + 1536 and tracker.host_peak == 2048
    del a, c


def test_a_cuda_target_counts_each_parameter_rounded_to_512_bytes():
    """The fake step's figures on a CUDA target are the real model's storages each rounded up to 512 bytes; on a CPU
    target, exact."""
    config, training = tiny_config("llama"), Training(4, ("q_proj", "v_proj"))
    (mode,) = resolve_modes(["full"], False)
    from lightning_ac.estimate.step import fake_step

    cpu = fake_step(config, torch.float32, training, mode, 16, 1, "sgd", target="cpu")
    cuda = fake_step(config, torch.float32, training, mode, 16, 1, "sgd", target="cuda")
    model = build_model(config, torch.float32, training, "cpu")
    sizes = [p.nbytes for p in model.parameters()]
    grads = [p.nbytes for p in model.parameters() if p.requires_grad]
    assert cpu.parameter_bytes == sum(sizes) and cpu.gradient_bytes == sum(grads)
    assert cuda.parameter_bytes == sum(-(-n // 512) * 512 for n in sizes)
    assert cuda.gradient_bytes == sum(-(-n // 512) * 512 for n in grads)
    assert any(n % 512 for n in sizes) and any(n % 512 == 0 for n in sizes)  # both kinds are checked
    # activations: no exact figure to hand, but every storage is whole blocks, and some are not on the CPU
    assert cuda.activation_peak_bytes % 512 == 0 and cuda.activation_peak_bytes > cpu.activation_peak_bytes


# -- the longest length: staircases, every candidate scanned -------------------------------------------------------


def _scan(total, device: int, step: int, upper: int) -> int:
    """The longest multiple of ``step`` up to ``upper`` whose total and margin fit ``device``, by trying every one."""
    return max((s for s in range(step, upper + 1, step) if _needed(total(s)) <= device), default=0)


def _staircase(base: int, rise: int, width: int):
    """A total that rises by ``rise`` every ``width`` tokens and is flat between (what the allocator's rounding makes
    of a line): ``base + rise * ceil(seq / width)``."""
    return lambda seq: base + rise * -(-seq // width)


STAIRCASES = [
    # (base, rise, width, step, device: the needed bytes at a length, plus an offset, known lengths)
    (10 * GiB, 300 * MiB, 3 * 512 + 100, 512, (20 * 512, 0), [8192, 32768]),  # the boundary on a plateau, exactly
    (10 * GiB, 300 * MiB, 3 * 512 + 100, 512, (20 * 512, -1), [8192, 32768]),  # one byte short of it
    (2 * GiB, 64 * MiB, 4096, 512, (50 * 512, 0), [1024, 65536]),  # wide plateaus: the line cuts them
    (2 * GiB, 64 * MiB, 4096, 512, (50 * 512, 1), [512]),
    (30 * GiB, GiB, 5000, 1024, (9 * 1024, 0), [2048, 3072]),  # two known points on one plateau: a flat line
    (GiB, 512, 512, 512, (100 * 512, 0), []),  # a rise of one block each step: nothing known
    (2 * GiB, 64 * MiB, 1000, 512, (14 * 512, 0), [8192, 32768]),  # settled only by the length between two tried
]


@pytest.mark.parametrize("base, rise, width, step, at, known", STAIRCASES)
def test_the_longest_fit_on_a_staircase_is_what_a_full_scan_finds(base, rise, width, step, at, known):
    """Needed memory against the length is a staircase (the allocator rounds), flat where a line through two points
    says it rises: the search must try the lengths, not trust the line. Judged by a scan of every candidate."""
    total = _staircase(base, rise, width)
    length, offset = at
    device, upper = _needed(total(length)) + offset, 2**16
    runs = []

    def run(seq: int) -> StepEstimate:
        runs.append(seq)
        return _line(seq, total(seq))

    found = longest_fit("m", [run(s) for s in known], run, device, step=step, upper=upper)
    expected = _scan(total, device, step, upper)
    assert expected > 0 and found.seq == expected and not found.limited
    assert _needed(total(found.seq)) <= device < _needed(total(found.seq + step))  # the test's arithmetic again


def test_the_longest_fit_agrees_with_a_full_scan_on_many_staircases():
    """Random non-decreasing staircases (widths that are not multiples of the step, rises, known lengths), with the
    device at a plateau's exact need, a byte either side, or anywhere: the search's answer is the scan's each time."""
    rng = random.Random(2024)
    for case in range(300):
        step = rng.choice([1, 2, 512])
        width = rng.randint(1, 7) * rng.choice([1, step]) + rng.randint(0, 3)
        total = _staircase(rng.randint(0, 40) * GiB, rng.randint(1, 50) * MiB, width)
        upper = step * rng.randint(4, 300)
        device = _needed(total(rng.randint(1, upper))) + rng.choice([0, 0, -1, 1, rng.randint(0, MiB)])
        known = [_line(s, total(s)) for s in (rng.randint(1, upper) for _ in range(rng.randint(0, 3)))]
        found = longest_fit("m", known, lambda s, total=total: _line(s, total(s)), device, step=step, upper=upper)
        expected = _scan(total, device, step, upper)
        assert (found.seq, found.limited) == (expected, expected == upper), (case, step, width, upper, device)


def test_a_known_length_off_the_step_is_not_taken_for_the_longest_fit():
    """A length asked for that is not a multiple of the step (1000 tokens, step 512) and fits does not become the
    answer: the longest multiple of 512 that fits is, by the scan."""
    total = _staircase(GiB, 100 * MiB, 250)
    device = _needed(total(1000))  # 1000 fits exactly; 1024 needs one rise more
    found = longest_fit("m", [_line(1000, total(1000))], lambda s: _line(s, total(s)), device, step=512, upper=2**14)
    assert found.seq == _scan(total, device, 512, 2**14) == 512


# -- the table's units, and the 4-bit weights ----------------------------------------------------------------------


def _estimate_of(total: int) -> Estimate:
    return Estimate("m", "d", "bfloat16", "lora", "adamw", "cuda", steps=[_line(32, total)])


def test_the_table_is_in_gib_from_exactly_one_gib_and_in_mib_below():
    table = markdown(_estimate_of(GiB))
    assert "figures for cuda (GiB)" in table and "| 1.00 |" in table
    table = markdown(_estimate_of(GiB - 1))
    assert "figures for cuda (MiB)" in table and "| 1024.00 |" in table  # 1023.999999 MiB, to two decimals
    assert [gib(3 * 2**29), gib(GiB - 1), gib(5 * MiB, MiB), gib(0)] == ["1.50", "1.00", "5.00", "0.00"]


@pytest.mark.parametrize(
    "in_features, out_features, packed, absmax",
    [
        (64, 2, 64, 2),  # 128 weights: exactly two 64-weight blocks, 64 bytes
        (65, 1, 33, 2),  # 65 weights: a block and one weight over; two weights a byte, the odd one alone
        (3, 5, 8, 1),  # 15 weights: one partial block
        (64, 64, 2048, 64),
    ],
)
def test_a_four_bit_weight_packs_two_a_byte_with_one_absmax_a_block(in_features, out_features, packed, absmax):
    """The QLoRA weights' storage as bitsandbytes makes it: ceil(n / 2) bytes and ceil(n / 64) float32 absmax."""
    from bitsandbytes.nn import Linear4bit

    from lightning_ac.estimate.qlora import pack_four_bit

    model = nn.Sequential(Linear4bit(in_features, out_features, bias=False, quant_type="nf4"))
    pack_four_bit(model, torch.bfloat16)
    layer = model[0]
    assert tuple(layer.weight.shape) == (packed, 1) and layer.weight.dtype == torch.uint8
    assert tuple(layer._estimate_absmax.shape) == (absmax,) and tuple(layer._estimate_code.shape) == (16,)


# -- the mode table --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layers, resident", [(1, 1), (3, 1), (4, 1), (7, 1), (8, 2), (11, 2), (12, 3), (32, 8), (80, 20)]
)
def test_a_quarter_of_the_layers_stays_resident_rounded_down_at_least_one(layers, resident):
    assert Mode("m", True, "L/4").resident_layers(layers) == resident
    assert Mode("m", True, "2").resident_layers(layers) == 2 and Mode("m", True).resident_layers(layers) == 0


def test_chunked_loss_is_one_more_setting_of_a_mode_and_keeps_its_block():
    off, off_chunked, full, full_chunked = resolve_modes(["off", "full", "chunked_loss"], False)
    assert [m.name for m in (off, off_chunked, full, full_chunked)] == [
        "off",
        "off+chunked_loss",
        "full",
        "full+chunked_loss",
    ]
    assert off.block is False and off_chunked.block == {"enabled": False, "chunked_loss": True}
    assert full.block is True and full_chunked.block == {"chunked_loss": True}
    (selective,) = resolve_modes(["selective_attn+chunked_loss"], False)
    (plain,) = resolve_modes(["selective_attn"], False)
    assert selective.block == {**plain.block, "chunked_loss": True}
    lora, full_finetune = default_modes(False), default_modes(True)
    streamed = [m.name for m in resolve_modes(lora, False) if m.layer_offload is not None]
    assert streamed and full_finetune == [m for m in lora if m not in streamed]
