"""Dynamo layer: make Dynamo record the writes ``__torch_dispatch__`` makes.

Compile-time half of the primary path (see ../README.md, "How it works"):

1. Around Dynamo's fake propagation of each op (``_get_fake_value_impl``), every
   traceable wrapper subclass *graph input* among the op's arguments is watched:
   its fake example value is snapshotted, reads of attributes the fake lacks are
   answered from the real input (and guarded), and after the op the writes are
   read off the fake.
2. Each write is recorded with Dynamo's own ``SideEffects.store_attr`` right
   after the op, so later user code in the frame reads the new value and Dynamo's
   residual bytecode replays it after the graph (``STORE_ATTR``), exactly like a
   user-level ``x.attr = v``.  A new tensor value is read off the traced input by
   an FX node (``read_attr``), which makes it a graph output.
3. Before the graph is compiled (``OutputGraph.compile_subgraph``) the fake
   example values are restored to their entry state, so guards, shape-guard
   production and AOTAutograd never see trace-time state.

The run-time half is Dynamo's residual bytecode itself; nothing of ours runs per
call.  Upstream request: pytorch #130028.
"""

from __future__ import annotations

import enum
import functools
import logging
from typing import Any, Callable, NoReturn

import torch
import torch.fx

from . import aot_layer, config, ctx_state
from .capture import (
    MISSING,
    AttributeWrite,
    TORCH_INTERNAL_ATTRS,
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
from .errors import RefusalKind, refuse

log = logging.getLogger(__name__)

_STATE_KEY = "_dynamo_ext_frame_state"


# --------------------------------------------------------------------------- #
# FX targets.  They run (a) during AOTAutograd's traces, on AOT's own instances,
# and (b) at run time with backend="eager", on the real inputs.
# --------------------------------------------------------------------------- #


def read_attr(obj: Any, name: str) -> Any:
    """Graph node for a tensor written into ``obj.name`` by ``__torch_dispatch__``."""
    return getattr(obj, name)


def seed_attr(obj: Any, name: str, value: Any) -> None:
    """Give a traced instance an attribute its real input has and dispatch reads.

    The attribute lies outside ``__tensor_flatten__``, so AOTAutograd's instances
    (rebuilt by ``__tensor_unflatten__``) do not carry it; this node hands it to
    them before the op that reads it: a tensor as a graph input, a constant as the
    (guarded) value Dynamo traced with.  On real inputs the attribute is already
    there and this is a no-op.  Being an unknown call target, the node also keeps
    AOTAutogradCache from reusing a graph traced under other attribute values.
    """
    if name not in obj.__dict__:
        obj.__dict__[name] = value if isinstance(value, torch.Tensor) else seed_copy(value)
        aot_layer.seeded(obj, name)


def seed_ctx_state(obj: Any, path: tuple, name: str, value: Any) -> None:
    """Hand the state object reachable from ``obj`` at ``path`` its tensor ``name`` as a
    graph input (a mask held by DTensor's MaskBuffer, say). Traces see the traced
    value; at run time it is the value the object already holds."""
    setattr(ctx_state.follow(obj, path), name, value)


# Constants FX cannot print as literals are passed to the graph by key.
_SEED_VALUES: dict[int, Any] = {}


def seed_attr_by_key(obj: Any, name: str, key: int) -> None:
    seed_attr(obj, name, _SEED_VALUES[key])


def _insert_seed(node: torch.fx.Node, w: "_Watched", name: str, value: Any) -> None:
    from torch._dynamo.variables import ConstantVariable

    target: Callable[..., None]
    if isinstance(value, torch.fx.Node) or ConstantVariable.is_literal(value):
        target, arg = seed_attr, value
    else:
        target, arg = seed_attr_by_key, len(_SEED_VALUES)
        _SEED_VALUES[arg] = seed_copy(value)
    with node.graph.inserting_before(node):
        seed = node.graph.call_function(target, (w.vt.as_proxy().node, name, arg))
    seed.meta["example_value"] = None


# --------------------------------------------------------------------------- #
# Per-frame state (one per OutputGraph)
# --------------------------------------------------------------------------- #


class _Watched:
    """A subclass seen as an op argument: a graph input (``real`` is the user's tensor),
    or an intermediate of the graph (``real`` is None: it only exists in the trace)."""

    __slots__ = ("fake", "vt", "real", "source")

    def __init__(self, fake: Any, vt: Any, is_input: bool) -> None:
        self.fake = fake
        self.vt = vt
        self.real = vt.as_proxy().node.meta["grapharg"].example if is_input else None
        self.source = vt.source

    @property
    def is_input(self) -> bool:
        return self.real is not None

    @property
    def cls_name(self) -> str:
        return type(self.fake).__name__


class FrameState:
    """What dynamo_ext changed while tracing one frame, so it can be undone."""

    def __init__(self) -> None:
        # Entry state of every fake example value we let dispatch write on.
        self.originals: dict[int, InstanceSnapshot] = {}
        self.guarded_reads: set[tuple[int, str]] = set()
        # Writes recorded with SideEffects, per real input: the AOT layer leaves them alone.
        # name -> the constant recorded (the last write wins), or GRAPH_VALUE.
        self.recorded: dict[int, tuple[Any, dict[str, Any]]] = {}
        # The same, with the Dynamo layer off: seen in fake propagation, not recorded.
        self.observed: dict[int, dict[str, Any]] = {}
        # Writes on objects reachable from a ctx (ctx_state): isolation only; dispatch
        # replays them at run time with backend="eager", the AOT layer otherwise.
        self.journal = Journal()
        self.lifted: set[tuple[int, str]] = set()  # (id(state object), attribute) made graph inputs
        self._by_fake: dict[int, Any] = {}
        self._inputs_seen: set[Any] = set()
        self._by_fake_new: dict[int, Any] = {}
        self._tracked_seen: set[Any] = set()

    @staticmethod
    def _new_items(d: dict, seen: set) -> list:
        """The items of ``d`` added since the last call (dicts keep insertion order, so
        they are at the end): per op this costs the new entries, not the whole dict."""
        new = []
        for key, value in reversed(d.items()):
            if key in seen:
                break
            new.append((key, value))
        seen.update(k for k, _ in new)
        return new[::-1]

    def input_for_fake(self, output: Any, fake: Any) -> Any:
        from torch._dynamo.variables import TensorVariable

        for _, vt in self._new_items(output.input_source_to_var, self._inputs_seen):
            if isinstance(vt, TensorVariable):
                ev = vt.proxy.node.meta.get("example_value")
                if ev is not None and "grapharg" in vt.proxy.node.meta:
                    self._by_fake[id(ev)] = vt
        return self._by_fake.get(id(fake))

    def intermediates(self, output: Any) -> dict[int, Any]:
        """``id(fake example value) -> variable`` of the tensors the graph computed."""
        from torch._dynamo.variables import TensorVariable

        side_effects = output.side_effects
        for _, vt in self._new_items(side_effects.id_to_variable, self._tracked_seen):
            if isinstance(vt, TensorVariable) and side_effects.is_attribute_mutation(vt) and vt.source is None:
                ev = vt.proxy.node.meta.get("example_value")
                if ev is not None:
                    self._by_fake_new[id(ev)] = vt
        return self._by_fake_new

    def remember(self, fake: Any) -> None:
        if id(fake) not in self.originals:
            self.originals[id(fake)] = InstanceSnapshot(fake)

    def restore_all(self) -> None:
        for snap in self.originals.values():
            snap.restore()
        self.journal.undo()
        self.journal.close()


def frame_state(output: Any) -> FrameState:
    state = output.__dict__.get(_STATE_KEY)
    if state is None:
        state = FrameState()
        output.__dict__[_STATE_KEY] = state
        output.add_cleanup_hook(state.restore_all)
    return state


# --------------------------------------------------------------------------- #
# Reads of state the fake lacks
# --------------------------------------------------------------------------- #


class _NeedsTensorSeed(BaseException):
    """Dispatch read a tensor attribute the fake lacks: seed it, then re-run the op.

    A BaseException so that neither the subclass's own ``except Exception`` nor
    Dynamo's RuntimeError wrapping swallows it.
    """

    def __init__(self, watched: _Watched, name: str) -> None:
        self.watched = watched
        self.name = name


class _RefusedRead(BaseException):
    def __init__(self, watched: _Watched, name: str, value: Any, direct_dict: bool = False) -> None:
        self.watched = watched
        self.name = name
        self.value = value
        self.direct_dict = direct_dict


class _DirectDictAccess(dict):
    """The traced instance's ``__dict__`` while the real input has attributes it lacks.

    Attribute syntax (``getattr``, ``hasattr``) reaches ``_ReadLog``'s hook; code
    that reads ``__dict__`` itself would silently see the trace's partial state
    instead, so any such read is refused.  Stores through attribute syntax use
    the C-level dict API and are not affected.
    """

    def __init__(self, entries: dict, watched: "_Watched", hidden: str) -> None:
        super().__init__(entries)
        self._watched = watched
        self._hidden = hidden

    def plain(self) -> dict:
        # dict's own C methods: the overrides below would refuse (and dict(self)
        # goes through keys() on a subclass).
        return {k: dict.__getitem__(self, k) for k in dict.__iter__(self)}

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise _RefusedRead(self._watched, self._hidden, self._watched.real.__dict__[self._hidden], direct_dict=True)

    __getitem__ = __contains__ = __iter__ = __len__ = _refuse
    get = pop = setdefault = keys = items = values = copy = popitem = _refuse


class _ReadLog:
    """Answers reads of attributes the fake example values lack, from the real inputs.

    Traceable subclasses rebuild fakes with ``__tensor_unflatten__``, which only
    restores the flatten ctx; an attribute outside it (a call counter, a cache)
    would be missing and dispatch would take another branch than in eager.  A
    ``__getattr__`` is put on the subclass for the duration of one op; it only
    sees attributes that normal lookup did not find.
    """

    def __init__(self, watched: list[_Watched], snaps: list[InstanceSnapshot]) -> None:
        # Intermediates need no answers: dispatch made them, in the trace as in eager.
        self._by_id = {id(w.fake): (w, s) for w, s in zip(watched, snaps) if w.is_input}
        self.present: list[tuple[_Watched, str, Any]] = []
        self.absent: list[tuple[_Watched, str]] = []
        self._classes = {type(w.fake) for w in watched}
        self._previous: dict[type, Any] = {}

    def __enter__(self) -> "_ReadLog":
        for cls in self._classes:
            self._previous[cls] = cls.__dict__.get("__getattr__", MISSING)
            cls.__getattr__ = self._make_hook(cls)  # type: ignore[attr-defined]
        for w, _ in self._by_id.values():  # graph inputs only
            hidden = user_state(w.real.__dict__).keys() - w.fake.__dict__.keys()
            if hidden:
                w.fake.__dict__ = _DirectDictAccess(w.fake.__dict__, w, sorted(hidden)[0])
        return self

    def __exit__(self, *exc: Any) -> None:
        for w, _ in self._by_id.values():
            if type(w.fake.__dict__) is _DirectDictAccess:
                w.fake.__dict__ = w.fake.__dict__.plain()
        for cls, prev in self._previous.items():
            if prev is MISSING:
                del cls.__getattr__  # type: ignore[attr-defined]
            else:
                cls.__getattr__ = prev  # type: ignore[attr-defined]
        self._previous.clear()

    def _make_hook(self, cls: type) -> Callable[[Any, str], Any]:
        prev = self._previous[cls]
        log_ = self

        def __getattr__(obj: Any, name: str) -> Any:
            entry = log_._by_id.get(id(obj))
            if entry is None or name.startswith("__") or name in TORCH_INTERNAL_ATTRS:
                if prev is not MISSING:
                    return prev(obj, name)
                base = getattr(super(cls, obj), "__getattr__", None)
                if base is not None:
                    return base(name)
                raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")
            return log_._answer(entry[0], entry[1], name)

        return __getattr__

    def _answer(self, w: _Watched, snap: InstanceSnapshot, name: str) -> Any:
        real_dict = w.real.__dict__
        if name not in real_dict:
            self.absent.append((w, name))
            raise AttributeError(f"{w.cls_name!r} object has no attribute {name!r}")
        value = real_dict[name]
        if isinstance(value, torch.Tensor):
            raise _NeedsTensorSeed(w, name)
        seeded = seed_copy(value)
        if seeded is MISSING:
            raise _RefusedRead(w, name, value)
        w.fake.__dict__[name] = seeded
        snap.note_seeded(name, seeded)
        self.present.append((w, name, value))
        return seeded

    def finish(self, tx: Any, state: FrameState, node: torch.fx.Node) -> None:
        """Guard the compiled code on every real-input attribute dispatch looked at,
        and seed the constants it read into the graph before ``node``."""
        from torch._dynamo.guards import GuardBuilder, install_guard
        from torch._dynamo.source import AttrSource

        for w, name, value in self.present:
            if (id(w.fake), name) in state.guarded_reads:
                continue
            state.guarded_reads.add((id(w.fake), name))
            _guard_constant(tx, AttrSource(w.source, name), value)
            _insert_seed(node, w, name, value)
        for w, name in self.absent:
            if (id(w.fake), name) in state.guarded_reads:
                continue
            state.guarded_reads.add((id(w.fake), name))
            install_guard(w.source.make_guard(functools.partial(GuardBuilder.HASATTR, attr=name)))


# Values Dynamo's EQUALS_MATCH guard accepts (guards.py, GuardBuilder.EQUALS_MATCH).
_EQUALS_GUARDABLE = (
    int, float, complex, bool, str, bytes, type(None), tuple, frozenset, list, set,
    torch.Size, torch.dtype, torch.device, torch.layout, torch.memory_format,
)


def _guard_constant(tx: Any, source: Any, value: Any) -> None:
    """Guard that the real attribute still equals the constant the trace used.

    Literal floats must be guarded by value: through VariableBuilder a float that
    changed between calls would become a dynamic SymFloat, i.e. a graph input the
    traced dispatch never sees.
    """
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.variables.builder import VariableBuilder
    from torch._dynamo.variables.lazy import LazyVariableTracker

    if type(value) in _EQUALS_GUARDABLE and not _holds_unguardable(value):
        install_guard(source.make_guard(GuardBuilder.EQUALS_MATCH))
    elif isinstance(value, enum.Enum):
        install_guard(source.make_guard(GuardBuilder.ID_MATCH))
    else:
        LazyVariableTracker.realize_all(VariableBuilder(tx, source)(value))


def _holds_unguardable(value: Any) -> bool:
    """Containers holding values EQUALS_MATCH cannot compare (nested dicts, objects)."""
    if isinstance(value, (tuple, frozenset, list, set)):
        return any(type(v) not in _EQUALS_GUARDABLE or _holds_unguardable(v) for v in value)
    return False


def _seed_tensor(tx: Any, node: torch.fx.Node, w: _Watched, name: str) -> None:
    """Make ``real.name`` a graph input and hand it to the traced instance before ``node``."""
    from torch._dynamo.source import AttrSource
    from torch._dynamo.variables.builder import VariableBuilder
    from torch._dynamo.variables.lazy import LazyVariableTracker

    if tx.output.current_tracer.parent is not None:
        _refuse_read(w, name, w.real.__dict__[name], "tensor attribute read inside a higher-order op body")
    vt = VariableBuilder(tx, AttrSource(w.source, name))(w.real.__dict__[name])
    vt = LazyVariableTracker.realize_all(vt)
    proxy = vt.as_proxy()
    _insert_seed(node, w, name, proxy.node)
    w.fake.__dict__[name] = proxy.node.meta["example_value"]


def _lift_ctx_state(tx: Any, node: torch.fx.Node, w: _Watched, state: FrameState) -> None:
    """Tensors held by state objects reachable from the input's ctx become graph inputs.

    They are real tensors shared by reference with the fake input (the ctx is not
    copied by fakification), which fake propagation cannot use (pytorch: "Please
    convert all Tensors to FakeTensors first"), and AOTAutograd must see them as
    inputs, not trace-time constants. The fake takes the graph input's fake value
    (journaled, so undone before the graph is compiled); a ``seed_ctx_state`` node
    before ``node`` hands AOTAutograd's passes the traced value.
    """
    from torch._dynamo.source import AttrSource, GetItemSource
    from torch._dynamo.variables.builder import VariableBuilder
    from torch._dynamo.variables.lazy import LazyVariableTracker

    for path, obj in ctx_state.find_state(w.real):
        for name, value in list(vars(obj).items()):
            if not isinstance(value, torch.Tensor) or (id(obj), name) in state.lifted:
                continue
            state.lifted.add((id(obj), name))
            source = w.source
            for kind, key in path:
                source = AttrSource(source, key) if kind == "attr" else GetItemSource(source, key)
            vt = LazyVariableTracker.realize_all(VariableBuilder(tx, AttrSource(source, name))(value))
            proxy = vt.as_proxy()
            with node.graph.inserting_before(node):
                seed = node.graph.call_function(seed_ctx_state, (w.vt.as_proxy().node, path, name, proxy.node))
            seed.meta["example_value"] = None
            setattr(obj, name, proxy.node.meta["example_value"])


def _refuse(kind: RefusalKind, w: _Watched, attr: str, value_type: str, context: str = "") -> NoReturn:
    """Refuse a write or read on ``w`` (a graph break, or an error under fullgraph=True).

    After the graph break the op runs eagerly from the user's frame, and Dynamo
    would try to compile the subclass's ``__torch_dispatch__`` frame itself (and
    the functions it calls), on the real input, where the same state problem
    comes back under a stock error.  Dispatch frames are run eagerly instead,
    recursively, which is what the graph break means.
    """
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    dispatch = getattr(type(w.fake).__torch_dispatch__, "__func__", None)
    code = getattr(dispatch, "__code__", None)
    if code is not None:
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
        _EAGER_DISPATCH_CODES.add(code)
    refuse(kind, w.cls_name, attr, value_type, context)


_EAGER_DISPATCH_CODES: set[Any] = set()


def release_dispatch_frames() -> None:
    """Undo ``_refuse``'s run-eagerly marks (``dynamo_ext.disable()`` calls this)."""
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    while _EAGER_DISPATCH_CODES:
        code = _EAGER_DISPATCH_CODES.pop()
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT))


def _refuse_read(w: _Watched, name: str, value: Any, context: str = "") -> NoReturn:
    _refuse(RefusalKind.UNSUPPORTED_STATE_READ, w, name, type(value).__name__, context)


# --------------------------------------------------------------------------- #
# Recording writes with Dynamo's SideEffects
# --------------------------------------------------------------------------- #


def _constant_vt(tx: Any, value: Any) -> Any:
    from torch._dynamo.source import GlobalSource
    from torch._dynamo.variables import ConstantVariable
    from torch._dynamo.variables.builder import SourcelessBuilder, VariableBuilder

    if ConstantVariable.is_literal(value):
        return ConstantVariable.create(value)
    try:
        vt = SourcelessBuilder.create(tx, value)
        if vt.is_python_constant() and vt.as_python_constant() == value:
            return vt
    except Exception:  # SourcelessBuilder raises Unsupported for types it cannot build
        pass
    # Immutable objects Dynamo cannot build without a source (frozen dataclasses,
    # some enums): replay them from a global holding the exact object.
    name = tx.output.install_global_by_id("__dynamo_ext_value", value)
    return VariableBuilder(tx, GlobalSource(name))(value)


def _graph_value_vt(tx: Any, state: FrameState, w: _Watched, write: AttributeWrite) -> Any:
    """A tensor or symbolic size written by dispatch, as a value the graph returns."""
    from torch._dynamo.variables.builder import wrap_fx_proxy
    from torch._subclasses.fake_tensor import is_fake

    value = write.new
    same = state.input_for_fake(tx.output, value) or _intermediate_vt(tx, value)
    if same is not None:
        # An alias of a graph input (the input itself, one of its inner tensors):
        # the residual bytecode loads it from its source, keeping identity.
        return same
    if isinstance(value, torch.Tensor) and not is_fake(value):
        _refuse(
            RefusalKind.OPAQUE_VALUE,
            w,
            write.name,
            f"{type(value).__name__} (a real tensor not computed in the traced program)",
        )
    proxy = tx.output.create_proxy("call_function", read_attr, (w.vt.as_proxy(), write.name), {})
    return wrap_fx_proxy(tx, proxy)


def _round_trip_mismatch(w: _Watched, entry: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """An attribute of the real input that the traced instance, as unflatten built it,
    does not hold: ``(name, traced value, input value)``. A value the fake lacks is
    normally answered from the input on read (``_ReadLog``), unless a class-level
    default answers first; a constant the fake holds must be the input's."""
    cls = type(w.fake)
    for name, real_value in user_state(vars(w.real)).items():
        traced = entry.get(name, MISSING)
        if traced is MISSING:
            if not hasattr(cls, name):
                continue  # read through to the input
            traced = getattr(cls, name)
            if isinstance(real_value, torch.Tensor) or not _same_value(traced, real_value):
                return name, traced, real_value
        elif (
            not isinstance(real_value, torch.Tensor)
            and classify_value(real_value) is ValueKind.CONSTANT
            and classify_value(traced) is ValueKind.CONSTANT
            and not _same_value(traced, real_value)
        ):
            return name, traced, real_value
    return None


def _record(tx: Any, state: FrameState, w: _Watched, writes: list[AttributeWrite]) -> None:
    if w.is_input and id(w.fake) in state.originals:
        bad = _round_trip_mismatch(w, state.originals[id(w.fake)].entries)
        if bad is not None:
            name, traced, real = bad
            _refuse(
                RefusalKind.FLATTEN_ROUND_TRIP,
                w,
                name,
                type(real).__name__,
                f"traced instance has {name}={traced!r}, the input has {name}={real!r}; "
                f"writes on it: {', '.join(wr.name for wr in writes)}",
            )
    if tx.output.current_tracer.parent is not None:
        wr = writes[0]
        _refuse(RefusalKind.WRITE_IN_HOP, w, wr.name, type(wr.new).__name__)
    if not torch._dynamo.config.replay_side_effects:
        # torch.export (strict) traces with replay off: the write would be dropped.
        wr = writes[0]
        _refuse(RefusalKind.UNREPLAYABLE_ENTRY, w, wr.name, type(wr.new).__name__)
    for wr in writes:  # refuse before recording anything
        bad = refusal_for(wr)
        if bad is not None:
            _refuse(bad[0], w, wr.name, bad[1])
    for wr in writes:
        if classify_value(wr.new) is ValueKind.CONSTANT:
            value_vt = _constant_vt(tx, wr.new)
        else:  # a tensor or a symbolic size
            value_vt = _graph_value_vt(tx, state, w, wr)
        where = w.source.name if w.source is not None else f"<intermediate {w.cls_name}>"
        log.debug("write recorded: %s.%s <- %s", where, wr.name, type(wr.new).__name__)
        tx.output.side_effects.store_attr(w.vt, wr.name, value_vt)
        if w.is_input:
            recorded = wr.new if classify_value(wr.new) is ValueKind.CONSTANT else aot_layer.GRAPH_VALUE
            state.recorded.setdefault(id(w.real), (w.real, {}))[1][wr.name] = recorded


# --------------------------------------------------------------------------- #
# The two hooks
# --------------------------------------------------------------------------- #


def _intermediate_vt(tx: Any, fake: Any) -> Any:
    """The variable of a tensor the graph computed, if Dynamo tracks it for attribute
    writes (``handle_traced_output`` tracks new tensors as ``AttributeMutationNew``,
    keyed by their proxy)."""
    return frame_state(tx.output).intermediates(tx.output).get(id(fake))


def _watched_args(node: torch.fx.Node, tx: Any, state: FrameState) -> list[_Watched]:
    watched: list[_Watched] = []
    seen: set[int] = set()

    def visit(arg: torch.fx.Node) -> torch.fx.Node:
        ev = arg.meta.get("example_value")
        if ev is not None and id(ev) not in seen and is_watched_type(ev):
            seen.add(id(ev))
            vt = state.input_for_fake(tx.output, ev)
            if vt is not None and vt.source is not None:
                watched.append(_Watched(ev, vt, is_input=True))
            else:
                vt = _intermediate_vt(tx, ev)
                if vt is not None:
                    watched.append(_Watched(ev, vt, is_input=False))
        return arg

    torch.fx.node.map_arg((node.args, node.kwargs), visit)
    return watched


def _has_subclass_arg(node: torch.fx.Node) -> bool:
    found = False

    def visit(arg: torch.fx.Node) -> torch.fx.Node:
        nonlocal found
        if not found and is_watched_type(arg.meta.get("example_value")):
            found = True
        return arg

    torch.fx.node.map_arg((node.args, node.kwargs), visit)
    return found


def make_fake_value_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``torch._dynamo.utils._get_fake_value_impl``."""

    @functools.wraps(original)
    def _get_fake_value_impl(node: torch.fx.Node, tx: Any, allow_non_graph_fake: bool = False) -> Any:
        if node.op == "placeholder" or not _has_subclass_arg(node):
            return original(node, tx, allow_non_graph_fake)
        if "example_value" in node.meta:  # original returns the cached value, runs nothing
            return original(node, tx, allow_non_graph_fake)
        state = frame_state(tx.output)
        state.journal.open()  # writes on ctx objects (MaskBuffer): undone before compiling
        watched = _watched_args(node, tx, state)
        if not watched:
            return original(node, tx, allow_non_graph_fake)
        for w in watched:
            if w.is_input:  # intermediates exist only in this trace: nothing to restore
                if id(w.fake) not in state.originals:
                    _lift_ctx_state(tx, node, w, state)
                state.remember(w.fake)
        while True:
            snaps = [InstanceSnapshot(w.fake) for w in watched]
            reads = _ReadLog(watched, snaps)
            attempt = Journal().open()  # an aborted attempt must not leave ctx-state writes
            try:
                with reads:
                    result = original(node, tx, allow_non_graph_fake)
            except _NeedsTensorSeed as need:
                attempt.undo()
                for s in snaps:
                    s.restore()
                _seed_tensor(tx, node, need.watched, need.name)
                continue
            except _RefusedRead as bad:
                attempt.undo()
                for s in snaps:
                    s.restore()
                if bad.direct_dict:
                    _refuse_read(
                        bad.watched,
                        bad.name,
                        bad.value,
                        "__torch_dispatch__ read the instance __dict__ directly while the input has "
                        f"attributes outside __tensor_flatten__ (e.g. {bad.name!r}); use getattr/hasattr",
                    )
                _refuse_read(bad.watched, bad.name, bad.value)
            except BaseException:
                attempt.undo()
                for s in snaps:
                    s.restore()
                raise
            finally:
                attempt.close()
            break
        reads.finish(tx, state, node)
        for w, snap in zip(watched, snaps):
            writes = snap.writes()
            if not writes:
                continue
            if config.dynamo_layer:
                _record(tx, state, w, writes)
            elif w.is_input:  # AOT layer alone: what fake propagation wrote, for its check
                seen = state.observed.setdefault(id(w.real), {})
                for wr in writes:
                    seen[wr.name] = wr.new if classify_value(wr.new) is ValueKind.CONSTANT else aot_layer.GRAPH_VALUE
        return result

    return _get_fake_value_impl


def make_compile_subgraph_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``OutputGraph.compile_subgraph``: restore the fakes first."""

    @functools.wraps(original)
    def compile_subgraph(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = self.__dict__.get(_STATE_KEY)
        if state is None:
            return original(self, *args, **kwargs)
        state.restore_all()
        # The backend is called from inside: tell the AOT layer which writes the
        # residual bytecode already replays, so none is applied twice.
        with aot_layer.dynamo_handled({k: names for k, (_, names) in state.recorded.items()}, state.observed):
            return original(self, *args, **kwargs)

    return compile_subgraph
