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
