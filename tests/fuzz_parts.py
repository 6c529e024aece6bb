"""Parts of the differential fuzzer (``tests/test_fuzz.py``): what is drawn, the class
factory that turns a drawn ``Spec`` into a wrapper subclass, the programs, and the
eager-vs-compiled runner with its strict state comparison.

A drawn case is a ``Spec`` (the subclass) and a ``Program`` (what runs, how many calls,
what the user changes between calls). Every dimension is optional and combines freely
with the others:

- ``writes``: which ops write what into which attribute, in the flatten ctx or not, in a
  flatten list that grows once set or not. Kinds: constants, counters, tensors from the
  input or the op's output, aliases of the inner tensor, None, frozen dataclasses, lists
  (refused: ``mutable_value``); ``update`` (read with attribute syntax where a default
  exists, then bumped: ``step + 1``, ``scale * 0.5``, ``"cold" <-> "warm"``);
  ``same_value`` / ``equal_value`` (the current value written back, or an equal one of
  another type or sign: 1.0 over 1, True over True, -0.0 over 0.0, an equal new tensor);
  sizes (``elem.shape``, ``shape[0]``, ``numel()``, ``f"{rows}x{cols}"``, a running
  row count), SymInts under ``dynamic=True`` or a changing batch size; ``stamp``: the op's
  result gets a dict of the first argument's row count and attribute
  (``out.stamp = {"rows": ..., "n": ...}``, as views keep their root's step), which holds
  SymInts where those are dynamic and reaches the next op as an intermediate.
- ``ctor``: defaults ``__new__`` sets outside the ctx; ``unflatten``: a default
  ``__tensor_unflatten__`` sets outside the ctx (possibly another value, or another
  attribute, than ``__new__``'s).
- ``getattr_kind`` / ``getattr_reads``: a user ``__getattr__`` serving names from a ctx
  tuple, from another attribute (``object.__getattribute__``), or forwarding to the
  inner tensor; dispatch reads names with ``getattr(x, name, default)`` into an
  attribute or into the op's result.
- ``ext_reads``: dispatch reads a module-level constant (``GAIN``), a module-level dict
  (``TABLE``, a per-op table), a closure variable or a closure dict entry (the class is
  built by a factory) into an attribute, a branch or the op's result; the program changes
  them between calls, and its own code may read the same globals.
- ``inner``: the inner tensor is itself a writing subclass (its own ctx counter, a
  counter / step / tensor cache outside its ctx); ``inner_writes``: the outer dispatch
  writes on the inner object.
- ``alias``: ``self.cache = self.elem`` with ``__tensor_flatten__`` naming both; left
  alone, toggled between alias and a rounded copy, or made an alias by an op; the op
  may compute with ``cache``.

The program draws 1-3 inputs, 1-4 ops, an optional graph break (in the op loop of a nested
frame, where Dynamo then compiles frames such as ``__torch_dispatch__`` on their own; or in
the compiled function itself), requires_grad with backward (of every output, or for part
of the graph: the first or last output only, or ``backward(inputs=[the first input])``), 2-4 calls, ``dynamic``, a
fixed or a changing batch size, and user changes of the inputs' attributes between calls
(the same change on the eager and the compiled side).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Iterator, Sequence

import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only

import dynamo_ext
import subclasses as S
from dynamo_ext import RefusalKind
from harness import assert_same_identities, leaked_fakes, plain

aten = torch.ops.aten

OPS = {"mul": aten.mul.Tensor, "add": aten.add.Tensor, "sin": aten.sin.default}


def op_name(func: Any) -> str | None:
    # an if-chain, not a dict lookup: the module-level dict dispatch reads is TABLE, drawn
    if func is aten.mul.Tensor:
        return "mul"
    if func is aten.add.Tensor:
        return "add"
    if func is aten.sin.default:
        return "sin"
    return None

# ----------------------------------------------------------------- module state read by dispatch

GAIN = 1.0  # a module-level constant (rebound by the program between calls)
# A module-level dict, a per-op table as subclass authors write them (its entries changed
# by the program between calls).
TABLE: dict = {}


def reset_globals() -> None:
    global GAIN
    GAIN = 1.0
    TABLE.clear()
    TABLE.update({op: 1.0 for op in OPS.values()})


reset_globals()


# ----------------------------------------------------------------- what is drawn

# What a write stores. "list" must be refused (a fresh mutable object), never silently wrong.
KINDS = [
    "constant",
    "counter",
    "tensor_from_input",
    "tensor_from_output",
    "alias",
    "none",
    "frozen_dataclass",
    "list",
    "update",
    "same_value",
    "equal_value",
    "sym_size",
    "sym_rows",
    "sym_numel",
    "sym_desc",
    "sym_acc",
    "stamp",
]
TENSOR_KINDS = {"tensor_from_input", "tensor_from_output", "alias"}
ATTRS = ("a", "b", "step", "scale")

# Named defaults (readable in hypothesis' output); "tensor" is a copy of the inner tensor.
DEFAULTS: dict[str, Any] = {
    "zero": 0,
    "one": 1,
    "one_f": 1.0,
    "zero_f": 0.0,
    "true": True,
    "cold": "cold",
    "none": None,
    "tensor": "<elem.clone()>",
}
# Values the user sets between calls: the defaults and a few more.
USER_VALUES = dict(DEFAULTS, ten=10, four_f=4.0, warm="warm", neg_zero_f=-0.0)

SOURCES = ("global_const", "global_dict", "closure_var", "closure_dict")
EXT_VALUES = (0.5, 1.0, 2.0, 3.0)


@dataclasses.dataclass(frozen=True)
class Write:
    op: str
    kind: str
    attr: str
    in_ctx: bool
    grows_flatten: bool  # a tensor attribute listed in __tensor_flatten__ once set


@dataclasses.dataclass(frozen=True)
class GetattrRead:
    op: str
    name: str  # read with getattr(x, name, 1.0)
    use: str  # "attr": recorded in got_<name>; "output": multiplies the op's result


@dataclasses.dataclass(frozen=True)
class ExtRead:
    op: str
    source: str  # SOURCES
    use: str  # "attr": ext_<source>; "branch": ext_mode; "output": multiplies the result


@dataclasses.dataclass(frozen=True)
class Inner:
    """The inner subclass's own writes (on its first argument, after the op)."""

    ctx_op: str | None  # bumps ``ops``, in its ctx
    dict_op: str | None  # writes outside its ctx:
    dict_kind: str  # "counter": hits (probed); "step": step from __new__; "cache": a tensor


@dataclasses.dataclass(frozen=True)
class InnerWrite:
    """The outer dispatch writes on its inner subclass object (``first.elem``)."""

    op: str
    kind: str  # counter | constant | tensor | equal | list
    attr: str  # "ops" (the inner ctx entry when it has one) or "seen"


@dataclasses.dataclass(frozen=True)
class Spec:
    writes: tuple[Write, ...]
    ctor: tuple[tuple[str, str], ...] = ()  # (attr, default) set in __new__
    unflatten: tuple[str, str] | None = None  # (attr, default) set by __tensor_unflatten__
    getattr_kind: str | None = None  # ctx_tuple | other_attr | other_attr_raise | forward
    getattr_reads: tuple[GetattrRead, ...] = ()
    ext_reads: tuple[ExtRead, ...] = ()
    inner: Inner | None = None
    inner_writes: tuple[InnerWrite, ...] = ()
    alias: str | None = None  # static | toggle | write_alias
    alias_op: str = "mul"
    alias_use: bool = False  # alias_op computes with ``cache``


@dataclasses.dataclass(frozen=True)
class Layout:
    ctx: tuple[str, ...]
    growing: tuple[str, ...]
    direct: frozenset  # attributes dispatch reads with attribute syntax (always present)


def layout_of(spec: Spec) -> Layout:
    """A well-formed subclass: an attribute in the flatten list only ever holds tensors; the
    ctx holds no tensors; attributes with a constructor / unflatten default are outside
    both."""
    defaulted = {a for a, _ in spec.ctor} | ({spec.unflatten[0]} if spec.unflatten else set())
    writes = [w for w in spec.writes if w.kind != "stamp"]  # a stamp writes on the result
    growing = {w.attr for w in writes if w.grows_flatten} - defaulted
    tensorish = {w.attr for w in writes if w.kind in TENSOR_KINDS}
    ctx = {w.attr for w in writes if w.in_ctx} - growing - tensorish - defaulted
    return Layout(tuple(sorted(ctx)), tuple(sorted(growing)), frozenset(ctx | {a for a, _ in spec.ctor}))


# ----------------------------------------------------------------- helpers dispatch calls


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)


def _bump(v: Any) -> Any:
    """What an ``update`` write stores: step + 1, scale * 0.5, cold <-> warm, ..."""
    if isinstance(v, bool):
        return not v
    if _is_int(v):
        return v + 1
    if isinstance(v, (float, torch.SymFloat)):
        return v * 0.5
    if isinstance(v, str):
        return "warm" if v == "cold" else "cold"
    if isinstance(v, torch.Tensor):
        return v * 0.5 + 1
    if v is None:
        return 0
    return 1


def _equal(v: Any) -> Any:
    """A value equal to ``v``: True over True, 1.0 over 1, -0.0 over 0.0, a new equal string,
    Size or tuple, an equal new tensor; anything else: ``v`` itself."""
    if isinstance(v, bool):
        return bool(v)
    if _is_int(v):
        return float(v)
    if isinstance(v, float):
        return -v if v == 0 else v + 0.0
    if isinstance(v, str):
        return (v + "!")[:-1]
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, torch.Size):
        return torch.Size(tuple(v))
    if isinstance(v, tuple):
        return tuple(v)
    return v


def _rows(t: torch.Tensor) -> Any:
    return t.shape[0] if t.dim() > 0 else 0


def _scale_by(out: Any, factors: list) -> Any:
    for f in factors:
        if isinstance(f, torch.Tensor):
            if f.shape == out.shape:
                out = out * f
        elif isinstance(f, (int, float, torch.SymInt, torch.SymFloat)):
            out = out * f
    return out


def _default(name: str, elem: torch.Tensor) -> Any:
    return elem.clone() if name == "tensor" else DEFAULTS[name]


# ----------------------------------------------------------------- the class factory


def make_inner(inner: Inner) -> type:
    ctx = ("ops",) if inner.ctx_op else ()

    class FuzzInner(S.WritingTensor):
        CTX = ctx

        @staticmethod
        def __new__(cls, elem, requires_grad=False, **attrs):
            r = S.WritingTensor.__new__(cls, elem, requires_grad, **attrs)
            if inner.dict_kind == "step":
                r.step = 0
            return r

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            first = next((a for a in args if isinstance(a, cls)), None)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if first is None:
                return out
            name = op_name(func)
            if name is not None and name == inner.ctx_op:
                first.ops = first.ops + 1 if _is_int(first.ops) else 1  # the outer may write a str there
            if name is not None and name == inner.dict_op:
                if inner.dict_kind == "counter":
                    first.hits = getattr(first, "hits", 0) + 1
                elif inner.dict_kind == "step":
                    first.step = first.step + 1
                elif getattr(first, "cache", None) is None:
                    first.cache = first.elem * 2
            return out

    return FuzzInner


def make_subclass(spec: Spec) -> tuple[type, type | None, Callable[[str, float], None]]:
    """The drawn subclass, its inner subclass (or None), and ``set_closure(source, value)``,
    which changes the closure state its dispatch reads."""
    lay = layout_of(spec)
    ctx_names = lay.ctx + (("_qmeta",) if spec.getattr_kind == "ctx_tuple" else ())
    growing, direct = lay.growing, lay.direct
    writes, ctor, unflat = spec.writes, spec.ctor, spec.unflatten
    getattr_reads, ext_reads, inner_writes = spec.getattr_reads, spec.ext_reads, spec.inner_writes
    alias, alias_op, alias_use = spec.alias, spec.alias_op, spec.alias_use
    output_ops = {r.op for r in getattr_reads if r.use == "output"} | {r.op for r in ext_reads if r.use == "output"}

    # closure state (a variable and a dict), changed by the program through set_closure
    knob = 1.0
    box = {"k": 1.0}

    def set_closure(source: str, value: float) -> None:
        nonlocal knob
        if source == "closure_var":
            knob = value
        else:
            box["k"] = value

    def read(first, attr):
        if attr in direct:
            return getattr(first, attr)
        return getattr(first, attr, 0)

    class Fuzzed(S.WritingTensor):
        CTX = ctx_names

        @staticmethod
        def __new__(cls, elem, requires_grad=False, **attrs):
            r = S.WritingTensor.__new__(cls, elem, requires_grad, **attrs)
            for attr, name in ctor:
                setattr(r, attr, _default(name, elem))
            if alias is not None:
                r.cache = elem.clone() if alias == "write_alias" else elem
            return r

        @classmethod
        def default(cls, name):
            return (0.5, 1) if name == "_qmeta" else 0

        def inner_names(self):
            names = ["elem", "cache"] if alias is not None else ["elem"]
            return names + [a for a in growing if self.__dict__.get(a) is not None]

        @classmethod
        def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
            r = super().__tensor_unflatten__(inner, ctx, outer_size, outer_stride)
            if unflat is not None:
                setattr(r, unflat[0], _default(unflat[1], r.elem))
            return r

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, cls)), None)
            name = op_name(func) if first is not None else None
            factors = []
            # ------------------------------------------------ before the op: reads, alias writes
            if name is not None:
                if alias == "toggle" and name == alias_op:
                    if first.cache is first.elem:
                        first.cache = first.elem.to(torch.bfloat16).to(first.elem.dtype)
                    else:
                        first.cache = first.elem
                elif alias == "write_alias" and name == alias_op:
                    first.cache = first.elem
                for r in getattr_reads:
                    if r.op != name:
                        continue
                    v = getattr(first, r.name, 1.0)
                    if r.use == "attr":
                        setattr(first, "got_" + r.name, v)
                    else:
                        factors.append(v)
                for r in ext_reads:
                    if r.op != name:
                        continue
                    if r.source == "global_const":
                        v = GAIN
                    elif r.source == "global_dict":
                        v = TABLE.get(func, 1.0)
                    elif r.source == "closure_var":
                        v = knob
                    else:
                        v = box["k"]
                    if r.use == "attr":
                        setattr(first, "ext_" + r.source, v)
                    elif r.use == "branch":
                        first.ext_mode = "hi" if v > 1.0 else "lo"
                    else:
                        factors.append(v)
            # ------------------------------------------------ the op
            ctx = {n: getattr(first, n) for n in cls.CTX} if first is not None else {}
            if alias is not None and alias_use and name == alias_op:
                u_args = tree_map_only(cls, lambda t: t.cache, args)
                u_kwargs = tree_map_only(cls, lambda t: t.cache, kwargs)
            else:
                u_args = tree_map_only(cls, lambda t: t.elem, args)
                u_kwargs = tree_map_only(cls, lambda t: t.elem, kwargs)
            out = func(*u_args, **u_kwargs)
            if name is not None and name in output_ops and isinstance(out, torch.Tensor):
                out = _scale_by(out, factors)
            if func in (aten.detach.default, aten.alias.default) or not isinstance(out, torch.Tensor):
                out = cls(out, **ctx) if isinstance(out, torch.Tensor) else out
            else:
                out = tree_map_only(torch.Tensor, lambda t: cls(t, **ctx), out)
            if name is None:
                return out
            # ------------------------------------------------ after the op: writes
            for w in writes:
                if w.op != name:
                    continue
                k = w.kind
                if k == "stamp":
                    if isinstance(out, cls):
                        out.stamp = {"rows": _rows(first.elem), "n": getattr(first, w.attr, 0)}
                    continue
                if k == "constant":
                    value = f"{w.op}-seen"
                elif k == "counter":
                    prev = read(first, w.attr)
                    value = prev + 1 if _is_int(prev) else 1
                elif k == "tensor_from_input":
                    value = first.elem * 2 + 1
                elif k == "tensor_from_output":
                    value = out.elem.cos() if isinstance(out, cls) else first.elem
                elif k == "alias":
                    value = first.elem
                elif k == "none":
                    value = None
                elif k == "frozen_dataclass":
                    value = S.Stats(3, w.op)
                elif k == "list":
                    value = [w.op]
                elif k == "update":
                    value = _bump(read(first, w.attr))
                elif k == "same_value":
                    value = read(first, w.attr)
                elif k == "equal_value":
                    value = _equal(read(first, w.attr))
                elif k == "sym_size":
                    value = first.elem.shape
                elif k == "sym_rows":
                    value = _rows(first.elem)
                elif k == "sym_numel":
                    value = first.elem.numel()
                elif k == "sym_desc":
                    # 2-d on inputs and results; the backward also dispatches on 0-d gradients
                    shape = first.elem.shape
                    value = f"{shape[0]}x{shape[1]}" if len(shape) == 2 else f"{first.elem.numel()}"
                else:  # sym_acc
                    prev = read(first, w.attr)
                    value = (prev if _is_int(prev) else 0) + _rows(first.elem)
                if w.attr in growing and (not isinstance(value, torch.Tensor) or value is first.elem):
                    # a flatten list names distinct tensors: no constants, no second name for elem
                    value = first.elem * 3
                setattr(first, w.attr, value)
            for iw in inner_writes:
                if iw.op != name:
                    continue
                target = first.elem
                attr = iw.attr
                if iw.kind == "counter":
                    prev = getattr(target, attr, 0)
                    setattr(target, attr, prev + 1 if _is_int(prev) else 1)
                elif iw.kind == "constant":
                    setattr(target, attr, f"{name}-outer")
                elif iw.kind == "tensor":
                    target.seen_t = target.elem * 2
                elif iw.kind == "equal":
                    setattr(target, attr, _equal(getattr(target, attr, 0)))
                else:
                    target.seen_l = [name]
            return out

    if spec.getattr_kind == "ctx_tuple":

        def __getattr__(self, name):
            if name == "scale":
                return self._qmeta[0]
            if name == "zp":
                return self._qmeta[1]
            raise AttributeError(name)

    elif spec.getattr_kind in ("other_attr", "other_attr_raise"):
        fallback = spec.getattr_kind == "other_attr"

        def __getattr__(self, name):
            if name == "scale":
                try:
                    return object.__getattribute__(self, "user_scale")
                except AttributeError:
                    if fallback:
                        return 1.5
                    raise AttributeError(name)
            raise AttributeError(name)

    elif spec.getattr_kind == "forward":

        def __getattr__(self, name):
            if name == "elem":
                raise AttributeError(name)
            return getattr(self.elem, name)

    if spec.getattr_kind is not None:
        Fuzzed.__getattr__ = __getattr__  # type: ignore[attr-defined]

    inner_cls = make_inner(spec.inner) if spec.inner is not None else None
    return Fuzzed, inner_cls, set_closure


# ----------------------------------------------------------------- programs


@dataclasses.dataclass(frozen=True)
class Change:
    """User code between calls, the same on both sides (skipped where it would make the
    program invalid in eager, e.g. deleting an attribute dispatch reads unprobed)."""

    call: int  # before this call (1..calls-1)
    input: int
    what: str  # set | set_equal | del | elem_add | served | inner_set
    attr: str
    value: str  # a USER_VALUES key


@dataclasses.dataclass(frozen=True)
class Program:
    n_inputs: int
    steps: tuple[tuple[str, int, int], ...]  # (op, lhs index, rhs index) over values so far
    break_after: int | None
    requires_grad: bool
    calls: int = 2
    dynamic: bool | None = None
    batch: str = "same"  # "same": the same inputs every call; "grow": new inputs, more rows each call
    changes: tuple[Change, ...] = ()
    ext_changes: tuple[tuple[int, str, float], ...] = ()  # (before call, source, value)
    break_top: bool = False  # the graph break in the compiled function itself, not in the op loop
    reads_globals: bool = False  # user code reads GAIN and TABLE too (returned as outputs)
    #: which backward runs: "all" outputs, the "first" or "last" output only, or every output
    #: with ``inputs=[the first input]`` (See Note [A backward run for part of the graph])
    part: str = "all"

    def _steps(self, vals: list, lo: int, hi: int, brk: bool, at_break: Callable[[list], None] | None = None) -> list:
        for k in range(lo, hi):
            op, i, j = self.steps[k]
            a, b = vals[i % len(vals)], vals[j % len(vals)]
            if op == "mul":
                vals.append(a * b)
            elif op == "add":
                vals.append(a + b)
            elif op == "mm":
                # matrix products keep the (rows, 2) shape; their backward's first argument is
                # an input (``a.t() @ grad``), whose ctx the gradient of ``b.t() @ b`` copies
                vals.append(a @ (b.t() @ b))
            else:
                vals.append(a.sin())
            if brk and self.break_after == k:
                torch._dynamo.graph_break()
                if at_break is not None:
                    at_break(vals)
        return vals

    def __call__(self, *xs, at_break: Callable[[list], None] | None = None):
        """The program, its graph break (if any) inside the op loop of this nested frame;
        ``at_break`` (eager runs only) is called where the graph breaks."""
        return self.tail(self._steps(list(xs), 0, len(self.steps), True, at_break), len(xs))

    def head(self, xs: Sequence[Any]) -> list:
        """The ops up to the graph break (``break_top``: the caller breaks the graph)."""
        return self._steps(list(xs), 0, self.break_after + 1, False)

    def tail(self, vals: list, n_inputs: int, start: int | None = None) -> tuple:
        if start is not None:
            vals = self._steps(vals, start, len(self.steps), False)
        out = tuple(vals[n_inputs:])
        if self.reads_globals:
            out = out + (GAIN, TABLE.get(aten.mul.Tensor))
        return out

    @property
    def fullgraph(self) -> bool:
        return self.break_after is None or self.break_after >= len(self.steps)

    @property
    def splits_at_top(self) -> bool:
        return self.break_top and not self.fullgraph


ROWS = (2, 3, 5, 4)


def make_inputs(cls: type, inner_cls: type | None, program: Program, call: int) -> list:
    rows = ROWS[call] if program.batch == "grow" else 2
    xs = []
    for i in range(program.n_inputs):
        base = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * 0.25 + i + 1
        elem = inner_cls(base) if inner_cls is not None else base
        xs.append(cls(elem, requires_grad=program.requires_grad))
    return xs


def apply_change(ch: Change, xs: Sequence[Any], spec: Spec, lay: Layout) -> None:
    x = xs[ch.input % len(xs)]
    with torch.no_grad():
        if ch.what == "set":
            name = ch.value
            if ch.attr in lay.growing and name not in ("none", "tensor"):
                name = "none"  # a flatten-list attribute holds a tensor or nothing
            if ch.attr in lay.ctx and name == "tensor":
                name = "ten"  # the ctx holds constants
            value = torch.full((x.shape[0], 2), 3.0) if name == "tensor" else USER_VALUES[name]
            setattr(x, ch.attr, value)
        elif ch.what == "set_equal":
            if ch.attr in vars(x):
                setattr(x, ch.attr, _equal(getattr(x, ch.attr)))
        elif ch.what == "del":
            if ch.attr not in lay.direct and ch.attr in vars(x):
                delattr(x, ch.attr)
        elif ch.what == "elem_add":
            x.elem.add_(0.5)
        elif ch.what == "served":
            if spec.getattr_kind == "ctx_tuple":
                x._qmeta = (3.0, 2)
            elif spec.getattr_kind == "forward":
                x.elem.tag = "calibrated"
            else:
                x.user_scale = 4.0
        elif ch.what == "inner_set":
            if spec.inner is not None:
                x.elem.seen = 5


def predict_refusals(spec: Spec, program: Program, backend: str = "aot_eager") -> set[RefusalKind]:
    """The refusals a fullgraph compile must raise: a fresh list left in an attribute by an op
    the program runs (by its own write, or carried over by a same/equal-value write), or on
    the inner subclass of the op's first argument. On the eager backend the graph runs
    dispatch for real on intermediates, so a list on an intermediate's inner subclass is
    made at run time, as in eager: refused only where the first argument is an input (its
    write is replayed); AOT backends rebuild every output with ``__tensor_unflatten__``."""
    lay = layout_of(spec)
    ran = {op for op, _, _ in program.steps}
    on_input = {op for k, (op, i, _) in enumerate(program.steps) if i % (program.n_inputs + k) < program.n_inputs}
    refused: set[RefusalKind] = set()
    for op in ran:
        inner_list = any(iw.op == op and iw.kind == "list" for iw in spec.inner_writes)
        inner_list = inner_list and (backend != "eager" or op in on_input)
        holds: dict[str, bool] = {}
        for w in spec.writes:
            if w.op != op or w.kind == "stamp":
                continue
            if w.attr in lay.growing:
                holds[w.attr] = False
            elif w.kind == "list":
                holds[w.attr] = True
            elif w.kind not in ("same_value", "equal_value"):
                holds[w.attr] = False
        if any(holds.values()) or inner_list:
            refused.add(RefusalKind.MUTABLE_VALUE)
        if backend != "eager" and any(w.op == op and w.kind == "stamp" for w in spec.writes):
            # a stamped result is an output (every step's value is), which AOTAutograd builds
            # anew: a fresh dict (``opaque_value`` where it holds a SymInt or a tensor) it
            # cannot give it; on the eager backend dispatch makes it at run time
            refused |= {RefusalKind.MUTABLE_VALUE, RefusalKind.OPAQUE_VALUE}
    return refused


# ----------------------------------------------------------------- strategies

OP_ST = st.sampled_from(sorted(OPS))
#: a program's steps: the ops dispatch reacts to, and matrix products (See Program._steps)
STEP_ST = st.sampled_from(sorted(OPS) + ["mm"])

write_st = st.builds(
    Write,
    op=OP_ST,
    kind=st.sampled_from(KINDS),
    attr=st.sampled_from(ATTRS),
    in_ctx=st.booleans(),
    grows_flatten=st.booleans(),
)


@st.composite
def spec_st(draw) -> Spec:
    writes = tuple(draw(st.lists(write_st, min_size=1, max_size=3)))
    ctor = tuple(sorted(draw(st.dictionaries(st.sampled_from(ATTRS), st.sampled_from(sorted(DEFAULTS)), max_size=2)).items()))
    unflatten = draw(st.none() | st.tuples(st.sampled_from(ATTRS), st.sampled_from(sorted(DEFAULTS))))
    getattr_kind = draw(st.none() | st.sampled_from(["ctx_tuple", "other_attr", "other_attr_raise", "forward"]))
    getattr_reads = tuple(
        draw(
            st.lists(
                st.builds(
                    GetattrRead,
                    op=OP_ST,
                    name=st.sampled_from(["scale", "zp", "tag", "a"]),
                    use=st.sampled_from(["attr", "output"]),
                ),
                min_size=1 if getattr_kind else 0,
                max_size=2,
            )
        )
    )
    ext_reads = tuple(
        draw(
            st.lists(
                st.builds(ExtRead, op=OP_ST, source=st.sampled_from(SOURCES), use=st.sampled_from(["attr", "branch", "output"])),
                max_size=2,
            )
        )
    )
    inner = draw(
        st.none()
        | st.builds(Inner, ctx_op=st.none() | OP_ST, dict_op=st.none() | OP_ST, dict_kind=st.sampled_from(["counter", "step", "cache"]))
    )
    inner_writes = ()
    if inner is not None:
        inner_writes = tuple(
            draw(
                st.lists(
                    st.builds(
                        InnerWrite,
                        op=OP_ST,
                        kind=st.sampled_from(["counter", "constant", "tensor", "equal", "list"]),
                        attr=st.sampled_from(["ops", "seen"]),
                    ),
                    max_size=2,
                )
            )
        )
    alias = draw(st.none() | st.sampled_from(["static", "toggle", "write_alias"]))
    alias_op, alias_use = "mul", False
    if alias is not None:
        alias_op, alias_use = draw(OP_ST), draw(st.booleans())
    return Spec(writes, ctor, unflatten, getattr_kind, getattr_reads, ext_reads, inner, inner_writes, alias, alias_op, alias_use)


@st.composite
def program_st(draw, spec: Spec) -> Program:
    n_inputs = draw(st.integers(1, 3))
    steps = tuple(
        draw(st.lists(st.tuples(STEP_ST, st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=4))
    )
    break_after = draw(st.none() | st.integers(0, 3))
    requires_grad = draw(st.booleans())
    calls = draw(st.integers(2, 4))
    dynamic = draw(st.sampled_from([None, True]))
    batch = draw(st.sampled_from(["same", "grow"]))
    changes = tuple(
        draw(
            st.lists(
                st.builds(
                    Change,
                    call=st.integers(1, calls - 1),
                    input=st.integers(0, 2),
                    what=st.sampled_from(["set", "set_equal", "del", "elem_add", "served", "inner_set"]),
                    attr=st.sampled_from(ATTRS),
                    value=st.sampled_from(sorted(USER_VALUES)),
                ),
                max_size=3,
            )
        )
    )
    ext_changes = ()
    if spec.ext_reads:
        ext_changes = tuple(
            draw(
                st.lists(
                    st.tuples(st.integers(1, calls - 1), st.sampled_from(SOURCES), st.sampled_from(EXT_VALUES)),
                    max_size=3,
                )
            )
        )
    break_top = draw(st.booleans()) if break_after is not None else False
    # user code reading the module globals dispatch reads too
    reads_globals = draw(st.booleans()) if any(r.source.startswith("global") for r in spec.ext_reads) else False
    part = draw(st.sampled_from(["all", "all", "first", "last", "inputs"])) if requires_grad else "all"
    return Program(
        n_inputs, steps, break_after, requires_grad, calls, dynamic, batch, changes, ext_changes, break_top, reads_globals,
        part,
    )


@st.composite
def case_st(draw) -> tuple[Spec, Program]:
    spec = draw(spec_st())
    return spec, draw(program_st(spec))


# ----------------------------------------------------------------- comparison


def _const_key(v: Any) -> Any:
    """Constants compared strictly: type and value (1 vs 1.0 vs True, 0.0 vs -0.0)."""
    if isinstance(v, float):
        return ("float", math.copysign(1.0, v), repr(v))
    if isinstance(v, torch.Size):
        return ("Size", tuple((type(d).__name__, d) for d in v))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_const_key(x) for x in v))
    return (type(v).__name__, repr(v))


def picture(obj: Any, depth: int = 0) -> dict[str, tuple]:
    """Every attribute of ``obj``: constants by type and value; tensors by type, dtype,
    shape, requires_grad, values and identity with earlier attributes; nested subclasses
    recursively."""
    items = sorted(((k, v) for k, v in vars(obj).items() if not k.startswith("_dynamo")), key=lambda kv: kv[0])
    out: dict[str, tuple] = {}
    for name, v in items:
        if isinstance(v, torch.Tensor):
            if v is obj:
                out[name] = ("self",)
                continue
            twin = next((n for n, w in items if w is v and n < name), None)
            if twin is not None:
                out[name] = ("same_as", twin)
                continue
            nested = picture(v, depth + 1) if is_traceable_wrapper_subclass(v) and depth < 3 else None
            out[name] = ("tensor", type(v).__name__, v.dtype, tuple(v.shape), v.requires_grad, plain(v).clone(), nested)
        else:
            out[name] = ("value", _const_key(v))
    return out


def assert_same_picture(e: dict, c: dict, where: str, ignore: frozenset = frozenset()) -> None:
    ek, ck = e.keys() - ignore, c.keys() - ignore
    assert ek == ck, f"{where}: attributes differ: eager {sorted(ek)} vs compiled {sorted(ck)}"
    for name in sorted(ek):
        ev, cv = e[name], c[name]
        assert ev[0] == cv[0], f"{where}.{name}: eager {ev[:2]} vs compiled {cv[:2]}"
        if ev[0] == "tensor":
            assert ev[1:5] == cv[1:5], f"{where}.{name}: eager {ev[1:5]} vs compiled {cv[1:5]}"
            torch.testing.assert_close(cv[5], ev[5], msg=lambda m: f"{where}.{name}: {m}")
            if ev[6] is not None:
                assert_same_picture(ev[6], cv[6], f"{where}.{name}")
        else:
            assert ev == cv, f"{where}.{name}: eager {ev} vs compiled {cv}"


def assert_same_outputs(e_out: Any, c_out: Any, where: str, ignore: frozenset) -> None:
    e_flat, e_spec = tree_flatten(e_out)
    c_flat, c_spec = tree_flatten(c_out)
    assert e_spec == c_spec, f"{where}: output structure {e_spec} vs {c_spec}"
    for i, (e, c) in enumerate(zip(e_flat, c_flat)):
        assert type(e) is type(c), f"{where}: output {i}: {type(e)} vs {type(c)}"
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(plain(c), plain(e), msg=lambda m: f"{where}: output {i}: {m}")
            if is_traceable_wrapper_subclass(e):
                assert not leaked_fakes(c), f"{where}: output {i}: trace-time tensors leaked into {leaked_fakes(c)}"
                assert_same_picture(picture(e), picture(c), f"{where}: output[{i}]", ignore)
        else:
            assert _const_key(e) == _const_key(c), f"{where}: output {i}: {e!r} vs {c!r}"


def gradient_read_justified(exc: BaseException, spec: Spec, program: Program, backend: str) -> bool:
    """A refusal of a read on an incoming gradient of the traced backward (See Note [Reads on
    incoming gradients]) is allowed, not required: which reads the backward's dispatch makes
    depends on the ops' backward formulas. It is justified only where it is true: AOT
    backends, gradients, and an attribute outside the class's flatten ctx (only the inner
    tensors and the ctx of eager's gradient reach the compiled backward; the rest, what
    ``__tensor_unflatten__`` sets or dispatch makes from its operands, no trace can know),
    or an inner tensor of a class whose flatten list names one tensor twice (``cache =
    elem``), which the rebuilt gradient holds as two."""
    e = exc
    seen = set()
    while e is not None and not isinstance(e, dynamo_ext.SubclassWriteError) and id(e) not in seen:
        seen.add(id(e))
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    if not isinstance(e, dynamo_ext.SubclassWriteError) or "incoming gradient" not in e.context:
        return False
    if e.kind is not RefusalKind.UNSUPPORTED_STATE_READ or not program.requires_grad or backend == "eager":
        return False
    if "from separate tensors" in e.context:
        # the gradient's inner tensors: dispatch's outputs hold one under two names
        return spec.alias is not None and e.attr in ("elem", "cache")
    # any other attribute outside the class's flatten ctx: eager's gradient may hold what
    # dispatch made it from after the graph (or a caller set), which no trace can know
    classes = [c for c in make_subclass(spec)[:2] if c is not None]
    return any(f"] {c.__name__}." in str(e) and e.attr not in getattr(c, "CTX", ()) for c in classes)


def backward_change_justified(exc: BaseException, at_break: dict | None, after: dict, read: set) -> bool:
    """A ``changed_before_backward`` refusal when a compiled backward runs is allowed where it
    is true: the program's graph break splits it into graphs; in eager, some object the
    inputs reach held another value of the attribute the refusal names when the forward
    returned than at the break (where the earlier graph's forward returned: a later graph's
    forward moved it on before ``backward()``), and eager's backward read it there (so eager's
    backward reads the new value, where the compiled one was traced with the old: README,
    Limits). ``at_break`` / ``after``: id -> shallow picture of each reachable object;
    ``read``: the (id, name) reads of eager's backward."""
    e = _subclass_write_error(exc)
    if e is None or e.kind is not RefusalKind.CHANGED_BEFORE_BACKWARD or at_break is None:
        return False
    return any(
        oid in after and _value_key(pic.get(e.attr)) != _value_key(after[oid].get(e.attr)) and (oid, e.attr) in read
        for oid, pic in at_break.items()
    )


def coerced_gradient_justified(
    exc: BaseException, outs_and_grads: Sequence[tuple], others: Sequence[Any], read: set,
    at_break: dict | None = None, after: dict | None = None,
) -> bool:
    """A ``changed_before_backward`` refusal of an incoming gradient the compiled backward
    would coerce (See Note [A gradient coerced to the traced metadata]) is allowed where it is
    true: in eager, the gradient flowing into some output held, when it got there, another
    value of the attribute the refusal names than the output did (at any nesting level: a
    mul after the graph, ``backward()``'s ones made from another tensor's ctx), and eager's
    backward read that attribute on a gradient (an object that is neither an input nor an
    output). ``outs_and_grads``: (output's state, its gradient's state), each a list of
    (class name, attributes) as ``_state_tree`` took them when the gradient arrived;
    ``others``: the inputs and outputs; ``read``: (id, name) reads of eager's backward. Or the
    traced tangent's value is stale: an output of the graph before a break (or a subclass it
    holds) held another value of the attribute when the forward returned than at the break (a
    later graph's op counted on it), so the gradient eager makes from it differs from what the
    earlier graph traced (``at_break`` / ``after``: id -> picture, as for
    ``backward_change_justified``)."""
    e = _subclass_write_error(exc)
    if e is None or e.kind is not RefusalKind.CHANGED_BEFORE_BACKWARD or "__coerce_same_metadata_as_tangent__" not in str(e):
        return False
    absent = object()

    def differs(a: Any, b: Any) -> bool:
        return type(a) is not type(b) or a != b

    moved = at_break is not None and after is not None and any(
        oid in after and _value_key(pic.get(e.attr)) != _value_key(after[oid].get(e.attr)) for oid, pic in at_break.items()
    )
    if not moved and not any(
        len(out) != len(g)
        or any(oc != gc or differs(od.get(e.attr, absent), gd.get(e.attr, absent)) for (oc, od), (gc, gd) in zip(out, g))
        for out, g in outs_and_grads
    ):
        return False
    not_grads = {id(o) for o in others}
    return any(name == e.attr and oid not in not_grads for oid, name in read)


def _state_tree(t: Any, depth: int = 0) -> list[tuple[str, dict]]:
    """A subclass's non-tensor attributes, and its nested subclasses' (by name), read past the
    class's ``__getattribute__`` (the backward's read log must not see them)."""
    if not is_traceable_wrapper_subclass(t):
        return [(type(t).__name__, {})]
    d = object.__getattribute__(t, "__dict__")
    out = [(type(t).__name__, {k: v for k, v in d.items() if not isinstance(v, torch.Tensor)})]
    if depth < 3:
        for name in sorted(k for k, v in d.items() if is_traceable_wrapper_subclass(v)):
            out.extend(_state_tree(d[name], depth + 1))
    return out


def gradient_ctx_refusal_justified(exc: BaseException, program: Program, e_in: Sequence[Any], e_out: Any) -> bool:
    """A ``write_in_backward`` refusal of a gradient whose traced flatten ctx holds a symbolic
    value (See Note [A gradient's ctx made from sizes or counts]), at any compile, is allowed
    where it is true: in eager, this call's backward gives some input a gradient whose ctx
    holds an int (a count or size, symbolic where it is dynamic). Runs eager's backward."""
    e = _subclass_write_error(exc)
    if e is None or e.kind is not RefusalKind.WRITE_IN_BACKWARD or "gradient's flatten ctx" not in str(e):
        return False
    if not program.requires_grad:
        return False
    _backward(e_out, program.part, e_in)
    return any(any(_holds_int(ctx) for ctx in _ctx_tree(x.grad)) for x in e_in)


def _ctx_tree(t: Any) -> list[Any]:
    """The flatten ctx of a subclass and of the subclasses nested in it."""
    if not is_traceable_wrapper_subclass(t):
        return []
    names, ctx = t.__tensor_flatten__()
    return [ctx] + [c for n in names for c in _ctx_tree(getattr(t, n))]


def _holds_symbolic(v: Any) -> bool:
    if isinstance(v, (tuple, list)):
        return any(_holds_symbolic(x) for x in v)
    if isinstance(v, dict):
        return any(_holds_symbolic(x) for x in v.values())
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) or leaked_fakes_value(v)


def leaked_fakes_value(v: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(v, (FakeTensor, FunctionalTensor))


def _holds_int(v: Any) -> bool:
    if isinstance(v, (tuple, list)):
        return any(_holds_int(x) for x in v)
    if isinstance(v, dict):
        return any(_holds_int(x) for x in v.values())
    return type(v) is int


def _value_key(v: Any) -> Any:
    if v is None or v[0] != "tensor":
        return v
    return (v[0], v[1:5], v[5].tolist())


def _reachable(objs: Sequence[Any], depth: int = 0) -> list[Any]:
    """The inputs and the subclasses nested in them (inner tensors, attributes)."""
    out = []
    for o in objs:
        if is_traceable_wrapper_subclass(o):
            out.append(o)
            if depth < 3:
                out.extend(_reachable([v for v in vars(o).values() if isinstance(v, torch.Tensor) and v is not o], depth + 1))
    return out


@contextlib.contextmanager
def _reads_logged(classes: Sequence[type], log: set) -> Iterator[None]:
    """Record every attribute read on instances of ``classes`` (the test's own classes) as
    ``(id(obj), name)`` while the block runs; eager runs only."""
    saved = {}
    for cls in classes:
        saved[cls] = cls.__dict__.get("__getattribute__")
        base = cls.__getattribute__

        def logged(obj, name, _base=base):
            log.add((id(obj), name))
            return _base(obj, name)

        cls.__getattribute__ = logged
    try:
        yield
    finally:
        for cls, previous in saved.items():
            if previous is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = previous


def _subclass_write_error(exc: BaseException) -> Any:
    e, seen = exc, set()
    while e is not None and not isinstance(e, dynamo_ext.SubclassWriteError) and id(e) not in seen:
        seen.add(id(e))
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return e if isinstance(e, dynamo_ext.SubclassWriteError) else None


def refusal_kind(exc: BaseException) -> RefusalKind | None:
    """The dynamo_ext refusal carried by ``exc`` or its causes (Unsupported naming
    ``dynamo_ext: <kind>``, or a SubclassWriteError inside BackendCompilerFailed)."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, dynamo_ext.SubclassWriteError):
            return e.kind
        msg = str(e)
        for k in RefusalKind:
            if k.gb_type in msg:
                return k
        todo += [getattr(e, "inner_exception", None), e.__cause__, e.__context__]
    return None


def _event(what: str) -> None:
    """A hypothesis statistics event (``--hypothesis-show-statistics``); a no-op outside a test."""
    if currently_in_test_context():
        event(what)


def _backward(out: Any, part: str = "all", inputs: Sequence[Any] = ()) -> None:
    ts = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if part == "first":
        ts = ts[:1]
    elif part == "last":
        ts = ts[-1:]
    wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad][:1]
    if part == "inputs" and wanted:
        sum(t.sum() for t in ts).backward(inputs=wanted)
    else:
        sum(t.sum() for t in ts).backward()


def partial_backward_refused(exc: BaseException, program: Program) -> bool:
    """A ``write_in_backward`` refusal of a backward for part of the graph is allowed (README,
    Limits): eager ran some of the dispatch calls that write one attribute, or which it ran
    is not known. The inputs must be as before ``backward()`` (checked by the caller)."""
    e = _subclass_write_error(exc)
    return (
        program.part != "all" and e is not None and e.kind is RefusalKind.WRITE_IN_BACKWARD
        and "partial backward" in str(e)
    )


# ----------------------------------------------------------------- the runner


def run_case(spec: Spec, program: Program, backend: str) -> None:
    """Eager vs compiled, call after call; or, where predicted, the refusal at the first
    compile with the compiled side's inputs untouched."""
    reset_globals()
    try:
        _run_case(spec, program, backend)
    finally:
        reset_globals()


def run_compiled_only(spec: Spec, program: Program, backend: str) -> None:
    """The compiled side of ``run_case`` alone, nothing compared: whether the program runs
    at all (stock torch crashing on a program shows here; run_case would first see the
    writes stock loses)."""
    reset_globals()
    try:
        cls, inner_cls, set_closure = make_subclass(spec)
        compiled = torch.compile(_program_fn(program), backend=backend, fullgraph=program.fullgraph, dynamic=program.dynamic)
        xs = make_inputs(cls, inner_cls, program, 0)
        for call in range(program.calls):
            if call:
                (xs,) = _between_calls(spec, program, call, cls, inner_cls, set_closure, [xs])
            out = compiled(*xs)
            if program.requires_grad:
                _backward(out, program.part, xs)
                for x in xs:
                    x.grad = None
    finally:
        reset_globals()


def _program_fn(program: Program) -> Callable[..., Any]:
    """The function compiled: the program, its graph break at the top level where drawn;
    ``at_break`` (eager runs only) is called where the graph breaks."""

    def fn(*xs, at_break=None):
        if program.splits_at_top:
            vals = program.head(xs)
            torch._dynamo.graph_break()
            if at_break is not None:
                at_break(vals)
            return program.tail(vals, len(xs), program.break_after + 1)
        return program(*xs, at_break=at_break)

    return fn


def _between_calls(
    spec: Spec, program: Program, call: int, cls: type, inner_cls: type | None,
    set_closure: Callable[[str, float], None], sides: list[list],
) -> list[list]:
    """Before call ``call`` (> 0): each side's inputs made again for a new batch size, the
    drawn external changes made once, the drawn user changes made on each side."""
    if program.batch == "grow":
        sides = [make_inputs(cls, inner_cls, program, call) for _ in sides]
    for when, source, value in program.ext_changes:
        if when == call:
            _set_ext(source, value, set_closure)
    for ch in program.changes:
        if ch.call == call:
            for xs in sides:
                apply_change(ch, xs, spec, layout_of(spec))
    return sides


def _set_ext(source: str, value: float, set_closure: Callable[[str, float], None]) -> None:
    global GAIN
    if source == "global_const":
        GAIN = value
    elif source == "global_dict":
        for op in TABLE:
            TABLE[op] = value
    else:
        set_closure(source, value)


def _run_case(spec: Spec, program: Program, backend: str) -> None:
    cls, inner_cls, set_closure = make_subclass(spec)
    fullgraph = program.fullgraph
    refused = predict_refusals(spec, program, backend) if fullgraph else set()
    # Compiled outputs hold exactly eager's attributes: AOTAutograd builds them with
    # __tensor_unflatten__, and what it alone sets is taken off them again (it used to be
    # left, as in stock: See Note [An output holding an input subclass] and plan_outputs).
    # Stock leaves on AOTAutograd's outputs what __tensor_unflatten__ alone sets (dynamo_ext takes
    # it off): set aside where stock runs, so that what stock does past it (a gradient) is seen and
    # compared with ours (See _stock_shows_the_same in test_fuzz.py)
    ignore: frozenset = frozenset({spec.unflatten[0]}) if spec.unflatten and not dynamo_ext.is_enabled() else frozenset()

    fn = _program_fn(program)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=fullgraph, dynamic=program.dynamic)
    e_in = make_inputs(cls, inner_cls, program, 0)
    c_in = make_inputs(cls, inner_cls, program, 0)
    for call in range(program.calls):
        where = f"call {call + 1}"
        if call:
            e_in, c_in = _between_calls(spec, program, call, cls, inner_cls, set_closure, [e_in, c_in])
            for i, (e, c) in enumerate(zip(e_in, c_in)):
                assert_same_picture(picture(e), picture(c), f"{where}: before, input {i} (the user's change)")
        before = [picture(c) for c in c_in]
        e_at_break: dict | None = None

        def at_break(vals):
            nonlocal e_at_break
            # the inputs and what the earlier graph computed (its outputs)
            e_at_break = {id(o): picture(o) for o in _reachable(list(e_in) + list(vals))}

        try:
            e_out = fn(*e_in, at_break=at_break)
        except Exception as exc:  # the generator must only draw programs valid in eager
            raise AssertionError(f"{where}: the program raised in eager (a generator bug): {exc!r}") from exc
        e_after = {id(o): picture(o) for o in _reachable(list(e_in) + list(tree_leaves(e_out)))}
        try:
            c_out = compiled(*c_in)
        except Exception as exc:
            kind = refusal_kind(exc)
            justified = kind is not None and gradient_ctx_refusal_justified(exc, program, e_in, e_out)
            if not justified and (
                kind is None or call or (kind not in refused and not gradient_read_justified(exc, spec, program, backend))
            ):
                raise
            for i, c in enumerate(c_in):
                assert not leaked_fakes(c), f"{where}: refused ({kind.value}) but fakes leaked into input {i}"
                assert_same_picture(before[i], picture(c), f"{where}: refused ({kind.value}) but input {i} touched")
            _event(f"refused: {kind.value}")
            return
        assert not refused, f"{where}: expected a refusal {sorted(k.value for k in refused)}, compiled ran"
        assert_same_outputs(e_out, c_out, where, ignore)
        assert_same_identities({"in": e_in, "out": e_out}, {"in": c_in, "out": c_out}, where)
        if program.requires_grad:
            e_read: set = set()
            e_grads: list[tuple] = []  # (output, the gradient flowing into it) as it arrived, in eager
            hooks = [
                t.register_hook(lambda g, t=t: e_grads.append((_state_tree(t), _state_tree(g))))
                for t in tree_leaves(e_out)
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            with _reads_logged([c for c in (cls, inner_cls) if c is not None], e_read):
                _backward(e_out, program.part, e_in)
            for h in hooks:
                h.remove()
            before_backward = [picture(c) for c in c_in]
            try:
                _backward(c_out, program.part, c_in)
            except Exception as exc:
                if coerced_gradient_justified(exc, e_grads, list(e_in) + list(tree_leaves(e_out)), e_read, e_at_break, e_after):
                    why = "a gradient's ctx coerced"
                elif backward_change_justified(exc, e_at_break, e_after, e_read):
                    why = "a later graph moved state on"
                elif partial_backward_refused(exc, program):
                    why = "a backward for part of the graph"
                else:
                    raise
                for i, c in enumerate(c_in):  # See Note [A refusal undoes the backward's earlier writes]
                    assert_same_picture(before_backward[i], picture(c), f"{where}: refused at backward() but input {i} touched")
                    assert c.grad is None, f"{where}: refused at backward() but input {i} has a gradient"
                _event(f"refused when the backward ran: {why}")
                return
            for i, (e, c) in enumerate(zip(e_in, c_in)):
                assert (c.grad is None) == (e.grad is None), f"{where}: input {i}: grad {c.grad} vs eager {e.grad}"
                if e.grad is not None:
                    torch.testing.assert_close(plain(c.grad), plain(e.grad), msg=lambda m: f"{where}: input {i} grad: {m}")
                    assert type(c.grad) is type(e.grad), f"{where}: input {i} grad: {type(c.grad)} vs eager {type(e.grad)}"
                    if is_traceable_wrapper_subclass(e.grad):
                        # The gradient's flatten ctx holds no value of a trace (a SymInt: See
                        # Note [A gradient's ctx made from sizes or counts]). Its values are
                        # what AOTAutograd's compiled backward builds from the metadata it traced
                        # for incoming gradients, as in stock (README, Limits); other attributes
                        # written on gradients are eager's temporaries.
                        for c_ctx in _ctx_tree(c.grad):
                            assert not _holds_symbolic(c_ctx), f"{where}: input {i} grad ctx {c_ctx!r} holds a trace's value"
                e.grad = c.grad = None
        for i, (e, c) in enumerate(zip(e_in, c_in)):
            assert not leaked_fakes(c), f"{where}: trace-time tensors leaked into input {i}: {leaked_fakes(c)}"
            assert_same_picture(picture(e), picture(c), f"{where}: input {i}")
        assert_same_identities({"in": e_in, "out": e_out}, {"in": c_in, "out": c_out}, f"{where}, at its end")
    _event("matched eager" + ("" if counter.frame_count else " (nothing compiled)"))
