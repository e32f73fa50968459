"""What a causal LM's ``forward`` does between its output head and its loss, read from its syntax tree.

The chunked loss computes each chunk's logits with the model's head and must then do to them what the model does
before its loss: most models nothing, Gemma's soft-capping (``logits / cap``, ``tanh``, ``* cap``), Granite's
``logits / logits_scaling``, a scale written on the head's own line (HyperCLOVAX's ``* logits_scaling``, Falcon-H1's
``* lm_head_multiplier``), an upcast or a layout change (OPT's ``.contiguous()``, Mamba's ``.float()``). The
statements from the head's call to the loss's call are read as a tree, not as lines: each must be an elementwise
scale of the head's output by a number or a ``self.`` attribute that holds one (read from the model at install),
``tanh``, ``.float()`` or ``.contiguous()``, a guard ``if <attribute> is not None:`` around such statements, or
``loss = None``; and the loss must be called with the variable that holds the result. Anything else is refused,
naming the statement.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["LogitOp", "SourceError", "apply_logit_ops", "head_name", "logit_ops"]

# ("mul" | "div", value), or ("tanh" | "float" | "contiguous", None), applied in order to the head's output
LogitOp = Tuple[str, Any]
# Methods a forward may call on the logits without changing their values: an upcast (the chunks upcast to float32 for
# the loss anyway, as transformers' loss does) and a layout change.
_METHODS = ("float", "contiguous")


class SourceError(ValueError):
    """The forward does something between its head and its loss that the chunked loss cannot reproduce."""


def apply_logit_ops(logits: torch.Tensor, ops: Sequence[LogitOp]) -> torch.Tensor:
    """Apply ``ops`` to a chunk's logits, each as the model's forward writes it (same op, same operand)."""
    for op, value in ops:
        if op == "mul":
            logits = logits * value
        elif op == "div":
            logits = logits / value
        elif op == "tanh":
            logits = torch.tanh(logits)
        elif op == "float":
            logits = logits.float()
        else:
            logits = logits.contiguous()
    return logits


def head_name(model: nn.Module) -> Optional[str]:
    """The attribute path of ``model``'s output head (``lm_head``; ModernBERT-decoder's ``decoder``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    return next((name for name, module in model.named_modules() if name and module is head), None)


def logit_ops(model: nn.Module) -> List[LogitOp]:
    """What ``type(model).forward`` does to its head's output before handing it to ``self.loss_function``.

    Raises:
        SourceError: If the source cannot be read, does not call the head and then the loss on its result, or does
            anything there other than the forms the module docstring lists.
    """
    name = head_name(model)
    try:
        source = textwrap.dedent(inspect.getsource(type(model).forward))
        function = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError) as err:
        raise SourceError(f"its forward's source cannot be read ({err})") from None
    assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
    body = function.body
    head_at = next((i for i, s in enumerate(body) if name and _calls(s, f"self.{name}")), None)
    loss_at = next((i for i, s in enumerate(body) if _calls(s, "self.loss_function")), None)
    if head_at is None or loss_at is None or loss_at <= head_at:
        raise SourceError(f"its forward does not call self.{name or 'lm_head'}(...) and then self.loss_function(...)")
    reader = _Reader(model, f"self.{name}")
    variable, ops = reader.head(body[head_at])
    for statement in body[head_at + 1 : loss_at]:
        ops += reader.statement(statement, variable)
    ops += reader.loss(body[loss_at], variable)
    return ops


def _calls(node: ast.AST, function: str) -> bool:
    return any(isinstance(n, ast.Call) and ast.unparse(n.func) == function for n in ast.walk(node))


class _Reader:
    def __init__(self, model: nn.Module, head: str) -> None:
        self.model, self.head_call = model, head

    def refuse(self, node: ast.AST) -> SourceError:
        return SourceError(f"its forward does `{ast.unparse(node)}` between its head and its loss")

    def read(self, node: ast.AST, statement: ast.AST) -> Any:
        """A constant, or a ``self.a.b`` attribute read from the model now."""
        if isinstance(node, ast.Constant):
            return node.value
        path = ast.unparse(node).split(".")
        if path[0] != "self" or len(path) < 2 or not all(p.isidentifier() for p in path):
            raise self.refuse(statement)
        value: Any = self.model
        for part in path[1:]:
            if not hasattr(value, part):
                raise SourceError(f"its forward reads {ast.unparse(node)}, which this model does not have")
            value = getattr(value, part)
        return value

    def value(self, node: ast.AST, statement: ast.AST) -> Any:
        """A scale: a number (or a tensor that does not train: the chunks give gradients to the head's parameters
        alone, so a trained scale would never get its own)."""
        value = self.read(node, statement)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number or (isinstance(value, torch.Tensor) and not value.requires_grad):
            return value
        raise SourceError(
            f"its forward scales its logits by {ast.unparse(node)}, which is {type(value).__name__}"
            + (" and trains" if isinstance(value, torch.Tensor) else "")
            + ", not a number"
        )

    def head(self, statement: ast.stmt) -> Tuple[str, List[LogitOp]]:
        """``x = self.head(...)``, or with one scale: ``x = self.head(...) * s`` (``/ s``, ``s * self.head(...)``)."""
        if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
            raise self.refuse(statement)
        target, value = statement.targets[0], statement.value
        if not isinstance(target, ast.Name):
            raise self.refuse(statement)
        ops = self._head_call(value)
        if ops is not None:
            return target.id, ops
        if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div)):
            ops = self._head_call(value.left)
            if ops is not None:
                return target.id, [
                    *ops,
                    ("mul" if isinstance(value.op, ast.Mult) else "div", self.value(value.right, value)),
                ]
            ops = self._head_call(value.right)
            if ops is not None and isinstance(value.op, ast.Mult):
                return target.id, [*ops, ("mul", self.value(value.left, value))]
        raise self.refuse(statement)

    def _head_call(self, node: ast.AST) -> Optional[List[LogitOp]]:
        """``self.head(...)``, or with methods that keep its values (``.float()``, ``.contiguous()``) called on it:
        those methods as ops; ``None`` for anything else."""
        ops: List[LogitOp] = []
        while _is_method(node, _METHODS):
            ops.insert(0, (node.func.attr, None))  # type: ignore[attr-defined]
            node = node.func.value  # type: ignore[attr-defined]
        if isinstance(node, ast.Call) and ast.unparse(node.func) == self.head_call:
            return ops
        return None

    def statement(self, statement: ast.stmt, variable: str) -> List[LogitOp]:
        if isinstance(statement, ast.Assign) and ast.unparse(statement) == "loss = None":
            return []
        if isinstance(statement, ast.If) and not statement.orelse:
            test = statement.test
            is_not_none = (
                isinstance(test, ast.Compare)
                and len(test.ops) == 1
                and isinstance(test.ops[0], ast.IsNot)
                and isinstance(test.comparators[0], ast.Constant)
                and test.comparators[0].value is None
            )
            if not is_not_none:
                raise self.refuse(statement)
            if self.read(test.left, statement) is None:  # type: ignore[union-attr]
                return []
            return [op for inner in statement.body for op in self.statement(inner, variable)]
        if not (
            isinstance(statement, ast.Assign)
            and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name)
            and statement.targets[0].id == variable
        ):
            raise self.refuse(statement)
        value = statement.value
        is_variable = lambda node: isinstance(node, ast.Name) and node.id == variable  # noqa: E731
        if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div)) and is_variable(value.left):
            return [("mul" if isinstance(value.op, ast.Mult) else "div", self.value(value.right, statement))]
        if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult) and is_variable(value.right):
            return [("mul", self.value(value.left, statement))]
        if (
            isinstance(value, ast.Call)
            and ast.unparse(value.func) == "torch.tanh"
            and len(value.args) == 1
            and not value.keywords
            and is_variable(value.args[0])
        ):
            return [("tanh", None)]
        if _is_method(value, _METHODS) and is_variable(value.func.value):  # type: ignore[attr-defined]
            return [(value.func.attr, None)]  # type: ignore[attr-defined]
        raise self.refuse(statement)

    def loss(self, statement: ast.stmt, variable: str) -> List[LogitOp]:
        """The loss is called with the variable that holds the head's output (first argument, or ``logits=``); in the
        ``if`` that holds the call (``if labels is not None:``), what comes before it is read like the statements
        before the ``if``. Returns the ops read there."""
        ops: List[LogitOp] = []
        if isinstance(statement, ast.If):
            for inner in statement.body:
                if _calls(inner, "self.loss_function"):
                    statement = inner
                    break
                ops += self.statement(inner, variable)
        call = next(
            n for n in ast.walk(statement) if isinstance(n, ast.Call) and ast.unparse(n.func) == "self.loss_function"
        )
        given = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "logits"), None)
        if not (isinstance(given, ast.Name) and given.id == variable):
            raise SourceError(
                f"its forward calls `{ast.unparse(call)}` with something other than its head's output ({variable})"
            )
        return ops


def _is_method(node: ast.AST, names: Sequence[str]) -> bool:
    """``<something>.name()`` for one of ``names``, without arguments."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in names
        and not node.args
        and not node.keywords
    )
