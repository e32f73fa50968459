"""ActivationOffload(hidden_states="auto") with no ActivationCheckpointing: the ConfigError names a value not given.

Brief/docstring: ActivationOffload's ``hidden_states``: "``"auto"`` (beside ``ActivationCheckpointing(budget=...)``)";
the suite's ConfigErrors are documented as "the message names the argument and the fix" (ActivationCheckpointing's
docstring, Raises), and docs/budget.md: "Without `budget`, `hidden_states: auto` is a `ConfigError`".

What happens: the error reads "ActivationOffload(hidden_states='cpu') acts on checkpointed decoder layers, but the
Trainer has no ActivationCheckpointing. Add ActivationCheckpointing() to the callbacks, ..." -- it quotes 'cpu', which
the user did not pass, and its fix (a plain ActivationCheckpointing()) only leads to the next ConfigError (auto needs a
budget).
"""

import lightning
import pytest
import torch
import transformers

from lightning_ac import ActivationOffload
from lightning_ac.config import ConfigError


def test_error_quotes_auto_and_asks_for_a_budget():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).train()

    class LM(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, b, i):
            return self.model(input_ids=b, labels=b).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    trainer = lightning.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ActivationOffload(hidden_states="auto")],
    )
    data = torch.utils.data.DataLoader([torch.randint(0, 300, (1, 16))], batch_size=None)
    with pytest.raises(ConfigError) as info:
        trainer.fit(LM(), data)
    msg = str(info.value)
    assert "hidden_states='cpu'" not in msg, msg
    assert "auto" in msg and "budget" in msg, msg
