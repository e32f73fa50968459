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

import logging
import re
import warnings

import lightning
import torch
import transformers

from lightning_ac import ActivationCheckpointing


class LM(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=8000,
        )
        self.model = transformers.AutoModelForCausalLM.from_config(cfg).train()

    def training_step(self, b, i):
        return self.model(input_ids=b, labels=b).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_tool_weighed_on_a_shorter_batch_is_not_credited_with_the_difference():
    lines = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    log = logging.getLogger("lightning_ac")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    g = torch.Generator().manual_seed(1)
    lengths = [
        1024,
        1024,
        128,
        1024,
        1024,
        1024,
    ]  # 1 measures, 2 again (warm), 3 weighs the chunked loss, 4 the tiled MLP
    data = torch.utils.data.DataLoader([torch.randint(0, 8000, (1, s), generator=g) for s in lengths], batch_size=None)
    ac = ActivationCheckpointing(budget="25MiB", chunked_loss="auto", tiled_mlp="auto")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lightning.Trainer(
                accelerator="cpu",
                max_steps=len(lengths),
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[ac],
            ).fit(LM(), data)
    finally:
        log.removeHandler(handler)
    # whatever was weighed on which step, no tool is credited with the difference between a short and a long step
    owns = [float(m) for line in lines for m in re.findall(r"its own (-?[\d.]+) ms", line)]
    assert all(own > -500.0 for own in owns), [line for line in lines if "budget:" in line]
    assert any("weighing" in line for line in lines), lines
