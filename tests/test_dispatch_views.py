"""A view dispatch makes and keeps (``self.dv = self.elem.detach()``, a transposed-weight cache
``self.t_cache = self.elem.t()``). Dispatch runs below autograd: eager's view has no ``_base``
and a version counter of its own. On the AOT backends the kept value came back as a view
AOTAutograd regenerated, sharing the inner tensor's counter (outside round 41): the
caller's in-place change through it moved the inner tensor's ``_version`` (a cache keyed on
it rebuilt) and failed a backward that saved the input."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten
BACKENDS = ["eager", "aot_eager"]

VIEWS = {
    "detach": lambda t: t.detach(),
    "t": lambda t: t.t(),
    "row": lambda t: t[0],
    "view": lambda t: t.view(-1),
    "data": lambda t: t.data,
    "alias": lambda t: t,
}


class Keeps(torch.Tensor):
    """Keeps a view of its inner tensor on every multiplication, and counts rebuilds of a
    cache keyed on the inner tensor's version."""

    VIEW = "detach"

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

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, Keeps) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func is aten.mul.Tensor and isinstance(args[0], Keeps):
            w = args[0]
            if w.__dict__.get("key") != w.elem._version:
                w.key = w.elem._version
                w.builds = w.__dict__.get("builds", 0) + 1
            w.kept = VIEWS[cls.VIEW](w.elem)
        return out


def fn(w, x):
    return (w * x).sum()


def _state(w):
    kept = w.kept
    return (kept._base is None, kept._version, w.elem._version, w.key, w.builds, kept.tolist(), w.elem.tolist(),
            kept.untyped_storage().data_ptr() == w.elem.untyped_storage().data_ptr(), kept is w.elem)


def _run(f, cls):
    w = cls(torch.arange(6.0).reshape(2, 3))
    seen = []
    for i in range(3):
        out = f(w, torch.ones(2, 3))
        seen.append((out.item(), _state(w)))
        with torch.no_grad():
            w.kept.mul_(2)  # the caller changes the kept view in place
        seen.append(_state(w))
    return seen


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_a_kept_view_counts_as_eager_counts(view, backend, fullgraph):
    cls = type(f"Keeps_{view}", (Keeps,), {"VIEW": view})
    torch._dynamo.reset()
    eager = _run(fn, cls)
    compiled = _run(torch.compile(fn, backend=backend, fullgraph=fullgraph), cls)
    assert compiled == eager


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("view", ["detach", "t"])
def test_a_backward_after_the_kept_view_changed(view, backend):
    """The forward saved the input; the caller changes the kept view before ``backward()``:
    eager runs it (the view's counter is its own)."""
    cls = type(f"Keeps_{view}", (Keeps,), {"VIEW": view})

    def run(f):
        w, x = cls(torch.ones(2, 3)), torch.ones(2, 3, requires_grad=True)
        loss = f(w, x)
        with torch.no_grad():
            w.kept.mul_(2)
        loss.backward()
        return x.grad.tolist(), w.elem.tolist(), w.elem._version

    torch._dynamo.reset()
    eager = run(fn)
    assert run(torch.compile(fn, backend=backend, fullgraph=True)) == eager
