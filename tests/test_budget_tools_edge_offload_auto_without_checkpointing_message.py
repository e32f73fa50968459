"""ActivationOffload(hidden_states="auto") with no ActivationCheckpointing: the ConfigError names a value not given.

Brief/docstring: ActivationOffload's ``hidden_states``: "``"auto"`` (beside ``ActivationCheckpointing(budget=...)``)";
the suite's ConfigErrors are documented as "the message names the argument and the fix" (ActivationCheckpointing's
docstring, Raises), and docs/budget.md: "Without `budget`, `hidden_states: auto` is a `ConfigError`".

What happens: the error reads "ActivationOffload(hidden_states='cpu') acts on checkpointed decoder layers, but the
Trainer has no ActivationCheckpointing. Add ActivationCheckpointing() to the callbacks, ..." -- it quotes 'cpu', which
the user did not pass, and its fix (a plain ActivationCheckpointing()) only leads to the next ConfigError (auto needs a
budget).
"""

import pytest
from budget_tools_cases import TinyLM, batches, cpu_trainer, tiny_llama

from lightning_ac import ActivationOffload
from lightning_ac.config import ConfigError


def test_error_quotes_auto_and_asks_for_a_budget():
    model = TinyLM(tiny_llama(vocab_size=300, intermediate_size=64, hidden_size=32, layers=2))
    trainer = cpu_trainer([ActivationOffload(hidden_states="auto")], 1)
    data = batches([16], 300)
    with pytest.raises(ConfigError) as info:
        trainer.fit(model, data)
    msg = str(info.value)
    assert "hidden_states='cpu'" not in msg, msg
    assert "auto" in msg and "budget" in msg, msg
