"""Differential tests: dispatch writes on graph inputs survive torch.compile as in eager."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
from torch.utils._pytree import tree_map_only
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import dynamo_ext
import subclasses as S
from dynamo_ext.testing import WrapperTensor
from harness import assert_refused_untouched, assert_same_state, differential, stock_torch


def one(cls, **attrs):
    return lambda: [cls(torch.arange(4.0) + 1, **attrs)]


def two(cls):
    return lambda: [cls(torch.arange(4.0) + 1), cls(torch.arange(4.0) - 2)]


def mul3(x):
    return x * 3


def mul_then_add(x):
    return x * 2, x + 1


def mul_twice(x):
    return x * 2, x * 3


def mul_xy(x, y):
    return x * y


def tag_after_op(x):
    y = x * 3
    return y, x.tag


def cache_after_op(x):
    y = x * 3
    return y, x.cache + 1


def write_on_intermediate(x):
    y = x * 2
    return y + 1, y  # the add writes on y, which the caller receives


@dataclasses.dataclass
class Case:
    name: str
    fn: Callable[..., Any]
    make: Callable[[], list]
    calls: int
    frames: int  # expected compiled frames over all calls (recompiles eager semantics need)
    graph_break: bool = False

    def __str__(self) -> str:
        return self.name


CASES = [
    # ctx counter that changes every call: after its first change it is a symbolic input
    # (See Note [Symbolic ints in a flatten ctx]): two compiles, however many calls.
    Case("ctx_counter", mul3, one(S.CounterTensor), calls=3, frames=2),
    # flatten list grows once the cache is set: one recompile, then stable.
    Case("growing_flatten_cache", mul3, one(S.GrowingCacheTensor), calls=3, frames=2),
    # tensor cache outside the flatten contract: second call sees it (guarded).
    Case("cache_outside_ctx", mul3, one(S.CachingTensor), calls=3, frames=2),
    # __dict__ counter outside the ctx: read by dispatch, so guarded per value.
    Case("dict_counter", mul3, one(S.CallCounter), calls=3, frames=3),
    Case("ctx_constants_all_kinds", mul3, one(S.ConstantsTensor), calls=2, frames=2),
    # written but never read by dispatch: no guard, no recompile.
    Case("dict_constants_unread", mul3, one(S.OutOfCtxConstants), calls=3, frames=1),
    Case("last_write_wins", mul_then_add, one(S.LastWinsTensor), calls=1, frames=1),
    Case("later_op_reads_write", mul_then_add, one(S.ReadBackTensor), calls=2, frames=2),
    Case("intermediate_cache", mul3, one(S.IntermediateCacheTensor), calls=2, frames=1),
    Case("aliases_and_none", mul_then_add, one(S.AliasTensor, cache=7), calls=2, frames=1),
    Case("reset_tensor_to_none", mul3, lambda: [S.ResetTensor(torch.ones(4), cache=torch.zeros(4))], calls=2, frames=1),
    Case("two_inputs", mul_xy, two(S.TwoInputTensor), calls=2, frames=2),
    Case("same_input_several_ops", mul_twice, one(S.CounterTensor), calls=2, frames=2),
    Case("user_reads_tag_after_op", tag_after_op, one(S.CounterTensor), calls=2, frames=2),
    Case("user_reads_cache_after_op", cache_after_op, one(S.CachingTensor), calls=2, frames=2),
    Case("rebind_inner_tensor", mul3, one(S.RebindInner), calls=2, frames=1),
    # writes on a returned intermediate: Dynamo's residual bytecode sets them on the output
    Case("write_on_returned_intermediate", write_on_intermediate, one(S.MarkOnAdd), calls=2, frames=1),
    Case("size_and_sized_tensor", mul3, one(S.ShapeRecorder), calls=2, frames=1),
    # dispatch reads __dict__ itself: every entry eager would find there is answered and
    # guarded; the int counter becomes a symbolic input after its first change
    Case("dict_read_directly", mul3, one(S.DirectDictReader, seen=1), calls=3, frames=2),
]


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breakable"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_eager(case, backend, fullgraph):
    outcome = differential(case.fn, case.make, backend=backend, fullgraph=fullgraph, calls=case.calls)
    assert outcome.frames == case.frames


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("cls", [S.CounterTensor, S.CachingTensor, S.GrowingCacheTensor, S.CallCounter])
def test_fresh_input_gets_eager_state(cls, backend):
    """No trace-time state leaks from one compiled call into another input."""
    differential(mul3, one(cls), backend=backend, calls=3, fresh_inputs_each_call=True)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_result_depends_on_state_outside_ctx(backend):
    """Dispatch reads a user-set attribute outside the ctx: numbers follow it, guarded."""
    outcome = differential(mul3, one(S.UserScaled, scale=2.0), backend=backend, calls=2)
    assert outcome.frames == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_user_changes_state_outside_ctx_between_calls(backend):
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(mul3, backend=counter, fullgraph=True)
    for scale in (2.0, 3.0, 3.0, None):
        attrs = {} if scale is None else {"scale": scale}
        e, c = S.UserScaled(torch.arange(4.0), **attrs), S.UserScaled(torch.arange(4.0), **attrs)
        torch.testing.assert_close(compiled(c).elem, mul3(e).elem)
        assert c.used == e.used
    assert counter.frame_count == 3  # 2.0, 3.0, absent: each a guard failure


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_write_before_graph_break_read_after(backend):
    def fn(x):
        y = x * 3
        torch._dynamo.graph_break()
        return y + x.tag, x.cache * 1 if hasattr(x, "cache") else None

    class Both(S.CounterTensor):
        @classmethod
        def on_op(cls, func, first):
            super().on_op(func, first)
            if func is torch.ops.aten.mul.Tensor:
                first.cache = first.elem + 10

    outcome = differential(fn, one(Both), backend=backend, fullgraph=False, calls=2)
    assert outcome.frames == 4  # 2 graphs per call; the tag changes every call


def _mul3_sum(x):
    return (x * 3).sum() * 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("cls", [S.CounterTensor, S.CachingTensor, S.CallCounter])
def test_requires_grad_forward_writes_and_grads(cls, backend):
    differential(
        _mul3_sum, lambda: [cls(torch.arange(4.0) + 1, requires_grad=True)], backend=backend, calls=3, backward=True,
    )


def test_a_gradient_carrying_the_counter_in_its_ctx():
    """CounterTensor's outputs carry its ctx, the backward's gradients too: once the tag is a
    symbolic input (its first change recompiles), the compiled backward rebuilt every
    gradient with the traced tag (stock leaves a SymInt there), and the recompile was
    refused. The gradients are rebuilt with each call's tag now (See Note [A gradient's ctx
    made from sizes or counts])."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_mul3_sum, backend=counter, fullgraph=True)
    xe = S.CounterTensor(torch.arange(4.0) + 1, requires_grad=True)
    xc = S.CounterTensor(torch.arange(4.0) + 1, requires_grad=True)
    for call in range(4):
        _mul3_sum(xe).backward()
        compiled(xc).backward()
        assert type(xc.grad.tag) is int and (xc.tag, xc.grad.tag) == (xe.tag, xe.grad.tag), f"call {call + 1}"
        torch.testing.assert_close(xc.grad.elem, xe.grad.elem)
        xe.grad = xc.grad = None
    assert (xc.tag, counter.frame_count) == (4, 2)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("cls", [S.ConstantsTensor, S.ShapeRecorder, S.CachingTensor])
def test_dynamic_shapes(cls, backend):
    """A new size each call (eager and compiled inputs of a call share it): one frame."""
    sizes = iter([4, 4, 5, 5])

    def make():
        return [cls(torch.arange(float(next(sizes))))]

    outcome = differential(mul3, make, backend=backend, calls=2, dynamic=True, fresh_inputs_each_call=True)
    assert outcome.frames == 1


# ----------------------------------------------------------------- the two failures


def test_regression_counter_write_lost_on_stock_aot_eager():
    """Stock torch 2.13 silently drops ``first.tag += 1``; with dynamo_ext it is kept."""
    with stock_torch():
        x = S.CounterTensor(torch.arange(4.0))
        torch.compile(mul3, backend="aot_eager", fullgraph=True)(x)
        assert x.tag == 0  # the write is lost on stock: this is the bug
    x = S.CounterTensor(torch.arange(4.0))
    torch.compile(mul3, backend="aot_eager", fullgraph=True)(x)
    assert x.tag == 1


def test_regression_growing_flatten_expected_fake_tensor():
    """Stock: ``expected FakeTensor for arg, got NoneType``; with dynamo_ext: eager's cache."""
    with stock_torch():
        x = S.GrowingCacheTensor(torch.arange(4.0))
        with pytest.raises(Exception, match="expected FakeTensor for arg"):
            torch.compile(mul3, backend="aot_eager", fullgraph=True)(x)
    x = S.GrowingCacheTensor(torch.arange(4.0))
    torch.compile(mul3, backend="aot_eager", fullgraph=True)(x)
    assert type(x.cache) is torch.Tensor
    torch.testing.assert_close(x.cache, torch.arange(4.0) * 2)


@dataclasses.dataclass
class _OpStats:
    muls: int = 0


OP_STATS = _OpStats()


class CountsInModuleObject(S.WritingTensor):
    """Counts muls in a module-level object, from the hook the shared base's dispatch
    calls: no tracked object is touched while the hook is on the stack."""

    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.mul.Tensor:
            OP_STATS.muls += 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_module_object_a_class_hook_writes_is_written_once_per_call(backend):
    torch._dynamo.reset()
    OP_STATS.muls = 0
    compiled = torch.compile(mul3, backend=backend, fullgraph=True)
    x = CountsInModuleObject(torch.arange(4.0))
    for call in range(1, 4):
        compiled(x)
        assert OP_STATS.muls == call


# --------------------------------------------------------------------------- writes on plain tensors


class TagsItsActivation(S.WritingTensor):
    """A weight whose matmul counts its uses and tags the plain activation it multiplies."""

    @classmethod
    def before_op(cls, func, args, kwargs):
        if func is torch.ops.aten.mm.default and isinstance(args[1], cls):
            x, w = args
            w.uses = getattr(w, "uses", 0) + 1
            x.seen_by = w.uses


def _mm_input(w, x):
    return torch.mm(x, w)


def _mm_intermediate(w, x):
    y = x * 2
    return y, torch.mm(y, w)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fn", [_mm_input, _mm_intermediate], ids=["graph_input", "returned_intermediate"])
def test_dispatch_writes_on_a_plain_tensor_it_is_given(backend, fn):
    def make():
        return [TagsItsActivation(torch.randn(3, 2, generator=torch.Generator().manual_seed(0))), torch.ones(4, 3)]

    out = differential(fn, make, backend=backend, calls=3)
    assert out.compiled_inputs[0].uses == 3
    if fn is _mm_input:
        assert out.compiled_inputs[1].seen_by == 3


def test_dispatch_writes_on_a_plain_tensor_under_the_aot_layer_alone():
    from functorch.compile import aot_function, nop

    w, x = TagsItsActivation(torch.ones(3, 2)), torch.ones(4, 3)
    aot_function(_mm_input, fw_compiler=nop)(w, x)
    assert (w.uses, x.seen_by) == (1, 1)
    torch._dynamo.reset()
    with dynamo_ext.config.patch(dynamo_layer=False):
        compiled = torch.compile(_mm_input, backend="aot_eager", fullgraph=True)
        w, x = TagsItsActivation(torch.ones(3, 2)), torch.ones(4, 3)
        for _ in range(2):
            compiled(w, x)
    assert (w.uses, x.seen_by) == (2, 2)


# --------------------------------------------------------------------------- a global tuple of classes


class Marks(S.WritingTensor):
    """Dispatch counts the ops whose inner tensor is not one of the module's WRAPPED classes."""

    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.mul.Tensor:
            first.unwrapped = getattr(first, "unwrapped", 0) + (0 if isinstance(first.elem, WRAPPED) else 1)


WRAPPED: tuple = (Marks,)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_dispatch_reads_a_global_tuple_of_classes(backend):
    global WRAPPED
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2, backend=backend, fullgraph=True)
    xe, xc = Marks(torch.ones(3)), Marks(torch.ones(3))
    try:
        for wrapped in [(Marks,), (torch.Tensor,), (Marks,)]:
            WRAPPED = wrapped  # the user rebinds it between calls: guarded, as Dynamo guards globals
            xe * 2
            compiled(xc)
            assert xc.unwrapped == xe.unwrapped
    finally:
        WRAPPED = (Marks,)
    assert xe.unwrapped == 2


class CountsOnTheActivation(S.WritingTensor):
    """A weight whose matmul keeps a count on the plain activation it multiplies."""

    @classmethod
    def before_op(cls, func, args, kwargs):
        if func is torch.ops.aten.mm.default:
            x = args[0]
            x.seen_by = getattr(x, "seen_by", 0) + 1  # read, then written: guarded when absent


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_count_kept_on_a_plain_tensor(backend, fullgraph):
    def make():
        return [CountsOnTheActivation(torch.ones(3, 2)), torch.ones(4, 3)]

    out = differential(_mm_input, make, backend=backend, fullgraph=fullgraph, calls=3)
    assert out.compiled_inputs[1].seen_by == 3


class SkipsKnownKinds(S.WritingTensor):
    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.mul.Tensor:
            first.hits = getattr(first, "hits", 0) + (0 if any(isinstance(first.elem, k) for k in KNOWN) else 1)


KNOWN: frozenset = frozenset({torch.Tensor})


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("dynamic", [None, True])
def test_dispatch_reads_a_global_frozenset_of_classes(backend, dynamic):
    global KNOWN
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2, backend=backend, fullgraph=True, dynamic=dynamic)
    xe, xc = SkipsKnownKinds(torch.ones(3)), SkipsKnownKinds(torch.ones(3))
    try:
        for known in [frozenset({torch.Tensor}), frozenset(), frozenset({torch.Tensor})]:
            KNOWN = known
            xe * 2
            compiled(xc)
            assert xc.hits == xe.hits
    finally:
        KNOWN = frozenset({torch.Tensor})
    assert xe.hits == 1


def test_a_count_kept_on_a_plain_tensor_with_the_aot_layer_alone():
    torch._dynamo.reset()
    with dynamo_ext.config.patch(dynamo_layer=False):
        compiled = torch.compile(_mm_input, backend="aot_eager", fullgraph=True)
        w, x = CountsOnTheActivation(torch.ones(3, 2)), torch.ones(4, 3)
        for _ in range(3):
            compiled(w, x)
    assert x.seen_by == 3


class ScalesByItsOperand(S.WritingTensor):
    """Dispatch only reads a scale the user may keep on the plain tensor it multiplies by
    (``getattr(other, "scale", 1.0)``): it never writes it."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        other = args[1] if len(args) > 1 else None
        if func is torch.ops.aten.mul.Tensor and isinstance(other, torch.Tensor) and not isinstance(other, cls):
            return cls(out.elem * getattr(other, "scale", 1.0))
        return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_scale_only_read_on_a_plain_tensor_the_user_sets_later(backend, fullgraph):
    """The name is absent at the first compile (guarded on staying absent), then set, then
    changed: each value is read from the real tensor (stock aot_eager keeps the first trace's
    default, the first compile used to as well)."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(lambda x, p: x * p, backend=counter, fullgraph=fullgraph)
    x, p = ScalesByItsOperand(torch.ones(3)), torch.full((3,), 2.0)
    for scale in (None, None, 5.0, 7.0, 7.0):
        if scale is not None:
            p.scale = scale
        expected = 2.0 * (scale or 1.0)
        assert compiled(x, p).elem.tolist() == [expected] * 3, f"scale {scale}"
    assert counter.frame_count == 3


class Requantizes(S.WritingTensor):
    """Dispatch marks the inner tensor it used, then replaces it by a new one (a weight
    requantized after use): the mark stays on the old inner tensor."""

    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.mul.Tensor:
            first.elem.used = getattr(first.elem, "used", 0) + 1
            first.elem = first.elem * 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("inner", ["plain", "subclass"])
def test_a_write_on_an_inner_tensor_dispatch_then_replaces(backend, inner):
    """The residual write goes to the inner tensor the input held when the call started, not
    to the one it holds afterwards (under backend="eager" the graph itself runs dispatch)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2, backend=backend, fullgraph=True)

    def make():
        elem = torch.arange(3.0)
        return Requantizes(S.CallCounter(elem) if inner == "subclass" else elem)

    xe, xc = make(), make()
    for call in range(3):
        old_e, old_c = xe.elem, xc.elem
        xe * 2
        compiled(xc)
        assert old_c.used == old_e.used == 1, f"call {call}"
        assert "used" not in vars(xc.elem) and "used" not in vars(xe.elem), f"call {call}"
        assert_same_state(xe, xc, f"call {call}")
        assert_same_state(old_e, old_c, f"call {call}: the replaced inner tensor")


class ReadsItsDict(S.WritingTensor):
    """Dispatch reads a knob the user may set through ``__dict__`` and records what it saw;
    every instance also holds a tensor dispatch never touches (answering the ``__dict__``
    read makes it a graph input, and the op is traced again)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        mult = 1.0
        for a in args:
            if isinstance(a, cls):
                knob = a.__dict__.get("knob")
                mult *= 1.0 if knob is None else float(knob)
                a.knob_seen = knob
                a.scale = a.__dict__.get("scale", 1.0) * 2 + 0.5
        out = super().__torch_dispatch__(func, types, args, kwargs)
        return type(out)(out.elem * mult)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_dict_reads_of_two_inputs_traced_again_after_a_tensor_is_seeded(backend, fullgraph):
    """The second trace of the op read the instance dicts as the first trace's answers had
    left them undone: the knob read back None and a float counter its first value, silently
    replayed on the eager backend (inconsistent_passes on AOT backends)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: a * b, backend=backend, fullgraph=fullgraph)

    def make():
        return [ReadsItsDict(torch.ones(2), buf=torch.zeros(())) for _ in range(2)]

    e, c = make(), make()
    for knob in (3, 5, 7, 7):
        e[0].knob = c[0].knob = knob
        torch.testing.assert_close(compiled(*c).elem, (e[0] * e[1]).elem)
        for a, b in zip(e, c):
            assert_same_state(a, b, f"knob {knob}")
        assert c[0].knob_seen == knob and c[1].knob_seen is None


class CountsThroughItsDict(S.WritingTensor):
    """Dispatch starts its count through the instance dict (``setdefault``) before the first
    attribute read: the trace must read back what it put there."""

    KIND = "int"

    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.sin.default:
            if cls.KIND == "int":
                first.__dict__.setdefault("n", 0)
                first.n = first.n + 1
            else:
                first.__dict__.setdefault("ops", ())
                first.ops = first.ops + ("sin",)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("kind", ["int", "tuple"])
def test_a_count_started_through_the_instance_dict(backend, fullgraph, kind):
    """The read after ``__dict__.setdefault`` was answered "absent" from the real object (it
    raised: a dispatch_raised refusal, a crash of Dynamo's error message under fullgraph=False)."""
    cls = type(f"CountsThroughItsDict_{kind}", (CountsThroughItsDict,), {"KIND": kind})

    def make():
        return [cls(torch.arange(3.0))]

    out = differential(lambda x: x.sin(), make, backend=backend, fullgraph=fullgraph, calls=3)
    held = vars(out.compiled_inputs[0])
    assert held.get("n", held.get("ops")) in (3, ("sin",) * 3)


class AppliesItsDictInOrder(S.WritingTensor):
    """A debugging wrapper: the user registers post-ops as attributes (``post_mul_*``,
    ``post_add_*``), dispatch applies them in the order the instance dict holds them and
    records the order it saw."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        first = next((a for a in args if isinstance(a, cls)), None)
        if first is None or not isinstance(out, cls):
            return out
        elem = out.elem
        for k, v in first.__dict__.items():
            if k.startswith("post_mul"):
                elem = elem * v
            elif k.startswith("post_add"):
                elem = elem + v
        first.seen = tuple(k for k in vars(first) if k != "seen")
        return cls(elem)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_the_instance_dict_is_read_in_eager_order(backend, fullgraph):
    """Code iterating ``__dict__`` sees its entries in the order eager holds them (the user's
    order of assignment), not the order the trace answered them in (by name: the add came
    before the multiply, and the outputs differed)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2, backend=backend, fullgraph=fullgraph)
    xe, xc = AppliesItsDictInOrder(torch.arange(3.0)), AppliesItsDictInOrder(torch.arange(3.0))
    for call, (name, value) in enumerate([("post_mul_z", 10.0), ("post_add_a", 1.0), ("post_mul_z", 2.0), ("post_add_0", -3.0)]):
        setattr(xe, name, value)
        setattr(xc, name, value)
        out_e, out_c = xe * 2, compiled(xc)
        torch.testing.assert_close(out_c.elem, out_e.elem, msg=lambda m: f"call {call}: {m}")
        assert xc.seen == xe.seen, f"call {call}"
        assert_same_state(xe, xc, f"call {call}")


class WritesNan(S.WritingTensor):
    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.mul.Tensor:
            first.v = float("nan")
            first.w = float("-inf")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_nan_written_by_dispatch(backend):
    """Each AOTAutograd pass writes nan alike (compared with ==, the passes disagreed:
    inconsistent_passes)."""
    import math

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2, backend=backend, fullgraph=True)
    x = WritesNan(torch.arange(3.0))
    compiled(x)
    assert math.isnan(x.v) and x.w == float("-inf")


class _Quantized(torch.Tensor):
    """An inner subclass (a stand-in for a quantized payload)."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)
        r.elem = elem
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*tree_map_only(cls, lambda t: t.elem, args), **tree_map_only(cls, lambda t: t.elem, kwargs or {}))
        return tree_map_only(torch.Tensor, cls, out)


class KeepsReference(torch.Tensor):
    """Wraps a quantized payload and keeps a reference copy of it, made when built; a matmul
    records which reference it used."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)
        r.elem = elem
        r.ref = elem.clone()
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mul.Tensor:
            args[0].used = args[0].ref
        out = func(*tree_map_only(cls, lambda t: t.elem, args), **tree_map_only(cls, lambda t: t.elem, kwargs or {}))
        return tree_map_only(_Quantized, cls, out)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_an_intermediate_records_a_tensor_its_constructor_set(backend):
    """``used`` on a returned intermediate is the very tensor its constructor put in ``ref``,
    as in eager (a separately rebuilt graph output replaced it)."""

    def fn(x):
        y = x + x
        return y, y * x

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    for call in range(2):
        ye, _ = fn(KeepsReference(_Quantized(torch.arange(4.0))))
        yc, _ = compiled(KeepsReference(_Quantized(torch.arange(4.0))))
        assert ye.used is ye.ref
        assert yc.used is yc.ref, f"call {call + 1}"
        torch.testing.assert_close(yc.ref.elem, ye.ref.elem)


class TagsItsResults(torch.Tensor):
    """A weight-only wrapper whose dispatch returns plain tensors and tags them (the source
    op, an absmax scale), as activation-quantization code does; with ``KEEP`` it also keeps
    the last result on the weight."""

    KEEP = False

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*[a.elem if isinstance(a, cls) else a for a in args], **(kwargs or {}))
        out.src = func.__name__
        out.scale = out.abs().amax() / 127
        if cls.KEEP:
            next(a for a in args if isinstance(a, cls)).last_out = out
        return out


class KeepsTaggedResults(TagsItsResults):
    KEEP = True


def _mm_only(x, w):
    return torch.mm(x, w)


def _mm_and_more(x, w):
    h = torch.mm(x, w)
    return h, h.relu()


def _mm_summed(x, w):
    return torch.mm(x, w).sum()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize(
    "cls,fn",
    [(TagsItsResults, _mm_only), (TagsItsResults, _mm_and_more), (KeepsTaggedResults, _mm_summed)],
    ids=["returned", "returned_and_used", "kept_on_the_weight"],
)
def test_a_plain_result_dispatch_tagged(backend, cls, fn):
    """Note [Attributes on a plain output]: the plain tensor dispatch returns holds its tags
    after the compiled call, returned or kept on the weight (lost on AOT backends before)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 4, generator=g), torch.randn(4, 3, generator=g)
    differential(fn, lambda: [x.clone(), cls(w.clone())], backend=backend, calls=2)


class RecordsItsSum(torch.Tensor):
    """Dispatch counts its ops and records a data-dependent statistic (``.item()``), as a
    loss-scale or amax tracker does."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem
        self.step = 0

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*[a.elem if isinstance(a, cls) else a for a in args], **(kwargs or {}))
        for a in args:
            if isinstance(a, cls):
                a.step += 1
                a.total = a.elem.sum().item()
        return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_data_dependent_value_written_beside_a_counter(backend):
    """``.item()`` written beside a counter that became symbolic: the compile that follows
    failed inside Dynamo (an unbacked symbol not returned by the node that made it); the
    data-dependent value's graph node is made first now."""

    def f(x, y):
        return (x + y).sin()

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, generator=g), torch.randn(3, generator=g)
    differential(f, lambda: [RecordsItsSum(x.clone()), y.clone()], backend=backend, calls=3)


class CachesItsInner(torch.Tensor):
    """Dispatch caches the inner tensor itself when ``cache`` is None, and computes with
    ``cache`` (a user may clear it, or put a replacement there)."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem
        self.cache = None

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        for a in args:
            if isinstance(a, cls) and a.cache is None:
                a.cache = a.elem
        return func(*[a.cache if isinstance(a, cls) else a for a in args], **(kwargs or {}))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
def test_a_cache_aliasing_an_inner_tensor_the_user_clears_or_replaces(backend, fullgraph):
    """A read of ``cache`` while it is ``elem`` is guarded as that alias: cleared by the user
    (or a fresh weight), the call fills it again; replaced by another tensor, the call
    computes with it. The graph for the alias was reused, silently (an outside tester's find)."""

    def run(fn):
        g = torch.Generator().manual_seed(0)
        w, w2 = CachesItsInner(torch.randn(4, 4, generator=g)), CachesItsInner(torch.randn(4, 4, generator=g))
        x = torch.ones(1, 4)
        state = lambda t: "None" if t.cache is None else ("elem" if t.cache is t.elem else "other")  # noqa: E731
        seen = []
        for _ in range(2):
            fn(x, w)
            seen.append(state(w))
        w.cache = None
        fn(x, w)
        seen.append(state(w))
        fn(x, w2)
        seen.append(state(w2))
        w.cache = torch.zeros(4, 4)
        seen.append(fn(x, w).sum().item())
        return seen

    def mm(x, w):
        return torch.mm(x, w)

    torch._dynamo.reset()
    eager = run(mm)
    assert eager == ["elem", "elem", "elem", "elem", 0.0]
    assert run(torch.compile(mm, backend=backend, fullgraph=fullgraph)) == eager


class KeepsAViewOfItsCache(torch.Tensor):
    """Dispatch builds a cached copy once, computes with it and keeps each result: through
    ``F.linear``'s ``t`` of the weight, the kept result is a view of the cache."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, dtype=elem.dtype, strides=elem.stride(), device=elem.device, requires_grad=True
        )

    def __init__(self, elem):
        self.elem = elem
        self.cache = None
        self.last_out = None

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        ws = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, cls)]
        for a in ws:
            if a.cache is None:
                a.cache = a.elem * 2
        out = func(*torch.utils._pytree.tree_map_only(cls, lambda t: t.cache, args), **(kwargs or {}))
        for a in ws:
            a.last_out = out
        return out


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
def test_written_tensors_that_alias_one_another(fullgraph):
    """Note [Written tensors that alias one another]: AOTAutograd refuses a graph whose
    outputs alias one another with subclass inputs; the written cache and the view of it
    kept as the last result are such outputs. A refusal of dynamo_ext's (AOTAutograd's
    AssertionError was raised under fullgraph=False), and eager's state without fullgraph."""

    def fn(x, w):
        return torch.nn.functional.linear(x @ w, w)

    def run(f):
        torch.manual_seed(0)
        w = KeepsAViewOfItsCache(torch.randn(4, 4))
        y = f(torch.randn(3, 4), w)
        return y.detach(), w.cache.detach(), w.last_out.detach()

    torch._dynamo.reset()
    eager = run(fn)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=fullgraph)
    if fullgraph:
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="dynamo_ext: opaque_value"):
            run(compiled)
        return
    for e, c in zip(eager, run(compiled)):
        torch.testing.assert_close(c, e)


_GENERATED_SOURCE = '''
import torch


class Generated(torch.Tensor):
    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*[a.elem if isinstance(a, cls) else a for a in args], **(kwargs or {}))
        if func is torch.ops.aten.mul.Tensor:
            args[0].n = getattr(args[0], "n", 0) + 1
        return cls(out) if isinstance(out, torch.Tensor) else out
'''


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("namespace", [{}, {"__name__": "generated"}], ids=["no_name", "named"])
def test_a_subclass_defined_by_exec(backend, fullgraph, namespace):
    """A class made by ``exec(source, {})`` (generated or plugin code) has ``__module__ ==
    "builtins"``: it was taken for one of Python's own and never hooked, its count left at
    the trace's 1 on every call (an outside tester's find; stock's eager backend counts)."""
    ns = dict(namespace)
    exec(_GENERATED_SOURCE, ns)
    cls = ns["Generated"]

    def f(w, x):
        return w * x

    def run(fn):
        w = cls(torch.ones(2))
        w.n = 0
        seen = []
        for _ in range(4):
            fn(w, torch.ones(2))
            seen.append(w.n)
        return seen

    torch._dynamo.reset()
    assert run(torch.compile(f, backend=backend, fullgraph=fullgraph)) == run(f) == [1, 2, 3, 4]


class ScaleProperty(WrapperTensor):
    """float8-style: ``scale`` is a property whose setter stores ``_scale`` and counts sets."""

    @property
    def scale(self):
        return self._scale

    @scale.setter
    def scale(self, value):
        self._scale = value
        self._sets = getattr(self, "_sets", 0) + 1

    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.mul.Tensor:
            first.scale = first.elem.abs().max() / 448.0
            first.last_scale = first.scale


class RenamesOnSet(ScaleProperty):
    """Its own ``__setattr__`` keeps ``amax`` under ``_amax`` and logs the names set."""

    def __setattr__(self, name, value):
        if name == "amax":
            super().__setattr__("_log", getattr(self, "_log", ()) + (name,))
            name = "_amax"
        super().__setattr__(name, value)

    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.mul.Tensor:
            first.amax = first.elem.abs().max()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("cls", [ScaleProperty, RenamesOnSet], ids=lambda c: c.__name__)
def test_a_property_setter_or_own_setattr_decides_where_a_write_lands(backend, fullgraph, cls):
    """``s.scale = v`` through a property's setter (or a class's own ``__setattr__``) does not
    put ``scale`` in the instance dict: recorded as ``scale``, the write looked like a deletion
    and was refused as ``deleted_attribute`` (an outside tester's find). What the setter sets
    is what is replayed."""
    make = lambda: [cls(torch.tensor([1.0, -3.0, 2.0])), torch.ones(3)]  # noqa: E731
    if cls is not ScaleProperty and fullgraph:
        # Dynamo replays with STORE_ATTR, through the class's own __setattr__ a second time
        assert_refused_untouched(lambda w, x: w * x, make, backend, "opaque_value")
        return
    differential(lambda w, x: w * x, make, backend=backend, fullgraph=fullgraph, calls=3)


class CountsSets(WrapperTensor):
    """Its own ``__setattr__`` counts how often ``scale`` is set (a dirty flag)."""

    def __setattr__(self, name, value):
        if name == "scale":
            object.__setattr__(self, "scale_sets", self.__dict__.get("scale_sets", 0) + 1)
        object.__setattr__(self, name, value)

    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.mul.Tensor:
            first.scale = first.elem.abs().max() / 4


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_class_counting_sets_in_its_own_setattr(backend):
    """Replaying ``scale`` runs the class's ``__setattr__`` a second time (two sets counted
    for one, silently: an outside tester's find): a name that ``__setattr__`` set besides
    the assigned one is refused in both layers, eager under ``fullgraph=False``. A class
    whose ``__setattr__`` only records assignments elsewhere replays each once
    (test_aot_layer.py::test_each_write_applied_exactly_once_in_both_modes)."""
    make = lambda: [CountsSets(torch.tensor([1.0, -3.0, 2.0])), torch.ones(3)]  # noqa: E731
    differential(lambda w, x: w * x, make, backend=backend, fullgraph=False, calls=3)
    if backend == "aot_eager":
        _aot_layer_alone_refuses(make, "opaque_value")


def _aot_layer_alone_refuses(make, kind):
    """The AOTAutograd layer alone (Dynamo's off) refuses ``w * x`` as ``kind``, ``w`` untouched."""
    with dynamo_ext.config.patch(dynamo_layer=False):
        torch._dynamo.reset()
        w, x = make()
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=kind):
            torch.compile(lambda w, x: w * x, backend="aot_eager", fullgraph=True)(w, x)
        assert set(vars(w)) == {"elem"}


class WritesUnderADescriptor(WrapperTensor):
    """Dispatch writes the instance dict itself under a name a data descriptor of the class
    owns: ``shape`` (torch's), or ``scale`` (its own property, whose setter keeps ``_scale``)."""

    name = "shape"

    @property
    def scale(self):
        return self.__dict__.get("_scale", 1.0)

    @scale.setter
    def scale(self, value):
        self.__dict__["_scale"] = value

    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.mul.Tensor:
            first.__dict__[cls.name] = "seen"


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("name", ["shape", "scale"])
def test_a_dict_write_under_a_name_a_descriptor_owns(backend, fullgraph, name):
    """``self.__dict__["shape"] = v`` puts ``shape`` in the dict, where ``setattr`` would go
    to the class's descriptor: the replay's ``setattr`` raised (``shape`` is not writable) or
    ran the property's setter eager never ran (an outside tester's find). Refused as
    ``opaque_value``, eager under ``fullgraph=False``."""

    class W(WritesUnderADescriptor):
        pass

    W.name = name
    make = lambda: [W(torch.tensor([1.0, -3.0, 2.0])), torch.ones(3)]  # noqa: E731
    if fullgraph:
        assert_refused_untouched(lambda w, x: w * x, make, backend, "opaque_value")
        return
    out = differential(lambda w, x: w * x, make, backend=backend, fullgraph=False, calls=2)
    assert out.eager_inputs[0].__dict__[name] == "seen" and "_scale" not in vars(out.compiled_inputs[0])
    if backend == "aot_eager":
        _aot_layer_alone_refuses(make, "opaque_value")


class ReadsBackADictWrite(WrapperTensor):
    """Dispatch counts in the instance dict and reads the count back by attribute in the same
    op (``self.__dict__["hits"] = ...; self.last = self.hits``)."""

    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.mul.Tensor:
            first.__dict__["hits"] = getattr(first, "hits", 0) + 1
            first.last = first.hits * 10
            first.amax = first.elem.abs().max()
            first.__dict__["seen"] = True


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
def test_a_dict_write_read_back_in_the_same_op(backend, fullgraph):
    """Reading back a name the op wrote through the dict took that write as seen, and the op's
    writes no longer held it: ``hits`` was never replayed, ``last`` was (an outside tester's
    find: a property's name written through ``vars(self)``). A dict write is ordered among the
    op's writes where it was made (a later round's find: after a tensor write, on aot_eager)."""
    make = lambda: [ReadsBackADictWrite(torch.tensor([1.0, -3.0, 2.0])), torch.ones(3)]  # noqa: E731
    out = differential(lambda w, x: w * x, make, backend=backend, fullgraph=fullgraph, calls=3)
    assert out.compiled_inputs[0].hits == 3 and out.compiled_inputs[0].last == 30
    # the order is dispatch's, a name first read as absent and then written through the dict too
    assert list(vars(out.compiled_inputs[0])) == list(vars(out.eager_inputs[0])) == ["elem", "hits", "last", "amax", "seen"]


class KeepsASumThroughItsDict(WrapperTensor):
    """Every op keeps its result's sum through the dict and reads it back."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*[a.elem if isinstance(a, cls) else a for a in args], **(kwargs or {}))
        first = next((a for a in args if isinstance(a, cls)), None)
        if first is not None and isinstance(out, torch.Tensor):
            first.__dict__["k"] = out.sum()
            first.k2 = first.k * 2
        return cls(out) if isinstance(out, torch.Tensor) else out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_dict_write_read_back_on_an_incoming_gradient(backend):
    """In the backward, the same op on the incoming gradient (``grad * x``) reads back what it
    wrote through the gradient's dict: its own write, answered (it was refused as a read of
    the gradient's state, ``unsupported_state_read``: an outside tester's find)."""
    make = lambda: [KeepsASumThroughItsDict(torch.tensor([1.0, -3.0, 2.0]), requires_grad=True)]  # noqa: E731
    differential(lambda w: w * 2 + 1, make, backend=backend, fullgraph=True, calls=2, backward=True)
