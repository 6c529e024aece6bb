"""Values written or read by dispatch: what the compiled program can carry and replay.

Shared by both layers (compile time).  ``classify`` says how a written value is
replayed after a compiled call: rebuilt as a constant by the residual bytecode, or
returned by the graph (tensors, and anything holding a SymInt under dynamic shapes).
``refusal_for`` is the one decision, for both layers, of which writes cannot be
replayed exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import types
from typing import Any

import torch

from .errors import RefusalKind


class _Sentinel:
    __slots__ = ("_text",)

    def __init__(self, text: str) -> None:
        self._text = text

    def __repr__(self) -> str:
        return self._text

    def __reduce__(self) -> str:  # plans are pickled with AOTAutogradCache entries
        return _SENTINEL_NAMES[self._text]


#: "The attribute is absent" on either side of a write (a deletion, or no value before).
MISSING: Any = _Sentinel("<missing>")
#: What a plan knows of a value computed by the traced program (a tensor or a SymInt).
GRAPH_VALUE: Any = _Sentinel("<a graph value>")
#: A plan's entry state for an attribute that held a tensor when tracing started.
HELD_TENSOR: Any = _Sentinel("<a tensor>")
_SENTINEL_NAMES = {"<missing>": "MISSING", "<a graph value>": "GRAPH_VALUE", "<a tensor>": "HELD_TENSOR"}

# Containers whose in-place mutation a copy can detect by value.
PLAIN_MUTABLE = (list, dict, set, bytearray)

_SCALAR_CONSTANTS = (
    int,
    float,
    complex,
    bool,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
)

SYMBOLIC_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)

# Values computed by the traced program: compared by identity (== on a SymInt would
# add a guard), replayed as graph outputs.
GRAPH_VALUE_TYPES = (torch.Tensor, *SYMBOLIC_TYPES)

# Attributes torch's C++ caches on the Python object of a subclass with custom sizes or
# strides (NestedTensor): a capsule and its length, written and read by torch itself
# (torch/csrc/PyInterpreter.cpp). Not the subclass's state: never answered, recorded,
# seeded or restored; copying the length without the capsule aborts the process.
# torch.Tensor's own Python-level bookkeeping (hooks, Dynamo's markers) lives in the
# instance dict too and is torch's business.
_TORCH_INTERNAL_NAMES = frozenset(
    name + suffix
    for name in ("_sizes_capsule", "_strides_capsule", "_sym_sizes_capsule", "_sym_strides_capsule")
    for suffix in ("", "_len")
) | frozenset(("_backward_hooks", "_post_accumulate_grad_hooks", "_specialize_on"))  # the last: mark_dynamic's
_TORCH_INTERNAL_PREFIXES = ("_dynamo_", "_has_dynamo")


def is_torch_internal(name: str) -> bool:
    return name[:1] == "_" and (name in _TORCH_INTERNAL_NAMES or name.startswith(_TORCH_INTERNAL_PREFIXES))


def user_state(d: dict) -> dict:
    """``d`` (an instance ``__dict__``) without torch's own entries."""
    for k in d:  # a loop, not any(...): this runs for every tracked object at every op
        if k[:1] == "_" and (k in _TORCH_INTERNAL_NAMES or k.startswith(_TORCH_INTERNAL_PREFIXES)):
            return {k: v for k, v in d.items() if not is_torch_internal(k)}
    return d


def same_value(old: Any, new: Any) -> bool:
    """Equal as constants: same type and ``==``; graph values only by identity."""
    if old is new:
        return True
    if isinstance(old, GRAPH_VALUE_TYPES) or isinstance(new, GRAPH_VALUE_TYPES):
        return False
    if type(old) is not type(new):
        return False
    if type(old) is float and old != old and new != new:
        return True  # nan, written by each pass alike
    try:
        return bool(old == new)
    except Exception:
        return False


def contains_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(contains_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(contains_tensor(v) for v in value.values())
    return False


def symbolic_constant(value: Any) -> Any:
    """A SymInt/SymFloat/SymBool whose expression is a number, whatever the symbols are
    (``nan * s0`` is nan): its Python value; ``MISSING`` for anything else. Dynamo cannot
    make a graph value of a symbolic nan (its example-value check compares with ``!=``)."""
    if not isinstance(value, SYMBOLIC_TYPES):
        return MISSING
    expr = getattr(value.node, "expr", None)  # a nested int's node has none
    if not getattr(expr, "is_number", False):
        return MISSING
    try:
        if isinstance(value, torch.SymBool):
            return bool(expr)
        return int(expr) if isinstance(value, torch.SymInt) else float(expr)
    except (TypeError, ValueError):
        return MISSING


def contains_symbolic(value: Any) -> bool:
    """A SymInt/SymFloat/SymBool anywhere inside (a ``torch.Size`` of SymInts, say)."""
    if isinstance(value, SYMBOLIC_TYPES):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(contains_symbolic(v) for v in value)
    if isinstance(value, dict):
        return any(contains_symbolic(v) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(contains_symbolic(getattr(value, f.name, None)) for f in dataclasses.fields(value))
    return False


def is_immutable_constant(value: Any) -> bool:
    """Values the residual bytecode can rebuild exactly: immutable, tensor- and SymInt-free."""
    if isinstance(value, _SCALAR_CONSTANTS):
        return True
    if isinstance(value, (tuple, frozenset)):  # torch.Size included
        return all(is_immutable_constant(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        params = getattr(type(value), "__dataclass_params__", None)
        return bool(params is not None and params.frozen) and all(
            is_immutable_constant(getattr(value, f.name)) for f in dataclasses.fields(value)
        )
    return False


def is_code_object(value: Any) -> bool:
    """Functions, classes, modules: compared by identity, like Dynamo guards them."""
    return isinstance(
        value,
        (
            types.FunctionType,
            types.BuiltinFunctionType,
            types.MethodType,
            types.ModuleType,
            type,
            torch._ops.OpOverload,
            torch._ops.OpOverloadPacket,
        ),
    )


class ValueKind(enum.Enum):
    CONSTANT = "constant"  # immutable, rebuilt by the residual bytecode
    TENSOR = "tensor"
    SYMBOLIC = "symbolic"  # holds a SymInt/SymFloat/SymBool (dynamic shapes): a graph output
    DELETE = "delete"
    MUTABLE = "mutable"  # a fresh mutable object: eager identity cannot be replayed
    OPAQUE = "opaque"  # an object the replay cannot rebuild


def classify(value: Any) -> ValueKind:
    if value is MISSING:
        return ValueKind.DELETE
    if isinstance(value, torch.Tensor):
        return ValueKind.TENSOR
    if contains_symbolic(value):
        if isinstance(value, SYMBOLIC_TYPES) or (
            # a tuple or torch.Size; a namedtuple is rebuilt from fields, not from a list
            type(value) in (tuple, torch.Size)
            and all(isinstance(v, SYMBOLIC_TYPES) or is_immutable_constant(v) for v in value)
        ):
            return ValueKind.SYMBOLIC
        return ValueKind.OPAQUE  # a container of SymInts the graph cannot return as such
    if is_immutable_constant(value):
        return ValueKind.CONSTANT
    if isinstance(value, PLAIN_MUTABLE) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        return ValueKind.MUTABLE
    return ValueKind.OPAQUE


def refusal_for(new: Any, old: Any = MISSING, in_place: bool = False) -> tuple[RefusalKind, str] | None:
    """Why a write of ``new`` cannot be replayed exactly, as ``(kind, value type name)``;
    None if it can. One decision for both layers: the Dynamo layer turns it into a graph
    break, the AOTAutograd layer into a ``SubclassWriteError``."""
    if in_place:
        return RefusalKind.IN_PLACE_MUTATION, type(new).__name__
    kind = classify(new)
    if kind is ValueKind.DELETE:
        return RefusalKind.DELETED_ATTRIBUTE, type(old).__name__
    if kind is ValueKind.MUTABLE:
        return RefusalKind.MUTABLE_VALUE, type(new).__name__
    if kind is ValueKind.OPAQUE:
        return RefusalKind.OPAQUE_VALUE, type(new).__name__
    return None


def trace_copy(value: Any) -> Any:
    """The copy of a real object's non-tensor attribute that a traced instance gets.

    Immutable constants and code objects are shared; plain containers of constants are
    deep-copied so a trace cannot mutate the real object.  Anything else returns
    ``MISSING``: it cannot be carried into a trace.
    """
    if is_immutable_constant(value) or is_code_object(value):
        return value
    if isinstance(value, PLAIN_MUTABLE) and not contains_tensor(value):
        return copy.deepcopy(value)
    return MISSING
