"""docs/configuration.md: "Every rejected value raises `lightning_ac.ConfigError` (a `ValueError`) naming the field,
the value and the fix". docs/budget.md: "with a size of your own, `chunked_loss: {chunk_tokens: 512, budget_decides:
true}` ... Without `budget`, `auto` is a `ConfigError` naming the fix."

Write the mapping form without a budget. The error quotes a value the user never wrote ("chunked_loss: auto"), never
names the field that is wrong (`budget_decides`), and its fix ("write chunked_loss: true") would silently drop the
user's chunk_tokens: 512. (In this block "auto" is also the value of chunk_tokens, with another meaning.)
"""

import pytest

from lightning_ac import ConfigError, parse_config


@pytest.mark.parametrize(
    "field,block",
    [
        ("chunked_loss", {"chunked_loss": {"chunk_tokens": 512, "budget_decides": True}}),
        ("tiled_mlp", {"tiled_mlp": {"tile_tokens": 4096, "budget_decides": True}}),
    ],
)
def test_mapping_form_without_budget_names_budget_decides(field, block):
    with pytest.raises(ConfigError) as info:
        parse_config(block)
    msg = str(info.value)
    assert f"{field}.budget_decides" in msg, msg
    assert f"{field}: auto" not in msg, msg
