"""The write plan of one compiled graph (frozen at compile time) and its replay (run time).

The AOTAutograd layer's planner (``aot_layer.Planner``) fills a ``WritePlan`` from
the tracing passes and freezes it; every entry point (``aot_module_simplified``,
``aot_function``, an AOTAutogradCache hit) wraps the compiled callable with the
same ``Replay``: strip the extra outputs the passes appended, set the planned
writes on the real objects in the order dispatch made them, and arm the backward's
writes.  The shape follows AOTAutograd's own ``CompilerWrapper``: ``pre_compile``
returns what ``post_compile`` needs, nothing else is shared between the two times.

A plan with no object targets is plain data (picklable): it is stored with an
AOTAutogradCache entry and a hit replays it.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import math
import pickle
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import capture, counters, free_state, partial_backward
from .errors import RefusalKind, SubclassWriteError
from .values import HELD_TENSOR, MISSING, ValueKind, classify, contains_symbolic, same_value, user_state


class ValueFrom(enum.Enum):
    CONSTANT = "constant"  # value: the constant
    OUTPUT = "output"  # value: position among the extra outputs
    INPUT = "input"  # value: position of the input it aliases
    INNER = "inner"  # value: (input position, path, attribute) of a tensor an input held
    COUNTED = "counted"  # value: an expression over attributes read (counters.py), computed at run time
    SIBLING = "sibling"  # value: (output index, path): an earlier place in the outputs holding the same tensor
    PACKED = "packed"  # value: (tuple type, ((ValueFrom, value), ...)): a torch.Size or tuple of symbolic ints
    SIZE = "size"  # value: (input position, dim): that input's size there
    #: value: the traced value, holding symbolic ints resolved in each call (resolve_symbolic;
    #: a backward write: See Note [A backward write of a symbolic value] in aot_layer.py)
    SYMBOLIC = "symbolic"


# The name of a write on an output that replaces the output itself (``ValueFrom.SIBLING``).
WHOLE_OUTPUT = ""


@dataclasses.dataclass(frozen=True)
class PlannedWrite:
    """One attribute write to replay on a real object after each call."""

    input_index: int  # position among the compiled function's flat inputs; -1: ``obj``
    path: capture.Path  # from that input to the object written on (nested subclasses)
    name: str
    value_from: ValueFrom
    value: Any
    entry: Any = MISSING  # the attribute's value when tracing started: a constant, MISSING, HELD_TENSOR
    obj: Any = None  # a registered state object written on (shared with eager by reference)
    born: int = -1  # for an object the traced code made: its position among those of its pass
    output_index: int = -1  # a write on the compiled function's output at that position

    def signature(self) -> tuple:
        if self.output_index >= 0:
            where: Any = ("output", self.output_index, self.path)
        elif self.obj is None:
            where: Any = (self.input_index, self.path)
        elif self.born >= 0:  # each pass makes its own: compared by role, not identity
            where = ("new", type(self.obj).__name__, self.born)
        else:
            where = ("obj", id(self.obj))
        value = repr(self.value) if self.value_from is ValueFrom.CONSTANT else self.value
        return (where, self.name, self.value_from, value)

    def target(self, inputs: Sequence[Any]) -> Any:
        if self.obj is not None:
            return self.obj
        return capture.follow(inputs[self.input_index], self.path)


class ReadKind(enum.Enum):
    ATTR = "attr"  # an attribute's value (``_version``: the tensor's version counter)
    ABSENT = "absent"  # no instance attribute shadows a class attribute (a method read)
    KEYS = "keys"  # which attributes the instance dict holds


@dataclasses.dataclass(frozen=True)
class EntryRead:
    """State a tracing pass read from a real input. Under Dynamo it is guarded as it is
    read; with no Dynamo guards (AOTAutograd called directly) a call must present the
    same attribute values, or the plan is stale; an AOTAutogradCache entry is loaded only
    where the inputs hold all of it."""

    input_index: int
    path: capture.Path
    name: str
    value: Any  # ATTR: a constant, MISSING (absent), HELD_TENSOR; KEYS: the names, in order
    kind: ReadKind = ReadKind.ATTR

    @property
    def key(self) -> tuple:
        return (self.input_index, self.path, self.kind, self.name)

    @property
    def checkable(self) -> bool:
        """Whether another process can tell that an object holds this state."""
        return self.kind is not ReadKind.ATTR or self.value is MISSING or self.value is HELD_TENSOR or (
            classify(self.value) is ValueKind.CONSTANT and plain(self.value)
        )


def plain(value: Any) -> bool:
    """Compared by value across processes: builtin scalars, enums, dtypes, and containers
    and dataclasses of them."""
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(plain(v) for v in value)
    if isinstance(value, dict):
        return all(plain(k) and plain(v) for k, v in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a config object
        return all(plain(getattr(value, f.name)) for f in dataclasses.fields(value))
    return type(value) in (int, float, bool, str, bytes, complex, type(None)) or isinstance(
        value, (enum.Enum, torch.dtype, torch.device, torch.Size)
    )


@dataclasses.dataclass(frozen=True)
class WritePlan:
    writes: tuple[PlannedWrite, ...] = ()
    n_extra: int = 0
    backward_writes: tuple[PlannedWrite, ...] = ()
    #: what the traced backward decided from counted values: each must hold again
    backward_decisions: tuple[counters.Decision, ...] = ()
    #: names the traced backward read, each as it must still be when the compiled backward
    #: runs: ((index, path, name), how); how: "value" or "identity" (as the attribute holds it
    #: when the forward returns), ("constant", value) or ("output", k) (the forward's k-th
    #: output: a value Dynamo's residual bytecode writes after the graph)
    backward_checks: tuple[tuple[tuple, Any], ...] = ()
    #: what the traced backward decided, guarded on the forward (aot_layer's
    #: Planner._install_backward_guard); installed again when the plan is loaded from cache
    backward_guards: tuple[tuple, ...] = ()
    #: what the traced backward's code read through globals and closure variables, each as
    #: traced: it must still hold when the compiled backward runs (See Note [State the traced
    #: backward reads outside the tensors] in free_state.py)
    backward_free: tuple[free_state.BackwardRead, ...] = ()
    #: what the backward's writes need from a run for part of its graph: See Note [A
    #: backward run for part of the graph] in partial_backward.py
    whole_backward: partial_backward.BackwardParts | None = None
    entry_reads: tuple[EntryRead, ...] = ()
    #: symbols of the trace whose value in each call the compiled backward needs, each with
    #: where its run-time value is found: ((expression, ValueFrom, value), ...). Held by an
    #: incoming gradient's traced ctx the backward read (See Note [A traced tangent ctx
    #: holding a symbolic value] in aot_layer.py) or by a gradient's traced ctx (See Note
    #: [A gradient's ctx made from sizes or counts]).
    call_symbols: tuple[tuple[Any, "ValueFrom", Any], ...] = ()
    #: the compiled backward's subclass gradients holding a symbolic or counted ctx value
    #: are rebuilt with this call's values
    rebuild_gradients: bool = False
    #: what dispatch left on the gradients the traced backward returns, set again on the
    #: rebuilt ones: ((tensor input position, class, path, ((name, value or count's expression,
    #: how), ...)), ...) (See Note [What dispatch leaves on a gradient the backward returns] in
    #: aot_layer.py)
    gradient_state: tuple[tuple[int, type, tuple, tuple[tuple[str, Any, str], ...]], ...] = ()
    #: Dynamo guards the inputs' state; called directly, the entry state is checked per call.
    guarded: bool = True
    #: the outputs that are tensors dispatch made and wrote: See Note [A view dispatch writes]
    dispatch_made: tuple[int, ...] = ()
    #: flat input positions the compiled graph does not compute with: See Note [A tensor the
    #: graph takes in but does not compute with]
    unlinked_inputs: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return (
            not self.writes and not self.backward_writes and not self.n_extra and not self.backward_armed
            and not self.dispatch_made and not self.unlinked_inputs
        )

    @property
    def backward_armed(self) -> bool:
        """Whether each call's compiled backward has something to check or write."""
        return bool(
            self.backward_writes or self.backward_decisions or self.backward_checks or self.call_symbols
            or self.rebuild_gradients or self.gradient_state or self.backward_free
            or (self.whole_backward is not None and self.whole_backward.drops)
        )

    def why_not_cacheable(self) -> str | None:
        """Why another process could not reuse this plan (None: it can)."""
        if any(w.obj is not None for w in self.writes + self.backward_writes):
            return "writes on an object that is not among the graph's inputs"
        if any(r.cell is not None for r in self.backward_free):
            return "the traced backward reads a closure variable (another process has other cells)"
        bad = next((r for r in self.entry_reads if not r.checkable), None)
        if bad is not None:
            return f"the trace read {bad.name}, a {type(bad.value).__name__} not comparable by value"
        try:
            pickle.dumps(self)
        except Exception as e:  # noqa: BLE001 - any value pickle rejects
            return f"the plan does not pickle ({type(e).__name__}: {e})"
        return None


def _now(obj: Any, r: EntryRead) -> Any:
    if r.kind is ReadKind.KEYS:
        return tuple(capture.obj_dict(obj))
    if r.kind is ReadKind.ABSENT:
        return MISSING if r.name not in capture.obj_dict(obj) else "<shadowed>"
    return obj._version if r.name == "_version" else capture.eager_lookup(obj, r.name)[0]


def _entry_shown(value: Any) -> str:
    return "<absent>" if value is MISSING else repr(value)


def _holds(r: EntryRead, now: Any) -> bool:
    if r.value is MISSING or now is MISSING:
        return r.value is now
    if r.value is HELD_TENSOR:
        return isinstance(now, torch.Tensor)
    if r.kind is ReadKind.ATTR and classify(now) is not ValueKind.CONSTANT:
        return False
    if type(now) is float and type(r.value) is float and now == r.value == 0.0:
        return math.copysign(1.0, now) == math.copysign(1.0, r.value)  # -0.0 == 0.0, but not in eager's arithmetic
    return type(now) is type(r.value) and now == r.value


def check_entry(plan: WritePlan, inputs: Sequence[Any], reads: Sequence[EntryRead] | None = None) -> None:
    """Refuse a call whose inputs do not hold the attribute values the plan was traced
    from (``stale_plan``): only where no Dynamo guard covers it."""
    for r in plan.entry_reads if reads is None else reads:
        # the keys of the instance dict and names read as absent too (``self.__dict__.get("n",
        # 0)`` on the first call): skipped, every call replayed the first call's count
        obj = capture.follow(inputs[r.input_index], r.path)
        now = _now(obj, r)
        if not _holds(r, now):
            name = r.name or "<the instance dict's keys>"
            raise SubclassWriteError(
                RefusalKind.STALE_PLAN,
                type(obj).__name__,
                name,
                type(now).__name__,
                context=f"traced with {name}={_entry_shown(r.value)}, called with {name}={_entry_shown(now)}",
            )
    if reads is None:
        failed = _failed_backward_guard(plan, inputs)
        if failed is not None:
            g, name, obj = failed
            now = getattr(obj, name, MISSING)
            raise SubclassWriteError(
                RefusalKind.STALE_PLAN,
                type(obj).__name__,
                name,
                type(now).__name__,
                context=f"the backward was traced where {name} gave {g[2:]!r}; called with {name}={now!r}",
            )


def state_mismatch(plan: WritePlan, inputs: Sequence[Any]) -> str | None:
    """The first piece of state the plan was traced from that the inputs do not hold."""
    for r in plan.entry_reads:
        try:
            obj = capture.follow(inputs[r.input_index], r.path)
            now = _now(obj, r)
        except (IndexError, AttributeError) as e:
            return f"input {r.input_index}{r.path}: {e}"
        if not _holds(r, now):
            return f"traced with {r.kind.value} {r.name}={r.value!r}, now {now!r}"
    try:
        failed = _failed_backward_guard(plan, inputs)
    except (IndexError, AttributeError) as e:
        return f"input: {e}"
    if failed is not None:
        return f"the backward was traced where {failed[1]} gave {failed[0][2:]!r}"
    return None


def _failed_backward_guard(plan: WritePlan, inputs: Sequence[Any]) -> tuple[tuple, str, Any] | None:
    """The first of what the traced backward decided from the ints it read that the inputs
    no longer give: (guard, name, object), or None."""
    for g in plan.backward_guards:
        (index, path, name) = g[1]
        obj = capture.follow(inputs[index], path)
        holds = (
            counters.evaluate(g[2], lambda key: getattr(obj, name)) == g[3]
            if g[0] == "decision"
            else same_value(getattr(obj, name), g[2])
        )
        if not holds:
            return g, name, obj
    return None


def _resolve(value_from: ValueFrom, value: Any, inputs: Sequence[Any], extras: Sequence[Any]) -> Any:
    """The run-time value of a planned write's value."""
    if value_from is ValueFrom.OUTPUT:
        return extras[value]
    if value_from is ValueFrom.INPUT:
        return inputs[value]
    if value_from is ValueFrom.INNER:
        return getattr(capture.follow(inputs[value[0]], value[1]), value[2])
    if value_from is ValueFrom.SIZE:
        return inputs[value[0]].shape[value[1]]
    if value_from is ValueFrom.PACKED:
        kind, parts = value
        items = [_resolve(f, v, inputs, extras) for f, v in parts]
        return kind(items)
    return value


class Replay:
    """Run-time half: what runs after each call of a compiled graph with a plan."""

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan
        # One flat tuple per write, computed once.
        self._steps = [
            (w.obj, w.input_index, w.path, w.name, w.value_from, w.value, w.entry)
            for w in plan.writes
            if w.output_index < 0
        ]
        self._output_steps = [
            (w.output_index, w.path, w.name, w.value_from, w.value) for w in plan.writes if w.output_index >= 0
        ]
        self._cut = plan.n_extra
        # See Note [A backward write of a symbolic value] in aot_layer.py
        self._symbolic = any(w.value_from is ValueFrom.SYMBOLIC for w in plan.backward_writes)
        # What the backward's counts and decisions read: each must still be there when the
        # compiled backward runs (a statistic the user deleted between the forward and
        # backward(): eager's getattr default is not known here)
        self._counted = list(dict.fromkeys(
            [k for w in plan.backward_writes if w.value_from is ValueFrom.COUNTED for k in counters.reads_in(w.value)]
            + [k for d in plan.backward_decisions for k in counters.reads_in(d.expr)]
        ))
        # Objects the traced code made, held by the outputs' ctx: See Note [Objects dispatch
        # makes, per shape]. id -> (object, {attribute: its value when made})
        self._born: dict[int, tuple[Any, dict[str, Any]]] = {}
        for w in plan.writes:
            if w.obj is not None and w.born >= 0:
                self._born.setdefault(id(w.obj), (w.obj, {}))[1].setdefault(w.name, w.entry)
        self._first_shapes: tuple | None = None
        self._by_shapes: dict[tuple, dict[int, Any]] = {}
        # objects eager makes anew each call: copies of these, as they were made
        self._templates: dict[int, Any] | None = None

    def _born_for(self, inputs: Sequence[Any]) -> dict[int, Any] | None:
        """Note [Objects dispatch makes, per shape]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        An object dispatch makes and an output's ctx holds (DTensor's ``MaskBuffer`` in a
        partial embedding's placement) is baked into the compiled outputs: the first pass's.
        In eager, DTensor's sharding-propagation cache, keyed by the inputs' shapes, hands
        the same buffer to every call of one shape and another to each other shape: masks
        of calls of different lengths are pending at once, a second mask of the same shape
        counts one more or conflicts. A graph compiled for dynamic shapes serves every
        length, so at run time each distinct set of input shapes gets its own copy of the
        object as it was made (the first set keeps the traced one), and the outputs are
        rebound to it (``capture.rebind_held``).

        That holds for a class eager hands out from such a cache (``capture.ONE_PER_KEY``).
        Any other object dispatch makes (``st = Stats(); return QT(out, st)``) is made anew
        by every eager call: each call after the first gets its own copy as it was made.
        Sharing the traced one gave every later output the first call's statistics, or
        raised ``stale_plan`` at run time (an outside tester's find). None: the traced
        objects serve."""
        if self._templates is None:  # the first call: the traced objects serve it
            self._templates = {
                oid: _as_made(obj, made) for oid, (obj, made) in self._born.items() if type(obj) not in capture.ONE_PER_KEY
            }
            self._first_shapes = tuple(tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor))
            return None
        mapping: dict[int, Any] = {}
        if len(self._templates) < len(self._born):
            shapes = tuple(tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor))
            if shapes != self._first_shapes:
                mapping = self._by_shapes.get(shapes)  # type: ignore[assignment]
                if mapping is None:
                    if len(self._by_shapes) >= _MAX_SHAPES:
                        self._by_shapes.pop(next(iter(self._by_shapes)))
                    mapping = self._by_shapes[shapes] = {
                        oid: _as_made(obj, made) for oid, (obj, made) in self._born.items() if oid not in self._templates
                    }
                mapping = dict(mapping)
        for oid, template in self._templates.items():
            mapping[oid] = copy.copy(template)
        return mapping or None

    def strip(self, out: Any) -> tuple[Any, Sequence[Any]]:
        """Split the compiled callable's outputs into the caller's and the extra ones."""
        if not self._cut:
            return out, ()
        cut = len(out) - self._cut
        return type(out)(out[:cut]), out[cut:]

    def apply(self, inputs: Sequence[Any], extras: Sequence[Any], born: dict[int, Any] | None = None) -> None:
        """Set the planned writes on the real objects, in the order dispatch made them;
        writes on a shared state object go to its replay function, as one set."""
        shared: dict[int, tuple[Any, dict[str, Any], dict[str, Any]]] = {}
        for obj, index, path, name, value_from, value, entry in self._steps:
            if value_from is not ValueFrom.CONSTANT:
                value = _resolve(value_from, value, inputs, extras)
            if obj is not None:
                if born is not None:
                    obj = born.get(id(obj), obj)
                _, entries, values = shared.setdefault(id(obj), (obj, {}, {}))
                entries.setdefault(name, entry)
                values[name] = value
                continue
            target = capture.follow(inputs[index], path) if path else inputs[index]
            setattr(target, name, value)
        for obj, entries, values in shared.values():
            capture.replayer_for(obj)(obj, entries, values)

    def __call__(self, inputs: Sequence[Any], out: Any) -> Any:
        if not self.plan.guarded:
            check_entry(self.plan, inputs)
        if self.plan.backward_writes and torch.is_grad_enabled() and _saved_tensors_hooked():
            raise SubclassWriteError(
                RefusalKind.WRITE_IN_BACKWARD, "compiled backward", "<writes of the backward>", "saved-tensor hooks",
                context="See Note [Backward writes under saved-tensor hooks]",
            )
        if self.plan.dispatch_made:
            out = _as_dispatch_made(out, self.plan.dispatch_made, inputs)
        extras = out[len(out) - self._cut :] if self._cut else ()  # extra outputs follow the caller's
        for index, path, name, value_from, value in self._output_steps:
            if value_from is ValueFrom.SIBLING:  # See Note [One object in several places of the outputs]
                value = capture.follow(out[value[0]], value[1])
            elif value_from is not ValueFrom.CONSTANT:
                value = _resolve(value_from, value, inputs, extras)
            if name == WHOLE_OUTPUT:
                out = type(out)((*out[:index], value, *out[index + 1 :]))
                continue
            target = capture.follow(out[index], path) if path else out[index]
            if value is MISSING:  # set by __tensor_unflatten__ alone: eager's output lacks it
                target.__dict__.pop(name, None)
                continue
            setattr(target, name, value)
        out, extras = self.strip(out)
        born = self._born_for(inputs) if self._born else None
        if born is not None:
            for leaf in pytree.tree_leaves(out):
                capture.rebind_held(leaf, born)
        self.apply(inputs, extras, born)
        if self.plan.backward_armed:
            self.arm_backward(inputs, out, extras)
        return out

    def arm_backward(self, inputs: Sequence[Any], out: Any, extras: Sequence[Any] = ()) -> None:
        """Check and set the backward's state each time the compiled backward of this call
        runs: before it runs, what it was traced with must still hold (a knob the user set
        between the forward and ``backward()`` raises there, before any gradient is
        accumulated); after it ran, its writes are set."""
        node = _compiled_backward_node(out)
        if node is None:  # nothing requires grad: there will be no backward
            return
        # the hooks below reach the node weakly: the node holds them, and a hook holding the
        # node kept it, the inputs and the batch alive after the backward (an outside
        # tester's find: one training step's tensors per compile, until torch._dynamo.reset())
        node_ref = _weak(node)
        inputs = list(inputs)
        writes, decisions = self.plan.backward_writes, self.plan.backward_decisions

        def read(key: tuple) -> Any:
            index, path, name = key
            return getattr(capture.follow(inputs[index], path), name)

        def holder_name(key: tuple) -> str:
            return type(capture.follow(inputs[key[0]], key[1])).__name__

        def now(key: tuple) -> Any:
            holder = capture.follow(inputs[key[0]], key[1])
            if key[2] == DICT_KEYS:
                return frozenset(user_state(capture.obj_dict(holder)))
            return capture.eager_lookup(holder, key[2])[0]

        # what the forward left: the compiled backward runs with these
        snapshot = []
        for key, how in self.plan.backward_checks:
            if isinstance(how, tuple) and how[0] == "packed":
                parts = [c if kind == "constant" else out[c] for kind, c in how[2]]
                snapshot.append((key, "value", how[1](parts)))
            elif isinstance(how, tuple) and how[0] == "keys":  # the names Dynamo replays, set after this
                snapshot.append((key, "value", now(key) | how[1]))
            elif isinstance(how, tuple):
                snapshot.append((key, "value", how[1] if how[0] == "constant" else out[how[1]]))
            else:
                snapshot.append((key, how, now(key)))

        # a tensor changed in place since (``w.amax.mul_(2)``) counts as changed too
        versions = [then._version if isinstance(then, torch.Tensor) else None for _, _, then in snapshot]

        free = self.plan.backward_free
        whole = self.plan.whole_backward
        drops = whole is not None and whole.drops
        counted = self._counted

        # this run's writes eager would not make, gradients eager leaves undefined and shares
        # of counts, set by before_backward (See Note [A backward run for part of the graph] in partial_backward.py)
        this_run: list[partial_backward.Run] = [partial_backward.WHOLE]

        def before_backward(grad_outputs: Any) -> None:
            this_run[0] = partial_backward.WHOLE
            try:
                check_before_backward(grad_outputs)
            except SubclassWriteError:
                _undo_this_backward()  # See Note [A refusal undoes the backward's earlier writes]
                raise

        def check_before_backward(grad_outputs: Any) -> None:
            if torch.is_grad_enabled() and (writes or decisions or snapshot or counted or free):
                # Note [A backward with grad mode on]: under create_graph=True eager's backward
                # runs with grad mode on, and dispatch telling the backward by
                # ``not torch.is_grad_enabled()`` (as float8 code does) takes its forward branch;
                # the compiled backward was traced with grad mode off (an outside tester's find)
                raise SubclassWriteError(
                    RefusalKind.WRITE_IN_BACKWARD, "compiled backward", "<state of the backward>", "create_graph",
                    context="the backward runs with grad mode on (create_graph=True), where the compiled "
                    "backward was traced with it off: dispatch reading grad mode would take another branch",
                )
            if whole is not None:
                this_run[0] = partial_backward.decide(node_ref(), whole, grad_outputs)
            for w in writes:  # See Note [A backward write of a symbolic value] in aot_layer.py
                if w.value_from is ValueFrom.SYMBOLIC and call_value(w) is MISSING:
                    raise SubclassWriteError(
                        RefusalKind.WRITE_IN_BACKWARD, holder_name((w.input_index, w.path, w.name)), w.name,
                        type(w.value).__name__,
                        context=f"the backward writes {w.value!r}, symbolic while traced, and its value in this "
                        "call is not known",
                    )
            for r in free:
                if not r.holds():
                    current = r.now()
                    raise SubclassWriteError(
                        RefusalKind.CHANGED_BEFORE_BACKWARD, "traced backward", r.where(), type(current).__name__,
                        context=f"the compiled backward was traced with {r.where()} = {_shown(r)}; "
                        f"it is {_shown(r, current)} now (eager's backward would read the new value)",
                    )
            for key in counted:
                if capture.eager_lookup(capture.follow(inputs[key[0]], key[1]), key[2])[1] == "absent":
                    raise SubclassWriteError(
                        RefusalKind.CHANGED_BEFORE_BACKWARD, holder_name(key), key[2], "absent",
                        context=f"the compiled backward counts from {key[2]}, which the forward left set; "
                        "it is absent now (deleted before backward())",
                    )
            for (key, how, then), version in zip(snapshot, versions):
                value = now(key)
                if (value is then or (how == "value" and same_value(value, then))) and (
                    version is None or value._version == version
                ):
                    continue
                raise SubclassWriteError(
                    RefusalKind.CHANGED_BEFORE_BACKWARD, holder_name(key), key[2], type(value).__name__,
                    context=f"the compiled backward was traced with {key[2]} = {then!r}, its value when the "
                    f"forward returned; it is {value!r} now",
                )
            for d in decisions:
                got = counters.evaluate(d.expr, read)
                if got != d.value:
                    key = counters.reads_in(d.expr)[0]
                    raise SubclassWriteError(
                        RefusalKind.CHANGED_BEFORE_BACKWARD, holder_name(key), key[2], "int",
                        context=f"the compiled backward was traced where {d.expr} was {d.value!r}; now it is {got!r}",
                    )

        def call_value(w: PlannedWrite) -> Any:
            return resolve_symbolic(w.value, getattr(node_ref(), SYMBOL_VALUES_ATTR, None), read)

        def after_backward(grad_inputs: Any, grad_outputs: Any) -> None:
            skipped, shares = this_run[0].skipped, dict(this_run[0].shares)
            made = [w for w in writes if (w.input_index, w.path, w.name) not in skipped]
            values = [
                counters.evaluate(shares.get((w.input_index, w.path, w.name), w.value), read)
                if w.value_from is ValueFrom.COUNTED
                else call_value(w) if w.value_from is ValueFrom.SYMBOLIC
                else w.value
                for w in made
            ]
            journal = _this_backward_journal()
            for w, value in zip(made, values):
                target = w.target(inputs)
                journal.append((target, w.name, capture.obj_dict(target).get(w.name, MISSING)))
                setattr(target, w.name, value)

        if (self.plan.call_symbols or self.plan.rebuild_gradients) and "CompiledFunction" in type(node).__name__:
            # this call's values of them: read where the compiled backward coerces its
            # incoming gradients (aot_layer.make_process_tangent_hook) and below
            symbols = {expr: _resolve(f, v, inputs, extras) for expr, f, v in self.plan.call_symbols}
            setattr(node, SYMBOL_VALUES_ATTR, symbols)
            if self.plan.rebuild_gradients:

                def with_call_values(grad_inputs: Any, grad_outputs: Any) -> Any:
                    return tuple(_rebuilt_with(g, symbols, read) for g in grad_inputs)

                node.register_hook(_not_traced(with_call_values))  # before after_backward's writes (see Note in aot_layer.py)
        elif self.plan.rebuild_gradients:
            raise SubclassWriteError(
                RefusalKind.WRITE_IN_BACKWARD, type(node).__name__, "<flatten ctx>", "gradient",
                context="the gradients' ctx is rebuilt on the compiled backward's node, which these outputs do not reach",
            )
        if self.plan.unlinked_inputs:
            # The hooks keep what they read, not an input the graph does not compute with: a
            # result kept from the previous call, whose own node's hooks kept the one before,
            # and so on (See Note [A tensor the graph takes in but does not compute with]).
            # This call's symbol values are taken by now.
            referenced = {w.input_index for w in writes} | {k[0] for k, _ in self.plan.backward_checks}
            referenced |= {k[0] for k in self._counted}  # the counts' and the decisions' reads
            for i in self.plan.unlinked_inputs:
                held = inputs[i] if i < len(inputs) else None
                if i not in referenced and isinstance(held, torch.Tensor) and held.grad_fn is not None:
                    inputs[i] = None
        if self.plan.gradient_state:
            gradient_state = self.plan.gradient_state

            def with_dispatch_state(grad_inputs: Any, grad_outputs: Any) -> None:
                run = this_run[0]
                values = getattr(node_ref(), SYMBOL_VALUES_ATTR, None)
                todo = []
                for index, cls, path, items in gradient_state:
                    grad = grad_inputs[index] if index < len(grad_inputs) else None
                    target = capture.follow(grad, path) if grad is not None else None
                    if type(target) is not cls:
                        continue  # no gradient (a backward for part of the graph), or another class
                    for name, value, how in items:
                        why = None
                        if how == "counted" and (run.skipped or run.shares):
                            why = (
                                "a backward for part of the graph: the count dispatch left on a gradient was traced "
                                "with every call of the backward before it, and eager's runs only some of them"
                            )
                        elif how == "counted":
                            value = counters.evaluate(value, read)
                        elif how == "symbolic":
                            value = resolve_symbolic(value, values, read)
                            if value is MISSING:
                                why = "the sizes dispatch left on a gradient are not known in this call"
                        elif how == "tensor":
                            if not _gradient_seen(node_ref(), index):
                                continue  # x.grad: autograd's detach of it, which dispatch tags again
                            why = (
                                "dispatch left a tensor on a gradient the backward returns, which the compiled "
                                "backward does not return: autograd.grad or a tensor hook would get the gradient "
                                "without it"
                            )
                        if why is not None:
                            _undo_this_backward()  # See Note [A refusal undoes the backward's earlier writes]
                            raise SubclassWriteError(RefusalKind.WRITE_IN_BACKWARD, cls.__name__, name, how, context=why)
                        todo.append((target, name, value))
                for target, name, value in todo:  # nothing is set where one is refused
                    setattr(target, name, value)

            node.register_hook(_not_traced(with_dispatch_state))  # after the gradients are rebuilt
        if snapshot or decisions or free or counted or drops or self._symbolic or (whole is not None and whole.may_refuse):
            node.register_prehook(_not_traced(before_backward))
        def drop_undefined(grad_inputs: Any, grad_outputs: Any) -> Any:
            return partial_backward.drop(grad_inputs, this_run[0].nulled) if this_run[0].nulled else None

        def after_backward_and_drop(grad_inputs: Any, grad_outputs: Any) -> Any:
            after_backward(grad_inputs, grad_outputs)
            return drop_undefined(grad_inputs, grad_outputs)

        # one hook where both are needed: each call through the disabled function costs
        if writes:
            node.register_hook(_not_traced(after_backward_and_drop if drops else after_backward))
        elif drops:
            node.register_hook(_not_traced(drop_undefined))

    def wrap_boxed(self, compiled: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """The compiled callable AOTAutograd returns from its stage 2 (boxed: it takes one
        list of flat inputs, which it may clear)."""

        unlinked = self.plan.unlinked_inputs

        def run_with_replay(args: list[Any]) -> Any:
            inputs = list(args)
            for i in unlinked:  # See Note [A tensor the graph takes in but does not compute with]
                if i < len(args) and isinstance(args[i], torch.Tensor) and args[i].grad_fn is not None:
                    args[i] = _unlinked(args[i])
            return self(inputs, compiled(args))

        for attr in ("_boxed_call", "zero_grad"):
            if hasattr(compiled, attr):
                setattr(run_with_replay, attr, getattr(compiled, attr))
        run_with_replay.__wrapped__ = compiled  # type: ignore[attr-defined]
        return run_with_replay


def _unlinked(t: torch.Tensor) -> torch.Tensor:
    """Note [A tensor the graph takes in but does not compute with]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A tensor attribute dispatch reads (``prev = self.last``, or the whole instance dict: ``"keep"
    in self.__dict__``) is made a graph input, so that the traced read finds it. Where the
    traced graph does not compute with it, eager's autograd never links to it, while
    AOTAutograd's compiled node takes every input requiring grad as an edge: a result kept
    from an earlier call (``self.last = out``) linked each call's backward to the earlier
    graph, which ``backward()`` had freed (an error eager does not raise), or, where that graph
    was retained, ran its backward again, its hooks and dispatch's backward writes with it (an
    outside tester's finds; stock loses the write). The graph's inputs no node of the joint
    graph uses (stage 2) are handed to the compiled function, when they carry a ``grad_fn``,
    as a stand-in that requires no grad: ``detach()`` for a plain tensor, a wrapper of the
    same class, sizes and instance dict for a subclass (made without its constructor or its
    dispatch, which eager never runs here). A leaf requiring grad is passed as it is: its
    ``AccumulateGrad`` gets no gradient, as in eager. The replay keeps the real inputs."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return t.detach()
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t) or t.layout is not torch.strided:
        return t
    try:
        r = torch.Tensor._make_wrapper_subclass(
            type(t), t.size(), strides=t.stride(), storage_offset=t.storage_offset(), dtype=t.dtype,
            device=t.device, layout=t.layout, requires_grad=False,
        )
        r.__dict__.update(t.__dict__)
    except (AttributeError, TypeError, RuntimeError):  # state in slots, another kind of tensor
        return t
    return r


def _saved_tensors_hooked() -> bool:
    """Note [Backward writes under saved-tensor hooks]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Under ``saved_tensors_hooks`` (``save_on_cpu``, offloading, a ``detach`` pack), eager's
    backward runs dispatch on what the unpack hook returns, which need not be the input (a
    class whose ``detach`` or ``to`` makes a new wrapper: the copy takes the backward's writes
    and is dropped, the input keeps its state). The compiled backward's replay writes the
    input (an outside tester's find: silently other than eager).
    Which one eager writes is the hooks' to decide, so a call whose backward writes, made
    with such hooks active, is refused (``write_in_backward``) when the compiled forward
    returns, before any of its writes is set. Not covered: hooks entered between the
    forward and ``backward()`` do not apply to what the forward saved, in eager either."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


def _call(hook: Callable[..., Any], *args: Any) -> Any:
    return hook(*args)


_call_eagerly: Callable[..., Any] | None = None


def _not_traced(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A hook of the compiled backward's node runs as Python, on the real objects: compiled
    autograd, which traces the backward's hooks with Dynamo, runs it eagerly (a graph break;
    with a ``fullgraph=True`` compiler, an error naming dynamo_ext where Dynamo failed to
    convert the objects it holds). One disabled function, made once (making one costs about a
    millisecond), calls each call's hook."""
    global _call_eagerly
    if _call_eagerly is None:
        _call_eagerly = torch._dynamo.disable(
            _call, reason="dynamo_ext: the compiled backward's hook reads and writes the real objects; "
            "compiled autograd runs it eagerly (use a fullgraph=False compiler for compiled autograd)",
        )
    return functools.partial(_call_eagerly, hook)


# Note [A refusal undoes the backward's earlier writes]
# One ``backward()`` may run several compiled backwards (two compiled forwards summed, a
# graph break's two graphs): each sets its writes when it has run. Where a later one is
# refused when it would run (``changed_before_backward``), the earlier ones' writes were set
# already: a count left at 1 where it was 0 before ``backward()`` and eager gives 2 (an
# outside tester's find). The writes each compiled backward sets are kept per backward pass
# (autograd's graph task), with the values they replaced, until that pass ends; a refusal
# puts them back, in reverse order, before it raises.

_JOURNALS: dict[int, list[tuple[Any, str, Any]]] = {}
_KEPT_JOURNALS = 8  # passes that ended by an error other than a refusal drop out after this


def _this_backward_journal() -> list[tuple[Any, str, Any]]:
    task = torch._C._current_graph_task_id()
    journal = _JOURNALS.get(task)
    if journal is not None:
        return journal
    if task < 0 or torch._dynamo.compiled_autograd.in_compiled_autograd_region:
        return []  # no pass of autograd's own to end it (compiled autograd runs the hooks)
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _JOURNALS.pop(task, None))
    journal = _JOURNALS[task] = []
    for old in sorted(_JOURNALS)[:-_KEPT_JOURNALS]:
        del _JOURNALS[old]
    return journal


def _gradient_seen(node: Any, index: int) -> bool:
    """Whether the gradient the compiled backward's node sends its input ``index`` is handed
    to user code as it is: a leaf's that ``autograd.grad`` captures or a tensor hook of the
    leaf gets (``x.grad`` is autograd's ``detach`` of it). A gradient flowing on to another
    node is not (README, Limits)."""
    nexts = node.next_functions
    if index >= len(nexts):
        return True
    fn = nexts[index][0]
    if fn is None or type(fn).__name__ != "AccumulateGrad":
        return False
    try:
        torch._C._will_engine_execute_node(fn)
    except RuntimeError:  # a leaf autograd.grad captures
        return True
    return bool(getattr(fn.variable, "_backward_hooks", None))


def _undo_this_backward() -> None:
    for target, name, old in reversed(_JOURNALS.pop(torch._C._current_graph_task_id(), [])):
        if old is MISSING:
            capture.obj_dict(target).pop(name, None)
        else:
            setattr(target, name, old)


_TRACED = object()


def _shown(r: free_state.BackwardRead, value: Any = _TRACED) -> str:
    """A read's value for a message (as traced by default)."""
    value = r.value if value is _TRACED else value
    if value is MISSING:
        return "absent"
    if r.kind == "code" and isinstance(value, tuple):
        return f"function {value[1]}"
    return repr(value)


#: The name a backward check of which names an instance dict holds goes by (See Note [The
#: instance dict read in the traced backward] in aot_layer.py).
DICT_KEYS = "__dict__"

#: The attribute of a compiled backward's autograd node holding one call's values of the
#: plan's ``call_symbols``: {expression: value}.
SYMBOL_VALUES_ATTR = "_dynamo_ext_symbol_values"


def resolve_symbolic(ctx: Any, values: dict[Any, Any] | None, read: Callable[[Any], Any] | None = None) -> Any:
    """``ctx`` with each symbolic value replaced by its value in this call (``values``:
    {expression: value}) and each counted int by its expression evaluated with ``read``
    (counters.py); MISSING where one is not known."""
    if isinstance(ctx, counters.CountedInt):
        return counters.evaluate(ctx.expr, read) if read is not None else MISSING
    if isinstance(ctx, (torch.SymInt, torch.SymFloat)):
        expr = ctx.node.expr
        free = getattr(expr, "free_symbols", ())
        if values is None and free:
            return MISSING
        if free and expr in values:
            return values[expr]
        if not all(s in values for s in free):
            return MISSING
        # (no free symbol: a SymInt whose expression simplified to a number, ``2``)
        got = expr.xreplace({s: values[s] for s in free}) if free else expr
        try:
            return int(got) if isinstance(ctx, torch.SymInt) else float(got)
        except (TypeError, ValueError):
            return MISSING
    if not (contains_symbolic(ctx) or counters.holds_counted(ctx)):
        return ctx
    if type(ctx) in (list, tuple, torch.Size):
        parts = [resolve_symbolic(v, values, read) for v in ctx]
        return MISSING if any(p is MISSING for p in parts) else type(ctx)(parts)
    if type(ctx) is dict:
        items = {k: resolve_symbolic(v, values, read) for k, v in ctx.items()}
        return MISSING if any(v is MISSING for v in items.values()) else items
    return MISSING  # a SymBool, a symbolic value in another container


def _rebuilt_with(grad: Any, values: dict[Any, Any], read: Callable[[Any], Any]) -> Any:
    """A gradient the compiled backward built from the ctx it traced, rebuilt (it and the
    subclasses nested in it) with this call's values of the symbolic and counted values its
    ctx holds (See Note [A gradient's ctx made from sizes or counts] in aot_layer.py)."""
    if not is_traceable_wrapper_subclass(grad):
        return grad
    names, ctx = grad.__tensor_flatten__()
    inner = {n: getattr(grad, n) for n in names}
    rebuilt = {n: _rebuilt_with(t, values, read) for n, t in inner.items()}
    if not (contains_symbolic(ctx) or counters.holds_counted(ctx)) and all(rebuilt[n] is inner[n] for n in names):
        return grad
    now = resolve_symbolic(ctx, values, read)
    if now is MISSING:
        raise SubclassWriteError(
            RefusalKind.WRITE_IN_BACKWARD, type(grad).__name__, "<flatten ctx>", type(ctx).__name__,
            context=f"the gradient's flatten ctx {ctx!r} holds a value computed while traced whose value in this "
            "call is not known",
        )
    return type(grad).__tensor_unflatten__(rebuilt, now, grad.size(), grad.stride())


_MAX_SHAPES = 1024  # sets of input shapes a graph keeps made objects for (See Note [Objects dispatch makes, per shape])


def _as_dispatch_made(out: Any, positions: tuple[int, ...], inputs: Sequence[Any]) -> Any:
    """Note [A view dispatch writes]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Dispatch runs below autograd, where a view it makes (``self.dv = self.elem.detach()``,
    ``self.t_cache = self.elem.t()``) is tracked as none: no ``_base``, a version counter of its
    own. The AOT backends return such a written value as a graph output aliasing an input,
    which AOTAutograd regenerates as a view of it at the autograd level, sharing the input's
    counter: the caller's in-place change through it failed a backward that saved the input,
    and moved a counter a cache was keyed on (an outside tester's find). ``positions``: the
    outputs that were such a value while traced (no view, on an input's storage). Each is
    replaced with an alias made below autograd as eager's is, one per tensor (a tensor written
    in two places stays one object); not one that is an input or an inner tensor itself, or
    also the caller's output."""
    fresh: dict[int, Any] = {}
    items = list(out)
    held = {id(t) for t in (*inputs, *capture.inner_plain_tensors(list(inputs))) if isinstance(t, torch.Tensor)}
    for i in positions:
        value = items[i]
        if type(value) not in (torch.Tensor, torch.nn.Parameter) or id(value) in held:
            continue
        if id(value) not in fresh:
            if any(v is value for j, v in enumerate(items) if j not in positions):
                continue
            with torch._C._AutoDispatchBelowADInplaceOrView():
                fresh[id(value)] = torch.ops.aten.alias.default(value)
        items[i] = fresh[id(value)]
    return type(out)(items) if fresh else out


def _as_made(obj: Any, made: dict[str, Any]) -> Any:
    """A copy of ``obj`` holding what it held when the traced code made it."""
    fresh = copy.copy(obj)
    for name, value in made.items():
        if value is MISSING:
            capture.obj_dict(fresh).pop(name, None)
        else:
            setattr(fresh, name, value)
    return fresh


def _weak(node: Any) -> Callable[[], Any]:
    """A weak reference to the node of an ``autograd.Function`` (AOTAutograd's compiled one),
    which lives as long as its graph; a strong one to another node, whose Python object torch
    may make anew on each access."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        return weakref.ref(node)
    return lambda: node


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
