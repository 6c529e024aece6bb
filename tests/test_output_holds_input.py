"""An output subclass built around a subclass input of the graph (See Note [An output holding
an input subclass] in aot_layer.py).

``Outer(t)`` in a compiled function: eager's output holds ``t`` itself, with its live state.
AOTAutograd rebuilds the output, and the subclass in it, from the flatten ctx it traced, so
the compiled output held a copy whose ctx counter was the trace's (silently one or more
behind once the counter became a symbolic int; stock loses the identity too). The fuzzer
found it where Dynamo compiles dispatch's own wrapping code (``cls(t, **ctx)``) as a frame.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import dynamo_ext
from dynamo_ext.testing import WrapperTensor


class Counted(WrapperTensor):
    """Counts its ops in its flatten ctx."""

    CTX = ("ops",)

    @classmethod
    def on_op(cls, func, first):
        first.ops = first.ops + 1


class Holder(WrapperTensor):
    pass


def wrap(t):
    return Holder(t)


def add_then_wrap(t):
    u = t + t  # counts on t
    return Holder(u), Holder(t)


def wrap_twice(t):
    h = Holder(t)
    return h, Holder(t * 2)


@pytest.fixture(autouse=True)
def _enabled():
    torch._dynamo.reset()
    dynamo_ext.enable()
    yield
    dynamo_ext.disable()
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
@pytest.mark.parametrize("fn", [wrap, add_then_wrap, wrap_twice], ids=lambda f: f.__name__)
def test_the_output_holds_the_input_itself(fn, backend):
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter)
    te, tc = Counted(torch.ones(2), ops=0), Counted(torch.ones(2), ops=0)
    for call in range(4):
        te.ops = tc.ops = call * 2  # the user moves the counter between calls
        e_out, c_out = fn(te), compiled(tc)
        e_out = e_out if isinstance(e_out, tuple) else (e_out,)
        c_out = c_out if isinstance(c_out, tuple) else (c_out,)
        assert tc.ops == te.ops, f"call {call}"
        for k, (e, c) in enumerate(zip(e_out, c_out)):
            assert type(c.elem) is type(e.elem)
            assert (c.elem is tc) == (e.elem is te), f"call {call}, output {k}: identity"
            assert c.elem.ops == e.elem.ops, f"call {call}, output {k}: ops {c.elem.ops} vs eager {e.elem.ops}"
            torch.testing.assert_close(c.elem.elem, e.elem.elem)
    # add_then_wrap's dispatch reads the counter: it becomes symbolic after its first change
    # (one more compile); wrap only holds it, and Dynamo's ctx guard compiles per value, as stock
    assert counter.frame_count <= (4 if fn is wrap else 2)


class Marked(WrapperTensor):
    """``__tensor_unflatten__`` alone marks what it built; the constructor does not."""

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        r = super().__tensor_unflatten__(inner, ctx, outer_size, outer_stride)
        r.from_unflatten = True
        return r


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_an_output_lacks_what_only_unflatten_sets(backend):
    # AOTAutograd builds the output with __tensor_unflatten__; eager's comes from dispatch.
    compiled = torch.compile(lambda x: x * 2, backend=backend, fullgraph=True)
    for _ in range(2):
        e_out, c_out = Marked(torch.ones(2)) * 2, compiled(Marked(torch.ones(2)))
        assert sorted(vars(c_out)) == sorted(vars(e_out)) == ["elem"]


# A write on the holder's inner subclass, a bump of its ctx counter, then a rebind of the
# holder's attribute, all in one op: the recompile after the counter's change failed with an
# AssertionError of the package's own (a nested fake propagation ended the op's).


class Leaf(WrapperTensor):
    CTX = ("version",)


class Rebinder(WrapperTensor):
    INNER = ("a",)

    def inner_names(self):
        return ["a"]

    @staticmethod
    def __new__(cls, a, requires_grad=False):
        r = WrapperTensor.__new__(cls, a, requires_grad)
        del r.elem
        r.a = a
        return r

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["a"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        for x in args:
            if isinstance(x, cls):
                x.a.cache = x.a.elem * 2
                x.a.version = x.a.version + 1
                x.a = Leaf(x.a.elem + 0, version=x.a.version + 1)
        out = func(*[x.a if isinstance(x, cls) else x for x in args], **(kwargs or {}))
        return cls(out) if isinstance(out, torch.Tensor) else out


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_a_write_on_the_inner_then_a_rebind_in_one_op(backend, fullgraph):
    compiled = torch.compile(lambda h: h * 2, backend=backend, fullgraph=fullgraph)
    he, hc = Rebinder(Leaf(torch.ones(3), version=0)), Rebinder(Leaf(torch.ones(3), version=0))
    for call in range(3):
        old_e, old_c = he.a, hc.a
        e_out, c_out = he * 2, compiled(hc)
        assert hc.a.version == he.a.version, f"call {call}"
        torch.testing.assert_close(old_c.cache, old_e.cache)
        assert old_c.version == old_e.version
        torch.testing.assert_close(c_out.a.elem, e_out.a.elem)
