"""AOTAutograd layer: catch, unwind and replay the writes Dynamo did not record.

AOTAutograd traces the function it is given several times (metadata analysis,
subclass metadata, the final trace, debug re-traces), each time on fresh
subclass instances rebuilt by ``__tensor_unflatten__``.  Dispatch runs again in
every pass and writes on those instances (pytorch #130028, problem 1: a pass
that starts from another pass's state traces something else; a flatten list
that grew fails AOTAutograd's ``has_metadata_mutation`` with ``expected
FakeTensor for arg, got NoneType``).

Compile time (``TracingPass``, wrapped around the traced function):

- each pass starts from the entry state: the instances get the constant state of
  the real inputs that ``__tensor_unflatten__`` cannot restore, and are put back
  exactly as they were when the pass returns;
- the writes a pass made are read off and planned (``WritePlan``): constants are
  kept, aliases of inputs are remembered by position, and new tensor values are
  appended to the traced function's outputs (problem 2: the epilogue needs them
  as real tensors);
- every pass must plan the same writes, or the compile is refused;
- writes the Dynamo layer already recorded for this graph are left to Dynamo's
  residual bytecode (never applied twice).

Run time (``WritePlan.replay``, wrapped around the compiled callable): the extra
outputs are stripped from what the caller sees and the planned writes are set on
the real inputs, in the order dispatch made them.

Entry points: ``aot_module_simplified`` (used by Dynamo's ``aot_eager`` and
``inductor`` and by ``torch._dynamo.backends.common.aot_autograd`` backends),
``aot_function`` and ``aot_module`` called directly.  Graphs with subclass
inputs bypass AOTAutogradCache while enabled: a cache hit skips every trace, so
the write plan would be unknown (inductor's FX graph cache still applies, it
caches the traced graph, extra outputs included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree

from . import config
from .capture import (
    MISSING,
    AttributeWrite,
    InstanceSnapshot,
    ValueKind,
    _same_value,
    classify_value,
    is_watched_type,
    refusal_for,
    seed_copy,
    user_state,
)
from .ctx_state import Journal
from .errors import RefusalKind, SubclassWriteError

_local = threading.local()


def _stack(name: str) -> list:
    stack = getattr(_local, name, None)
    if stack is None:
        stack = []
        setattr(_local, name, stack)
    return stack


@contextlib.contextmanager
def _pushed(name: str, item: Any) -> Iterator[None]:
    stack = _stack(name)
    stack.append(item)
    try:
        yield
    finally:
        stack.pop()


def _top(name: str) -> Any:
    stack = _stack(name)
    return stack[-1] if stack else None


class _Marker:
    """A named sentinel for a value the plan knows only by its kind."""

    def __init__(self, text: str) -> None:
        self._text = text

    def __repr__(self) -> str:
        return self._text


#: What the Dynamo layer recorded for a write whose value is a tensor or symbolic size.
GRAPH_VALUE = _Marker("<a graph value>")


@contextlib.contextmanager
def dynamo_handled(writes: dict[int, dict[str, Any]], observed: dict[int, dict[str, Any]]) -> Iterator[None]:
    """While Dynamo compiles a graph: ``{id(real input): {name: value}}`` its residual
    bytecode replays; ``observed``: the same seen but not recorded (Dynamo layer off)."""
    with _pushed("handled", writes), _pushed("observed", observed):
        yield


# --------------------------------------------------------------------------- #
# The plan: compile-time record of what to replay
# --------------------------------------------------------------------------- #


#: ``PlannedWrite.entry`` for an attribute that held a tensor when the pass started.
HELD_TENSOR = _Marker("<a tensor>")


@dataclasses.dataclass(frozen=True)
class PlannedWrite:
    input_index: int  # position among the traced function's flat inputs
    name: str
    kind: str  # "constant" | "output" | "input" | "inner"
    value: Any = None  # the constant; the extra-output position; the input position; (position, inner name)
    entry: Any = MISSING  # the attribute's value when the pass started, if a constant (or absent); HELD_TENSOR
    obj: Any = None  # set for a write on an object reachable from a ctx (then input_index is -1)

    def signature(self) -> tuple:
        where = ("obj", id(self.obj)) if self.obj is not None else self.input_index
        return (where, self.name, self.kind, self.value if self.kind != "constant" else repr(self.value))

    def target(self, inputs: Sequence[Any]) -> Any:
        return self.obj if self.obj is not None else inputs[self.input_index]


class WritePlan:
    """The writes one compiled graph must replay, agreed on by every tracing pass."""

    def __init__(
        self, handled: dict[int, dict[str, Any]] | None = None, observed: dict[int, dict[str, Any]] | None = None
    ) -> None:
        self.real_inputs: list[Any] = []
        self.handled = handled or {}
        self.observed = observed or {}
        self.writes: list[PlannedWrite] | None = None
        self.n_extra = 0
        self.passes = 0
        self.backward_writes: list[PlannedWrite] = []
        # Registered ctx-state objects as the latest pass left them, before the undo:
        # (object, attribute, value). Compile time only; cleared when the compile ends.
        self.pass_state: list[tuple[Any, str, Any]] = []
        self._passes_after: list[list[tuple[int, InstanceSnapshot]]] = []

    # -- compile time -------------------------------------------------------

    def plan_pass(
        self,
        args: Sequence[Any],
        writes: list[tuple[int, AttributeWrite]],
        entry: dict[int, dict[str, Any]],
        object_writes: Sequence[tuple[Any, AttributeWrite]] = (),
    ) -> list[Any]:
        """Classify one pass's writes; check they agree with earlier passes; return extra outputs.

        ``writes``: on the watched arguments, by position; ``object_writes``: on objects
        reachable from a ctx (``ctx_state``); ``entry``: the attributes of each watched
        argument when the pass started.
        """
        planned: list[PlannedWrite] = []
        extras: list[Any] = []
        todo: list[tuple[int, Any, AttributeWrite]] = []
        for i, wr in writes:
            real = id(self.real_inputs[i]) if i < len(self.real_inputs) else None
            replayed = self.handled.get(real, {})  # by Dynamo's residual bytecode: not planned here
            seen = replayed.get(wr.name, self.observed.get(real, {}).get(wr.name, MISSING))
            if seen is not MISSING:
                self._check_against_dynamo(args, i, wr, seen)
            if wr.name not in replayed:
                todo.append((i, None, wr))
        todo += [(-1, obj, wr) for obj, wr in object_writes]
        for index, obj, wr in todo:
            bad = refusal_for(wr)
            if bad is not None:
                cls_name = type(obj if obj is not None else args[index]).__name__
                raise SubclassWriteError(bad[0], cls_name, wr.name, bad[1])
            if classify_value(wr.new) is ValueKind.CONSTANT:
                write = PlannedWrite(index, wr.name, "constant", wr.new)
            else:  # a tensor or a symbolic size
                write = self._plan_graph_value(args, index, wr, entry, extras)
            if wr.old is MISSING or classify_value(wr.old) is ValueKind.CONSTANT:
                write = dataclasses.replace(write, entry=wr.old)
            elif isinstance(wr.old, torch.Tensor):
                write = dataclasses.replace(write, entry=HELD_TENSOR)
            planned.append(dataclasses.replace(write, obj=obj) if obj is not None else write)
        self.passes += 1
        if self.writes is None:
            self.writes, self.n_extra = planned, len(extras)
        elif [p.signature() for p in planned] != [p.signature() for p in self.writes]:
            first = (planned or self.writes)[0]
            raise SubclassWriteError(
                RefusalKind.INCONSISTENT_PASSES,
                type(first.target(args)).__name__,
                first.name,
                "see context",
                context=f"pass 1 planned {self.writes}; pass {self.passes} planned {planned}",
            )
        return extras

    @staticmethod
    def _check_against_dynamo(args: Sequence[Any], index: int, wr: AttributeWrite, recorded: Any) -> None:
        """The constant Dynamo's fake propagation wrote must be the one this pass
        computed, or the value depends on how the op was traced (e.g. on the inner
        tensors' type) and no traced value is known to be eager's."""
        if recorded is GRAPH_VALUE or classify_value(wr.new) is not ValueKind.CONSTANT:
            return
        if not _same_value(recorded, wr.new):
            raise SubclassWriteError(
                RefusalKind.INCONSISTENT_PASSES,
                type(args[index]).__name__,
                wr.name,
                type(wr.new).__name__,
                context=f"Dynamo recorded {wr.name}={recorded!r}; an AOTAutograd pass wrote {wr.new!r}",
            )

    @staticmethod
    def _plan_graph_value(
        args: Sequence[Any],
        index: int,
        wr: AttributeWrite,
        entry: dict[int, dict[str, Any]],
        extras: list[Any],
    ) -> PlannedWrite:
        value = wr.new
        for j, a in enumerate(args):
            if value is a:
                return PlannedWrite(index, wr.name, "input", j)
        # An alias of a tensor some input already held when the pass started.
        for j, attrs in entry.items():
            for attr, held in attrs.items():
                if value is held:
                    return PlannedWrite(index, wr.name, "inner", (j, attr))
        extras.append(value)
        return PlannedWrite(index, wr.name, "output", len(extras) - 1)

    def remember_pass(self, snaps: list[tuple[int, InstanceSnapshot]]) -> None:
        """The instances of a finished pass, as restored: anything written on them later
        was written by the backward, which AOTAutograd traces after the forward returned."""
        self._passes_after.append(snaps)

    def forget_passes(self) -> None:
        """Drop the traced instances kept for ``plan_backward`` (they hold fake and
        functional tensors): the plan lives as long as the compiled function."""
        self._passes_after = []

    def plan_backward(self) -> None:
        """Plan the writes the backward made (constants), replayed once per backward call.

        The backward of a traced pass ran on instances restored to the entry state,
        while eager's backward sees the state the forward left: exact only for attributes
        the forward did not write, so the others are refused.
        """
        late: dict[tuple[int, str], PlannedWrite] = {}
        forward = {(w.input_index, w.name) for w in self.writes or ()}
        for snaps in self._passes_after:
            for index, snap in snaps:
                for wr in snap.writes():
                    real = self.real_inputs[index] if index < len(self.real_inputs) else None
                    planned = PlannedWrite(index, wr.name, "constant", wr.new, entry=wr.old)
                    kind, why = RefusalKind.WRITE_IN_BACKWARD, None
                    if classify_value(wr.new) is not ValueKind.CONSTANT or wr.in_place:
                        why = "only constant writes are replayed at backward time"
                    elif (index, wr.name) in forward or wr.name in self.handled.get(id(real), ()):
                        why = "the forward writes the same attribute"
                    elif late.setdefault((index, wr.name), planned).signature() != planned.signature():
                        kind, why = RefusalKind.INCONSISTENT_PASSES, "passes wrote different values"
                    if why:
                        raise SubclassWriteError(kind, type(snap.obj).__name__, wr.name, type(wr.new).__name__, why)
        self.backward_writes = list(late.values())

    # -- run time -----------------------------------------------------------

    def check_entry_state(self, inputs: Sequence[Any], writes: Sequence[PlannedWrite] | None = None) -> None:
        """Refuse a call whose inputs do not hold the state the writes were traced from
        (the plan would replay stale values). Needed where no Dynamo guard covers it:
        direct AOTAutograd calls, and writes made in the backward."""
        for w in self.writes or () if writes is None else writes:
            obj = w.target(inputs)
            now = obj.__dict__.get(w.name, MISSING)
            if w.entry is MISSING and now is MISSING:
                continue
            if w.entry is HELD_TENSOR and isinstance(now, torch.Tensor):
                continue  # which tensor is the graph's business: Dynamo guards it as an input
            if w.entry is MISSING or now is MISSING or classify_value(now) is not ValueKind.CONSTANT or now != w.entry:
                raise SubclassWriteError(
                    RefusalKind.STALE_PLAN,
                    type(obj).__name__,
                    w.name,
                    type(now).__name__,
                    context=f"traced with {w.name}={w.entry!r}, called with {w.name}={now!r}",
                )

    @functools.cached_property
    def object_writes(self) -> list[PlannedWrite]:
        # Read at run time only, once the passes have fixed the plan: computed once, not per call.
        return [w for w in self.writes or () if w.obj is not None]

    def strip(self, out: Any) -> tuple[Any, Sequence[Any]]:
        """Split the compiled callable's outputs into the caller's and the extra ones."""
        if not self.n_extra:
            return out, ()
        cut = len(out) - self.n_extra
        return type(out)(out[:cut]), out[cut:]

    @functools.cached_property
    def _steps(self) -> list[tuple[Any, int, str, str, Any]]:
        # Read at run time only, once the passes have fixed the plan: one flat tuple per write.
        return [(w.obj, w.input_index, w.name, w.kind, w.value) for w in self.writes or ()]

    def apply(self, inputs: Sequence[Any], extras: Sequence[Any]) -> None:
        """Set the planned writes on the real inputs, in the order dispatch made them."""
        for obj, index, name, kind, value in self._steps:
            if kind == "output":
                value = extras[value]
            elif kind == "input":
                value = inputs[value]
            elif kind == "inner":
                value = getattr(inputs[value[0]], value[1])
            setattr(inputs[index] if obj is None else obj, name, value)

    def replay(self, inputs: Sequence[Any], out: Any) -> Any:
        out, extras = self.strip(out)
        if self.object_writes:
            # No guard covers state reachable from a ctx (it is shared, not an input).
            self.check_entry_state(inputs, self.object_writes)
        self.apply(inputs, extras)
        if self.backward_writes:
            self.on_backward(inputs, out)
        return out

    def on_backward(self, inputs: Sequence[Any], out: Any) -> None:
        """Set the backward's writes when the compiled backward of this call runs."""
        node = _compiled_backward_node(out)
        if node is None:  # nothing requires grad: there will be no backward
            return
        inputs = list(inputs)

        def after_backward(grad_inputs: Any, grad_outputs: Any) -> None:
            self.check_entry_state(inputs, self.backward_writes)
            for w in self.backward_writes:
                setattr(inputs[w.input_index], w.name, w.value)

        node.register_hook(after_backward)


# --------------------------------------------------------------------------- #
# Compile time: around each tracing pass
# --------------------------------------------------------------------------- #


def _seed_constants(traced: Any, real: Any) -> None:
    """Hand a pass's instance the real input's state that unflatten cannot restore."""
    mine = traced.__dict__
    for name, value in user_state(real.__dict__).items():
        if name not in mine and not isinstance(value, torch.Tensor):
            copied = seed_copy(value)
            if copied is not MISSING:
                mine[name] = copied


# The entry snapshots of the AOTAutograd pass running now, by id of the traced instance.
_PASS_ENTRY: dict[int, InstanceSnapshot] = {}


def seeded(obj: Any, name: str) -> None:
    """A ``seed_attr`` node handed a traced instance an attribute of its real input
    during a pass: it belongs to the pass's entry state (else deleting it, say, would
    not show in the pass's diff)."""
    snap = _PASS_ENTRY.get(id(obj))
    if snap is not None and snap.obj is obj and name not in snap.entries:
        snap.entries[name] = obj.__dict__[name]


def tracing_pass(fn: Callable[..., Any], plan: WritePlan | None, flat_outputs: bool) -> Callable[..., Any]:
    """Wrap the function AOTAutograd traces: one call is one tracing pass.

    ``flat_outputs``: the function returns a flat tuple (aot_module_simplified),
    extra outputs are appended to it; otherwise it returns ``(out, extras)``.
    """

    @functools.wraps(fn)
    def traced_call(*args: Any, **kwargs: Any) -> Any:
        leaves = pytree.arg_tree_leaves(*args, **kwargs)
        reals = plan.real_inputs if plan is not None else []
        # Entry state: what unflatten restored plus the real input's constants (seeded).
        # Each pass is diffed against it and put back to it; so is the backward's start.
        before: list[tuple[int, InstanceSnapshot]] = []
        for i, a in enumerate(leaves):
            if is_watched_type(a):
                if i < len(reals) and is_watched_type(reals[i]):
                    _seed_constants(a, reals[i])
                before.append((i, InstanceSnapshot(a)))
        journal = Journal().open()
        _PASS_ENTRY.update((id(snap.obj), snap) for _, snap in before)
        try:
            out = fn(*args, **kwargs)
            _refuse_inner_metadata_mutation(leaves, before)
            writes = [(i, wr) for i, snap in before for wr in snap.writes()]
            net = journal.net_writes()
            object_writes = [(obj, AttributeWrite(name, old, new)) for obj, name, old, new in net]
            if plan is not None:
                plan.pass_state = [(obj, name, new) for obj, name, _, new in net]
            if plan is None:
                _refuse_unplanned(leaves, writes + [(-1, wr) for _, wr in object_writes])
                extras: list[Any] = []
            else:
                extras = plan.plan_pass(leaves, writes, {i: snap.entries for i, snap in before}, object_writes)
        finally:
            _PASS_ENTRY.clear()
            journal.undo()
            journal.close()
            for _, snap in before:
                snap.restore()
        if plan is not None:
            plan.remember_pass([(i, InstanceSnapshot(snap.obj)) for i, snap in before])
        if flat_outputs:
            return (*out, *extras) if extras else out
        return out, tuple(extras)

    return traced_call


def _compiled_backward_node(out: Any) -> Any:
    """The autograd node of AOTAutograd's compiled backward behind these outputs."""
    for t in pytree.tree_leaves(out):
        if not isinstance(t, torch.Tensor) or t.grad_fn is None:
            continue
        stack, seen = [t.grad_fn], set()
        while stack:  # below view-replay and subclass wrapping nodes
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if "CompiledFunction" in type(node).__name__:
                return node
            stack.extend(n for n, _ in node.next_functions)
        return t.grad_fn
    return None


def _refuse_inner_metadata_mutation(leaves: Sequence[Any], before: list[tuple[int, InstanceSnapshot]]) -> None:
    """An inner tensor's sizes/strides changed in place (``self.elem.t_()``).

    Stock AOTAutograd refuses this with "Metadata mutations are currently not allowed
    on tensor subclasses", which names neither the subclass nor the attribute.
    Assigning a new tensor instead (``self.elem = self.elem.t()``) is a write this
    layer replays.
    """
    from torch._subclasses.functional_tensor import FunctionalTensor

    for i, snap in before:
        for name, value in snap.entries.items():
            if isinstance(value, FunctionalTensor) and value is getattr(leaves[i], name, None):
                if torch._functionalize_has_metadata_mutation(value.elem):
                    raise SubclassWriteError(
                        RefusalKind.INNER_METADATA_MUTATION,
                        type(leaves[i]).__name__,
                        name,
                        "Tensor (sizes/strides changed in place)",
                    )


def _refuse_unplanned(leaves: Sequence[Any], writes: list[tuple[int, AttributeWrite]]) -> None:
    if writes:
        index, wr = writes[0]
        raise SubclassWriteError(
            RefusalKind.UNREPLAYABLE_ENTRY,
            type(leaves[index]).__name__ if index >= 0 else "a ctx object",
            wr.name,
            type(wr.new).__name__,
        )


# --------------------------------------------------------------------------- #
# The hooks
# --------------------------------------------------------------------------- #


def make_prepare_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``torch._functorch.aot_autograd.prepare_aot_module_simplified``."""

    @functools.wraps(original)
    def prepare_aot_module_simplified(mod: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
        args = list(args)
        result = original(mod, args, *rest, **kwargs)
        if not config.aot_layer or not any(is_watched_type(a) for a in args):
            return result
        functional_call, params_buffers_flat = result[0], result[1]
        plan: WritePlan | None = _top("plans")
        if plan is not None:
            plan.real_inputs = list(params_buffers_flat) + args
        # Without a plan (export and other AOT entry points) writes are refused.
        return (tracing_pass(functional_call, plan, flat_outputs=True), *result[1:])

    return prepare_aot_module_simplified


def _compile_with_plan(plan: WritePlan, compile_: Callable[[], Any]) -> Any:
    from torch._functorch import config as functorch_config

    try:
        with _pushed("plans", plan), functorch_config.patch(enable_autograd_cache=False):
            compiled = compile_()
    finally:
        plan.pass_state = []  # trace-time values: must not outlive the compile
    try:
        plan.plan_backward()
    finally:
        plan.forget_passes()
    return compiled


def make_aot_module_simplified_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``aot_module_simplified`` (both where it is defined and
    ``torch._dynamo.backends.common``, which imports it by name)."""

    @functools.wraps(original)
    def aot_module_simplified(mod: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
        args = list(args)
        if not config.aot_layer or not any(is_watched_type(a) for a in args):
            return original(mod, args, *rest, **kwargs)
        handled = _top("handled")
        plan = WritePlan(handled, _top("observed"))
        compiled = _compile_with_plan(plan, lambda: original(mod, args, *rest, **kwargs))
        if not plan.writes and not plan.backward_writes:
            return compiled
        n_params = len(plan.real_inputs) - len(args)
        params = plan.real_inputs[:n_params]
        plan.real_inputs = []  # compile-time only: the compiled function must not keep the inputs alive
        # Under Dynamo its guards keep the inputs' state as traced; called directly, check.
        check = handled is None

        if isinstance(mod, torch._dynamo.utils.GmWrapper):

            @functools.wraps(compiled)
            def boxed_forward(runtime_args: list[Any]) -> Any:
                inputs = [*params, *runtime_args]  # the callee clears runtime_args
                if check:
                    plan.check_entry_state(inputs)
                return plan.replay(inputs, compiled(runtime_args))

            return boxed_forward

        @functools.wraps(compiled)
        def forward(*runtime_args: Any) -> Any:
            inputs = [*params, *runtime_args]
            if check:
                plan.check_entry_state(inputs)
            return plan.replay(inputs, compiled(*runtime_args))

        return forward

    return aot_module_simplified


def make_coerce_tangent_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``coerce_tangent_and_suggest_memory_format`` in AOTAutograd's
    metadata collection, which runs on a pass's outputs after the pass returned.

    A subclass may need its ctx state to coerce a tangent: DTensor redistributes a
    ``_MaskPartial`` output to ``Replicate``, which applies and releases the mask the
    pass wrote into its MaskBuffer. The pass has undone that write by then, so the
    coercion sees the state the pass left, journaled and undone again after it.
    """

    @functools.wraps(original)
    def coerce_tangent_and_suggest_memory_format(x: Any, *args: Any, **kwargs: Any) -> Any:
        plan: WritePlan | None = _top("plans")
        if plan is None or not plan.pass_state:
            return original(x, *args, **kwargs)
        from torch._functorch._aot_autograd.functional_utils import from_fun
        from torch._subclasses.functional_tensor import FunctionalTensor

        with Journal() as journal:
            try:
                for obj, name, value in plan.pass_state:
                    if isinstance(value, FunctionalTensor):  # the tangents are unwrapped too
                        value = from_fun(value)
                    if value is MISSING:
                        obj.__dict__.pop(name, None)
                    else:
                        setattr(obj, name, value)
                return original(x, *args, **kwargs)
            finally:
                journal.undo()

    return coerce_tangent_and_suggest_memory_format


def make_aot_function_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``torch._functorch.aot_autograd.aot_function`` (``aot_module`` calls it)."""

    @functools.wraps(original)
    def aot_function(fn: Callable[..., Any], *rest: Any, **kwargs: Any) -> Callable[..., Any]:
        if not config.aot_layer:
            return original(fn, *rest, **kwargs)
        plan = WritePlan()
        compiled = original(tracing_pass(fn, plan, flat_outputs=False), *rest, **kwargs)
        traced = False

        @functools.wraps(fn)
        def returned_function(*args: Any, **kw: Any) -> Any:
            nonlocal traced
            leaves = pytree.arg_tree_leaves(*args, **kw)
            if not traced:  # aot_function traces on its first call
                plan.real_inputs = list(leaves)
                out, extras = _compile_with_plan(plan, lambda: compiled(*args, **kw))
                plan.real_inputs = []
                traced = True
            else:
                plan.check_entry_state(leaves)
                out, extras = compiled(*args, **kw)
            plan.apply(leaves, extras)
            if plan.backward_writes:
                plan.on_backward(leaves, out)
            return out

        return returned_function

    return aot_function


def make_export_functional_call_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``create_functional_call`` as bound in ``torch.export._trace``.

    Non-strict ``torch.export`` traces the module through it with ``make_fx``; the
    exported program has no epilogue, so a write made there is refused, never dropped.
    """

    @functools.wraps(original)
    def create_functional_call(*args: Any, **kwargs: Any) -> Any:
        functional_call = original(*args, **kwargs)
        if not config.aot_layer:
            return functional_call
        return tracing_pass(functional_call, None, flat_outputs=True)

    return create_functional_call
