"""What users see during training: the per-layer table and the logged metrics."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
from conftest import clone, fit, tiny_model

from lightning_ac import ActivationCheckpointing, ActivationOffload
from lightning_ac.report import LayerRow, render_layer_table


def test_verbose_prints_one_table_per_run(caplog):
    base = tiny_model("qwen3")
    with caplog.at_level(logging.INFO, logger="lightning_ac"):
        fit(
            clone(base),
            [
                ActivationCheckpointing(selective={"save": ["attention"], "save_modules": ["o_proj"]}, verbose=True),
                ActivationOffload(hidden_states="cpu", copy_on_host=True, verbose=True),
            ],
        )
    tables = [r.getMessage() for r in caplog.records if "decoder layers" in r.getMessage() and "┃" in r.getMessage()]
    assert len(tables) == 1
    table = tables[0]
    # the type column and the SAC column both name the two sliding layers
    assert table.count("attention recomputed (sliding_attention)") == 2
    assert "o_proj (1 module)" in table and "input → cpu" in table


def test_not_verbose_prints_no_table(caplog):
    with caplog.at_level(logging.INFO, logger="lightning_ac"):
        fit(tiny_model("llama"), [ActivationCheckpointing()])
    assert not any("┃" in r.getMessage() for r in caplog.records)


def test_plain_text_table_without_rich():
    rows = [LayerRow(0, "model.layers.0", "full_attention", True, "attention", "input → cpu"),
            LayerRow(1, "model.layers.1", "—", False, "—", "—")]  # fmt: skip
    text = render_layer_table(rows, use_rich=False)
    lines = text.splitlines()
    assert lines[0].split() == ["#", "layer", "type", "recomputed", "SAC", "saves", "offloaded"]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split()[:4] == ["0", "model.layers.0", "full_attention", "yes"]
    assert lines[3].split()[:4] == ["1", "model.layers.1", "—", "no"]


def test_table_shows_layer_offloading():
    from lightning_ac import LayerOffload

    callback = LayerOffload(copy_on_host=True)
    seen = {}

    class Grab(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            seen["rows"] = callback.plan.layer_rows()

    fit(tiny_model("llama", lora=True), [ActivationCheckpointing(), callback, Grab()])
    rows = seen["rows"]
    assert len(rows) == 4 and all(r.recomputed for r in rows)
    assert all(r.offloaded == "frozen params (0.1 MiB) ↔ cpu" for r in rows), rows[0].offloaded
