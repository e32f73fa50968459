"""What a causal LM's ``forward`` does between its output head and its loss, read from its syntax tree.

The chunked loss computes each chunk's logits with the model's head and must then do to them what the model does
before its loss: most models nothing, Gemma's soft-capping (``logits / cap``, ``tanh``, ``* cap``), Granite's
``logits / logits_scaling``, a scale written on the head's own line (HyperCLOVAX's ``* logits_scaling``, Falcon-H1's
``* lm_head_multiplier``). The statements from the head's call to the loss's call are read as a tree, not as lines:
each must be an elementwise scale or ``tanh`` of the head's output by a number or a ``self.`` attribute (read from
the model at install), a guard ``if <attribute> is not None:`` around such statements, or ``loss = None``; and the
loss must be called with the variable that holds the result. Anything else is refused, naming the statement.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["LogitOp", "SourceError", "apply_logit_ops", "head_name", "logit_ops"]

# ("mul" | "div", value) or ("tanh", None), applied in order to the head's output
LogitOp = Tuple[str, Any]


class SourceError(ValueError):
    """The forward does something between its head and its loss that the chunked loss cannot reproduce."""


def apply_logit_ops(logits: torch.Tensor, ops: Sequence[LogitOp]) -> torch.Tensor:
    """Apply ``ops`` to a chunk's logits, each as the model's forward writes it (same op, same operand)."""
    for op, value in ops:
        if op == "mul":
            logits = logits * value
        elif op == "div":
            logits = logits / value
        else:
            logits = torch.tanh(logits)
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
    reader.loss(body[loss_at], variable)
    return ops


def _calls(node: ast.AST, function: str) -> bool:
    return any(isinstance(n, ast.Call) and ast.unparse(n.func) == function for n in ast.walk(node))


class _Reader:
    def __init__(self, model: nn.Module, head: str) -> None:
        self.model, self.head_call = model, head

    def refuse(self, node: ast.AST) -> SourceError:
        return SourceError(f"its forward does `{ast.unparse(node)}` between its head and its loss")

    def value(self, node: ast.AST, statement: ast.AST) -> Any:
        """A number, or a ``self.a.b`` attribute read from the model now."""
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        path = ast.unparse(node).split(".")
        if path[0] != "self" or len(path) < 2 or not all(p.isidentifier() for p in path):
            raise self.refuse(statement)
        value: Any = self.model
        for part in path[1:]:
            value = getattr(value, part)
        return value

    def head(self, statement: ast.stmt) -> Tuple[str, List[LogitOp]]:
        """``x = self.head(...)``, or with one scale: ``x = self.head(...) * s`` (``/ s``, ``s * self.head(...)``)."""
        if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
            raise self.refuse(statement)
        target, value = statement.targets[0], statement.value
        if not isinstance(target, ast.Name):
            raise self.refuse(statement)
        if self._is_head(value):
            return target.id, []
        if isinstance(value, ast.BinOp):
            if self._is_head(value.left) and isinstance(value.op, (ast.Mult, ast.Div)):
                return target.id, [("mul" if isinstance(value.op, ast.Mult) else "div", self.value(value.right, value))]
            if self._is_head(value.right) and isinstance(value.op, ast.Mult):
                return target.id, [("mul", self.value(value.left, value))]
        raise self.refuse(statement)

    def _is_head(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and ast.unparse(node.func) == self.head_call

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
            if self.value(test.left, statement) is None:  # type: ignore[union-attr]
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
        raise self.refuse(statement)

    def loss(self, statement: ast.stmt, variable: str) -> None:
        """The loss is called with the variable that holds the head's output (first argument, or ``logits=``)."""
        call = next(
            n for n in ast.walk(statement) if isinstance(n, ast.Call) and ast.unparse(n.func) == "self.loss_function"
        )
        given = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "logits"), None)
        if not (isinstance(given, ast.Name) and given.id == variable):
            raise SourceError(
                f"its forward calls `{ast.unparse(call)}` with something other than its head's output ({variable})"
            )
