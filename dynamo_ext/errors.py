"""Refusals: writes dynamo_ext cannot replay exactly.

A refusal is raised through Dynamo's own graph-break mechanism
(``torch._dynamo.exc.unimplemented``), so that under ``fullgraph=True`` the
user gets an ``Unsupported`` error and under ``fullgraph=False`` Dynamo breaks
the graph before the op and runs it eagerly (eager semantics, the reason is in
``torch._dynamo.explain``).  Every refusal has a stable ``kind``; the message
names the subclass, the attribute, the value type, why, and what to do.
"""

from __future__ import annotations

import enum
from typing import NoReturn


class RefusalKind(str, enum.Enum):
    #: A fresh mutable object (list, dict, set, non-frozen dataclass) was written.
    MUTABLE_VALUE = "mutable_value"
    #: An existing container attribute was mutated in place.
    IN_PLACE_MUTATION = "in_place_mutation"
    #: A value the residual bytecode cannot rebuild (arbitrary object, real tensor).
    OPAQUE_VALUE = "opaque_value"
    #: The write happened inside a higher-order-op body (cond, checkpoint, ...).
    WRITE_IN_HOP = "write_in_hop"
    #: Dispatch read an attribute of the real input that cannot be carried into the trace.
    UNSUPPORTED_STATE_READ = "unsupported_state_read"
    #: An attribute was deleted (``del self.attr``).
    DELETED_ATTRIBUTE = "deleted_attribute"
    #: A write made while the backward was traced (on an input saved for backward).
    WRITE_IN_BACKWARD = "write_in_backward"
    #: An AOTAutograd entry point that has no run-time epilogue (export, aot_export_*).
    UNREPLAYABLE_ENTRY = "unreplayable_entry"
    #: An inner tensor's sizes/strides were changed in place (``self.elem.t_()``).
    INNER_METADATA_MUTATION = "inner_metadata_mutation"
    #: A directly compiled AOTAutograd function called with state other than it was traced with.
    STALE_PLAN = "stale_plan"
    #: AOTAutograd's passes disagree with each other or with what Dynamo recorded.
    INCONSISTENT_PASSES = "inconsistent_passes"
    #: The traced instance does not hold the input's state (flatten/unflatten do not round-trip it).
    FLATTEN_ROUND_TRIP = "flatten_round_trip"

    @property
    def gb_type(self) -> str:
        return f"dynamo_ext: {self.value}"


_WHY = {
    RefusalKind.MUTABLE_VALUE: (
        "In eager the attribute then holds a new mutable object that later code may mutate "
        "or share; the compiled program can only rebuild a copy after the graph, so identity "
        "and later in-place changes would differ from eager."
    ),
    RefusalKind.IN_PLACE_MUTATION: (
        "An existing container held by the attribute was mutated in place. The compiled "
        "program replays attribute assignments only; an in-place change to a shared object "
        "cannot be replayed exactly."
    ),
    RefusalKind.OPAQUE_VALUE: (
        "The compiled program rebuilds written values after the graph. It can rebuild "
        "immutable constants (numbers, strings, enums, dtypes, devices, tuples and frozen "
        "dataclasses of these) and tensors computed in the graph, not this value."
    ),
    RefusalKind.WRITE_IN_HOP: (
        "The write happened while tracing the body of a higher-order op (torch.cond, "
        "activation checkpointing, ...). Such bodies may run a different number of times "
        "than traced, so a write made there cannot be replayed once after the graph."
    ),
    RefusalKind.UNSUPPORTED_STATE_READ: (
        "__torch_dispatch__ read an attribute of the input that is not part of "
        "__tensor_flatten__ and whose value cannot be carried into the traced program."
    ),
    RefusalKind.DELETED_ATTRIBUTE: (
        "Dynamo's residual bytecode in torch 2.13 replays attribute deletions only on "
        "plain Python objects, not on tensor inputs, so the deletion would be lost."
    ),
    RefusalKind.WRITE_IN_BACKWARD: (
        "The write happened in the backward. dynamo_ext replays a backward write when the "
        "compiled backward runs if its value is a constant and the forward does not write "
        "the same attribute (the traced backward starts from the state before the forward); "
        "this one is not such a write."
    ),
    RefusalKind.UNREPLAYABLE_ENTRY: (
        "This AOTAutograd entry point (torch.export, aot_export_*) produces a graph with "
        "no run-time epilogue, so the write would be silently dropped."
    ),
    RefusalKind.INNER_METADATA_MUTATION: (
        "An inner tensor of the subclass had its sizes or strides changed in place; "
        "AOTAutograd cannot represent an in-place metadata change of a subclass input "
        "(stock: 'Metadata mutations are currently not allowed on tensor subclasses')."
    ),
    RefusalKind.STALE_PLAN: (
        "The function was compiled with AOTAutograd directly (no Dynamo, so no guards) "
        "while the input held another value of this attribute; replaying the traced "
        "write now would leave a value eager would not."
    ),
    RefusalKind.INCONSISTENT_PASSES: (
        "AOTAutograd traced the function several times and the attribute writes differed "
        "between passes (or from what Dynamo recorded), so there is no single write to replay."
    ),
    RefusalKind.FLATTEN_ROUND_TRIP: (
        "torch.compile traces the op on an instance rebuilt with __tensor_flatten__ / "
        "__tensor_unflatten__, and that instance does not hold the input's value of this "
        "attribute (unflatten drops or resets it, or a class-level default hides it), so "
        "the traced write was computed from state eager would not see."
    ),
}

_HINTS = {
    RefusalKind.MUTABLE_VALUE: [
        "Store an immutable value instead (a tuple instead of a list, a frozen dataclass).",
        "Or list the state in the __tensor_flatten__ ctx as immutable values.",
    ],
    RefusalKind.IN_PLACE_MUTATION: [
        "Assign a new immutable value (self.log = self.log + (item,)) instead of mutating.",
    ],
    RefusalKind.OPAQUE_VALUE: [
        "Write an immutable constant or a tensor computed from the inputs instead.",
        "A real tensor captured from outside the traced program cannot be replayed: "
        "compute it inside __torch_dispatch__ or pass it in as an input.",
    ],
    RefusalKind.WRITE_IN_HOP: [
        "Move the op that writes outside the higher-order op's body.",
        "Or wrap the writing region with torch._dynamo.disable so it runs eagerly.",
    ],
    RefusalKind.UNSUPPORTED_STATE_READ: [
        "Carry the state in __tensor_flatten__ (tensors as inner tensors, constants in ctx).",
        "Or store an immutable constant or a tensor in that attribute.",
    ],
    RefusalKind.DELETED_ATTRIBUTE: [
        "Reset the attribute to None instead of deleting it.",
    ],
    RefusalKind.WRITE_IN_BACKWARD: [
        "Record a constant in the backward, in an attribute the forward leaves alone.",
        "Or make the write on the gradient instead of the saved input.",
    ],
    RefusalKind.UNREPLAYABLE_ENTRY: [
        "Use torch.compile, or apply the state change outside the exported program.",
    ],
    RefusalKind.INNER_METADATA_MUTATION: [
        "Assign a new tensor instead (self.elem = self.elem.t() rather than self.elem.t_()): "
        "dynamo_ext replays that write.",
    ],
    RefusalKind.STALE_PLAN: [
        "Compile again for this state (call aot_function / aot_module_simplified again).",
        "Or use torch.compile, whose guards recompile when the state changes.",
    ],
    RefusalKind.INCONSISTENT_PASSES: [
        "Make the write depend only on the subclass's flatten state and the op's inputs.",
    ],
    RefusalKind.FLATTEN_ROUND_TRIP: [
        "Make __tensor_unflatten__ restore every ctx entry and inner tensor "
        "__tensor_flatten__ returns.",
        "Keep state outside the ctx out of class-level defaults (set it in __init__ or "
        "read it with getattr(self, name, default)).",
    ],
}


def explain(kind: RefusalKind, cls_name: str, attr: str, value_type: str) -> str:
    if kind is RefusalKind.UNSUPPORTED_STATE_READ:
        what = f"read attribute {attr!r} (value of type {value_type}) of a graph input"
        cannot = "cannot carry it into the traced program"
    elif kind is RefusalKind.FLATTEN_ROUND_TRIP:
        what = f"wrote on a graph input whose attribute {attr!r} (value of type {value_type}) the traced instance does not hold"
        cannot = "cannot replay its writes exactly"
    else:
        what = f"wrote attribute {attr!r} (value of type {value_type}) on a graph input"
        cannot = "cannot replay it exactly"
    return f"{cls_name}.__torch_dispatch__ {what}, and dynamo_ext {cannot}. {_WHY[kind]}"


def refuse(kind: RefusalKind, cls_name: str, attr: str, value_type: str, context: str = "") -> NoReturn:
    """Raise a Dynamo graph break (``Unsupported``) for a write that cannot be replayed."""
    from torch._dynamo.exc import unimplemented

    unimplemented(
        gb_type=kind.gb_type,
        context=context or f"{cls_name}.{attr} <- {value_type}",
        explanation=explain(kind, cls_name, attr, value_type),
        hints=list(_HINTS[kind]),
    )


class SubclassWriteError(RuntimeError):
    """A refused write outside Dynamo (AOTAutograd called directly)."""

    def __init__(self, kind: RefusalKind, cls_name: str, attr: str, value_type: str, context: str = "") -> None:
        self.kind = kind
        hints = "\n".join(f"  - {h}" for h in _HINTS[kind])
        msg = f"[{kind.gb_type}] {explain(kind, cls_name, attr, value_type)}\nHints:\n{hints}"
        if context:
            msg += f"\nDeveloper context: {context}"
        super().__init__(msg)
