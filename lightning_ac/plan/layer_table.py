"""The per-layer table of an applied plan: one row per decoder layer, each part described by the engine that does
it (the selective policy, the budget, the weight streamer, the activation-offload runtime)."""

from __future__ import annotations

from typing import List, Optional

from lightning_ac.budget import BudgetController, Choice
from lightning_ac.layers import DecoderLayers
from lightning_ac.offload.activations import ActivationOffloadRuntime
from lightning_ac.offload.weights import LayerWeightStreamer
from lightning_ac.report import LayerRow
from lightning_ac.selective.policy import SelectivePolicy
from lightning_ac.tiled_mlp.install import TiledMLP

__all__ = ["layer_rows"]


def layer_rows(
    layers: DecoderLayers,
    recomputed: List[bool],
    selective: Optional[SelectivePolicy],
    budget: Optional[BudgetController],
    weight_streamer: Optional[LayerWeightStreamer],
    activation_offload: Optional[ActivationOffloadRuntime],
    tiled_mlp: Optional[TiledMLP] = None,
) -> List[LayerRow]:
    """One row per decoder layer: recomputed or not, what it saves (its MLP's input only, where the MLP is tiled),
    what is offloaded where."""
    rows = []
    for index, (name, _) in enumerate(layers.layers):
        is_recomputed = bool(recomputed[index]) if index < len(recomputed) else False
        layer_type = layers.layer_types[index] if index < len(layers.layer_types) else None
        # under a budget, the save rules apply to the layers it makes selective, not to every recomputed one
        ruled = is_recomputed if budget is None else budget.choices[index] is Choice.selective
        saves = selective.describe_layer(index, ruled) if selective is not None else None
        if budget is not None:
            saves = "; ".join(filter(None, [budget.describe_layer(index), saves]))
        if tiled_mlp is not None:
            saves = "; ".join(filter(None, [saves, tiled_mlp.describe_layer()]))
        offloaded: List[str] = []
        if weight_streamer is not None:
            offloaded += filter(None, [weight_streamer.describe_layer(index)])
        if activation_offload is not None:
            offloaded += activation_offload.describe_layer(is_recomputed, selective is not None and ruled)
        rows.append(LayerRow(index, name, layer_type or "—", is_recomputed, saves or "—", ", ".join(offloaded) or "—"))
    return rows
