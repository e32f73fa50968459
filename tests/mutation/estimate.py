"""Behaviour mutants of estimate: see :mod:`tests.mutation`."""

from __future__ import annotations

from typing import List

from mutation import Equivalent, Mutant

EXACT = "tests/test_estimate_exact.py"
FIT = "lightning_ac/estimate/fit.py"
BUDGET = "lightning_ac/estimate/budget.py"
TRACKER = "lightning_ac/estimate/tracker.py"
MODES = "lightning_ac/estimate/modes.py"
RANKS = "lightning_ac/estimate/ranks.py"
RANK_UNITS = ("tests/test_estimate_ranks.py",)
RANK_STEP = ("tests/test_distributed.py::test_the_estimate_per_rank_is_what_a_real_rank_holds_under_fsdp2_and_ddp",)
STAIRCASES = (
    f"{EXACT}::test_the_longest_fit_on_a_staircase_is_what_a_full_scan_finds",
    f"{EXACT}::test_the_longest_fit_agrees_with_a_full_scan_on_many_staircases",
)

MUTANTS: List[Mutant] = [
    # -- rounding at exact multiples ----------------------------------------------------------------------------
    Mutant(
        TRACKER,
        "return -(-n // r) * r if r > 1 else n",
        "return (n // r + 1) * r if r > 1 else n",
        "the allocator's rounding adds a 512-byte block to storages that are an exact multiple of it",
        (f"{EXACT}::test_each_storage_is_rounded_up_to_the_cuda_block",),
    ),
    Mutant(
        "lightning_ac/estimate/qlora.py",
        "blocks = math.ceil(n / BLOCKSIZE)",
        "blocks = n // BLOCKSIZE + 1",
        "a 4-bit weight of an exact number of 64-weight blocks counts one absmax too many",
        (
            f"{EXACT}::test_a_four_bit_weight_packs_two_a_byte_with_one_absmax_a_block",
            "tests/test_estimate.py::test_qlora_and_the_loss_reach_the_table_from_the_cli",
        ),
    ),
    Mutant(
        "lightning_ac/estimate/budget.py",
        'return f"{self.budget_bytes // 2**20}MiB" if self.budget_bytes >= 2**20 else "none"',
        'return f"{self.budget_bytes // 2**20}MiB" if self.budget_bytes > 2**20 else "none"',
        "a plan leaving exactly 1 MiB says the weights do not fit (setting none)",
        (f"{EXACT}::test_the_budget_setting_is_whole_mib_rounded_down",),
    ),
    Mutant(
        "lightning_ac/estimate/render.py",
        'unit, unit_name = (2**30, "GiB") if largest >= 2**30 else (2**20, "MiB")',
        'unit, unit_name = (2**30, "GiB") if largest > 2**30 else (2**20, "MiB")',
        "a table whose largest figure is exactly 1 GiB is printed in MiB",
        (f"{EXACT}::test_the_table_is_in_gib_from_exactly_one_gib_and_in_mib_below",),
    ),
    Mutant(
        MODES,
        'return max(1, layers // 4) if value == "L/4" else int(value)',
        'return max(1, -(-layers // 4)) if value == "L/4" else int(value)',
        "layer offloading's resident quarter of the layers is rounded up (more layers kept on the device)",
        (f"{EXACT}::test_a_quarter_of_the_layers_stays_resident_rounded_down_at_least_one",),
    ),
    # -- the margin and what a device leaves --------------------------------------------------------------------
    Mutant(
        FIT,
        "return CONTEXT_BYTES + int(FRAGMENTATION * device_total)",
        "return max(CONTEXT_BYTES, int(FRAGMENTATION * device_total))",
        "the margin is the larger of the context and the fragmentation, not their sum",
        (f"{EXACT}::test_the_margin_is_a_gib_and_five_percent_of_the_total_rounded_down",),
    ),
    Mutant(
        FIT,
        "return step.device_total_bytes + margin_bytes(step.device_total_bytes) <= device_memory",
        "return step.device_total_bytes + margin_bytes(step.device_total_bytes) < device_memory",
        "a step that needs exactly the device's memory is said not to fit",
        (
            f"{EXACT}::test_a_step_fits_a_device_of_exactly_its_total_and_margin_and_not_one_byte_less",
            *STAIRCASES,
        ),
    ),
    Mutant(
        BUDGET,
        "total = int((device_memory - CONTEXT_BYTES) / (1 + FRAGMENTATION))\n"
        "    while total + 1 + margin_bytes(total + 1) <= device_memory:\n"
        "        total += 1\n"
        "    while total + margin_bytes(total) > device_memory:\n"
        "        total -= 1\n",
        "total = int(device_memory / (1 + FRAGMENTATION) - CONTEXT_BYTES)\n",
        "what a device leaves takes the fragmentation share of the context too (the budget's plan gets less)",
        (f"{EXACT}::test_what_a_device_leaves_is_the_most_that_fits_it",),
    ),
    Mutant(
        BUDGET,
        "    while total + 1 + margin_bytes(total + 1) <= device_memory:\n        total += 1\n",
        "",
        "what a device leaves is the division's, a byte short of what fits (the margin's 5% is rounded down)",
        (
            f"{EXACT}::test_what_a_device_leaves_is_the_most_that_fits_it",
            f"{EXACT}::test_what_a_device_leaves_inverts_the_margin_at_any_size",
        ),
    ),
    Mutant(
        BUDGET,
        "plan_for(name, seq, batch, figures, usable_bytes(d) - figures.fixed_bytes, d)",
        "plan_for(name, seq, batch, figures, d - figures.fixed_bytes, d)",
        "the budget's plan is made for the device's whole size, without the margin",
        (f"{EXACT}::test_the_budgets_plan_is_made_for_what_the_device_leaves_after_the_margin_and_the_fixed_bytes",),
    ),
    Mutant(
        BUDGET,
        "fixed = step.parameter_bytes + step.buffer_bytes + step.gradient_bytes + step.optimizer_bytes",
        "fixed = step.parameter_bytes + step.buffer_bytes + step.gradient_bytes",
        "the budget's plan forgets the optimizer's state (a budget too large by it)",
        (f"{EXACT}::test_the_fixed_bytes_are_weights_gradients_optimizer_state_and_the_batch",),
    ),
    Mutant(
        TRACKER,
        "device += live[Kind.OPTIMIZER] + live[Kind.WEIGHTS]",
        "device += live[Kind.WEIGHTS]",
        "the device total leaves out the optimizer's state",
        (f"{EXACT}::test_the_device_peak_holds_every_device_kind_and_not_the_host",),
    ),
    # -- the longest length on staircase curves -----------------------------------------------------------------
    Mutant(
        FIT,
        "while hi is None or hi - lo > step:",
        "while hi is None or hi - lo > 2 * step:",
        "the longest-length search stops with two steps between fit and no fit (the longest fit can be a step short)",
        STAIRCASES,
    ),
    Mutant(
        FIT,
        "elif not lo < guess < hi:  # the line puts the boundary within a step of one end: try that end's neighbour\n"
        "            settling, guess = True, lo + step if guess <= lo else hi - step",
        "elif not lo < guess < hi:  # trusts the line: the boundary is at the end it points to\n            break",
        "the longest-length search trusts the line between two lengths (a staircase's plateau past it is missed)",
        STAIRCASES,
    ),
    Mutant(
        FIT,
        "multiples = sorted(s for s in seen if s % step == 0)",
        "multiples = sorted(seen)",
        "a length asked for that is not a multiple of the search's step is reported as the longest fit",
        (f"{EXACT}::test_a_known_length_off_the_step_is_not_taken_for_the_longest_fit",),
    ),
    # -- one rank of N ----------------------------------------------------------------------------------------
    Mutant(
        RANKS,
        "            tracker.label(fsdp_param.sharded_param.grad, Kind.GRADIENT)",
        "            pass",
        "FSDP2's sharded gradients count as activations (the reduce-scatter's output is never taken for a gradient)",
        RANK_UNITS,
    ),
    Mutant(
        RANKS,
        "        if tracker.active:\n            tracker.resized(storage)",
        "        pass",
        "a gathered layer FSDP2 frees (resizing its storage to 0) stays counted: every layer gathered at once",
        RANK_UNITS,
    ),
    Mutant(
        RANKS,
        'tagged_method(tracker, FSDPParamGroup, "unshard", Kind.WEIGHTS)',
        'tagged_method(tracker, FSDPParamGroup, "unshard", Kind.ACTIVATION)',
        "the all-gather's buffers count as activations, not gathered weights",
        RANK_UNITS,
    ),
    Mutant(
        RANKS,
        'tagged_method(tracker, FSDPParamGroup, "wait_for_unshard", Kind.WEIGHTS)',
        'tagged_method(tracker, FSDPParamGroup, "wait_for_unshard", Kind.ACTIVATION)',
        "the gathered parameters FSDP2 copies out of the all-gather count as activations, not gathered weights",
        RANK_UNITS,
    ),
    Mutant(
        RANKS,
        "with tracker, tracker.tagging(Kind.GRADIENT):",
        "with tracker:",
        "DDP's gradient buckets count as activations made before the step (the grads column misses them)",
        (*RANK_UNITS, "tests/test_estimate.py::test_a_rank_of_more_ranks_holds_less_and_the_table_says_per_rank"),
    ),
    Mutant(
        TRACKER,
        "        yield local(output).untyped_storage()",
        "        yield output.untyped_storage()",
        "a DTensor op's output is counted at its global size (FSDP2's optimizer step counts whole parameters)",
        RANK_STEP,
    ),
    Mutant(
        RANKS,
        'if strategy != "single" and devices < 2:',
        'if strategy != "single" and devices < 1:',
        "--strategy fsdp on one device runs a world of one instead of asking for --devices",
        ("tests/test_estimate.py::test_bad_arguments_are_refused_before_anything_runs",),
    ),
    # -- the mode table ---------------------------------------------------------------------------------------
    Mutant(
        MODES,
        'return {"enabled": False, **on}',
        "return on",
        "off+chunked_loss checkpoints every layer (the chunked loss turns checkpointing on)",
        (f"{EXACT}::test_chunked_loss_is_one_more_setting_of_a_mode_and_keeps_its_block",),
    ),
]

EQUIVALENT: List[Equivalent] = []
