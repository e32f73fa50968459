"""``chunked_loss``: a transformers causal-LM model computes its training loss a chunk of tokens at a time.

For the run, each model's output head (``lm_head``) and its ``loss_function`` are replaced by the instance's own
attributes (put back at removal). In a training forward called with ``labels`` (the module in training mode,
gradients on), the head hands the model an empty placeholder instead of the logits and keeps the final hidden
states; the model's ``loss_function`` then computes the loss from those, a chunk at a time
(:func:`~lightning_ac.loss.function.chunked_causal_lm_loss`), and the output's ``logits`` is ``None``. Every other
call (evaluation, no gradients, no labels) computes as the model does.

What a model's ``forward`` does between its head and its loss is read from its syntax tree, once, before training
(:mod:`lightning_ac.loss.source`): nothing, for most causal LMs; scales and ``tanh`` (Gemma's final-logit
soft-capping, Granite's, Cohere's and HyperCLOVAX's logit scales), which the chunks apply the same way. Anything else
(a sliced vocabulary...) is refused, naming what was found, rather than computed differently. At each chunked call,
the logits that reach the loss must be what the head returned where the source does nothing to them (a forward hook
on the head that changes them is caught there), and a tensor of their shape where it changes them.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_ac._logging import rank_zero_warn
from lightning_ac.config import AUTO, ConfigError
from lightning_ac.loss.function import chunked_causal_lm_loss
from lightning_ac.loss.source import LogitOp, SourceError, apply_logit_ops, head_name, logit_ops

__all__ = [
    "LOSS_ATTRIBUTES",
    "MAX_AUTO_CHUNK_LOGIT_BYTES",
    "MIN_AUTO_CHUNK_TOKENS",
    "ChunkedLoss",
    "auto_chunk_tokens",
    "install_chunked_loss",
]

_MISSING = object()
# what the chunked loss sets on a model besides its head's forward (the plan's journal records it)
LOSS_ATTRIBUTES = ("_loss_function",)


# chunk_tokens: auto never takes fewer tokens a chunk: below it each chunk's matmuls are too small to run at speed.
# Measured on the cpu-vocab preset (2,048 tokens, hidden 256, vocabulary 32,000; python -m lightning_ac.bench
# --preset cpu-vocab): 32-token chunks made full + chunked_loss 1.10x slower than full, 128-token chunks 0.79x
# (faster: no whole logits to write), at 72.0 MiB of activations against 69.3 MiB with 32 and 773.0 MiB without.
MIN_AUTO_CHUNK_TOKENS = 128
# ... and never more tokens than make this many bytes of float32 logits: the hidden states' worth grows with the
# sequence (2 GiB of logits a chunk for Llama-3-8B at 64k tokens, with their softmax and gradient beside them), where
# a chunk of a fixed size is as fast. Measured on this CPU (2026-12-04; hidden 1,024, Llama-3's vocabulary of 128,256,
# 8,192 tokens, bf16, the loss and its gradients, best of 3): 5.6 ms a token with 128-token chunks, 4.6 with 256, 4.0
# with 512 (250.5 MiB of logits) and 1,024, 4.2 with 2,048 and 4.5 with 4,096: larger chunks are no faster.
MAX_AUTO_CHUNK_LOGIT_BYTES = 256 * 2**20


def auto_chunk_tokens(tokens: int, hidden_size: int, vocab_size: int) -> int:
    """``chunk_tokens: auto``: the tokens whose logits hold as many elements as the final hidden states of all
    ``tokens`` (rounded up to a power of two), at least :data:`MIN_AUTO_CHUNK_TOKENS`, and no more than make
    :data:`MAX_AUTO_CHUNK_LOGIT_BYTES` of float32 logits (rounded down to a power of two, and not below the floor):
    the head's working set is then about the size of one layer's input at short lengths and bounded at any length,
    whatever the vocabulary, and each chunk's matmuls stay large enough to run at speed. Never more than
    ``tokens``."""
    if tokens <= 0:
        return 1
    wanted = max(1, -(-tokens * hidden_size // vocab_size))
    chunk = max(MIN_AUTO_CHUNK_TOKENS, 1 << (wanted - 1).bit_length())
    bounded = MAX_AUTO_CHUNK_LOGIT_BYTES // (4 * vocab_size)
    if bounded >= 1:
        chunk = min(chunk, max(MIN_AUTO_CHUNK_TOKENS, 1 << (bounded.bit_length() - 1)))
    return min(tokens, chunk)


def _standard_loss() -> Any:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


@dataclass
class _Call:
    """One training forward with labels: the hidden states the head received, and whether the loss used them."""

    hidden: Optional[torch.Tensor] = None
    placeholder: Optional[torch.Tensor] = None
    computed: bool = False


class _Model:
    """What the chunked loss installs on one model, and what it found there before."""

    def __init__(self, model: nn.Module, ops: List[LogitOp]) -> None:
        self.model = model
        self.head: nn.Module = model.get_output_embeddings()
        self.head_name = head_name(model) or "lm_head"
        self.ops = ops  # what the forward does to the head's output before its loss
        self.calls: List[Optional[_Call]] = []
        self.handles: List[Any] = []
        self.saved: Dict[str, Any] = {}


class ChunkedLoss:
    """Computes the causal-LM loss of each model a chunk of tokens at a time, for the run.

    Args:
        chunk_tokens: Tokens per chunk, or ``"auto"`` (:func:`auto_chunk_tokens`, per call).
        models: The transformers causal-LM models (each checked by :meth:`check`).
        budget_decides: Off until the memory budget turns it on (``chunked_loss: auto``): installed and checked all
            the same, each model computing its loss as it does meanwhile.
    """

    name = "chunked_loss"

    def __init__(self, chunk_tokens: Any, models: Sequence[nn.Module], budget_decides: bool = False) -> None:
        self.chunk_tokens = chunk_tokens
        self.budget_decides = budget_decides
        self.active = not budget_decides  # the budget turns it on where its step needs it
        self.turned_on_because = ""  # the budget's reason: "weighing", "faster" or "needed"
        self._models = [_Model(model, self.check(model)) for model in models]
        self._said_no_labels = False
        self.chunked_calls = 0  # training forwards whose loss was chunked
        self._without_logits = ""  # the model whose training forward last returned logits=None
        self.last_chunks: Optional[Tuple[int, int]] = None  # the last chunked call's (tokens a chunk, tokens)

    @staticmethod
    def check(model: nn.Module) -> List[LogitOp]:
        """Whether the chunked loss can compute ``model``'s loss exactly as the model does.

        Returns:
            What the model's forward does to its head's output before its loss (:mod:`lightning_ac.loss.source`),
            which the chunks do too.

        Raises:
            ConfigError: If it cannot, naming what stands in the way and the fix.
        """
        name = type(model).__name__
        fix = "Set chunked_loss: false for this model."
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None:
            raise ConfigError(
                f"activation_checkpointing.chunked_loss: {name} has no output head (get_output_embeddings() is None), "
                f"so there are no logits to chunk. {fix}"
            )
        loss = model.__dict__.get("_loss_function", _MISSING)
        if (
            loss is not _MISSING
            and loss is not _standard_loss()
            or (loss is _MISSING and model.loss_function is not _standard_loss())
        ):
            raise ConfigError(
                f"activation_checkpointing.chunked_loss: {name}.loss_function is not transformers' causal-LM loss "
                f"(ForCausalLMLoss) but {getattr(model.loss_function, '__name__', model.loss_function)!r}; the chunks "
                f"would compute another loss than yours. {fix}"
            )
        try:
            return logit_ops(model)
        except SourceError as err:
            raise ConfigError(
                f"activation_checkpointing.chunked_loss: {name}.forward cannot be reproduced a chunk at a time: {err}. "
                "The chunked loss reproduces a plain head and, between the head and the loss, scales by a number or a "
                "self. attribute that holds one, tanh, .float() and .contiguous() (Gemma's soft-capping, Granite's and "
                f"Cohere's logit scales). {fix}"
            ) from None

    @property
    def models(self) -> List[nn.Module]:
        """The models whose loss is chunked."""
        return [entry.model for entry in self._models]

    # -- install --------------------------------------------------------------------------------------------

    def install(self) -> None:
        for entry in self._models:
            model, head = entry.model, entry.head
            entry.saved = {
                "forward": head.__dict__.get("forward", _MISSING),
                "_loss_function": model.__dict__.get("_loss_function", _MISSING),
            }
            original = head.forward
            head.forward = self._head_forward(entry, original)
            model._loss_function = self._loss_function(entry, original)
            entry.handles = [
                model.register_forward_pre_hook(self._pre_hook(entry), with_kwargs=True),
                model.register_forward_hook(self._post_hook(entry), always_call=True),
            ]

    def remove(self) -> None:
        """Leave every model as it was found. Safe to call more than once."""
        for entry in self._models:
            for handle in entry.handles:
                handle.remove()
            entry.handles, entry.calls = [], []
            for owner, name in ((entry.head, "forward"), (entry.model, "_loss_function")):
                if name not in entry.saved:
                    continue
                previous = entry.saved.pop(name)
                if previous is _MISSING:
                    owner.__dict__.pop(name, None)
                else:
                    owner.__dict__[name] = previous

    def explain(self, error: BaseException, training: bool) -> None:
        """Say, on an error that reads ``None`` as a tensor after a training forward returned ``logits=None`` (a
        step computing token accuracy from the logits, as TRL's SFT does), what happened and what to do: a note on the
        error (printed with its traceback) and a log line."""
        if (
            not training  # a later validation error is not about the training forwards' logits
            or not self._without_logits
            or not isinstance(error, (AttributeError, TypeError))
            or "NoneType" not in str(error)
        ):
            return
        if self.budget_decides:
            # the user never wrote chunked_loss: true; the budget turned it on mid-run (budget/tools.py says why)
            why, fix = {
                "weighing": (
                    "chunked_loss: auto, and the memory budget turned it on for a step to weigh it",
                    "or set chunked_loss: false (the budget then chooses without it)",
                ),
                "faster": (
                    "chunked_loss: auto, and the memory budget kept it on: its plan steps faster",
                    "or set chunked_loss: false (the budget then chooses without it)",
                ),
            }.get(
                self.turned_on_because,
                (
                    "chunked_loss: auto, and the memory budget turned it on: no plan fits the budget without it",
                    "or set chunked_loss: false and a larger budget (without the chunked loss this step's logits do "
                    "not fit it)",
                ),
            )
        else:
            why = "chunked_loss is on"
            fix = "or set chunked_loss: false"
        note = (
            f"lightning_ac: this may be the chunked loss ({why}): {self._without_logits}'s training forwards with "
            "labels return logits=None (the loss is computed a chunk at a time, and the logits never exist whole). "
            "Compute what needs the logits in validation_step (evaluation forwards return them), or call the model "
            f"without labels and compute the loss yourself, {fix}."
        )
        if hasattr(error, "add_note"):
            error.add_note(note)
        rank_zero_warn(note.removeprefix("lightning_ac: "))  # the log line has the prefix of its own

    def describe(self) -> str:
        heads = ", ".join(sorted({f"{type(e.model).__name__}.{e.head_name}" for e in self._models}))
        if self.chunk_tokens == AUTO:
            tokens = f"chunks of logits the size of the final hidden states (at least {MIN_AUTO_CHUNK_TOKENS} tokens)"
        else:
            tokens = f"{self.chunk_tokens} tokens at a time"
        if not self.active:
            return f"loss chunked where the budget needs it ({tokens} through {heads}; not so far)"
        return f"loss chunked: {tokens} through {heads} (training forwards with labels return logits=None)"

    # -- the replacements -----------------------------------------------------------------------------------

    def _pre_hook(self, entry: _Model) -> Any:
        signature = inspect.signature(type(entry.model).forward)

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            labels = kwargs.get("labels")
            if labels is None and args:
                labels = signature.bind_partial(module, *args, **kwargs).arguments.get("labels")
            training = module.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
            training = training and self.active
            if training and labels is None and not self._said_no_labels:
                self._said_no_labels = True
                rank_zero_warn(
                    f"chunked_loss: a training forward of {type(module).__name__} was called without labels, so its "
                    "logits are built whole there and the loss is computed outside the model. Pass labels= to the "
                    "model for its loss to be chunked (said once)."
                )
            entry.calls.append(_Call() if training and labels is not None else None)

        return pre_hook

    def _head_forward(self, entry: _Model, original: Any) -> Any:
        def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            call = entry.calls[-1] if entry.calls else None
            if call is None or call.hidden is not None or args or kwargs:
                return original(hidden, *args, **kwargs)
            call.hidden = hidden
            # what the model passes on as its logits: nothing of the vocabulary's size
            call.placeholder = hidden.new_empty(*hidden.shape[:-1], 0)
            return call.placeholder

        return forward

    def _loss_function(self, entry: _Model, head_forward: Any) -> Any:
        standard = _standard_loss()

        def loss_function(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any) -> Any:
            call = entry.calls[-1] if entry.calls else None
            if call is None or call.hidden is None or call.computed:
                return standard(logits, labels, vocab_size, **kwargs)
            call.computed = True
            _check_logits(entry, call, logits)
            hidden = call.hidden
            given = kwargs.get("shift_labels")
            if (given if given is not None else labels).numel() != hidden.shape[:-1].numel():
                # labels that do not pair with the positions the head saw (logits_to_keep): the model's own loss
                # says what is wrong (or computes what it computes)
                return standard(apply_logit_ops(head_forward(hidden), entry.ops), labels, vocab_size, **kwargs)
            self.chunked_calls += 1
            params = [p for p in entry.head.parameters() if p.requires_grad]
            tokens = self.chunk_tokens
            if tokens == AUTO:
                tokens = auto_chunk_tokens(hidden.shape[:-1].numel(), hidden.shape[-1], vocab_size)
            self.last_chunks = (int(tokens), hidden.shape[:-1].numel())
            return chunked_causal_lm_loss(
                hidden,
                labels,
                head_forward,
                params,
                tokens,
                ignore_index=kwargs.get("ignore_index", -100),
                num_items_in_batch=kwargs.get("num_items_in_batch"),
                shifted_labels=kwargs.get("shift_labels"),
                logit_ops=entry.ops,
            )

        return loss_function

    def _post_hook(self, entry: _Model) -> Any:
        def post_hook(module: nn.Module, args: tuple, output: Any) -> Any:
            call = entry.calls.pop() if entry.calls else None
            if call is None or call.hidden is None:
                return None
            if not call.computed:
                raise RuntimeError(
                    f"chunked_loss: {type(module).__name__}'s forward took its output head's logits but did not "
                    "compute its loss with self.loss_function, so the chunked loss could not stand in for them. Set "
                    "chunked_loss: false for this model."
                )
            self._without_logits = type(module).__name__
            return _without_logits(output, call)

        return post_hook


def _check_logits(entry: _Model, call: _Call, logits: Any) -> None:
    """The logits that reach the loss are the head's output: the placeholder itself where the forward's source does
    nothing to it (so a forward hook on the head that changes it is caught), a tensor of its shape where the source
    changes it (there the check cannot tell the source's changes from a hook's)."""
    placeholder = call.placeholder
    assert placeholder is not None
    if not entry.ops and logits is placeholder:
        return
    # .float() of float32 logits, .contiguous(): the placeholder itself
    if entry.ops and torch.is_tensor(logits) and logits.shape == placeholder.shape:
        return
    raise RuntimeError(
        f"chunked_loss: the logits {type(entry.model).__name__}.forward passed to its loss are not what its source "
        f"does to its head's output ({', '.join(op for op, _ in entry.ops) or 'nothing'}): something else changed "
        f"them (a forward hook on {entry.head_name}?), which the chunked loss would leave out. Set chunked_loss: false "
        "for this model, or remove what changes its logits."
    )


def _without_logits(output: Any, call: _Call) -> Any:
    """The model's output with ``logits`` ``None``: the placeholder (or what the model made of it) is not logits."""
    from transformers.utils import ModelOutput

    def is_placeholder(value: Any) -> bool:
        return torch.is_tensor(value) and value.shape[-1:] == (0,) and value.shape[:-1] == call.hidden.shape[:-1]

    if isinstance(output, ModelOutput):
        if is_placeholder(output.get("logits")):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return type(output)(**{k: v for k, v in output.items() if k != "logits"})
        return output
    if isinstance(output, tuple):
        return tuple(None if is_placeholder(v) else v for v in output)
    return output


def install_chunked_loss(config: Any, layers: Any) -> Optional[ChunkedLoss]:
    """The causal-LM loss of each transformers model a chunk of tokens at a time, installed for the run (checked
    before it installs); ``None`` when the block does not ask for it (``config``: its ``chunked_loss``).

    Raises:
        ConfigError: If the model has no transformers causal-LM model, or one whose loss cannot be chunked.
    """
    if config is None:
        return None
    if not layers.hf_models:
        raise ConfigError(
            "activation_checkpointing.chunked_loss: the model has no transformers causal-LM model (a "
            "...ForCausalLM with an lm_head and a loss_function), whose loss the chunks compute. Set chunked_loss: "
            "false, or compute your own loss in chunks."
        )
    chunked = ChunkedLoss(config.chunk_tokens, layers.hf_models, config.budget_decides)
    chunked.install()
    return chunked
