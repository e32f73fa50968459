"""The block's typed schema: its dataclasses (Hydra structured configs too), the placements, the field names and
the checkpoint arguments torch accepts, and :class:`ConfigError`."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

import torch.utils.checkpoint

__all__ = [
    "AUTO",
    "ActivationCheckpointingConfig",
    "BLOCK_FIELDS",
    "CHECKPOINT_KWARGS",
    "CHUNKED_LOSS_FIELDS",
    "ChunkedLossConfig",
    "ConfigError",
    "DEFAULT_RECOMPUTE_LAYER_TYPES",
    "DEFAULT_SAVE",
    "FIRST_PLANS",
    "FIRST_PLAN_FIELD",
    "IMPLEMENTATIONS",
    "OFFLOAD_TARGETS",
    "OffloadConfig",
    "Placement",
    "SELECTIVE_FIELDS",
    "SET_BY_US",
    "SelectiveConfig",
    "TILED_MLP_FIELDS",
    "TiledMLPConfig",
]


class ConfigError(ValueError):
    """A rejected ``activation_checkpointing`` block or callback argument.

    The message names the field, the value that was given, and how to fix it.
    """


class Placement(str, Enum):
    """Where an offload target's tensors live. Compares equal to its string value (``"cpu"``)."""

    none = "none"
    cpu = "cpu"
    disk = "disk"
    # hidden_states only, beside a memory budget: the budget decides per decoder layer whether its input goes to host
    # memory (recomputed with it there), where the device needs it and the host has the room
    auto = "auto"

    def __str__(self) -> str:  # "cpu", not "Placement.cpu", in messages and YAML
        return self.value


DEFAULT_SAVE = ("attention",)

DEFAULT_RECOMPUTE_LAYER_TYPES = ("sliding_attention", "chunked_attention")


@dataclass
class SelectiveConfig:
    """Selective activation checkpointing: which ops a checkpointed layer saves instead of recomputing.

    Attributes:
        save: Op names matched as substrings of the qualified op name (``aten::mm``); ``attention`` names
            the attention kernels. ``[]`` saves nothing through the list.
        save_modules: Module names (exact, dotted suffix or glob) whose matmuls are saved.
        save_matmul_min_k: Save every matmul whose contraction dim is at least this (``>= 1``).
        save_sliding_window: Also save sliding-window attention calls.
        recompute_layer_types: Layer types whose attention is recomputed rather than saved.
    """

    save: List[str] = field(default_factory=lambda: list(DEFAULT_SAVE))
    save_modules: List[str] = field(default_factory=list)
    save_matmul_min_k: Optional[int] = None
    save_sliding_window: bool = False
    recompute_layer_types: List[str] = field(default_factory=lambda: list(DEFAULT_RECOMPUTE_LAYER_TYPES))


# budget: auto and chunked_loss.chunk_tokens: auto
AUTO = "auto"


@dataclass
class ChunkedLossConfig:
    """The causal-LM loss computed a chunk of tokens at a time (:mod:`lightning_ac.loss`).

    Attributes:
        chunk_tokens: Tokens per chunk (``>= 1``), or ``"auto"``: per call, as many tokens as make a chunk's logits
            the size of the final hidden states (``tokens x hidden_size / vocab_size``, rounded up to a power of
            two), at least 128 (smaller chunks run matmuls too small to be fast), and no more than make 256 MiB of
            float32 logits (rounded down to a power of two: 512 tokens of a 128,256-word vocabulary), so that the
            head's working set stays about the size of one layer's input, and stops growing with the sequence. A
            chunk's working set is about ``chunk_tokens x vocabulary`` float32 logits and their gradient; fewer tokens
            hold less and run more, smaller matmuls, each reading the head's whole weight.
        budget_decides: On only where the memory budget needs it (``chunked_loss: auto``, or ``budget_decides: true``
            beside ``chunk_tokens``; needs ``budget``): off until a step that recomputes every decoder layer is over
            the budget (measured, or by the figures), then on, and the step measured again
            (:mod:`lightning_ac.budget.tools`).
    """

    chunk_tokens: Any = AUTO
    budget_decides: bool = False


@dataclass
class TiledMLPConfig:
    """Each decoder layer's MLP a tile of tokens at a time (:mod:`lightning_ac.tiled_mlp`).

    Attributes:
        tile_tokens: Tokens per tile (``>= 1``), or ``"auto"``: per module, the most tokens (a power of two, at least
            1024) whose widest intermediate holds at most 256 MiB (an MLP's ``tile x intermediate_size`` in the input's
            dtype, a norm's float32 copy of its input), as ``chunk_tokens: auto`` bounds a chunk's logits: few large
            tiles (8,192 tokens for Llama-3-8B's MLP in bf16, 16,384 for its norms), whatever the sequence length.
        norms: Tile the decoder layers' norms and the final norm too (default ``True``): once the MLP is tiled, an
            RMSNorm's float32 copies of the hidden states (its saved input, six of them in its backward) are the
            most a recomputed layer holds at long context. ``False`` tiles the MLP only.
        mlp_modules: Each decoder layer's MLP, by name or glob relative to the layer (``[ffn]``,
            ``["*.feed_forward"]``), for layers that do not hold it as ``mlp``; ``None`` (the default): the layer's
            ``mlp``, as in every transformers model.
        budget_decides: On only where the memory budget needs it (``tiled_mlp: auto``; needs ``budget``), as
            ``chunked_loss: auto``; the budget turns the chunked loss on first.
    """

    tile_tokens: Any = AUTO
    norms: bool = True
    mlp_modules: Optional[List[str]] = None
    budget_decides: bool = False


@dataclass
class OffloadConfig:
    """Where each offload target's tensors go: ``none`` (default) or ``cpu``; ``true``/``false`` mean cpu/none.

    Each field is :class:`~lightning_ac.ActivationOffload`'s argument of the same name (documented there).
    """

    hidden_states: Any = Placement.none
    selective: Any = Placement.none
    all: Any = Placement.none

    @property
    def targets(self) -> List[str]:
        """The targets that move to the host, in :data:`OFFLOAD_TARGETS` order."""
        return [t for t in OFFLOAD_TARGETS if getattr(self, t) != Placement.none]

    @property
    def needs_checkpointing(self) -> List[str]:
        """The targets that act on checkpointed decoder layers."""
        return [t for t in self.targets if t in ("hidden_states", "selective")]


@dataclass
class ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` block: each field is :class:`~lightning_ac.ActivationCheckpointing`'s
    argument of the same name (documented there, once: LightningCLI's ``--help`` shows it), written in YAML
    (``true`` where Python writes ``True``); ``offload`` holds :class:`~lightning_ac.ActivationOffload`'s targets
    (:class:`OffloadConfig`).

    After :func:`parse_config`, ``selective`` is ``None`` or a :class:`SelectiveConfig`, ``kwargs`` a plain dict,
    ``budget`` an int of bytes or ``"auto"``, ``chunked_loss`` ``None`` or a :class:`ChunkedLossConfig`, and every
    offload target a :class:`Placement`.
    """

    enabled: bool = True
    implementation: str = "hf"
    reentrant: Optional[bool] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)
    selective: Any = None
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    budget: Any = None
    chunked_loss: Optional[ChunkedLossConfig] = None
    budget_first_plan: str = "measure"
    tiled_mlp: Optional[TiledMLPConfig] = None

    @property
    def use_reentrant(self) -> bool:
        """The resolved ``use_reentrant``: ``reentrant`` when set, else non-reentrant."""
        return bool(self.reentrant)

    @property
    def every_n_layers(self) -> int:
        """Checkpoint every n-th decoder layer (``kwargs.every_n_layers``, default 1)."""
        return int(self.kwargs.get("every_n_layers", 1))

    @property
    def checkpoint_kwargs(self) -> Dict[str, Any]:
        """The keyword arguments handed to ``torch.utils.checkpoint.checkpoint`` (``use_reentrant`` included)."""
        kwargs = {k: v for k, v in self.kwargs.items() if k != "every_n_layers"}
        return {"use_reentrant": self.use_reentrant, **kwargs}


IMPLEMENTATIONS = ("hf", "fsdp")

FIRST_PLANS = ("measure", "estimate")

FIRST_PLAN_FIELD = "budget_first_plan"

# What torch.utils.checkpoint.checkpoint accepts besides the function, its inputs and the keys we set ourselves.
# preserve_rng_state is read from **kwargs by torch; the rest are named parameters in 2.13.
SET_BY_US = {"context_fn", "respect_saved_tensors_hooks"}

CHECKPOINT_KWARGS = frozenset(
    {"preserve_rng_state"}
    | {
        name
        for name, p in inspect.signature(torch.utils.checkpoint.checkpoint).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in SET_BY_US | {"use_reentrant"}
    }
)

KWARG_TYPES: Dict[str, tuple] = {
    "preserve_rng_state": (bool,),
    "debug": (bool,),
    "early_stop": (bool,),
    "determinism_check": (str,),
}

BLOCK_FIELDS = tuple(f.name for f in dataclasses.fields(ActivationCheckpointingConfig))

SELECTIVE_FIELDS = tuple(f.name for f in dataclasses.fields(SelectiveConfig))

CHUNKED_LOSS_FIELDS = tuple(f.name for f in dataclasses.fields(ChunkedLossConfig))

TILED_MLP_FIELDS = tuple(f.name for f in dataclasses.fields(TiledMLPConfig))

# The offload targets, in the order messages, metrics and reports list them.
OFFLOAD_TARGETS = tuple(f.name for f in dataclasses.fields(OffloadConfig))
