"""The per-layer table of an applied plan: one row per decoder layer, each part described by the engine that does
it (the selective policy, the budget, the weight streamer, the activation-offload runtime); and the checkpointed
layers of models with nothing to train, which the applied line does not count as recomputed."""

from __future__ import annotations

from typing import Dict, List, Optional

from torch import nn

from lightning_ac.budget import BudgetController, Choice
from lightning_ac.layers import DecoderLayers
from lightning_ac.offload.activations import ActivationOffloadRuntime
from lightning_ac.offload.weights import LayerWeightStreamer
from lightning_ac.report import LayerRow
from lightning_ac.selective.policy import SelectivePolicy
from lightning_ac.tiled_mlp.install import TiledMLP

__all__ = ["describe_untrained", "layer_rows", "untrained_layers"]


def untrained_layers(root: nn.Module, layers: DecoderLayers, recomputed: List[bool]) -> Dict[str, int]:
    """The checkpointed decoder layers that no step records a graph in, by their model's name: a step recomputes a
    layer only where its forward records one (a parameter of it, or of what runs before it, requires grad). Of each
    transformers model, the layers before the first that trains, unless something before the layers trains: a
    parameter outside the layers and the output head, in the model or in a module that wraps it below ``root``
    (trained embeddings, a vision tower, PEFT's prompt tuning: gradients flow through every layer to them). So a
    frozen teacher or reference model has all its layers here, a head-only fine-tune all, LoRA on the last layers
    the ones before them."""
    names = {id(m): name for name, m in root.named_modules()}
    found: Dict[str, int] = {}
    for owner, model in enumerate(layers.hf_models):
        parts = names.get(id(model), "").split(".") if names.get(id(model)) else []
        scopes = [root.get_submodule(".".join(parts[: depth + 1])) for depth in range(len(parts))] or [model]
        own = [i for i, o in enumerate(layers.owners) if o == owner]
        in_layers = {id(p) for i in own for p in layers.modules[i].parameters()}
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        after = {id(p) for p in head.parameters()} if head is not None else set()
        after -= {id(p) for p in embeddings.parameters()} if embeddings is not None else set()  # tied: it feeds
        trains = [p for scope in scopes for p in scope.parameters() if p.requires_grad]
        if any(id(p) not in in_layers and id(p) not in after for p in trains):
            continue  # something before the layers trains: every layer records a graph
        training = [k for k, i in enumerate(own) if any(p.requires_grad for p in layers.modules[i].parameters())]
        count = sum(recomputed[i] for i in own[: training[0] if training else len(own)])
        if count:
            found[".".join(parts) or type(model).__name__] = count
    return found


def describe_untrained(untrained: Dict[str, int], noun: str) -> str:
    """The applied line's note on the layers :func:`untrained_layers` found, ``""`` when none."""
    if not untrained:
        return ""
    models = ", ".join(repr(name) for name in untrained)
    return (
        f"; {sum(untrained.values())} {noun} of {models} not counted: nothing to train in them or before them, "
        "so a step records no graph there to recompute (a frozen model's, or those before the first layer that "
        "trains)"
    )


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
