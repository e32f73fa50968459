"""Installing a selective policy: from a plan, or on a model whose checkpointing someone else enabled."""

from __future__ import annotations

import functools
import weakref
from typing import Any, Dict, List, Optional, Sequence

from torch import nn

import lightning_ac.release_gate as release_gate
from lightning_ac._logging import rank_zero_info
from lightning_ac.config import ConfigError, SelectiveConfig, parse_config
from lightning_ac.layers import DecoderLayers, compiled_layers, find_decoder_layers
from lightning_ac.selective.policy import SelectivePolicy, StorageFactory

__all__ = ["apply_selective_checkpointing", "attention_types", "build_policy"]

# The policy apply_selective_checkpointing installed on each decoder layer, until its handle's remove(): a plan that
# applies to a module holding that layer keeps it there (transformers' checkpointing, which the plan enables again,
# would otherwise replace it without a word).
_INSTALLED: weakref.WeakKeyDictionary[nn.Module, SelectivePolicy] = weakref.WeakKeyDictionary()


def _module_names(root: nn.Module, layers: DecoderLayers) -> Dict[nn.Module, str]:
    # save_modules names are the base model's: relative to the transformers model, which PEFT wraps from
    # outside; for plain torch layers, relative to the module the layers were searched in.
    names: Dict[nn.Module, str] = {}
    for owner in layers.hf_models or [root]:
        for name, module in owner.named_modules():
            names.setdefault(module, name)
    return names


def attention_types(layers: DecoderLayers) -> List[Optional[str]]:
    """Each layer's attention type, as the save rules read it: the model's ``layer_types``; where its config
    publishes none, a ``sliding_window`` makes every layer ``sliding_attention`` (Mistral, Mixtral, Phi-3,
    Starcoder2: transformers hands that window to every layer's attention, and SDPA keeps it in the mask, where the
    policy cannot see it, so that without this their attention was saved under SDPA and recomputed under flash
    attention)."""
    types = list(layers.layer_types) or [None] * len(layers)
    for index, layer_type in enumerate(types):
        if layer_type is not None or not layers.hf_models or index >= len(layers.owners):
            continue
        config = getattr(layers.hf_models[layers.owners[index]], "config", None)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        window = getattr(config, "sliding_window", None)
        if (
            getattr(config, "layer_types", None) is None
            and isinstance(window, int)
            and window > 0
            and getattr(config, "use_sliding_window", True) is not False
        ):
            types[index] = "sliding_attention"
    return types


def _kept(layers: DecoderLayers, config: SelectiveConfig) -> Dict[int, SelectivePolicy]:
    """The layers whose policy :func:`apply_selective_checkpointing` installed, kept (said in one line)."""
    kept = {index: _INSTALLED[m] for index, m in enumerate(layers.modules) if m in _INSTALLED}
    if kept:
        names = [layers.layers[index][0] for index in kept]
        where = names[0] if len(names) == 1 else f"{names[0]} to {names[-1]}"
        rank_zero_info(
            f"selective: {len(kept)} {layers.noun} ({where}) keep the policy apply_selective_checkpointing installed "
            f"on them; the block's selective rules (save: {config.save}) apply to the other {len(layers) - len(kept)}. "
            "To apply the block's rules there too, call remove() on the handle apply_selective_checkpointing "
            "returned before training."
        )
    return kept


def build_policy(
    config: SelectiveConfig,
    root: nn.Module,
    layers: DecoderLayers,
    checkpointed: Optional[Sequence[bool]] = None,
    storage_factory: Optional[StorageFactory] = None,
    keep_installed: bool = True,
) -> SelectivePolicy:
    """A policy for the decoder layers of ``root``. Under ``torch.compile`` (the layers or a module above them) the
    rules that name ops apply when the graph is traced; ``save_modules`` and ``offload.selective`` raise
    ``ConfigError`` there. With ``keep_installed``, layers that hold a policy :func:`apply_selective_checkpointing`
    installed keep it (said in one INFO line)."""
    modules = [m for _, m in layers.layers]
    compiled = compiled_layers(root, layers).describe()
    if compiled and config.save_modules:
        raise ConfigError(
            f"activation_checkpointing.selective.save_modules: {compiled}, and save_modules tells the modules apart "
            "by hooks around their calls, which a compiled graph runs once, when it is traced, not at each call. "
            "Under torch.compile name the ops instead (selective.save, selective.save_matmul_min_k), or leave the "
            "layers uncompiled."
        )
    if compiled and storage_factory is not None:
        raise ConfigError(
            f"activation_checkpointing.offload.selective: {compiled}, and offload.selective keeps what the policy "
            "saves in a host-resident storage that compiled graphs do not use (the saves stay inside the graph). "
            "Set offload.selective: none, or leave the layers uncompiled."
        )
    count = sum(checkpointed) if checkpointed is not None else len(modules)
    return SelectivePolicy(
        config,
        modules,
        _module_names(root, layers),
        attention_types(layers),
        storage_factory=storage_factory,
        diagnose_after=max(1, count),
        compiled=bool(compiled),
        kept=_kept(layers, config) if keep_installed else None,
    )


class _AppliedPolicy:
    """What :func:`apply_selective_checkpointing` installed; ``remove()`` undoes it."""

    def __init__(self, policy: SelectivePolicy, layers: List[nn.Module], originals: List[Any]) -> None:
        self.policy = policy
        self._layers, self._originals = layers, originals

    def remove(self) -> None:
        for layer, original in zip(self._layers, self._originals):
            layer._gradient_checkpointing_func = original
            if _INSTALLED.get(layer) is self.policy:
                del _INSTALLED[layer]
        self._layers, self._originals = [], []
        self.policy.remove()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)


def apply_selective_checkpointing(
    model: nn.Module, save: Sequence[str] = ("attention",), **rules: Any
) -> _AppliedPolicy:
    """Install a selective policy on a transformers model whose checkpointing is already enabled.

    Use this where checkpointing is turned on by someone else (``model.activation_checkpointing_enable()``
    from transformers, for instance), so that plugin-registered saves and the ``save`` list apply there
    too. ``apply_selective_checkpointing(model, save=[])`` applies only the registered saves.

    Args:
        model: A transformers model (plain or PEFT-wrapped) with non-reentrant checkpointing enabled.
        save: Ops to save, as in ``selective.save``.
        **rules: ``save_modules``, ``save_matmul_min_k``, ``save_sliding_window``, ``recompute_layer_types``.

    Returns:
        A handle exposing the policy's ``report()``/``problems()``; ``remove()`` uninstalls it.

    Raises:
        ConfigError: If a rule is invalid, no checkpointed layer is found, or checkpointing is reentrant.
        IncompatibleReleaseError: If selective checkpointing fails its self-check on a newer torch or transformers
            than the tested ones.
    """
    config = parse_config({"selective": {"save": list(save), **rules}}).selective
    assert config is not None
    layers = find_decoder_layers(model)
    checkpointed = [m for _, m in layers.layers if getattr(m, "gradient_checkpointing", False)]
    if not checkpointed:
        raise ConfigError(
            "apply_selective_checkpointing: found no checkpointed decoder layers. Enable checkpointing first "
            "(model.activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': False}))."
        )
    originals = []
    for layer in checkpointed:
        func = layer._gradient_checkpointing_func
        if getattr(func, "keywords", {}).get("use_reentrant", True) is not False:
            raise ConfigError(
                "apply_selective_checkpointing: selective checkpointing requires non-reentrant checkpointing. "
                "Enable it with activation_checkpointing_kwargs={'use_reentrant': False}."
            )
        originals.append(layer.__dict__.get("_gradient_checkpointing_func"))
    release_gate.ensure(["selective"])  # on a newer torch or transformers than the tested ones, before it acts
    # (a recompute outside a backward diagnoses after one recompute per checkpointed layer, not per layer)
    flags = [bool(getattr(m, "gradient_checkpointing", False)) for m in layers.modules]
    # a second call on the same layers replaces the first's policy (its context_fn is the one the partial passes)
    policy = build_policy(config, model, layers, checkpointed=flags, keep_installed=False)
    policy.install()
    for layer in checkpointed:
        layer._gradient_checkpointing_func = functools.partial(
            layer._gradient_checkpointing_func, context_fn=policy.checkpoint_context_fn()
        )
        _INSTALLED[layer] = policy
    return _AppliedPolicy(policy, checkpointed, originals)
