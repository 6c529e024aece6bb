"""Registered state objects dispatch makes anew for each output (per-output statistics, a
DTensor-like placement with its own mask buffer). Eager makes a new one every call; the
compiled outputs each hold their own too, with their own values, whatever the shapes
(outside round 42: under dynamic shapes every later output shared the first call's object
and statistics, and with static shapes the second call raised ``stale_plan`` at run time,
under ``fullgraph=False`` too)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._pytree import tree_map

import dynamo_ext

BACKENDS = ["eager", "aot_eager"]


@dynamo_ext.register_ctx_state
class Stats:
    def __init__(self):
        self.amax = None
        self.calls = 0


@dataclasses.dataclass(frozen=True)
class Spec:
    """A frozen ctx holding the state object, as DTensor's spec holds its placements."""

    stats: Stats
    tag: str = "rowwise"


class Scaled(torch.Tensor):
    """A float8-style tensor whose every op result carries fresh statistics; ``HOLD`` says
    how the ctx holds them."""

    HOLD = "direct"

    @staticmethod
    def __new__(cls, elem, ctx):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem, ctx):
        self.elem, self.ctx = elem, ctx

    def __tensor_flatten__(self):
        return ["elem"], self.ctx

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], ctx)

    @property
    def stats(self):
        return self.ctx if type(self).HOLD == "direct" else self.ctx.stats

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, Scaled) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() > 0:
            st = Stats()
            st.amax = out.abs().amax()
            st.calls = st.calls + 1
            return cls(out, st if cls.HOLD == "direct" else Spec(st))
        return out


class ScaledInSpec(Scaled):
    HOLD = "spec"


def fn(x, y):
    return x * y


def _run(f, cls, lengths):
    x = cls(torch.randn(8, generator=torch.Generator().manual_seed(9)), Stats() if cls.HOLD == "direct" else Spec(Stats()))
    outs = []
    for i, n in enumerate(lengths):
        outs.append(f(x, torch.randn(n, 1, generator=torch.Generator().manual_seed(i))))
    seen = [(o.elem.tolist(), o.stats.amax.item(), o.stats.calls, o.elem.abs().amax().item()) for o in outs]
    distinct = len({id(o.stats) for o in outs})
    return seen, distinct


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [Scaled, ScaledInSpec], ids=["in_ctx", "in_frozen_spec"])
@pytest.mark.parametrize(
    "lengths,dynamic", [([3, 3, 3], False), ([3, 4, 5, 6], None), ([3, 4, 3, 4], True)], ids=["static", "automatic", "dynamic"]
)
def test_each_output_gets_its_own_statistics(cls, backend, fullgraph, lengths, dynamic):
    torch._dynamo.reset()
    eager = _run(fn, cls, lengths)
    compiled = _run(torch.compile(fn, backend=backend, fullgraph=fullgraph, dynamic=dynamic), cls, lengths)
    assert compiled == eager
    assert compiled[1] == len(lengths)


@dynamo_ext.register_ctx_state
class Buffer:
    """A DTensor-like mask buffer: filled when a partial result is made, released when it
    is reduced."""

    def __init__(self):
        self.data = None
        self.refcount = 0

    def materialize(self, mask):
        if self.refcount == 0:
            self.data = mask
        self.refcount += 1

    def release(self):
        self.refcount -= 1
        if self.refcount == 0:
            self.data = None


class Partial(torch.Tensor):
    """An embedding lookup made partial: the out-of-range rows masked, the mask kept in a
    fresh buffer until the caller reduces the result."""

    @staticmethod
    def __new__(cls, elem, buf):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem, buf):
        self.elem, self.buf = elem, buf

    def __tensor_flatten__(self):
        return ["elem"], self.buf

    @classmethod
    def __tensor_unflatten__(cls, inner, buf, outer_size, outer_stride):
        return cls(inner["elem"], buf)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.embedding.default:
            weight, ids = args[0].elem, args[1]
            mask = (ids < 2) | (ids >= 6)
            buf = Buffer()
            buf.materialize(mask)
            return cls(func(weight, (ids - 2).clamp(0, 3)), buf)
        raise NotImplementedError(func)

    def reduce(self):
        out = self.elem.masked_fill(self.buf.data.unsqueeze(-1), 0.0)
        self.buf.release()
        return out


class Sharded(torch.Tensor):
    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem):
        self.elem = elem

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    __torch_dispatch__ = Partial.__torch_dispatch__


def lookup(w, ids):
    return torch.nn.functional.embedding(ids, w)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dynamic", [None, True, False], ids=["automatic", "dynamic", "static"])
def test_pending_partials_each_hold_their_own_mask(backend, dynamic):
    """Several partial lookups pending at once, reduced later, in another order."""

    def run(f):
        w = Sharded(torch.arange(8.0).reshape(4, 2))
        g = torch.Generator().manual_seed(3)
        outs = [f(w, torch.randint(0, 8, (2, n), generator=g)) for n in (3, 4, 5, 3)]
        held = [(o.buf.refcount, o.buf.data.tolist()) for o in outs]
        reduced = [o.reduce().tolist() for o in reversed(outs)]
        return held, reduced, [(o.buf.refcount, o.buf.data) for o in outs], len({id(o.buf) for o in outs})

    torch._dynamo.reset()
    eager = run(lookup)
    compiled = run(torch.compile(lookup, backend=backend, fullgraph=True, dynamic=dynamic))
    assert compiled == eager
