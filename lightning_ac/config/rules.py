"""The rules across fields: which offload targets, recompute settings and budget combine, for the block and for the
callbacks' merged requests alike."""

from __future__ import annotations

from lightning_ac.config.schema import ActivationCheckpointingConfig, ConfigError, OffloadConfig, Placement

__all__ = ["check_combination", "check_offload_targets"]


def check_offload_targets(offload: OffloadConfig, where: str) -> None:
    """The rule between offload targets, for the block and for ``ActivationOffload`` alike."""
    if offload.hidden_states != Placement.none and offload.all != Placement.none:
        if offload.hidden_states == Placement.auto:  # the budget would move inputs that all: cpu moves already
            raise ConfigError(
                f"{where}: hidden_states: auto cannot be combined with all: cpu, which already offloads each layer's "
                "input: the budget would have no input left to decide on. Drop all: cpu for the budget to decide "
                "where inputs go, or set hidden_states: none to offload everything."
            )
        raise ConfigError(
            f"{where}: hidden_states: cpu cannot be combined with all: cpu, which already offloads each layer's "
            "input. Keep one of them."
        )


def check_combination(cfg: ActivationCheckpointingConfig) -> None:
    """The rules that tie fields together; shared by YAML and Python (:func:`merge_requests`)."""
    off = Placement.none
    if not cfg.enabled:
        ignored = []
        if cfg.selective is not None:
            ignored.append("selective")
        if cfg.offload.hidden_states != off:
            ignored.append("offload.hidden_states")
        if cfg.offload.selective != off:
            ignored.append("offload.selective")
        if cfg.reentrant is not None:
            ignored.append("reentrant")
        if cfg.kwargs:
            ignored.append("kwargs")
        if cfg.implementation == "fsdp":
            ignored.append("implementation: fsdp")
        if cfg.budget is not None:
            ignored.append("budget")
        if ignored:
            raise ConfigError(
                "activation_checkpointing: enabled is false, so nothing is recomputed and only offload.all, "
                f"chunked_loss and tiled_mlp apply, but {', '.join(ignored)} "
                f"{'is' if len(ignored) == 1 else 'are'} set. "
                "Set enabled: true to recompute decoder layers, or remove "
                f"{', '.join(i.split(':')[0] for i in ignored)}."
            )
    check_offload_targets(cfg.offload, "activation_checkpointing.offload")
    if cfg.budget is None and cfg.budget_first_plan != "measure":
        raise ConfigError(
            f"activation_checkpointing.budget_first_plan: {cfg.budget_first_plan} says where the memory budget's "
            "first plan comes from, but budget is not set. Set budget (e.g. budget: 20GiB), or remove "
            "budget_first_plan."
        )
    for field_name in ("chunked_loss", "tiled_mlp"):
        if getattr(getattr(cfg, field_name), "budget_decides", False) and cfg.budget is None:
            raise ConfigError(
                f"activation_checkpointing.{field_name}.budget_decides: true (also what {field_name}=auto sets) "
                "turns it on where the memory budget needs it, but budget is not set (or enabled is false, which "
                f"sets none). Set budget (e.g. budget: 20GiB, or auto on an accelerator), or budget_decides: false "
                f"({field_name}: true) to have it on in every step, with the sizes you gave."
            )
    if cfg.offload.hidden_states == Placement.auto and cfg.budget is None:
        raise ConfigError(
            "activation_checkpointing.offload.hidden_states: auto moves a decoder layer's input to host memory where "
            "the memory budget needs it, but budget is not set. Set budget (e.g. budget: 20GiB, or auto on an "
            "accelerator), or hidden_states: cpu to move every recomputed layer's input."
        )
    if cfg.budget is not None and "every_n_layers" in cfg.kwargs:
        raise ConfigError(
            f"activation_checkpointing.budget: {cfg.budget!r} chooses which decoder layers are recomputed, and so "
            f"does kwargs.every_n_layers: {cfg.kwargs['every_n_layers']}. Keep one of them: remove "
            "kwargs.every_n_layers to let the budget choose, or remove budget."
        )
    if cfg.offload.selective != off and cfg.selective is None:
        raise ConfigError(
            "activation_checkpointing.offload.selective: cpu needs selective checkpointing, which decides what "
            "is saved. Add selective: true (save attention), or remove offload.selective."
        )
    if cfg.selective is not None and cfg.reentrant:
        raise ConfigError(
            "activation_checkpointing.selective: selective checkpointing requires non-reentrant checkpointing, "
            "but reentrant is true. Set reentrant: false (or leave it out), or remove selective."
        )
    if cfg.kwargs.get("debug") and (cfg.selective is not None or cfg.reentrant):
        what = "selective checkpointing (a custom context_fn)" if cfg.selective is not None else "reentrant: true"
        raise ConfigError(
            f"activation_checkpointing.kwargs.debug: torch's checkpoint debug mode does not work with {what}; torch "
            "would raise at the first training step. Remove kwargs.debug, or remove "
            f"{'selective' if cfg.selective is not None else 'reentrant: true'}."
        )
    if cfg.implementation == "fsdp" and cfg.reentrant:
        raise ConfigError(
            "activation_checkpointing.reentrant: implementation: fsdp runs torch's non-reentrant checkpoint around "
            "each layer, but reentrant is true. Set reentrant: false, or use implementation: hf."
        )
