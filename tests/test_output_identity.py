"""One tensor object held in several places of a compiled call's inputs and outputs (See
Note [One object in several places of the outputs] in aot_layer.py).

AOTAutograd rebuilds every output subclass and every subclass nested in one on its own, so
a nested subclass eager's outputs hold twice (under two names of one output, under names of
two outputs, as an output and inside another) came back as two objects. The fuzzer found the
first (a cache toggled away from ``elem`` and back); the rest are the same class. Every test
compares which places hold one object, across inputs and outputs, with eager.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map_only

from dynamo_ext.testing import WrapperTensor
from harness import assert_same_identities, differential

aten = torch.ops.aten

BACKENDS = ["eager", "aot_eager"]


class Inner(WrapperTensor):
    """A nested subclass with no state of its own."""


class Outer(WrapperTensor):
    """Wraps an ``Inner``; what its dispatch does to its results is set per test (``RULE``)."""

    RULE = None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next((a for a in args if isinstance(a, Outer)), None)
        out = func(*tree_map_only(Outer, lambda t: t.elem, args), **tree_map_only(Outer, lambda t: t.elem, kwargs))
        out = tree_map_only(torch.Tensor, lambda t: cls(t), out)
        if first is not None and cls.RULE is not None:
            cls.RULE(func, first, out)
        return out


class PeerOfResult(Outer):
    """mul: the operand keeps the result's inner tensor (``first.peer = out.elem``)."""

    @staticmethod
    def RULE(func, first, out):
        if func is aten.mul.Tensor:
            first.peer = out.elem


class KeepsOwnInner(Outer):
    """mul: the operand holds its own inner under a second name; the result holds it too."""

    @staticmethod
    def RULE(func, first, out):
        if func is aten.mul.Tensor:
            first.mine = first.elem
            out.src = first.elem


class KeepsResult(Outer):
    """mul: the operand keeps the whole result (``first.last = out``)."""

    @staticmethod
    def RULE(func, first, out):
        if func is aten.mul.Tensor:
            first.last = out


class KeepsInputsInner(Outer):
    """add: the result keeps the operand's inner tensor (the graph input's, on the first add)."""

    @staticmethod
    def RULE(func, first, out):
        if func is aten.add.Tensor:
            out.src = first.elem


class SharesInner(Outer):
    """clone: a new wrapper around the operand's own inner tensor (copy on write)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.clone.default:
            return cls(args[0].elem)
        return super().__torch_dispatch__(func, types, args, kwargs)


def clone_ops(x):
    y = x.clone()
    z = (x + 1).clone()
    return y, z


class Toggles(Outer):
    """add: ``cache`` flips between ``elem`` and a rounded copy (flattened both)."""

    def __init__(self, *args, **kwargs):
        self.cache = self.elem

    def inner_names(self):
        return ["elem", "cache"]

    @staticmethod
    def RULE(func, first, out):
        if func is aten.add.Tensor:
            first.cache = first.elem.to(torch.bfloat16).float() if first.cache is first.elem else first.elem


def make(cls, inner="subclass"):
    def inputs():
        elem = torch.arange(4.0).reshape(2, 2) + 1
        return [cls(Inner(elem) if inner == "subclass" else elem)]

    return inputs


def two_ops(x):
    y = x + 1
    z = y * 2
    return y, z


def toggle_twice(x):
    y = x + x
    a = y + x  # y.cache: a copy
    b = y + x  # y.cache: y.elem again
    return y, a, b


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("cls", [PeerOfResult, KeepsOwnInner, KeepsResult, KeepsInputsInner], ids=lambda c: c.__name__)
@pytest.mark.parametrize("inner", ["subclass", "plain"])
def test_an_intermediate_holding_a_tensor_another_place_holds(cls, backend, fullgraph, inner):
    out = differential(two_ops, make(cls, inner), backend=backend, fullgraph=fullgraph, calls=2)
    assert out.frames == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_output_around_an_inner_tensor_of_an_input(backend):
    out = differential(clone_ops, make(SharesInner), backend=backend, calls=2)
    assert out.frames == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_flattened_cache_set_back_to_elem(backend):
    out = differential(toggle_twice, make(Toggles), backend=backend, calls=2, fresh_inputs_each_call=True)
    assert out.frames == 1
    # the same inputs again: the input's cache is a copy at call 2 (a new graph), elem again at 3
    out = differential(toggle_twice, make(Toggles), backend=backend, calls=3)
    assert out.frames == 2


def test_the_check_sees_two_objects_where_eager_has_one():
    """The identity check itself: a rebuilt copy in one place is a difference."""
    xs = make(KeepsOwnInner)()
    y, z = two_ops(*xs)
    copy = dict(vars(z))
    z2 = KeepsOwnInner(Inner(z.elem.elem.clone()))
    z2.__dict__.update(copy, src=Inner(z.src.elem.clone()))
    with pytest.raises(AssertionError, match="held in several places"):
        assert_same_identities({"in": xs, "out": (y, z)}, {"in": xs, "out": (y, z2)}, "call 0")


class AliasesOperandsInner(Outer):
    """Every op: the operand and the result both keep the operand's inner tensor (an outside
    tester's find: a graph input stands for ``x.elem`` in one AOTAutograd pass and is a copy
    of it in the other, and the passes planned the result's ``src`` differently)."""

    @staticmethod
    def RULE(func, first, out):
        first.last_in = first.elem
        out.src = first.elem


def double(x):
    return x * 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inner", ["subclass", "plain"])
def test_an_input_and_the_result_keeping_the_inputs_inner(backend, inner):
    out = differential(double, make(AliasesOperandsInner, inner), backend=backend, calls=2)
    assert out.frames == 1


@pytest.mark.parametrize(
    "cls", [PeerOfResult, KeepsOwnInner, KeepsResult, KeepsInputsInner, AliasesOperandsInner], ids=lambda c: c.__name__
)
def test_direct_aot_function_keeps_identities(cls):
    """Without Dynamo: the AOTAutograd layer alone sets each later place from the first."""
    from functorch.compile import aot_function, nop

    compiled = aot_function(two_ops, fw_compiler=nop)
    xe, xc = make(cls)(), make(cls)()
    e_out, c_out = two_ops(*xe), compiled(*xc)
    assert_same_identities({"in": xe, "out": e_out}, {"in": xc, "out": c_out}, "aot_function")


# ------------------------------------------------------------------ a kept result that requires grad


class KeepsMmResult(Outer):
    """mm: the operand keeps the result it returns (``first.last_out = out``), which autograd
    then gives a grad_fn: an input holding a tensor of the graph that requires grad."""

    @staticmethod
    def RULE(func, first, out):
        if func is aten.mm.default:
            first.last_out = out


def _mm_inputs():
    gen = torch.Generator().manual_seed(0)
    x = KeepsMmResult(Inner(torch.randn(3, 4, generator=gen)), requires_grad=True)
    w = KeepsMmResult(Inner(torch.randn(4, 2, generator=gen)), requires_grad=True)
    return x, w


def returns_product(x, w):
    return x @ w


def returns_loss(x, w):
    return (x @ w).sum()


def returns_two(x, w):
    y = x @ w
    return y, y * 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn", [returns_product, returns_loss, returns_two], ids=lambda f: f.__name__)
def test_a_kept_result_the_loss_does_not_use(fn, backend):
    """The graph returns the kept result for the residual write; the loss does not reach it,
    and autograd's plain zero for it is made a zero of the traced subclass (See Note [A
    subclass output no gradient reached]): stock raises "Expected a ... tangent"."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    for call in range(2):
        xe, we = _mm_inputs()
        xc, wc = _mm_inputs()
        e_out, c_out = fn(xe, we), compiled(xc, wc)
        e_first = e_out[0] if isinstance(e_out, tuple) else e_out
        c_first = c_out[0] if isinstance(c_out, tuple) else c_out
        e_first.sum().backward()
        c_first.sum().backward()
        for e, c in ((xe, xc), (we, wc)):
            torch.testing.assert_close(c.grad.elem.elem, e.grad.elem.elem)
            assert type(c.grad) is type(e.grad)
        assert_same_identities({"in": [xe, we], "out": e_out}, {"in": [xc, wc], "out": c_out}, f"call {call}")
        assert xc.last_out.requires_grad and xc.last_out.grad_fn is not None
        torch.testing.assert_close(xc.last_out.elem.elem, xe.last_out.elem.elem)
