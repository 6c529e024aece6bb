"""Dispatch changes a tensor an attribute holds in place (``self.n.add_(1)``, a float8 weight's
``hist[0] = amax``), and the compiled function computes with that tensor after the op
(``x.n + 0``, the module buffer that is also the weight's history). Dynamo made the tensor a
graph input of its own, which the AOT backends read before the op changed it: the value from
before the op, silently (an outside tester's find; the state after the call was right). Such an
op is refused (``unsupported_state_read``) with nothing touched, and under ``fullgraph=False``
the graph breaks there and the rest runs eagerly. Programs that only return the tensor, read it
before the op, or compute with a tensor dispatch made itself are not refused."""

from __future__ import annotations

import pytest
import torch

from dynamo_ext.testing import WrapperTensor
from harness import assert_same_state, leaked_fakes

aten = torch.ops.aten


class Counted(WrapperTensor):
    """Counts its ops in a 0-d inner tensor, in place."""

    INNER = ("elem", "n")
    WRAP_OUTPUTS = False

    @classmethod
    def on_op(cls, func, first):
        first.n.add_(1)


class History(WrapperTensor):
    """A float8-style weight: each op shifts its amax history and records the new amax at the
    front, in place on the history tensor (the module's buffer)."""

    INNER = ("elem", "hist")
    WRAP_OUTPUTS = False

    @classmethod
    def on_op(cls, func, first):
        first.hist.copy_(torch.roll(first.hist, 1))
        first.hist[0] = first.elem.abs().amax()


class Doubles(WrapperTensor):
    """Changes the op's result in place inside dispatch (a tensor it made, not one it holds)."""

    INNER = ("elem", "n")
    WRAP_OUTPUTS = False

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is aten.mul.Tensor:
            out.mul_(2)
        return out


class Cache(WrapperTensor):
    """Makes a cache at its first op and changes it in place at each later one (an attribute
    outside the flatten list)."""

    WRAP_OUTPUTS = False

    @classmethod
    def on_op(cls, func, first):
        cache = first.__dict__.get("cache")
        if cache is None:
            first.cache = first.elem * 0
        else:
            cache.add_(1)


def cache_read(x, w):
    z = (x * w) * w
    return z, w.cache + 0


def read_after(x, w):
    y = x * w
    return y, w.n + 0


def held_before(x, w):
    n = w.n
    y = x * w
    return y, n * 1


def view_after(x, w):
    y = x * w
    return y, w.n.view(1) * 2


def between_two_ops(x, w):
    y = x * w
    k = w.n * 10
    return y * w + k


def returned(x, w):
    y = x * w
    return y, w.n


def read_before_only(x, w):
    b = w.n + 0
    y = x * w
    return y, b


def two_ops(x, w):
    y = x * w
    return (y * w).sum(), w.n


def result_changed(x, w):
    y = x * w
    return y + 1


class Scaled(torch.nn.Module):
    """The history is the module's buffer and the weight's inner tensor at once."""

    def __init__(self):
        super().__init__()
        self.register_buffer("hist", torch.zeros(4))
        self.w = History(torch.arange(1.0, 4.0), hist=self.hist)

    def forward(self, x):
        y = x * self.w
        return y * self.hist.sum()


REFUSED = [read_after, held_before, view_after, between_two_ops]
KEPT = [returned, read_before_only, two_ops]


def _counted():
    return torch.ones(3), Counted(torch.arange(1.0, 4.0), n=torch.zeros((), dtype=torch.int64))


def _run(fn, calls, inputs):
    outs = []
    for _ in range(calls):
        out = fn(*inputs)
        outs.append([o.clone() for o in out] if isinstance(out, tuple) else [out.clone()])
    return outs


def _eager_then_compiled(fn, backend, fullgraph):
    """Three eager calls on one input; an equal input and the compiled function for the other."""
    x_e, w_e = _counted()
    eager = _run(fn, 3, (x_e, w_e))
    x_c, w_c = _counted()
    torch._dynamo.reset()
    return eager, w_e, x_c, w_c, torch.compile(fn, backend=backend, fullgraph=fullgraph)


def _assert_outs(compiled, eager):
    assert len(compiled) == len(eager)
    for c_call, e_call in zip(compiled, eager):
        for c, e in zip(c_call, e_call):
            torch.testing.assert_close(c, e)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fn", REFUSED, ids=lambda f: f.__name__)
def test_a_tensor_dispatch_changed_in_place_is_not_read_from_before_the_op(fn, backend, fullgraph):
    eager, w_e, x_c, w_c, compiled = _eager_then_compiled(fn, backend, fullgraph)
    if fullgraph:
        with pytest.raises(torch._dynamo.exc.Unsupported, match="dynamo_ext: unsupported_state_read") as refused:
            compiled(x_c, w_c)
        assert "'n'" in str(refused.value) and "the compiled function" in str(refused.value)
        assert int(w_c.n) == 0, "a refusal changed the input"
        return
    _assert_outs(_run(compiled, 3, (x_c, w_c)), eager)
    assert_same_state(w_e, w_c, "input")
    assert int(w_c.n) == int(w_e.n) > 0


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fn", KEPT, ids=lambda f: f.__name__)
def test_a_tensor_dispatch_changed_in_place_returned_or_read_before_compiles_whole(fn, backend, fullgraph):
    eager, w_e, x_c, w_c, compiled = _eager_then_compiled(fn, backend, fullgraph)
    _assert_outs(_run(compiled, 3, (x_c, w_c)), eager)
    assert_same_state(w_e, w_c, "input")
    assert not leaked_fakes(w_c)
    if fn is returned:
        assert compiled(x_c, w_c)[1] is w_c.n, "the returned tensor is the input's own, as in eager"


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_result_dispatch_changed_in_place_is_not_refused(backend):
    make = lambda: (torch.ones(3), Doubles(torch.arange(1.0, 4.0), n=torch.zeros(())))  # noqa: E731
    x_e, w_e = make()
    x_c, w_c = make()
    torch._dynamo.reset()
    compiled = torch.compile(result_changed, backend=backend, fullgraph=True)
    for _ in range(2):
        torch.testing.assert_close(compiled(x_c, w_c), result_changed(x_e, w_e))


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_float8_history_that_is_also_a_buffer_is_read_as_in_eager_or_refused(backend, fullgraph):
    torch.manual_seed(0)
    m_e, m_c = Scaled(), Scaled()
    x = torch.randn(3)
    eager = [m_e(x).clone() for _ in range(3)]
    torch._dynamo.reset()
    compiled = torch.compile(m_c, backend=backend, fullgraph=fullgraph)
    if fullgraph:
        with pytest.raises(torch._dynamo.exc.Unsupported, match="dynamo_ext: unsupported_state_read"):
            compiled(x)
        assert not m_c.hist.any(), "a refusal changed the history"
        return
    for e in eager:
        torch.testing.assert_close(compiled(x), e)
    torch.testing.assert_close(m_c.hist, m_e.hist)
    assert m_c.w.hist is m_c.hist, "the weight's history is still the module's buffer"


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_cache_outside_the_flatten_list_changed_in_place_is_read_as_in_eager(backend):
    """The compiled function's tensor is the one the traced object holds (a graph input handed
    to it, or the tensor dispatch wrote): the AOT backends trace the change, nothing to refuse."""
    x_e, w_e = torch.ones(3), Cache(torch.arange(1.0, 4.0))
    x_c, w_c = torch.ones(3), Cache(torch.arange(1.0, 4.0))
    eager = _run(cache_read, 4, (x_e, w_e))
    torch._dynamo.reset()
    compiled = torch.compile(cache_read, backend=backend, fullgraph=True)
    _assert_outs(_run(compiled, 4, (x_c, w_c)), eager)
    assert_same_state(w_e, w_c, "input")
    assert not leaked_fakes(w_c)
