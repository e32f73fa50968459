"""A tool is weighed on whatever batch comes next: a shorter batch makes it look faster, and it is kept on.

docs/budget.md ("Tools on where the budget needs them, or where they make the step faster"): "The two measured steps
give two plans, each the fastest under the budget by its own figures; the tool's own time is what it changes outside
the recomputes ..., measured in both steps. It stays on where only its plan fits, or where its plan is predicted
faster by more than 10% of the recompute without it ...; else it is turned off again".

What happens: Llama (hidden 64, 4 layers, vocabulary 8000), batches of 1 x 1024 tokens, budget 25 MiB, chunked_loss
and tiled_mlp auto. With every batch 1024 tokens long, the tiled MLP is weighed and turned off again ("not predicted
faster (recompute 358.5 ms, against 0.0 ms and its own 503.5 ms with it)"). When the batch of the step that weighs
it happens to be 128 tokens long (varying sequence lengths), its times are compared unscaled with the 1024-token
step's, and it is kept on: "keeping tiled_mlp on: its plan steps 2467.1 ms faster (recompute 0.0 ms and its own
-2101.3 ms, against 365.8 ms of recompute without it)" -- a tool that adds work is credited with 2 s saved, and it
stays on for the 1024-token batches that follow. (The next 1024-token batch is also announced as "more than the 128
measured", though 1024-token steps were measured before.)
"""

import re

from budget_tools_cases import TinyLM, batches, cpu_trainer, suite_lines, tiny_llama

from lightning_ac import ActivationCheckpointing


def test_tool_weighed_on_a_shorter_batch_is_not_credited_with_the_difference():
    lengths = [1024, 1024, 128, 1024, 1024, 1024]  # 1 measures, 2 again (warm), 3 weighs the chunked loss, 4 the MLP
    ac = ActivationCheckpointing(budget="25MiB", chunked_loss="auto", tiled_mlp="auto")
    with suite_lines() as lines:
        cpu_trainer([ac], len(lengths)).fit(TinyLM(tiny_llama()), batches(lengths, 8000))
    # whatever was weighed on which step, no tool is credited with the difference between a short and a long step
    owns = [float(m) for line in lines for m in re.findall(r"its own (-?[\d.]+) ms", line)]
    assert all(own > -500.0 for own in owns), [line for line in lines if "budget:" in line]
    assert any("weighing" in line for line in lines), lines
