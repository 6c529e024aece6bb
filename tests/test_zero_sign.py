"""The sign of a float zero Dynamo reads itself (See Note [The sign of a float zero]).

Plain objects first (the reads are Dynamo's own: its guard compares floats with ``==``, an
unspecialized float is a sympy symbol whose zero has no sign), then a subclass whose
``__torch_dispatch__`` Dynamo compiles as a frame after a graph break, where the fuzzer
found it. Each case runs eager and compiled on separate, equal objects and compares the
value and its sign after every call; the sequences flip the sign of a zero, and move
between zero and other values, on purpose.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._pytree import tree_map_only

import dynamo_ext

SEQUENCE = [0.0, -0.0, 0.5, 0.0, -0.0, 0.25, -0.0, -0.0]


class Box:
    pass


def negate(t, b):
    b.a = -b.a
    return t + 1


def negate_twice_if_zero(t, b):
    v = b.a
    if v == 0:
        b.a = -(-v)
    return t + 1


def reciprocal(t, b):
    return t * (1.0 / b.a if b.a != 0 else math.copysign(1.0, b.a))


def _same(e, c):
    return type(e) is type(c) and e == c and math.copysign(1.0, e) == math.copysign(1.0, c)


@pytest.mark.parametrize("dynamic", [None, True, False])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fn", [negate, negate_twice_if_zero, reciprocal], ids=lambda f: f.__name__)
def test_a_plain_attribute_keeps_its_sign(fn, backend, dynamic):
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
    for k, a in enumerate(SEQUENCE):
        e, c = Box(), Box()
        e.a = c.a = a
        e_out, c_out = fn(torch.ones(3), e), compiled(torch.ones(3), c)
        assert _same(e.a, c.a), f"call {k} (a={a!r}): eager left {e.a!r}, compiled {c.a!r}"
        assert torch.equal(e_out, c_out) and torch.equal(torch.sign(e_out), torch.sign(c_out))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_the_same_sign_does_not_recompile(backend):
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(negate, backend=counter, dynamic=True)
    for a in [-0.0, -0.0, -0.0, 0.0, 0.0, -0.0]:
        b = Box()
        b.a = a
        compiled(torch.ones(3), b)
    assert counter.frame_count == 2  # one graph per sign, each reused


class Flipping(torch.Tensor):
    """Dispatch writes the negation of a ctx float on its first argument, as an
    ``equal_value`` write of the fuzzer does (-0.0 over 0.0)."""

    @staticmethod
    def __new__(cls, elem, a=0.0):
        t = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        t.elem = elem
        t.a = a
        return t

    def __tensor_flatten__(self):
        return ["elem"], {"a": self.a}

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], **ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = next(x for x in args if isinstance(x, Flipping))
        out = func(*tree_map_only(Flipping, lambda x: x.elem, args), **(kwargs or {}))
        out = tree_map_only(torch.Tensor, lambda t: Flipping(t, a=first.a), out)
        first.a = _flip(first.a)
        first.a = _flip(first.a)
        return out


def _flip(v):
    """An equal value of another type or sign: 0.0 over 0, -0.0 over 0.0."""
    if type(v) is int:
        return float(v)
    return -v if v == 0 else v + 0.0


def _ops(vals):
    for _ in range(1):
        vals.append(vals[-1] + vals[-1])
        # a graph break in a loop: Dynamo runs this frame eagerly, and compiles the
        # dispatch frames its op calls (dispatch's own code, read by Dynamo's rules)
        torch._dynamo.graph_break()
    return vals


def _program(x):
    return _ops([x])[-1] * 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_dispatch_compiled_as_a_frame_keeps_the_sign(backend):
    compiled = torch.compile(_program, backend=backend, dynamic=True)
    e = Flipping(torch.ones(2, 2), a=0)
    c = Flipping(torch.ones(2, 2), a=0)
    for k in range(4):
        e_out, c_out = _program(e), compiled(c)
        for what, ev, cv in [("input", e.a, c.a), ("output", e_out.a, c_out.a)]:
            assert type(ev) is type(cv) and ev == cv, f"call {k}: {what}.a eager {ev!r}, compiled {cv!r}"
            if isinstance(ev, float):
                assert math.copysign(1.0, ev) == math.copysign(1.0, cv), f"call {k}: {what}.a eager {ev!r}, compiled {cv!r}"
        assert not isinstance(c.a, torch.SymFloat) and not isinstance(c_out.a, (torch.SymFloat, torch.SymInt))


def test_stock_loses_the_sign():
    """Without dynamo_ext the plain case gives the other sign: the tests above can fail."""
    dynamo_ext.disable()
    try:
        compiled = torch.compile(negate, backend="aot_eager", dynamic=True)
        for a in [0.5, -0.0]:
            b = Box()
            b.a = a
            compiled(torch.ones(3), b)
        assert b.a == 0.0 and math.copysign(1.0, b.a) == -1.0  # eager: -(-0.0) is 0.0
    finally:
        dynamo_ext.enable()
