"""Behaviour mutants of budget (the choice, the controller and its re-plans): see :mod:`tests.mutation`."""

from __future__ import annotations

from typing import List

from mutation import Equivalent, Mutant

CHOICE = "lightning_ac/budget/choice.py"
CONTROLLER = "lightning_ac/budget/controller.py"
REPLAN = "lightning_ac/budget/replan.py"
TOOLS = "lightning_ac/budget/tools.py"
SWITCH = "lightning_ac/budget/switch.py"
W = "tests/test_budget_tools_weighing.py::"
A = "tests/test_budget_offload_auto.py::"
T = "tests/test_budget.py::"
OC = "tests/test_budget_offload_choice.py::"
C = "tests/test_budget_controller.py::"

MUTANTS: List[Mutant] = [
    # -- choice.py: the exact per-layer choice
    Mutant(
        CHOICE,
        "working = self.input_bytes + self.saved_bytes - min(self.input_saved_bytes, self.input_bytes)",
        "working = self.input_bytes + self.saved_bytes",
        "a recomputed layer that saves its input counts it twice: more recompute than needed, or nothing fits",
        (T + "test_a_recomputed_layer_that_saves_its_input_holds_it_once",),
    ),
    Mutant(
        CHOICE,
        "kept = [kept[int(i * step)] for i in range(MAX_STATES - 1)] + [kept[-1]]",
        "kept = [kept[int(i * step)] for i in range(MAX_STATES)]",
        "thinning the ways of unlike layers drops the fastest: more recompute than the optimum",
        (T + "test_thinning_the_ways_keeps_the_least_held_and_the_fastest",),
    ),
    Mutant(
        CHOICE,
        "for held, host, seconds, chosen in ways if held + head_bytes <= budget_bytes",
        "for held, host, seconds, chosen in ways if held <= budget_bytes",
        "the output head's backward is left out of the choice: over the budget at the head",
        (T + "test_the_output_head_runs_its_backward_with_every_layers_bytes_held",),
    ),
    Mutant(
        CHOICE,
        "if held + working <= budget_bytes",
        "if held + working < budget_bytes",
        "a layer whose backward peaks exactly at the budget is taken for over it: more recompute",
        (T + "test_a_recomputed_layer_that_saves_its_input_holds_it_once",),
    ),
    Mutant(
        CHOICE,
        "(held + layer_held, host + layer_host, seconds + layer_seconds, chosen + (choice,))",
        "(held + working, host + layer_host, seconds + layer_seconds, chosen + (choice,))",
        "each layer is taken to hold its whole working set until backward: far more recompute than needed",
        (T + "test_the_output_head_runs_its_backward_with_every_layers_bytes_held",),
    ),
    Mutant(
        CHOICE,
        "peak = max(peak, held + working)",
        "peak = max(peak, working)",
        "the estimated peak forgets what earlier layers hold: keeping everything is said to fit when it does not",
        (T + "test_the_peak_is_taken_where_it_happens_not_as_a_sum",),
    ),
    Mutant(
        CHOICE,
        "and self.selective_seconds < self.recompute_seconds",
        "and self.selective_seconds <= self.recompute_seconds",
        "the save rules are chosen where they measured no faster than a whole recompute",
        (T + "test_selective_is_offered_only_where_it_measured_faster_than_recompute",),
    ),
    Mutant(
        CHOICE,
        "if held + working <= budget_bytes and host + layer_host <= room",
        "if held + working <= budget_bytes",
        "the offloaded inputs are not held against the host's room: more inputs offloaded than the host can hold",
        (OC + "test_the_choice_with_offloading_is_the_brute_force_optimum_under_a_host_limit",),
    ),
    Mutant(
        CHOICE,
        "_, _, _, choices = min(finishing, key=lambda entry: entry[:3])",
        "_, _, _, choices = min(finishing, key=lambda entry: (entry[0], entry[2]))",
        "at equal time, more inputs in host memory than needed (the least device bytes taken first)",
        (OC + "test_fully_hidden_copies_offload_only_the_inputs_the_budget_needs",),
    ),
    Mutant(
        CHOICE,
        "if at and times[at - 1] <= seconds:",
        "if times and min(times) <= seconds:",
        "a way that holds more on the device but less on the host is dropped: a fitting offload plan is missed",
        (OC + "test_the_choice_with_offloading_is_the_brute_force_optimum_under_a_host_limit",),
    ),
    # -- controller.py: the closed loop
    Mutant(
        CONTROLLER,
        "self._calibrations[self._shape] = peak",
        "self._calibrations[None] = peak",
        "one calibration for every shape of work: an unpadded step lowers it and padded batches go over",
        (C + "test_the_calibration_is_kept_per_shape_of_work_and_the_plan_fits_the_largest",),
    ),
    Mutant(
        CONTROLLER,
        "self.calibration = max(self._calibrations.values())",
        "self.calibration = self._calibrations[self._shape]",
        "the calibration of the last step's shape of work, not the largest: padded batches go over",
        (C + "test_the_calibration_is_kept_per_shape_of_work_and_the_plan_fits_the_largest",),
    ),
    Mutant(
        CONTROLLER,
        "best = min(under, key=lambda c: self._estimate(c, 0)[1]) if under else tuple(everything)",
        "best = max(under, key=lambda c: self._estimate(c, 0)[1]) if under else tuple(everything)",
        "the fallback settles on the slowest choice measured under the budget",
        (C + "test_spent_corrections_fall_back_to_the_fastest_choice_measured_under_the_budget",),
    ),
    Mutant(
        CONTROLLER,
        "best = min(under, key=lambda c: self._estimate(c, 0)[1]) if under else tuple(everything)",
        "best = under[-1] if under else tuple(everything)",
        "the fallback settles on the last choice measured under the budget, not the fastest",
        (C + "test_spent_corrections_fall_back_to_the_fastest_choice_measured_under_the_budget",),
    ),
    Mutant(
        CONTROLLER,
        "self.measured_peak = self._measured.get(best)",
        "pass",
        "the fallback's settled plan reports the last step's peak, not its own",
        (C + "test_spent_corrections_fall_back_to_the_fastest_choice_measured_under_the_budget",),
    ),
    Mutant(
        CONTROLLER,
        "if over and not first:\n            self._over.add(tuple(choices))",
        "if over:\n            self._over.add(tuple(choices))",
        "a first real step over the budget bans its choice for the run: a layer more recomputed for good",
        (C + "test_a_first_real_step_over_the_budget_is_not_held_against_its_choice",),
    ),
    Mutant(
        CONTROLLER,
        "if over and choices == everything and not first:",
        "if over and choices == everything:",
        "a measuring step over the budget settles on recomputing every layer for the run",
        (C + "test_a_measuring_step_over_the_budget_with_every_layer_recomputed_does_not_settle_there",),
    ),
    Mutant(
        CONTROLLER,
        "+ (int(SLACK * budget) if over else 0)",
        "+ 0",
        "a correction aims right at the budget: the next step's noise crosses it again",
        (C + "test_a_correction_aims_a_slack_below_the_budget",),
    ),
    Mutant(
        CONTROLLER,
        "over = peak > budget",
        "over = peak >= budget",
        "a step whose peak is exactly the budget is corrected: more recompute",
        (C + "test_a_peak_exactly_at_the_budget_fits",),
    ),
    # -- tools.py: weighing the tools the budget decides
    Mutant(
        TOOLS,
        "faster = seconds_with < (1 - MIN_GAIN) * without.recompute_seconds",
        "faster = True",
        "a tool weighed stays on whatever it costs",
        (W + "test_a_tool_that_costs_more_than_it_saves_is_turned_off_again",),
    ),
    Mutant(
        TOOLS,
        "if plan.fits and not any(c is not Choice.keep for c in plan.choices):",
        "if False:",
        "a budget that keeps every layer still weighs the tools: a step with each on, not the plain run",
        (W + "test_a_budget_that_keeps_every_layer_weighs_nothing_and_trains_as_a_plain_run",),
    ),
    # -- switch.py: the offload choice
    Mutant(
        SWITCH,
        "if self.choice is Choice.offload:",
        "if False:",
        "a layer chosen to offload its input keeps it on the device: over the budget only offloading meets",
        (A + "test_a_budget_only_offloading_meets_settles_under_it_with_inputs_in_host_memory",),
    ),
    # -- replan.py: a new shape of work
    Mutant(
        REPLAN,
        "self._measured.clear()  # the peaks measured with other inputs do not say that a choice fits these\n"
        "        self.corrections = 0",
        "self._measured.clear()  # the peaks measured with other inputs do not say that a choice fits these",
        "a new shape of work after spent corrections settles at once on every layer recomputed",
        (C + "test_a_new_shape_of_work_gets_corrections_of_its_own",),
    ),
]

EQUIVALENT: List[Equivalent] = []
