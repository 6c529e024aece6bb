"""Reads dispatch makes on incoming gradients in the traced backward (See Note [Reads on
incoming gradients] in aot_layer.py).

In eager the gradient an op's backward dispatch gets was made by dispatch; in the traced
backward it is AOTAutograd's tangent, rebuilt by ``__tensor_unflatten__``. A scaled tensor
whose unflatten sets ``scale`` where its constructor does not reads differently on the two:
such a compile is refused, with the inputs untouched, and runs eagerly under
``fullgraph=False``. A scale carried in the ctx, or set alike by the constructor, compiles
and gives eager's gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import dynamo_ext
from dynamo_ext.errors import RefusalKind
from dynamo_ext.testing import WrapperTensor

aten = torch.ops.aten


class Scaled(torch.Tensor):
    """``mul`` multiplies its result by the first argument's ``scale`` (1.0 when it has none);
    each forward op records its name on its first argument."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, requires_grad=requires_grad)
        r.elem = elem
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    def __repr__(self):
        return f"{type(self).__name__}({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(a for a in pytree.tree_leaves(args) if isinstance(a, cls))
        if torch.is_grad_enabled():
            first.last_op = func.__name__
        out = func(*pytree.tree_map_only(cls, lambda t: t.elem, args), **pytree.tree_map_only(cls, lambda t: t.elem, kwargs))
        if func is aten.mul.Tensor:
            out = out * getattr(first, "scale", 1.0)
        return pytree.tree_map_only(torch.Tensor, cls, out)


class UnflattenSetsScale(Scaled):
    """``__tensor_unflatten__`` sets ``scale = 0.0``; the constructor dispatch uses does not."""

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        r = cls(inner["elem"])
        r.scale = 0.0
        return r


class ScaleInCtx(Scaled):
    """``scale`` is carried in the flatten ctx, and dispatch passes it on."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False, scale=0.5):
        r = Scaled.__new__(cls, elem, requires_grad)
        r.scale = scale
        return r

    def __tensor_flatten__(self):
        return ["elem"], self.scale

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], scale=ctx)


class ConstructorSetsScale(UnflattenSetsScale):
    """The constructor sets the same ``scale`` unflatten sets: dispatch-made tensors hold it,
    but nothing carries it to the compiled backward (a user may set another on a gradient)."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = Scaled.__new__(cls, elem, requires_grad)
        r.scale = 0.0
        return r


def f(x, w):
    return x * w


def _make(cls):
    return cls(torch.arange(1.0, 7.0).reshape(2, 3), requires_grad=True), cls(torch.full((2, 3), 2.0), requires_grad=True)


def _run(fn, cls):
    x, w = _make(cls)
    out = fn(x, w)
    out.sum().backward()
    return out.elem.clone(), x.grad.elem.clone(), w.grad.elem.clone(), (x.__dict__.get("last_op"), w.__dict__.get("last_op"))


@pytest.fixture(autouse=True)
def _enabled():
    torch._dynamo.reset()
    dynamo_ext.enable()
    yield
    dynamo_ext.disable()
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
@pytest.mark.parametrize("cls", [ScaleInCtx, Scaled], ids=lambda c: c.__name__)
def test_a_scale_the_ctx_carries_or_no_gradient_holds_compiles(cls, backend):
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for call in range(2):
        eager, comp = _run(f, cls), _run(compiled, cls)
        for e, c in zip(eager[:3], comp[:3]):
            torch.testing.assert_close(c, e, msg=lambda m: f"call {call}: {m}")
        assert eager[3] == comp[3]
    assert counter.frame_count == 1


def test_a_scale_only_unflatten_sets_is_refused_and_nothing_touched():
    # Eager's gradient of x is w * 1.0 (its incoming gradient was made by dispatch); the
    # traced backward would read scale 0.0 on the tangent and return zeros.
    eager = _run(f, UnflattenSetsScale)
    assert torch.equal(eager[1], torch.full((2, 3), 2.0))
    x, w = _make(UnflattenSetsScale)
    with pytest.raises(Exception) as info:
        torch.compile(f, backend="aot_eager", fullgraph=True)(x, w)
    assert "dynamo_ext: unsupported_state_read" in str(info.value)
    assert "incoming gradient" in str(info.value) and "'scale'" in str(info.value)
    assert "last_op" not in x.__dict__ and "last_op" not in w.__dict__ and x.grad is None


def test_a_scale_only_unflatten_sets_runs_eagerly_without_fullgraph():
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter)
    for call in range(2):
        eager, comp = _run(f, UnflattenSetsScale), _run(compiled, UnflattenSetsScale)
        for e, c in zip(eager[:3], comp[:3]):
            torch.testing.assert_close(c, e, msg=lambda m: f"call {call}: {m}")
        assert eager[3] == comp[3]


def test_stock_gives_the_unflatten_scale_to_the_gradient():
    # What the refusal prevents: with dynamo_ext off the compiled gradient is silently zero.
    dynamo_ext.disable()
    x, w = _make(UnflattenSetsScale)
    torch.compile(f, backend="aot_eager", fullgraph=True)(x, w).sum().backward()
    assert torch.equal(x.grad.elem, torch.zeros(2, 3))


def test_the_refusal_kind_is_documented():
    assert RefusalKind.UNSUPPORTED_STATE_READ.value == "unsupported_state_read"


class DictReader(Scaled):
    """``__tensor_unflatten__`` marks what it built; dispatch looks the mark up in the instance
    dict itself (``vars(a)``), on every argument, and doubles ``mul``'s result where found."""

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        r = cls(inner["elem"])
        r.from_unflatten = True
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        marked = any(isinstance(a, cls) and "from_unflatten" in vars(a) for a in pytree.tree_leaves(args))
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if marked and func is aten.mul.Tensor:
            out = cls(out.elem * 2)
        return out


def g(x, w):
    return x * w  # w plain: the incoming gradient is the only subclass read in w's gradient


@pytest.mark.parametrize("fn", [f, g], ids=["both_subclasses", "plain_weight"])
def test_a_mark_only_unflatten_sets_read_through_the_dict(fn):
    # Stock gives doubled outputs and gradients. With dynamo_ext the forward reads the real
    # inputs (no mark) and the backward's read on the incoming gradient is refused.
    def make():
        return DictReader(torch.arange(1.0, 7.0).reshape(2, 3), requires_grad=True), (
            DictReader(torch.full((2, 3), 2.0), requires_grad=True) if fn is f else torch.full((2, 3), 2.0, requires_grad=True)
        )

    x, w = make()
    with pytest.raises(Exception) as info:
        torch.compile(fn, backend="aot_eager", fullgraph=True)(x, w)
    assert "dynamo_ext: unsupported_state_read" in str(info.value) and "from_unflatten" in str(info.value)
    # without fullgraph: eager's numbers
    compiled = torch.compile(fn, backend="aot_eager")
    for call in range(2):
        (ex, ew), (cx, cw) = make(), make()
        e_out, c_out = fn(ex, ew), compiled(cx, cw)
        e_out.sum().backward()
        c_out.sum().backward()
        torch.testing.assert_close(c_out.elem, e_out.elem)
        assert sorted(vars(c_out)) == sorted(vars(e_out))
        for e, c in ((ex, cx), (ew, cw)):
            torch.testing.assert_close(getattr(c.grad, "elem", c.grad), getattr(e.grad, "elem", e.grad), msg=lambda m: f"call {call}: {m}")


class ScaleFromOperands(Scaled):
    """A scaled tensor as low-precision training writes one: ``scale`` lives on the instance
    (not in the ctx), every op's result gets the product of its operands' scales, and
    ``mul`` applies it. Unflatten gives 1.0, as does the constructor by default."""

    @staticmethod
    def __new__(cls, elem, scale=1.0, requires_grad=False):
        r = Scaled.__new__(cls, elem, requires_grad)
        r.scale = scale
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        scale = 1.0
        for a in pytree.tree_leaves(args):
            if isinstance(a, cls):
                scale = scale * a.scale
        out = func(*pytree.tree_map_only(cls, lambda t: t.elem, args), **pytree.tree_map_only(cls, lambda t: t.elem, kwargs))
        if func is aten.mul.Tensor:
            out = out * scale
        return pytree.tree_map_only(torch.Tensor, lambda o: cls(o, scale), out)


def _sin_times_3(x):
    return x.sin() * 3


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("gradient", ["passed", "made_after_the_graph"])
@pytest.mark.parametrize("cls", [ScaleFromOperands, ConstructorSetsScale], ids=lambda c: c.__name__)
def test_a_gradient_scale_the_trace_cannot_know_is_refused(cls, gradient, fullgraph):
    """The compiled backward read the traced tangent's scale (1.0, as this trace's outputs
    held it too) where eager's gradient holds 2.0 (passed to backward(gradient=g), or made by
    a mul after the graph): x.grad 4x off, silently (stock too). Refused while compiling,
    nothing touched; without fullgraph, eager's gradients."""
    compiled = torch.compile(_sin_times_3, backend="aot_eager", fullgraph=fullgraph)

    def run(fn):
        x = cls(torch.tensor([0.5, 1.0, 2.0]), requires_grad=True)
        s = cls(torch.ones(3))
        s.scale = 2.0
        if gradient == "passed":
            fn(x).backward(gradient=s)
        else:
            (fn(x) * s).sum().backward()
        return x

    xe = run(_sin_times_3)
    if fullgraph:
        x = cls(torch.tensor([0.5, 1.0, 2.0]), requires_grad=True)
        with pytest.raises(Exception) as info:
            compiled(x)
        assert "dynamo_ext: unsupported_state_read" in str(info.value) and "'scale'" in str(info.value)
        assert x.grad is None and sorted(vars(x)) == ["elem", "scale"] and x.scale == (0.0 if cls is ConstructorSetsScale else 1.0)
        return
    xc = run(compiled)
    torch.testing.assert_close(xc.grad.elem, xe.grad.elem, rtol=0, atol=0)
    assert xc.grad.scale == xe.grad.scale


class QMeta(torch.Tensor):
    """A quantized-style tensor: ``(scale, zero_point)`` in a ctx tuple ``_qmeta``, ``scale``
    served by the class's ``__getattr__``; ``mul`` multiplies its result by the first
    argument's scale, and results take the first argument's ``_qmeta``. A gradient whose ctx
    differs from the traced one is coerced to it, as torch asks of a subclass."""

    @staticmethod
    def __new__(cls, elem, qmeta=(1.0, 0), requires_grad=False):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, requires_grad=requires_grad)
        r.elem = elem
        r._qmeta = qmeta
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __getattr__(self, name):
        if name == "scale":
            return self._qmeta[0]
        raise AttributeError(name)

    def __tensor_flatten__(self):
        return ["elem"], self._qmeta

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], ctx)

    def __coerce_same_metadata_as_tangent__(self, expected_metadata, expected_type=None):
        return type(self)(self.elem, expected_metadata)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(a for a in pytree.tree_leaves(args) if isinstance(a, cls))
        out = func(*pytree.tree_map_only(cls, lambda t: t.elem, args), **pytree.tree_map_only(cls, lambda t: t.elem, kwargs))
        if func is aten.mul.Tensor:
            out = out * getattr(first, "scale", 1.0)
        return pytree.tree_map_only(torch.Tensor, lambda o: cls(o, first._qmeta), out)


class Labelled(QMeta):
    """The same, but dispatch reads nothing of the ctx: ``mul`` does not scale, and results
    get the default ``_qmeta`` (the ctx is a label the user sets)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*pytree.tree_map_only(cls, lambda t: t.elem, args), **pytree.tree_map_only(cls, lambda t: t.elem, kwargs))
        return pytree.tree_map_only(torch.Tensor, cls, out)


def _gradient_run(fn, cls, gradient):
    x = cls(torch.tensor([0.5, 1.0, 2.0]), requires_grad=True)
    s = cls(torch.ones(3), (2.0, 1))  # another ctx than the graph's output holds
    if gradient == "passed":
        fn(x).backward(gradient=s)
    elif gradient == "made_after_the_graph":
        (s * fn(x)).sum().backward()
    else:  # the traced ctx: nothing is coerced
        fn(x).sum().backward()
    return x


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("gradient", ["passed", "made_after_the_graph", "same_ctx"])
def test_a_gradient_coerced_to_the_traced_ctx_the_backward_reads(gradient, fullgraph):
    """The compiled backward's mul read the traced tangent's scale (1.0) where eager's
    gradient holds 2.0; AOTAutograd coerced the gradient to the traced ctx and x.grad came
    out 2x off, silently (stock too; a long fuzz finding). Refused when backward() runs,
    before any gradient is accumulated (See Note [A gradient coerced to the traced
    metadata]); a gradient with the traced ctx compiles and matches."""
    xe = _gradient_run(_sin_times_3, QMeta, gradient)
    compiled = torch.compile(_sin_times_3, backend="aot_eager", fullgraph=fullgraph)
    if gradient == "same_ctx":
        xc = _gradient_run(compiled, QMeta, gradient)
        torch.testing.assert_close(xc.grad.elem, xe.grad.elem, rtol=0, atol=0)
        return
    with pytest.raises(dynamo_ext.SubclassWriteError) as info:
        _gradient_run(compiled, QMeta, gradient)
    assert info.value.kind is RefusalKind.CHANGED_BEFORE_BACKWARD and info.value.attr == "_qmeta"
    assert "__coerce_same_metadata_as_tangent__" in str(info.value)


def test_stock_coerces_the_gradient_and_its_grad_is_off():
    dynamo_ext.disable()
    xe = _gradient_run(_sin_times_3, QMeta, "passed")
    xc = _gradient_run(torch.compile(_sin_times_3, backend="aot_eager", fullgraph=True), QMeta, "passed")
    assert not torch.allclose(xc.grad.elem, xe.grad.elem)


@pytest.mark.parametrize("gradient", ["passed", "made_after_the_graph"])
def test_a_gradient_coerced_in_what_the_backward_does_not_read(gradient):
    """A ctx dispatch does not read (a label): the coercion is what the hook is for, and the
    compiled backward runs with eager's gradients. (Dispatch that passes a gradient's ctx on
    to its results reads it: a gradient coerced there is refused, since eager's x.grad would
    hold the gradient's ctx where the compiled one holds the traced one.)"""
    xe = _gradient_run(_sin_times_3, Labelled, gradient)
    xc = _gradient_run(torch.compile(_sin_times_3, backend="aot_eager", fullgraph=True), Labelled, gradient)
    torch.testing.assert_close(xc.grad.elem, xe.grad.elem, rtol=0, atol=0)


class Calls(WrapperTensor):
    """An inner tensor counting its muls in its ctx ``n``; a mul scales its result by the
    first argument's count, and results take that count: the backward computes with the
    incoming gradient's ``n``."""

    CTX = ("n",)

    @classmethod
    def default(cls, name):
        return 1

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = next(a for a in pytree.tree_leaves(args) if isinstance(a, cls))
        n = first.n
        out = super().__torch_dispatch__(func, types, args, kwargs)  # results take the count n
        if func is aten.mul.Tensor:
            first.n = n + 1
            out = cls(out.elem * n, n=n)
        return out


class Holder(WrapperTensor):
    """The outer wrapper: no ctx of its own, results hold the inner results."""


def _square(x):
    return x * x


def _calls_run(fn, calls, relabel_at=None):
    x = Holder(Calls(torch.tensor([0.5, 1.0, 2.0])), requires_grad=True)
    grads, states = [], []
    for call in range(calls):
        out = fn(x)
        if call == relabel_at:
            out.elem.n = 7  # the gradient made from the output below holds 7
        out.sum().backward()
        grads.append(x.grad.elem.elem.clone())
        # the gradient's inner count: made from the incoming gradient's in the backward (an
        # int, never a symbol of the trace: See Note [A gradient's ctx made from sizes or counts])
        states.append((x.elem.n, out.elem.n, type(x.grad.elem.n), x.grad.elem.n))
        x.grad = None
    return grads, states


def test_a_gradient_holding_the_count_the_output_got_this_call():
    """The output's count is the input's, which Dynamo makes dynamic once it changed: the
    traced tangent's ctx holds that symbol, and the compiled backward computes with this
    call's value of it, as eager's backward does with the gradient's (made from the
    output). Compared with the symbol's first value, the gradient was "coerced" and
    refused at the third call's backward() (a long fuzz finding); now each call's value is
    the one compared (See Note [A traced tangent ctx holding a symbolic value])."""
    expected = _calls_run(_square, 4)
    counter = CompileCounterWithBackend("aot_eager")
    got = _calls_run(torch.compile(_square, backend=counter, fullgraph=True), 4)
    for e, c in zip(expected[0], got[0]):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
    assert got[1] == expected[1]
    assert counter.frame_count == 2  # the first count, then the count as a dynamic int


def test_a_gradient_whose_count_the_user_changed_after_the_forward_is_refused():
    """The user sets the output's count before making the loss from it: eager's backward
    scales by 7, the compiled one was traced to scale by the forward's count. Refused when
    backward() runs, before x.grad is accumulated."""
    expected = _calls_run(_square, 3, relabel_at=2)
    compiled = torch.compile(_square, backend="aot_eager", fullgraph=True)
    x = Holder(Calls(torch.tensor([0.5, 1.0, 2.0])), requires_grad=True)
    for call in range(3):
        out = compiled(x)
        if call < 2:
            out.sum().backward()
            x.grad = None
            continue
        out.elem.n = 7
        with pytest.raises(dynamo_ext.SubclassWriteError) as info:
            out.sum().backward()
        assert info.value.kind is RefusalKind.CHANGED_BEFORE_BACKWARD and x.grad is None
    assert expected[1][2][0] == x.elem.n


class CachesOnEveryArgument(torch.Tensor):
    """A weight-only quantized wrapper: dispatch fills a cached copy on every subclass
    argument (incoming gradients too) and wraps every result."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, strides=elem.stride(), device=elem.device)

    def __init__(self, elem):
        self.elem = elem
        self.cache = None
        self.hits = 0

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, cls):
                if a.cache is None:
                    a.cache = (a.elem * 0.5).detach()
                else:
                    a.hits += 1
        out = func(*pytree.tree_map_only(cls, lambda t: t.elem, args), **pytree.tree_map_only(cls, lambda t: t.elem, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)


def test_a_refusal_in_the_traced_backward_runs_the_whole_frame_eagerly():
    """The traced backward reads ``cache`` on an incoming gradient: refused, and under
    ``fullgraph=False`` the frame runs eagerly, whole. Dynamo compiled the part before the
    last op instead (a graph break it cannot resume from), whose output then got a subclass
    gradient where it traced a plain one: backward() raised (an outside tester's find)."""

    def f(x, w1, w2):
        h = F.gelu(F.linear(x, w1))  # a statement boundary: a state Dynamo could resume from
        return F.linear(h, w2)

    def run(fn):
        torch.manual_seed(0)
        w1 = torch.randn(16, 8, requires_grad=True)
        w2 = CachesOnEveryArgument(torch.randn(4, 16))
        fn(torch.randn(3, 8), w1, w2).sum().backward()
        return w1.grad.elem if isinstance(w1.grad, CachesOnEveryArgument) else w1.grad, w2.cache, w2.hits

    torch._dynamo.reset()
    counters.clear()
    eager = run(f)
    compiled = run(torch.compile(f, backend="aot_eager", fullgraph=False))
    torch.testing.assert_close(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1])
    assert compiled[2] == eager[2]
    assert counters["stats"]["unique_graphs"] == 0
