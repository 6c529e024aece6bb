"""Autograd state dispatch reads on a tensor it is handed (outside round 47): a gradient, a
view's base, hooks, whether a gradient is retained, on an inner tensor or on the subclass
input itself. The trace stand-in holds none of it and no Dynamo guard covered it: the first
trace's answer was replayed after the caller set a gradient, rebound the inner tensor to a
view of a flat buffer or registered a hook. Each call now matches eager, or is refused with
nothing touched under ``fullgraph=True`` (eager under ``fullgraph=False``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map_only

BACKENDS = ["eager", "aot_eager"]


def _has_hooks(t):
    return bool(t._backward_hooks)


def _has_post_hooks(t):
    return bool(t._post_accumulate_grad_hooks)


READS = {
    "grad": lambda t: t.grad is not None,
    "base": lambda t: t._base is not None,
    "is_view": lambda t: t._is_view(),
    "hooks": _has_hooks,
    "post_hooks": _has_post_hooks,
    "retains_grad": lambda t: t.retains_grad,
}


class Observed(torch.Tensor):
    """A wrapper recording, at each op, a fact about its inner tensor (``ON = "inner"``) or
    about itself (``ON = "outer"``)."""

    READ = "grad"
    ON = "inner"

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, requires_grad=elem.requires_grad and elem.is_leaf)
        r.elem = elem
        r.obs = None
        return r

    def __init__(self, *args):
        pass

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        for a in args:
            if isinstance(a, Observed):
                a.obs = READS[cls.READ](a.elem if cls.ON == "inner" else a)
        args = tree_map_only(Observed, lambda t: t.elem, args)
        return func(*args, **(kwargs or {}))


def _class(read, on):
    return type(f"Observed_{read}_{on}", (Observed,), {"READ": read, "ON": on})


def _hook(g):
    return g


# (read, on, how the tensor starts, what the caller changes between the calls)
def _plain():
    return torch.randn(4)


def _leaf_rg():
    return torch.randn(4, requires_grad=True)


def _nonleaf():
    return torch.randn(4, requires_grad=True) * 2


def _set_grad(w):
    w.elem.grad = torch.ones(4)


def _clear_grad(w):
    w.elem.grad = None


def _to_view(w):
    w.elem = torch.randn(8)[:4]


def _to_plain(w):
    w.elem = torch.randn(4)


def _add_hook(w):
    w.elem.register_hook(_hook)


def _add_post_hook(w):
    w.elem.register_post_accumulate_grad_hook(lambda p: None)


def _retain(w):
    w.elem.retain_grad()


def _outer_hook(w):
    w.register_hook(_hook)


CASES = {
    "grad_set": ("grad", "inner", _plain, _set_grad),
    "grad_cleared": ("grad", "inner", lambda: _with_grad(_plain()), _clear_grad),
    "base_view": ("base", "inner", _plain, _to_view),
    "base_unviewed": ("base", "inner", lambda: torch.randn(8)[:4], _to_plain),
    "is_view": ("is_view", "inner", _plain, _to_view),
    "hooks": ("hooks", "inner", _leaf_rg, _add_hook),
    "post_hooks": ("post_hooks", "inner", _leaf_rg, _add_post_hook),
    "retains_grad": ("retains_grad", "inner", _nonleaf, _retain),
    "outer_hooks": ("hooks", "outer", _leaf_rg, _outer_hook),
}


def _with_grad(t):
    t.grad = torch.ones(4)
    return t


def fn(w, x):
    return w * x


def _run(f, case, change):
    read, on, start, changer = CASES[case]
    torch.manual_seed(0)
    w, x = _class(read, on)(start()), torch.randn(4)
    seen = []
    for i in range(3):
        if i == 1 and change:
            changer(w)
        try:
            out = f(w, x)
        except torch._dynamo.exc.Unsupported as e:
            assert "dynamo_ext: unsupported_state_read" in str(e), e
            seen.append(("refused", w.__dict__["obs"]))
            continue
        seen.append((out.detach().tolist(), w.__dict__["obs"]))
    return seen


@pytest.mark.parametrize("change", [True, False], ids=["changed", "unchanged"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_autograd_state_dispatch_reads(case, backend, fullgraph, change):
    torch._dynamo.reset()
    # one class per case and run: eager's and the compiled run's
    eager = _run(fn, case, change)
    compiled = _run(torch.compile(fn, backend=backend, fullgraph=fullgraph), case, change)
    if not fullgraph:
        assert compiled == eager
        return
    # each call eager's, or refused with the attribute as the call before left it
    before = None
    for c, e in zip(compiled, eager):
        assert c == e or c == ("refused", before), (compiled, eager)
        before = c[1]
    if CASES[case][2] in (_plain, _leaf_rg, _nonleaf):
        # nothing to refuse before the caller's change
        assert compiled[0] == eager[0]
        if not change:
            assert compiled == eager
