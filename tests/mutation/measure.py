"""Behaviour mutants of the measurement (budget/measure.py, memory.py): see :mod:`tests.mutation`."""

from __future__ import annotations

from typing import List

from mutation import Equivalent, Mutant

MEASURE = "lightning_ac/budget/measure.py"
MEMORY = "lightning_ac/memory.py"
M = "tests/test_measure_exact.py::"

MUTANTS: List[Mutant] = [
    Mutant(
        MEASURE,
        "reading.input_bytes += sum(inputs.values())",
        "reading.input_bytes = sum(inputs.values())",
        "a layer called twice before backward holds one input, not two: the budget plans too little",
        (M + "test_a_layer_called_twice_before_backward_holds_both_forwards_saves",),
    ),
    Mutant(
        MEASURE,
        "            reading.saved_bytes += size\n",
        "            reading.saved_bytes = max(reading.saved_bytes, size)\n",
        "a layer's saves are its largest tensor's, not their sum",
        (M + "test_a_layer_called_twice_before_backward_holds_both_forwards_saves",),
    ),
    Mutant(
        MEASURE,
        "            if key in inputs:\n",
        "            if True:\n",
        "every saved tensor is taken for the layer's input: a recompute's working set is counted too small",
        (M + "test_a_layer_called_twice_before_backward_holds_both_forwards_saves",),
    ),
    Mutant(
        MEASURE,
        "input_saved_bytes=self.input_saved_bytes if input_held else 0,",
        "input_saved_bytes=self.input_saved_bytes,",
        "with offload.hidden_states the input that moved off the device is still subtracted from the working set",
        (M + "test_a_layer_called_twice_before_backward_holds_both_forwards_saves",),
    ),
    Mutant(
        MEASURE,
        " or _storage_key(tensor) in parameters:",
        ":",
        "a detached alias of a weight that a layer saves is counted as an activation: more recompute than needed",
        (M + "test_a_weight_saved_as_a_detached_alias_is_not_an_activation",),
    ),
    Mutant(
        MEASURE,
        "        if known is not None and known() is storage:\n            return None\n",
        "",
        "a storage saved twice (x * x, the rotary tables in every layer) is counted twice",
        (M + "test_a_storage_saved_twice_counts_once",),
    ),
    Mutant(
        MEASURE,
        "seen.setdefault(id(tensor.untyped_storage()), _nbytes(tensor))",
        "seen.setdefault(id(tensor), _nbytes(tensor))",
        "two views of one input are held twice in the bytes before the first layer",
        (M + "test_held_bytes_count_each_storage_of_the_call_once",),
    ),
    Mutant(
        MEASURE,
        'return ("tensor", str(value.dtype), value.dim(), value.device.type)',
        'return ("tensor", value.dim(), value.device.type)',
        "a batch in another precision is not a new shape of work: the plan measured in float32 runs bf16 batches",
        (M + "test_the_shape_of_work_tells_a_mask_and_a_precision_apart_but_not_a_length",),
    ),
    Mutant(
        MEMORY,
        "self._earlier = max(self._earlier, self.peak_so_far())",
        "self._earlier = self._earlier",
        "the measuring step's peak forgets what came before a restart: the step is said to fit when it did not",
        (M + "test_a_restart_reads_what_follows_and_the_result_keeps_the_whole_peak",),
    ),
    Mutant(
        MEMORY,
        "self._tracker.activation_peak = self._tracker.activation_now()",
        "self._tracker.activation_peak = self._tracker.activation_peak",
        "a restart keeps the peak before it: the output head's backward is measured as the forward's peak",
        (M + "test_a_restart_reads_what_follows_and_the_result_keeps_the_whole_peak",),
    ),
    Mutant(
        MEMORY,
        "            self._held += nbytes",
        "            self._held = nbytes",
        "bytes held from before the measurement are the last ones added, not their sum",
        (M + "test_a_restart_reads_what_follows_and_the_result_keeps_the_whole_peak",),
    ),
    Mutant(
        MEMORY,
        "activation = max(_activation_peak(tracker) + self._held, self._earlier)",
        "activation = max(_activation_peak(tracker), self._earlier)",
        "a measurement started inside the forward leaves out what was held before it: the peak reads too low",
        (M + "test_bytes_held_from_before_the_measurement_add_to_its_peak",),
    ),
]

EQUIVALENT: List[Equivalent] = []
