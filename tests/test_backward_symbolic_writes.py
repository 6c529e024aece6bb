"""The backward writes a value that is symbolic in the compile: an int read from a counter the
forward bumps, once Dynamo made that counter a dynamic int (See Note [A backward write of a
symbolic value] in aot_layer.py).

A float8-style weight keeps a step the forward bumps and records, in the backward, the step
the gradient belongs to. The first compile (step a constant) replayed it; the second (step
dynamic after it changed) was refused (``write_in_backward``) at the second call, where eager
runs (an outside tester's find). Each case runs eager and compiled on equal, separate inputs
over several calls and compares gradients and every attribute of the weight.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten


class StepWeight(torch.Tensor):
    """A weight whose forward ``mm`` bumps ``step`` and whose backward ``t`` (the gradient of
    the activation: ``grad @ w.t()``) records what ``record`` makes of the step."""

    record = staticmethod(lambda step: step)

    @staticmethod
    def __new__(cls, elem, requires_grad=True):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, requires_grad=requires_grad)

    def __init__(self, elem, requires_grad=True):
        self.elem = elem
        self.step = 0
        self.last_bwd = -1

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], requires_grad=False)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mm.default and isinstance(args[1], StepWeight):
            args[1].step += 1
        if func is aten.t.default and isinstance(args[0], StepWeight) and not torch.is_grad_enabled():
            args[0].last_bwd = cls.record(args[0].step)
        a, k = tree_map_only(StepWeight, lambda t: t.elem, (args, kwargs))
        return func(*a, **k)


class AsTuple(StepWeight):
    record = staticmethod(lambda step: (step, step * 2, "bwd"))


class AsHalf(StepWeight):
    record = staticmethod(lambda step: step / 2)


def _f(x, w):
    return torch.mm(x, w).sum()


def _state(w):
    return {k: v for k, v in vars(w).items() if not isinstance(v, torch.Tensor)}


def _run(fn, cls, calls, inputs=None):
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    w = cls(torch.randn(3, 2))
    seen = []
    for _ in range(calls):
        loss = fn(x, w)
        wanted = {"x": [x], "w": [w]}.get(inputs)
        loss.backward(inputs=wanted)
        seen.append((_state(w), None if x.grad is None else x.grad.clone(), None if w.grad is None else w.grad.clone()))
        x.grad = w.grad = None
    return seen


def _same(eager, compiled):
    for (es, ex, ew), (cs, cx, cw) in zip(eager, compiled, strict=True):
        assert cs == es
        for e, c in ((ex, cx), (ew, cw)):
            assert (e is None) == (c is None)
            if e is not None:
                torch.testing.assert_close(c, e, rtol=0, atol=0)
        for v in cs.values():
            for leaf in v if isinstance(v, tuple) else (v,):
                assert not isinstance(leaf, (torch.SymInt, torch.SymFloat))


@pytest.mark.parametrize("cls", [StepWeight, AsTuple, AsHalf], ids=["int", "tuple", "float"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_the_backward_records_a_step_the_forward_bumps(backend, cls):
    """Four training steps, ``fullgraph=True``: the step the backward records is eager's at
    every call, past the recompile that made the step dynamic (refused before)."""
    torch._dynamo.reset()
    eager = _run(_f, cls, 4)
    counter = CompileCounterWithBackend(backend)
    compiled = _run(torch.compile(_f, backend=counter, fullgraph=True), cls, 4)
    _same(eager, compiled)
    assert eager[-1][0]["last_bwd"] == cls.record(4)
    assert counter.frame_count == 2  # the step a constant, then a dynamic int


@pytest.mark.parametrize("inputs", ["x", "w"])
def test_a_backward_for_part_of_the_graph(inputs):
    """``backward(inputs=[x])`` runs ``grad @ w.t()`` (its ``t`` records the step);
    ``backward(inputs=[w])`` does not, and the step recorded stays as it was."""
    torch._dynamo.reset()
    eager = _run(_f, StepWeight, 3, inputs)
    compiled = _run(torch.compile(_f, backend="aot_eager", fullgraph=True), StepWeight, 3, inputs)
    _same(eager, compiled)
    assert eager[-1][0]["last_bwd"] == (3 if inputs == "x" else -1)


def test_a_step_the_user_sets_between_calls():
    """The user rewinds the step between calls (a checkpoint reload): the backward records
    the step the forward left in each call, as eager."""
    torch._dynamo.reset()

    def run(fn):
        torch.manual_seed(0)
        x = torch.randn(4, 3, requires_grad=True)
        w = StepWeight(torch.randn(3, 2))
        seen = []
        for step in (0, 5, 2, 9):
            w.step = step
            fn(x, w).backward()
            seen.append(_state(w))
        return seen

    eager = run(_f)
    compiled = run(torch.compile(_f, backend="aot_eager", fullgraph=True))
    assert compiled == eager
    assert [s["last_bwd"] for s in eager] == [1, 6, 3, 10]
