"""Inference through a weight that requires grad (an ``nn.Parameter`` holding a float8- or
int8-style wrapper) under ``torch.no_grad()``: the view the weight's dispatch returns for
``t()`` is, as autograd records it in no-grad mode, a view of the weight that requires grad.
That is autograd's state, not state dispatch set by hand: it compiles under ``fullgraph=True``
as in stock (outside round 43: refused as ``inner_metadata_mutation``). State dispatch does set
by hand on its result is still refused. (A returned view gets a ``grad_fn`` on the AOT backends,
stock alike: torch's own difference, not compared.)"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten
BACKENDS = ["eager", "aot_eager"]


class Cast(torch.Tensor):
    """A weight kept in its own precision, counting the transposes dispatch makes of it."""

    BY_HAND = False

    @staticmethod
    def __new__(cls, data, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, strides=data.stride(), requires_grad=requires_grad)

    def __init__(self, data, requires_grad=False):
        self._data = data

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.t.default:
            w = args[0]
            w.transposes = w.__dict__.get("transposes", 0) + 1
            out = cls(w._data.t())
            if cls.BY_HAND:
                out._data.requires_grad_()
            return out
        if func is aten.detach.default:
            return cls(args[0]._data.detach())
        unwrap = lambda t: t._data  # noqa: E731
        return func(*tree_map_only(Cast, unwrap, args), **tree_map_only(Cast, unwrap, kwargs or {}))


class ByHand(Cast):
    BY_HAND = True


def linear(w, x):
    return torch.mm(x, w.t())


def keeps_the_view(w, x):
    wt = w.t()
    return torch.mm(x, wt), wt


def _run(f, cls, parameter):
    g = torch.Generator().manual_seed(0)
    data = torch.randn(4, 8, generator=g)
    w = torch.nn.Parameter(cls(data)) if parameter else cls(data, requires_grad=True)
    seen = []
    for n in (2, 3):
        with torch.no_grad():
            out = f(w, torch.randn(n, 8, generator=g))
        outs = out if isinstance(out, tuple) else (out,)
        seen.append(([o._data.tolist() if isinstance(o, Cast) else o.tolist() for o in outs],
                     [o.requires_grad for o in outs], w.__dict__.get("transposes")))
    return seen


@pytest.mark.parametrize("parameter", [True, False], ids=["parameter", "requires_grad"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("f", [linear, keeps_the_view], ids=lambda f: f.__name__)
def test_inference_through_a_weight_that_requires_grad(f, backend, parameter):
    torch._dynamo.reset()
    eager = _run(f, Cast, parameter)
    assert _run(torch.compile(f, backend=backend, fullgraph=True), Cast, parameter) == eager


@pytest.mark.parametrize("backend", BACKENDS)
def test_requires_grad_set_by_hand_is_still_refused(backend):
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="dynamo_ext: inner_metadata_mutation"):
        _run(torch.compile(linear, backend=backend, fullgraph=True), ByHand, True)
