"""Refusals: reads and writes dynamo_ext cannot carry into a compiled program exactly.

One record per kind (``REFUSALS``): the stable ``kind`` string (no run-time data,
usable in tests and docs), what happened and why, what the user can do, which layer
raises it and as which exception.  Under Dynamo a refusal is a graph break
(``torch._dynamo.exc.unimplemented``): ``Unsupported`` under ``fullgraph=True``,
the op or frame run eagerly otherwise, the reason in ``torch._dynamo.explain`` and
the logs.  Outside Dynamo (AOTAutograd called directly) it is a ``SubclassWriteError``.
The README's refusal table is checked against these records by a test.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NoReturn


class RefusalKind(str, enum.Enum):
    MUTABLE_VALUE = "mutable_value"
    IN_PLACE_MUTATION = "in_place_mutation"
    OPAQUE_VALUE = "opaque_value"
    WRITE_IN_HOP = "write_in_hop"
    UNSUPPORTED_STATE_READ = "unsupported_state_read"
    DELETED_ATTRIBUTE = "deleted_attribute"
    WRITE_IN_BACKWARD = "write_in_backward"
    CHANGED_BEFORE_BACKWARD = "changed_before_backward"
    UNREPLAYABLE_ENTRY = "unreplayable_entry"
    INNER_METADATA_MUTATION = "inner_metadata_mutation"
    STALE_PLAN = "stale_plan"
    INCONSISTENT_PASSES = "inconsistent_passes"
    FLATTEN_ROUND_TRIP = "flatten_round_trip"
    GLOBAL_STATE_WRITE = "global_state_write"
    DISPATCH_RAISED = "dispatch_raised"
    TRACED_OPS_DIFFER = "traced_ops_differ"

    @property
    def gb_type(self) -> str:
        return f"dynamo_ext: {self.value}"

    @property
    def record(self) -> "Refusal":
        return REFUSALS[self]


@dataclasses.dataclass(frozen=True)
class Refusal:
    kind: RefusalKind
    summary: str  # one line, for the README table
    why: str  # the explanation in the error
    hints: tuple[str, ...]
    layer: str  # "Dynamo", "AOTAutograd" or "both"
    what: str = "wrote attribute {attr!r} (value of type {value_type}) on a traced object"
    raised_as: str = "Unsupported (graph break) under Dynamo; SubclassWriteError from AOTAutograd called directly"


_READ = "read attribute {attr!r} (value of type {value_type}) of the object a traced instance stands for"

REFUSALS: dict[RefusalKind, Refusal] = {
    r.kind: r
    for r in [
        Refusal(
            RefusalKind.MUTABLE_VALUE,
            "A fresh list, dict, set or non-frozen dataclass was written.",
            "In eager the attribute then holds a new mutable object that later code may mutate "
            "or share; the compiled program can only rebuild a copy after the graph, so identity "
            "and later in-place changes would differ from eager.",
            (
                "Store an immutable value instead (a tuple instead of a list, a frozen dataclass).",
                "Or list the state in the __tensor_flatten__ ctx as immutable values.",
            ),
            "both",
        ),
        Refusal(
            RefusalKind.IN_PLACE_MUTATION,
            "A container held by an attribute was mutated in place.",
            "The compiled program replays attribute assignments only; an in-place change to a "
            "container cannot be replayed exactly.",
            ("Assign a new immutable value (self.log = self.log + (item,)) instead of mutating.",),
            "both",
        ),
        Refusal(
            RefusalKind.OPAQUE_VALUE,
            "A value the compiled program cannot rebuild was written (an arbitrary object, a real tensor from outside the program).",
            "The compiled program rebuilds written values after the graph. It can rebuild "
            "immutable constants (numbers, strings, enums, dtypes, devices, tuples and frozen "
            "dataclasses of these), tensors and symbolic sizes computed in the graph, not this value.",
            (
                "Write an immutable constant or a tensor computed from the inputs instead.",
                "A real tensor captured from outside the traced program cannot be replayed: "
                "compute it inside __torch_dispatch__ or pass it in as an input.",
            ),
            "both",
        ),
        Refusal(
            RefusalKind.WRITE_IN_HOP,
            "A write inside a higher-order op body (checkpoint, an `autograd.Function`, cond, map, ...).",
            "Such bodies may run a different number of times than traced, so a write made there "
            "cannot be replayed once after the graph.",
            (
                "Move the op that writes outside the higher-order op's body.",
                "Or wrap the writing region with torch._dynamo.disable so it runs eagerly.",
            ),
            "Dynamo",
        ),
        Refusal(
            RefusalKind.UNSUPPORTED_STATE_READ,
            "Dispatch read state the traced program cannot carry or guard (an arbitrary object, a "
            "tensor inside a higher-order op body, a real tensor a shared state object no input "
            "reaches holds, a size mark_dynamic keeps symbolic given as a number); a Function's "
            "backward or an intermediate's hook reads state dispatch writes.",
            "The compiled program can only depend on state it can carry in (tensors as graph "
            "inputs, constants and symbolic ints it guards on); this value could change without "
            "the compiled program noticing.",
            (
                "Carry the state in __tensor_flatten__ (tensors as inner tensors, constants in ctx).",
                "Or store an immutable constant, an int or a tensor in that attribute.",
                "Register shared mutable state objects with dynamo_ext.register_ctx_state.",
            ),
            "both",
            what=_READ,
        ),
        Refusal(
            RefusalKind.DELETED_ATTRIBUTE,
            "An attribute was deleted (del self.attr).",
            "Dynamo's residual bytecode replays attribute deletions only on plain Python "
            "objects, not on tensors, so the deletion would be lost.",
            ("Reset the attribute to None instead of deleting it.",),
            "both",
            what="deleted attribute {attr!r} (it held a {value_type}) on a traced object",
        ),
        Refusal(
            RefusalKind.WRITE_IN_BACKWARD,
            "A backward write that cannot be replayed when the compiled backward runs (a gradient's ctx "
            "value unknown at run time, a partial backward's unknown writes, a saved output, a tensor on "
            "a gradient, checkpointing, saved-tensor hooks, create_graph=True).",
            "dynamo_ext replays a backward write when the compiled backward runs if its value is a "
            "constant or an int computed from the state the backward read, and the forward does "
            "not write the same attribute; this one is not such a write.",
            (
                "Record a constant or count in the backward, in an attribute the forward leaves alone.",
                "Or make the write on the gradient instead of the saved input.",
                "A gradient's flatten ctx is rebuilt as traced, its sizes and counts with each call's "
                "values: keep other values computed while traced out of the ctx that dispatch gives "
                "the tensors the backward returns.",
                "A backward run for part of the graph (autograd.grad of some inputs, an output with no "
                "gradient whose ops write): run the whole backward, or compile those outputs apart.",
                "A tensor dispatch leaves on a gradient reaches x.grad (autograd's detach is tagged "
                "again): read it there, not from autograd.grad's result or a tensor hook.",
            ),
            "AOTAutograd",
        ),
        Refusal(
            RefusalKind.CHANGED_BEFORE_BACKWARD,
            "State the compiled backward reads changed between its forward and backward() (a "
            "knob set by the user, a count moved on by another forward or an earlier backward).",
            "The backward was compiled for the value it read when the forward ran; eager's "
            "backward would read the new one, so running it would give other gradients or "
            "state. Raised when that backward runs, before its gradients are accumulated.",
            (
                "Set the attribute before the forward, or call backward() before changing it.",
                "Or run that backward eagerly (compile the forward only where the state is stable).",
            ),
            "AOTAutograd",
            what="read attribute {attr!r} (value of type {value_type}) in the compiled backward",
            raised_as="SubclassWriteError from backward()",
        ),
        Refusal(
            RefusalKind.UNREPLAYABLE_ENTRY,
            "A write under an entry point with no run-time epilogue (torch.export, aot_export_*).",
            "The exported program has no place to replay the write, so it would be silently dropped.",
            ("Use torch.compile, or apply the state change outside the exported program.",),
            "both",
        ),
        Refusal(
            RefusalKind.INNER_METADATA_MUTATION,
            "Tensor metadata changed in place: an inner tensor's sizes or strides (self.elem.t_()), its "
            "data on a parameter with grad on or in the backward; the class or autograd state of an input, "
            "its inner tensors or a tensor the op is handed (self.__class__ = C, requires_grad_, .grad, "
            "register_hook), or set by hand on a tensor dispatch makes.",
            "AOTAutograd cannot represent an in-place metadata change of a subclass input "
            "(stock: 'Metadata mutations are currently not allowed on tensor subclasses'), nor "
            "write back an inner tensor's in-place data change under autograd (stock returns "
            "None from the compiled function or fails to partition the graph); the class or autograd "
            "state dispatch sets changes only the traced objects (the compiled program makes its "
            "tensors as graph outputs, without it), and the compiled program cannot replay it.",
            (
                "Assign a new tensor instead (self.elem = self.elem.t() rather than self.elem.t_(), "
                "self.history = torch.roll(self.history, 1) rather than copy_): dynamo_ext replays that write.",
            ),
            "both",
        ),
        Refusal(
            RefusalKind.STALE_PLAN,
            "A function compiled with AOTAutograd directly was called with state other than it "
            "was traced with; or a shared state object no input reaches, with no replay "
            "function, changed since it was traced.",
            "No guard covers this state (AOTAutograd called directly has none; a shared object "
            "found through a cache is reachable from no input); replaying the traced write now "
            "would leave a value eager would not.",
            (
                "Compile again for this state (call aot_function / aot_module_simplified again).",
                "Or use torch.compile, whose guards recompile when the state changes.",
                "For a shared state class, register a replay function: "
                "register_ctx_state(cls, replay=...).",
            ),
            "AOTAutograd",
            what=_READ,
            raised_as="SubclassWriteError at call time (direct AOTAutograd use only)",
        ),
        Refusal(
            RefusalKind.INCONSISTENT_PASSES,
            "AOTAutograd's tracing passes wrote different values (the value depends on how the op was traced).",
            "AOTAutograd traced the function several times and the attribute writes differed "
            "between passes (or from what Dynamo recorded), so there is no single write to replay.",
            ("Make the write depend only on the subclass's state and the op's inputs, not on the traced tensor types.",),
            "AOTAutograd",
        ),
        Refusal(
            RefusalKind.FLATTEN_ROUND_TRIP,
            "Dispatch read an inner tensor that __tensor_unflatten__ does not restore.",
            "torch.compile traces the op on an instance rebuilt with __tensor_flatten__ / "
            "__tensor_unflatten__; that instance lacks this inner tensor the input flattens to, "
            "so the traced op would not see the input's state.",
            ("Make __tensor_unflatten__ restore every inner tensor __tensor_flatten__ returns.",),
            "both",
            what=_READ,
        ),
        Refusal(
            RefusalKind.GLOBAL_STATE_WRITE,
            "Dispatch changed state outside the tensors: a module global or container (a global log list), a class attribute (a class-level counter), a cache or a library object changed in place.",
            "The compiled program replays attribute writes on the objects the op reaches; a "
            "change to a module's globals made while tracing would happen once, at compile "
            "time, instead of on every call.",
            (
                "Keep the state on the tensor (an attribute, or a registered ctx-state object).",
                "Or run the op eagerly (torch._dynamo.disable on the code that logs).",
            ),
            "both",
            what="changed the global state {attr!r} ({value_type})",
        ),
        Refusal(
            RefusalKind.DISPATCH_RAISED,
            "Dispatch raised an exception while traced, or caught one torch raised (a budget check; "
            "`divmod` or numpy on a symbolic count or size; a branch on tensor data; "
            "`numpy()` on a traced tensor).",
            "In eager the exception leaves the state dispatch wrote before raising; a compiled "
            "program cannot raise it at run time, nor branch on tensor data while traced. The op "
            "runs eagerly (fullgraph=False), where it raises as in eager.",
            (
                "Let the frame graph-break (fullgraph=False): the op then raises exactly as in eager.",
                "Or check the condition in user code before the compiled call.",
                "On counts and sizes, use what symbolic ints support (//, %, +, *, comparisons).",
                "On tensor data, compute with torch.where instead of an if.",
            ),
            "both",
            what="raised {value_type} while traced (state {attr!r})",
        ),
        Refusal(
            RefusalKind.TRACED_OPS_DIFFER,
            "Traced, a writing class's dispatch would be handed other ops than in eager (Python "
            "decompositions: `dropout`, a batched `matmul`; `torch.inference_mode`; its own `__iter__`), "
            "or a tensor Dynamo does not track.",
            "What dispatch writes may hang on the ops it is handed, so the compiled program could "
            "write otherwise than eager. The op runs eagerly (fullgraph=False), as in eager.",
            (
                "Let the frame graph-break (fullgraph=False): the op then runs eagerly.",
                "Under torch.inference_mode, compile the call under torch.no_grad() instead.",
            ),
            "both",
            what="would be handed other ops than in eager ({value_type})",
        ),
    ]
}


def refusal_table() -> str:
    """The README's table of refusal kinds, made from the records (a test keeps them equal)."""
    lines = ["| kind (`gb_type`) | when | raised by |", "|---|---|---|"]
    for r in REFUSALS.values():
        lines.append(f"| `{r.kind.gb_type}` | {r.summary} | {r.layer} |")
    return "\n".join(lines)


def explain(kind: RefusalKind, cls_name: str, attr: str, value_type: str, reader: str = "") -> str:
    """``reader``: the code that read or wrote, where it is not the class's dispatch."""
    record = REFUSALS[kind]
    what = record.what.format(attr=attr, value_type=value_type)
    who = f"{reader} ({cls_name})" if reader else f"{cls_name}.__torch_dispatch__"
    return f"{who} {what}, and dynamo_ext cannot carry it exactly. {record.why}"


def refuse(
    kind: RefusalKind, cls_name: str, attr: str, value_type: str, context: str = "", hint: str = "", reader: str = ""
) -> NoReturn:
    """Raise a Dynamo graph break (``Unsupported``) naming the kind, class and attribute;
    ``hint``, where given, is the first of the hints (advice for this case)."""
    from torch._dynamo.exc import unimplemented

    unimplemented(
        gb_type=kind.gb_type,
        context=context or f"{cls_name}.{attr} <- {value_type}",
        explanation=explain(kind, cls_name, attr, value_type, reader),
        hints=([hint] if hint else []) + list(REFUSALS[kind].hints),
    )


class SubclassWriteError(RuntimeError):
    """A refused write or read outside Dynamo's tracing (AOTAutograd, or a run-time check)."""

    def __init__(self, kind: RefusalKind, cls_name: str, attr: str, value_type: str, context: str = "") -> None:
        self.kind = kind
        self.attr = attr
        self.context = context
        hints = "\n".join(f"  - {h}" for h in REFUSALS[kind].hints)
        msg = f"[{kind.gb_type}] {explain(kind, cls_name, attr, value_type)}\nHints:\n{hints}"
        if context:
            msg += f"\nDeveloper context: {context}"
        super().__init__(msg)
