"""Capture of attribute writes: snapshot, diff, restore.

This is the compile-time half shared by both layers.  Around one traced op (the
Dynamo layer) or one AOTAutograd tracing pass (the AOT layer), an instance's
``__dict__`` is snapshotted, the writes made meanwhile are read off as
``AttributeWrite`` records, and the instance can be put back exactly as it was,
so the next tracing pass starts from the entry state (pytorch #130028, problem 1).

It also decides which written values can be replayed exactly after a compiled
call (``classify_value``).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .errors import RefusalKind


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<missing>"


#: Stands for "the attribute is absent" on either side of a write.
MISSING: Any = _Missing()

# Containers whose in-place mutation a snapshot can detect by value.
_PLAIN_MUTABLE = (list, dict, set, bytearray)

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


@dataclasses.dataclass(frozen=True)
class AttributeWrite:
    """One attribute of one instance changed between two snapshots."""

    name: str
    old: Any  # MISSING when the attribute did not exist
    new: Any  # MISSING when the attribute was deleted
    in_place: bool = False  # the same container object was mutated


# Values computed by the traced program: compared by identity (== on a SymInt would
# add a guard), replayed as graph outputs.
GRAPH_VALUE_TYPES = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)


def _same_value(old: Any, new: Any) -> bool:
    if old is new:
        return True
    if isinstance(old, GRAPH_VALUE_TYPES) or isinstance(new, GRAPH_VALUE_TYPES):
        return False
    if type(old) is not type(new):
        return False
    try:
        return bool(old == new)
    except Exception:
        return False


def _contains_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_contains_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_contains_tensor(v) for v in value.values())
    return False


# Attributes torch's C++ caches on the Python object of a subclass with custom sizes or
# strides (NestedTensor): a capsule and its length, written and read by torch itself
# (torch/csrc/PyInterpreter.cpp). Not the subclass's state: never diffed, answered,
# seeded or restored; copying the length without the capsule aborts the process.
TORCH_INTERNAL_ATTRS = frozenset(
    name + suffix
    for name in ("_sizes_capsule", "_strides_capsule", "_sym_sizes_capsule", "_sym_strides_capsule")
    for suffix in ("", "_len")
)


def user_state(d: dict) -> dict:
    """``d`` (an instance ``__dict__``) without torch's own cache entries."""
    if TORCH_INTERNAL_ATTRS.isdisjoint(d):
        return d
    return {k: v for k, v in d.items() if k not in TORCH_INTERNAL_ATTRS}


class InstanceSnapshot:
    """The ``__dict__`` of one instance at one moment."""

    __slots__ = ("obj", "entries", "_deep")

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.entries = dict(user_state(obj.__dict__))
        # Plain containers can be mutated in place without rebinding the
        # attribute; keep a copy of their contents so that is not missed.
        self._deep = {
            k: copy.deepcopy(v)
            for k, v in self.entries.items()
            if isinstance(v, _PLAIN_MUTABLE) and not _contains_tensor(v)
        }

    def note_seeded(self, name: str, value: Any) -> None:
        """An attribute was copied in from the real input: it is entry state, not a write."""
        self.entries[name] = value
        if isinstance(value, _PLAIN_MUTABLE) and not _contains_tensor(value):
            self._deep[name] = copy.deepcopy(value)

    def writes(self) -> list[AttributeWrite]:
        now = user_state(self.obj.__dict__)
        out = []
        for name, new in now.items():
            old = self.entries.get(name, MISSING)
            if old is new:
                if name in self._deep and self._deep[name] != new:
                    out.append(AttributeWrite(name, self._deep[name], new, in_place=True))
                continue
            if old is not MISSING and _same_value(old, new):
                continue
            out.append(AttributeWrite(name, old, new))
        for name, old in self.entries.items():
            if name not in now:
                out.append(AttributeWrite(name, old, MISSING))
        return out

    def restore(self) -> None:
        d = self.obj.__dict__
        internal = {k: d[k] for k in TORCH_INTERNAL_ATTRS if k in d}  # torch's, left as they are
        d.clear()
        d.update(self.entries)
        d.update(internal)
        for name, contents in self._deep.items():
            # An in-place mutation changed the container itself: put its contents back.
            container = self.entries[name]
            if container != contents:
                if isinstance(container, dict):
                    container.clear()
                    container.update(copy.deepcopy(contents))
                elif isinstance(container, set):
                    container.clear()
                    container.update(copy.deepcopy(contents))
                else:
                    container[:] = copy.deepcopy(contents)


class ValueKind(enum.Enum):
    CONSTANT = "constant"  # immutable, rebuilt by the residual bytecode
    TENSOR = "tensor"
    SYMBOLIC = "symbolic"  # a SymInt/SymFloat/SymBool (dynamic shapes): a graph output
    DELETE = "delete"
    MUTABLE = "mutable"  # a fresh mutable object: eager identity cannot be replayed
    OPAQUE = "opaque"  # an object the replay cannot rebuild


def is_immutable_constant(value: Any) -> bool:
    """Values the residual bytecode can rebuild exactly: immutable and tensor-free."""
    if isinstance(value, _SCALAR_CONSTANTS):
        return True
    if isinstance(value, torch.Size):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(is_immutable_constant(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        params = getattr(type(value), "__dataclass_params__", None)
        return bool(params is not None and params.frozen) and all(
            is_immutable_constant(getattr(value, f.name)) for f in dataclasses.fields(value)
        )
    return False


def classify_value(value: Any) -> ValueKind:
    if value is MISSING:
        return ValueKind.DELETE
    if isinstance(value, torch.Tensor):
        return ValueKind.TENSOR
    if isinstance(value, GRAPH_VALUE_TYPES):
        return ValueKind.SYMBOLIC
    if is_immutable_constant(value):
        return ValueKind.CONSTANT
    if isinstance(value, _PLAIN_MUTABLE) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    ):
        return ValueKind.MUTABLE
    return ValueKind.OPAQUE


def refusal_for(write: AttributeWrite) -> tuple[RefusalKind, str] | None:
    """Why a write cannot be replayed exactly, as ``(kind, value type name)``; None if it can.

    One decision for both layers: the Dynamo layer turns it into a graph break, the
    AOTAutograd layer into a ``SubclassWriteError``.
    """
    if write.in_place:
        return RefusalKind.IN_PLACE_MUTATION, type(write.new).__name__
    kind = classify_value(write.new)
    if kind is ValueKind.DELETE:
        return RefusalKind.DELETED_ATTRIBUTE, type(write.old).__name__
    if kind is ValueKind.MUTABLE:
        return RefusalKind.MUTABLE_VALUE, type(write.new).__name__
    if kind is ValueKind.OPAQUE:
        return RefusalKind.OPAQUE_VALUE, type(write.new).__name__
    return None


def seed_copy(value: Any) -> Any:
    """The copy of a real input's non-tensor attribute that a traced instance gets.

    Immutable constants are shared; plain containers of constants are deep-copied
    so a trace cannot mutate the real input.  Anything else returns ``MISSING``:
    it cannot be carried into a trace.
    """
    if is_immutable_constant(value):
        return value
    if isinstance(value, _PLAIN_MUTABLE) and not _contains_tensor(value):
        return copy.deepcopy(value)
    return MISSING


def is_watched_type(value: Any) -> bool:
    return is_traceable_wrapper_subclass(value)
