"""The logits note blames the budget's need when the chunked loss was only on for weighing.

docs/budget.md ("Tools on where the budget needs them, or where they make the step faster"): "After the measuring
step, where the plan recomputes anything (or nothing fits), the budget weighs the first tool not weighed yet (the
chunked loss, then the tiled MLP): it turns it on and measures the next step with it ... It stays on where only its
plan fits, or where its plan is predicted faster ...; else it is turned off again".  The session's fix: "a chunked
loss turned on by the budget and a training_step that reads `out.logits` gets an error note saying the budget turned
it on".

What happens: with a budget that every-layer-recomputed fits comfortably (so the chunked loss is turned on only to be
weighed), a training_step that reads ``out.logits`` fails in the weighing step with a note that says "the memory
budget turned it on: even every layer recomputed was over the budget" and "without the chunked loss this step's
logits do not fit it" -- both false: the measuring step with every layer recomputed and no chunked loss was measured
under the budget. The advice ("set chunked_loss: false and a larger budget") sends the user after a larger budget
they do not need.
"""

import pytest
from budget_tools_cases import TinyLM, batches, cpu_trainer, tiny_llama

from lightning_ac import ActivationCheckpointing


class ReadsLogits(TinyLM):
    def training_step(self, b, i):
        out = self.model(input_ids=b, labels=b)
        acc = (out.logits[:, :-1].argmax(-1) == b[:, 1:]).float().mean()
        self.log("acc", acc)
        return out.loss


def test_logits_note_does_not_claim_every_layer_recomputed_was_over():
    # every layer recomputed, no chunked loss: its measured peak
    probe = ActivationCheckpointing(budget="1KiB")
    with pytest.warns(Warning):
        cpu_trainer([probe], 2).fit(TinyLM(tiny_llama()), batches([512] * 2, 8000))
    full_peak = probe.budget_plan["measured_peak_bytes"]
    budget = int(full_peak * 1.05)  # every layer recomputed fits; keeping every layer does not

    ac = ActivationCheckpointing(budget=budget, chunked_loss="auto")
    with pytest.raises(TypeError) as info:
        cpu_trainer([ac], 4).fit(ReadsLogits(tiny_llama()), batches([512] * 4, 8000))
    note = " ".join(getattr(info.value, "__notes__", []))
    assert "budget turned it on" in note  # the fix is there
    assert "every layer recomputed was over the budget" not in note, note
    assert "do not fit it" not in note, note
