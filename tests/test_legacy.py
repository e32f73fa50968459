"""The spec's migration table, row by row."""

from __future__ import annotations

import warnings

import pytest
from omegaconf import OmegaConf

from lightning_ac import ConfigError, LegacyConfigWarning, migrate_legacy, parse_config


@pytest.mark.parametrize(
    "legacy, block",
    [
        ({"gradient_checkpointing": True}, True),
        ({"gradient_checkpointing": False}, False),
        ({"gradient_checkpointing": "offload"}, {"offload": {"all": "cpu"}}),
        (
            {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
            {"reentrant": True},
        ),
        (
            {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}},
            {"reentrant": False},
        ),
        (
            {
                "gradient_checkpointing": True,
                "gradient_checkpointing_kwargs": {"preserve_rng_state": False, "every_n_layers": 2},
            },
            {"kwargs": {"preserve_rng_state": False, "every_n_layers": 2}},
        ),
        (
            {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"offload": True}},
            {"offload": {"hidden_states": "cpu"}},
        ),
        ({"gradient_checkpointing": True, "selective_checkpointing": True}, {"selective": True}),
        (
            {"gradient_checkpointing": True, "selective_checkpointing": {"save": ["attention", "aten::mm"]}},
            {"selective": {"save": ["attention", "aten::mm"]}},
        ),
        (
            {"gradient_checkpointing": True, "selective_checkpointing": {"save": ["attention"], "offload": True}},
            {"selective": {"save": ["attention"]}, "offload": {"selective": "cpu"}},
        ),
        ({"gradient_checkpointing": True, "activation_offloading": True}, {"offload": {"all": "cpu"}}),
        ({"gradient_checkpointing": True, "activation_offloading": "legacy"}, {"offload": {"all": "cpu"}}),
        ({"activation_offloading": True}, {"enabled": False, "offload": {"all": "cpu"}}),
        ({"activation_offloading": "legacy"}, {"enabled": False, "offload": {"all": "cpu"}}),
        (
            {"gradient_checkpointing": False, "activation_offloading": True},
            {"enabled": False, "offload": {"all": "cpu"}},
        ),
        (
            {"gradient_checkpointing": True, "activation_offloading": "hidden_states"},
            {"offload": {"hidden_states": "cpu"}},
        ),
        ({"fsdp_config": {"activation_checkpointing": True}}, {"implementation": "fsdp"}),
        ({"fsdp_config": {"activation_checkpointing": False}}, False),
        (
            # The spec's worked example.
            {
                "gradient_checkpointing": True,
                "gradient_checkpointing_kwargs": {"use_reentrant": False},
                "activation_offloading": "hidden_states",
            },
            {"reentrant": False, "offload": {"hidden_states": "cpu"}},
        ),
    ],
)
def test_migration_rows(legacy, block):
    original = {"learning_rate": 1e-4, **legacy}
    snapshot = {k: (dict(v) if isinstance(v, dict) else v) for k, v in original.items()}
    with pytest.warns(LegacyConfigWarning) as record:
        migrated = migrate_legacy(original)
    assert original == snapshot, "the input mapping must not be modified"
    assert migrated["activation_checkpointing"] == block
    assert migrated["learning_rate"] == 1e-4
    for key in (
        "gradient_checkpointing",
        "gradient_checkpointing_kwargs",
        "selective_checkpointing",
        "activation_offloading",
    ):
        assert key not in migrated
    assert "activation_checkpointing" not in migrated.get("fsdp_config", {})
    parse_config(migrated["activation_checkpointing"])
    assert len(record) == 1, "warns once"
    message = str(record[0].message)
    assert "deprecated" in message and "activation_checkpointing:" in message


def test_warning_prints_the_replacement_block_as_yaml():
    with pytest.warns(LegacyConfigWarning) as record:
        migrate_legacy(
            {
                "gradient_checkpointing": True,
                "gradient_checkpointing_kwargs": {"use_reentrant": False},
                "activation_offloading": "hidden_states",
            }
        )
    yaml_part = str(record[0].message).split("Replace them with:\n\n", 1)[1].split("\n\n")[0]
    assert OmegaConf.to_container(OmegaConf.create(yaml_part)) == {
        "activation_checkpointing": {"reentrant": False, "offload": {"hidden_states": "cpu"}}
    }


def test_legacy_warning_is_a_future_warning():
    assert issubclass(LegacyConfigWarning, FutureWarning)


def test_no_legacy_keys_returns_equal_copy_without_warning():
    cfg = {"activation_checkpointing": {"selective": True}, "lr": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = migrate_legacy(cfg)
    assert out == cfg and out is not cfg


def test_other_fsdp_config_keys_are_kept():
    with pytest.warns(LegacyConfigWarning):
        out = migrate_legacy({"fsdp_config": {"activation_checkpointing": True, "reshard_after_forward": True}})
    assert out["fsdp_config"] == {"reshard_after_forward": True}


def test_accepts_dictconfig():
    with pytest.warns(LegacyConfigWarning):
        out = migrate_legacy(OmegaConf.create({"gradient_checkpointing": True}))
    assert out == {"activation_checkpointing": True}


def test_torch_unknown_kwargs_dropped_with_warning_naming_them():
    with pytest.warns(LegacyConfigWarning) as record:
        out = migrate_legacy(
            {
                "gradient_checkpointing": True,
                "gradient_checkpointing_kwargs": {"use_reentrant": True, "bogus": 1, "use_cache": False},
            }
        )
    assert out["activation_checkpointing"] == {"reentrant": True}
    message = str(record[0].message)
    assert "bogus" in message and "use_cache" in message and "dropped" in message


def test_kwargs_without_gradient_checkpointing_are_dropped_with_note():
    with pytest.warns(LegacyConfigWarning, match="no effect"):
        out = migrate_legacy({"gradient_checkpointing_kwargs": {"use_reentrant": False}})
    assert out["activation_checkpointing"] is False


@pytest.mark.parametrize(
    "legacy, fragments",
    [
        ({"gradient_checkpointing": "offload_disk"}, ["offload_disk", "pending a fix", "all: cpu"]),
        ({"activation_offloading": "disk"}, ["activation_offloading: disk", "pending a fix"]),
        ({"gradient_checkpointing": True, "activation_offloading": "disk"}, ["disk"]),
        ({"selective_checkpointing": True}, ["selective_checkpointing", "gradient_checkpointing: true"]),
        (
            {"gradient_checkpointing": False, "selective_checkpointing": {"save": ["attention"]}},
            ["selective_checkpointing"],
        ),
        (
            {"activation_offloading": "hidden_states"},
            ["activation_offloading: hidden_states", "gradient_checkpointing"],
        ),
        (
            {"gradient_checkpointing": True, "fsdp_config": {"activation_checkpointing": True}},
            ["cannot both be true", "implementation: fsdp"],
        ),
        ({"gradient_checkpointing": True, "activation_checkpointing": True}, ["next to activation_checkpointing"]),
        ({"activation_offloading": True, "activation_checkpointing": {"enabled": False}}, ["activation_offloading"]),
        ({"gradient_checkpointing": "sometimes"}, ["gradient_checkpointing", "'sometimes'"]),
        ({"activation_offloading": "gpu"}, ["activation_offloading", "'gpu'"]),
        (
            # offload.all (activation_offloading) together with offload.hidden_states (kwargs.offload)
            {
                "gradient_checkpointing": True,
                "activation_offloading": True,
                "gradient_checkpointing_kwargs": {"offload": True},
            },
            ["hidden_states: cpu cannot be combined with all: cpu"],
        ),
        (
            {
                "gradient_checkpointing": True,
                "selective_checkpointing": True,
                "gradient_checkpointing_kwargs": {"use_reentrant": True},
            },
            ["requires non-reentrant"],
        ),
    ],
)
def test_rejected_combinations(legacy, fragments):
    with pytest.raises(ConfigError) as info:
        migrate_legacy(legacy)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    "legacy, block",
    [
        ({"gradient_checkpointing": True, "selective_checkpointing": {"offload": "none"}}, {"selective": True}),
        ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"offload": False}}, True),
        ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"offload": "cpu"}},
         {"offload": {"hidden_states": "cpu"}}),
    ],
)  # fmt: skip
def test_legacy_offload_flags_are_parsed_not_truthy(legacy, block):
    with pytest.warns(LegacyConfigWarning):
        assert migrate_legacy(legacy)["activation_checkpointing"] == block


def test_legacy_integers_are_not_booleans():
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        migrate_legacy({"gradient_checkpointing": 1})


@pytest.mark.parametrize(
    "legacy, starts",
    [
        (
            {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": "maybe"}},
            "gradient_checkpointing_kwargs.use_reentrant: expected true, false or null, got 'maybe'",
        ),
        (
            {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"every_n_layers": 0}},
            "gradient_checkpointing_kwargs.every_n_layers: expected an integer >= 1",
        ),
        ({"gradient_checkpointing": True, "selective_checkpointing": {"bogus": 1}}, "selective_checkpointing: unknown"),
    ],
)
def test_errors_in_migrated_values_name_the_legacy_key(legacy, starts):
    with pytest.raises(ConfigError) as info:
        migrate_legacy(legacy)
    message = str(info.value)
    assert message.startswith(starts), message
    assert "in the activation_checkpointing block: activation_checkpointing." in message


@pytest.mark.parametrize("config", ["a string", 3, ["gradient_checkpointing"]])
def test_a_config_that_is_not_a_mapping_is_a_config_error(config):
    with pytest.raises(ConfigError, match=r"migrate_legacy\(config\): expected the training config as a mapping"):
        migrate_legacy(config)
