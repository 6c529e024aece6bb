"""A value user code read from an attribute before an op whose dispatch writes that attribute
(See Note [Values read before dispatch wrote them] in dynamo_layer.py).

``s = x.step`` then ``x * 2`` (dispatch bumps ``x.step``), returning or keeping ``s``: Dynamo's
codegen loaded ``s`` from ``x.step`` after the graph, and under ``backend="eager"`` the graph
had run dispatch for real, so ``s`` came back bumped (stock too).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import dynamo_ext
from dynamo_ext.testing import WrapperTensor


class Stepped(WrapperTensor):
    """Every op counts on its first argument; the count is carried in the ctx."""

    CTX = ("step",)

    @classmethod
    def on_op(cls, func, first):
        first.step = first.step + 1


class Box:
    pass


def returns_it(x, box):
    s = x.step
    return x * 2, s


def keeps_it(x, box):
    s = x.step
    y = x * 2
    box.seen = s  # a user-level write of the value read before
    return y


def reads_after_a_break(x, box):
    y = x * 2
    torch._dynamo.graph_break()
    s = y.step
    return y * (s + 1), s


def reads_twice(x, box):
    a = x.step
    y = x + 1
    b = x.step  # after the write: the written value
    return y, a, b


@pytest.fixture(autouse=True)
def _enabled():
    torch._dynamo.reset()
    dynamo_ext.enable()
    yield
    dynamo_ext.disable()
    torch._dynamo.reset()


def _state(out):
    return [(type(o).__name__, getattr(o, "step", None), o.elem.tolist() if isinstance(o, WrapperTensor) else o) for o in out]


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fn", [returns_it, keeps_it, reads_after_a_break, reads_twice], ids=lambda f: f.__name__)
def test_the_value_read_before_the_write(fn, backend, dynamic):
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, dynamic=dynamic)
    xe, xc = Stepped(torch.ones(2), step=0), Stepped(torch.ones(2), step=0)
    be, bc = Box(), Box()
    for call in range(3):
        e_out, c_out = fn(xe, be), compiled(xc, bc)
        e_out = e_out if isinstance(e_out, tuple) else (e_out,)
        c_out = c_out if isinstance(c_out, tuple) else (c_out,)
        assert _state(c_out) == _state(e_out), f"call {call}"
        assert xc.step == xe.step and vars(bc) == vars(be), f"call {call}"
    assert counter.frame_count <= (6 if fn is reads_after_a_break else 4)  # two frames around the break
