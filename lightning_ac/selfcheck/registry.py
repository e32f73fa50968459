"""Each feature's self-check, registered with the release gate (:mod:`lightning_ac.release_gate`): on which
packages' releases it runs, how the feature is turned off, and the check. ``callbacks`` (the Lightning hooks the
suite callbacks implement) registers from :mod:`lightning_ac.selfcheck.lightning_hooks`, which knows them."""

from __future__ import annotations

from typing import List

from lightning_ac.release_gate import register
from lightning_ac.selfcheck.budget_check import check_budget
from lightning_ac.selfcheck.checks import (
    check_activation_checkpointing,
    check_layer_offloading,
    check_offload_all,
    check_offload_hidden_states,
    check_offload_selective,
    check_selective,
)
from lightning_ac.selfcheck.loss_check import check_chunked_loss

__all__: List[str] = []

register("activation_checkpointing", ("torch", "transformers"), "activation_checkpointing: false",
         check_activation_checkpointing)  # fmt: skip
register(
    "selective",
    ("torch", "transformers"),
    "remove activation_checkpointing.selective",
    check_selective,
    context=frozenset({"offload.hidden_states", "offload.all"}),
)
# transformers too: its layers must call the checkpoint function offload.hidden_states puts in place of torch's
register(
    "offload.hidden_states",
    ("torch", "transformers"),
    "activation_checkpointing.offload.hidden_states: none",
    check_offload_hidden_states,
)
register("offload.selective", ("torch",), "activation_checkpointing.offload.selective: none", check_offload_selective)
register("offload.all", ("torch",), "activation_checkpointing.offload.all: none", check_offload_all)
register("layer_offloading", ("torch",), "layer_offloading: false", check_layer_offloading)
# transformers too: its layers must call the checkpoint function the budget gives each of them
register(
    "budget",
    ("torch", "transformers"),
    "remove activation_checkpointing.budget",
    check_budget,
    "ran the memory budget's measuring step on a two-layer toy model and trained it one step without the budget",
)
# transformers only: its causal LMs' forward and loss are what the chunks stand in for
register(
    "chunked_loss",
    ("transformers",),
    "activation_checkpointing.chunked_loss: false",
    check_chunked_loss,
    "trained a two-layer toy model one step with its loss in one chunk and without it",
)
