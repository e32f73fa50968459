"""Every accepted form of the block and every rejection, table-driven."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from lightning_ac import (
    ActivationCheckpointingConfig,
    ConfigError,
    OffloadConfig,
    Placement,
    SelectiveConfig,
    callbacks_from_config,
    parse_config,
)
from lightning_ac.config import config_to_dict

DEFAULT_SELECTIVE = SelectiveConfig(save=["attention"])


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, ActivationCheckpointingConfig(enabled=False)),
        (False, ActivationCheckpointingConfig(enabled=False)),
        (True, ActivationCheckpointingConfig(enabled=True)),
        ({}, ActivationCheckpointingConfig(enabled=True)),
        ({"enabled": False}, ActivationCheckpointingConfig(enabled=False)),
        ({"reentrant": True}, ActivationCheckpointingConfig(reentrant=True)),
        ({"reentrant": False}, ActivationCheckpointingConfig(reentrant=False)),
        ({"implementation": "fsdp"}, ActivationCheckpointingConfig(implementation="fsdp")),
        ({"kwargs": {"every_n_layers": 2}}, ActivationCheckpointingConfig(kwargs={"every_n_layers": 2})),
        (
            {"kwargs": {"preserve_rng_state": False, "determinism_check": "none", "debug": True, "early_stop": False}},
            ActivationCheckpointingConfig(
                kwargs={"preserve_rng_state": False, "determinism_check": "none", "debug": True, "early_stop": False}
            ),
        ),
        ({"selective": True}, ActivationCheckpointingConfig(selective=DEFAULT_SELECTIVE)),
        ({"selective": False}, ActivationCheckpointingConfig(selective=None)),
        ({"selective": {}}, ActivationCheckpointingConfig(selective=DEFAULT_SELECTIVE)),
        ({"selective": {"save": []}}, ActivationCheckpointingConfig(selective=SelectiveConfig(save=[]))),
        (
            {
                "selective": {
                    "save": ["attention", "aten::mm"],
                    "save_modules": ["o_proj"],
                    "save_matmul_min_k": 8192,
                    "save_sliding_window": True,
                    "recompute_layer_types": ["chunked_attention"],
                }
            },
            ActivationCheckpointingConfig(
                selective=SelectiveConfig(["attention", "aten::mm"], ["o_proj"], 8192, True, ["chunked_attention"])
            ),
        ),
        ({"offload": {"all": "cpu"}}, ActivationCheckpointingConfig(offload=OffloadConfig(all=Placement.cpu))),
        ({"offload": {"all": True}}, ActivationCheckpointingConfig(offload=OffloadConfig(all=Placement.cpu))),
        ({"offload": {"all": False}}, ActivationCheckpointingConfig()),
        ({"offload": {"hidden_states": "none"}}, ActivationCheckpointingConfig()),
        (
            {"offload": {"hidden_states": "CPU"}},
            ActivationCheckpointingConfig(offload=OffloadConfig(hidden_states="cpu")),
        ),
        ({"offload": {}}, ActivationCheckpointingConfig()),
        # true/false as text, any case (a command line or quoted YAML): the boolean they spell
        ({"enabled": "False"}, ActivationCheckpointingConfig(enabled=False)),
        ({"reentrant": "TRUE"}, ActivationCheckpointingConfig(reentrant=True)),
        ({"offload": {"all": "true"}}, ActivationCheckpointingConfig(offload=OffloadConfig(all=Placement.cpu))),
        ({"offload": {"all": "False"}}, ActivationCheckpointingConfig()),
        (
            {"kwargs": {"preserve_rng_state": "false", "debug": "True"}},
            ActivationCheckpointingConfig(kwargs={"preserve_rng_state": False, "debug": True}),
        ),
        (
            {"selective": {"save_sliding_window": "true"}},
            ActivationCheckpointingConfig(selective=SelectiveConfig(save_sliding_window=True)),
        ),
        (
            {"enabled": False, "offload": {"all": "cpu"}},
            ActivationCheckpointingConfig(enabled=False, offload=OffloadConfig(all="cpu")),
        ),
        (
            {"selective": {"save": ["attention"]}, "offload": {"hidden_states": "cpu", "selective": "cpu"}},
            ActivationCheckpointingConfig(selective=DEFAULT_SELECTIVE, offload=OffloadConfig("cpu", "cpu", "none")),
        ),
        (
            {"selective": True, "offload": {"all": "cpu", "selective": True}},
            ActivationCheckpointingConfig(selective=DEFAULT_SELECTIVE, offload=OffloadConfig("none", "cpu", "cpu")),
        ),
    ],
)
def test_accepted_forms(value, expected):
    cfg = parse_config(value)
    assert cfg == expected
    # Parsing is idempotent: the normalised config (and its plain-data form) parse to themselves.
    assert parse_config(cfg) == cfg
    assert parse_config(config_to_dict(cfg)) == cfg


def test_offload_targets_compare_equal_to_strings():
    cfg = parse_config({"offload": {"hidden_states": True}})
    assert cfg.offload.hidden_states == "cpu" and cfg.offload.all == "none" and cfg.offload.selective == "none"
    assert str(cfg.offload.hidden_states) == "cpu"


def test_resolved_properties():
    assert parse_config(True).use_reentrant is False
    assert parse_config({"reentrant": True}).use_reentrant is True
    cfg = parse_config({"kwargs": {"every_n_layers": 3, "preserve_rng_state": False}})
    assert cfg.every_n_layers == 3
    assert cfg.checkpoint_kwargs == {"use_reentrant": False, "preserve_rng_state": False}


def test_accepts_dictconfig_and_structured_schema():
    structured = OmegaConf.structured(ActivationCheckpointingConfig)
    structured.selective = {"save": ["attention"]}
    structured.offload.hidden_states = True
    cfg = parse_config(structured)
    assert cfg.selective == DEFAULT_SELECTIVE and cfg.offload.hidden_states == "cpu"
    assert parse_config(OmegaConf.create({"enabled": False, "offload": {"all": "cpu"}})).offload.all == "cpu"


def test_structured_schema_rejects_unknown_fields():
    structured = OmegaConf.structured(ActivationCheckpointingConfig)
    with pytest.raises(Exception, match="typo"):
        OmegaConf.merge(structured, {"typo": 1})


@pytest.mark.parametrize(
    "value, fragments",
    [
        ("yes", ["activation_checkpointing", "'yes'", "true"]),
        (1, ["activation_checkpointing", "1"]),
        ({"typo": 1}, ["unknown field", "'typo'", "Valid fields"]),
        ({"enabled": "on"}, ["activation_checkpointing.enabled", "'on'", "It is text"]),
        ({"implementation": "deepspeed"}, ["implementation", "'deepspeed'", "hf", "fsdp"]),
        ({"reentrant": "no"}, ["activation_checkpointing.reentrant", "'no'"]),
        ({"kwargs": {"context_fn": None}}, ["kwargs.context_fn", "sets context_fn itself", "Remove"]),
        ({"kwargs": {"respect_saved_tensors_hooks": True}}, ["respect_saved_tensors_hooks", "itself"]),
        ({"kwargs": {"offload": True}}, ["kwargs.offload", "offload.hidden_states: cpu"]),
        ({"kwargs": {"use_reentrant": False}}, ["kwargs.use_reentrant", "reentrant: false"]),
        ({"kwargs": {"use_cache": False}}, ["kwargs.use_cache", "does not accept", "Accepted keys"]),
        ({"kwargs": {"every_n_layers": 0}}, ["every_n_layers", "0", ">= 1"]),
        ({"kwargs": {"every_n_layers": True}}, ["every_n_layers", "True"]),
        ({"kwargs": {"preserve_rng_state": "yes"}}, ["preserve_rng_state", "bool"]),
        ({"kwargs": {"determinism_check": "strict"}}, ["determinism_check", "'strict'"]),
        ({"kwargs": [1]}, ["kwargs", "mapping"]),
        ({"selective": "attention"}, ["selective", "'attention'", "save: [attention]"]),
        ({"selective": {"save": "attention"}}, ["selective.save", "[attention]"]),
        ({"selective": {"saves": ["attention"]}}, ["selective", "'saves'"]),
        ({"selective": {"save_matmul_min_k": 0}}, ["save_matmul_min_k", "0", ">= 1"]),
        ({"selective": {"save_matmul_min_k": 1.5}}, ["save_matmul_min_k", "1.5"]),
        ({"selective": {"save_sliding_window": "yes"}}, ["save_sliding_window", "'yes'"]),
        ({"selective": {"recompute_layer_types": [""]}}, ["recompute_layer_types"]),
        ({"offload": "cpu"}, ["offload is a mapping", "'cpu'", "{all: cpu}"]),
        ({"offload": True}, ["offload is a mapping", "True"]),
        ({"offload": {"everything": "cpu"}}, ["offload", "'everything'", "hidden_states, selective, all"]),
        ({"offload": {"all": "gpu"}}, ["offload.all: expected none, cpu, true or false, got 'gpu'", "all: cpu or"]),
        ({"offload": {"all": "disk"}}, ["offload.all", "disk", "pending a fix", "all: cpu"]),
        ({"offload": {"hidden_states": "disk"}}, ["offload.hidden_states", "pending a fix"]),
        ({"enabled": False, "selective": True}, ["enabled is false", "selective", "enabled: true"]),
        ({"enabled": False, "offload": {"hidden_states": "cpu"}}, ["enabled is false", "offload.hidden_states"]),
        ({"enabled": False, "selective": True, "offload": {"selective": "cpu"}}, ["offload.selective"]),
        ({"enabled": False, "reentrant": False}, ["enabled is false", "reentrant"]),
        ({"enabled": False, "kwargs": {"every_n_layers": 2}}, ["enabled is false", "kwargs"]),
        ({"enabled": False, "implementation": "fsdp"}, ["enabled is false", "implementation: fsdp"]),
        ({"offload": {"hidden_states": "cpu", "all": "cpu"}}, ["hidden_states: cpu", "all: cpu", "Keep one"]),
        ({"offload": {"selective": "cpu"}}, ["offload.selective", "needs selective", "selective: true"]),
        ({"selective": True, "reentrant": True}, ["requires non-reentrant", "reentrant: false"]),
        ({"implementation": "fsdp", "reentrant": True}, ["implementation: fsdp", "non-reentrant", "reentrant: false"]),
    ],
)
def test_rejections_name_field_value_and_fix(value, fragments):
    with pytest.raises(ConfigError) as info:
        parse_config(value)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_enabled_false_with_empty_kwargs_is_fine():
    assert parse_config({"enabled": False, "kwargs": {}}) == ActivationCheckpointingConfig(enabled=False)


@pytest.mark.parametrize(
    "value",
    [
        {"kwargs": {"debug": True}, "selective": True},
        {"kwargs": {"debug": True}, "reentrant": True},
    ],
)
def test_debug_is_rejected_where_torch_would_raise(value):
    with pytest.raises(ConfigError, match="kwargs.debug"):
        parse_config(value)
    parse_config({"kwargs": {"debug": True}})  # fine with non-reentrant and no selective


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"verify_steps": -1}, "callbacks_from_config(verify_steps=...)"),
        ({"verify_steps": "2"}, "callbacks_from_config(verify_steps=...)"),
        ({"copy_on_host": "yes"}, "callbacks_from_config(copy_on_host=...)"),
        ({"layer_offloading_resident_layers": -3}, "layer_offloading_resident_layers"),
        ({"layer_offloading_resident_layers": "two"}, "layer_offloading_resident_layers"),
    ],
)
def test_callbacks_from_config_checks_every_option_whatever_the_block(kwargs, field):
    # the block builds no ActivationOffload or LayerOffload, which would have checked these
    for block in (False, True, {"selective": True}):
        with pytest.raises(ConfigError, match=re.escape(field)):
            callbacks_from_config(block, **kwargs)


def test_yaml_text_is_refused_with_how_to_load_it():
    with pytest.raises(ConfigError, match=r"got the text 'enabled: true.*load it first \(OmegaConf.create\(text\)"):
        callbacks_from_config("enabled: true\nselective: true")
    block = OmegaConf.create("enabled: true\nselective: true")
    assert parse_config(block).selective is not None


@pytest.mark.parametrize(
    "block, arguments, says",
    [
        (True, {"layer_offloading_resident_layers": 2}, "layer_offloading_resident_layers: 2 keeps"),
        (True, {"verify_steps": 2}, r"callbacks_from_config\(verify_steps=2\) \(Hydra: offload_verify_steps\)"),
        ({"enabled": False, "chunked_loss": True}, {"verify_steps": 1}, "the block offloads nothing"),
    ],
)
def test_a_setting_that_would_do_nothing_is_an_error(block, arguments, says):
    with pytest.raises(ConfigError, match=says):
        callbacks_from_config(block, **arguments)


@pytest.mark.parametrize(
    "block, arguments",
    [
        (True, {"layer_offloading": True, "layer_offloading_resident_layers": 2}),
        ({"offload": {"all": "cpu"}}, {"verify_steps": 2}),
        (True, {"layer_offloading": True, "verify_steps": 2}),
    ],
)
def test_the_same_settings_where_they_act_are_taken(block, arguments):
    assert callbacks_from_config(block, **arguments)
