"""A cache keyed on a version counter: the subclass's own (``self._version``, moved on by an
optimizer's in-place step between calls), or an inner tensor's after the compiled function
changed it in place. The compiled program replayed the version it saw while traced (outputs
and gradients wrong from the second call, where stock's were right: an outside tester's
find). Each is read from the real tensor, plus the in-place changes made so far in the call,
and guarded."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map


class KeyedOnItsVersion(torch.Tensor):
    """A weight whose dispatch rebuilds a rounded copy when its own version moved on."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)
        r.elem, r.key, r.rebuilds = elem, None, 0
        return r

    def __init__(self, *args):
        pass

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return KeyedOnItsVersion(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable:  # an optimizer's in-place step
            func(args[0].elem, *tree_map(lambda t: t.elem if isinstance(t, cls) else t, args[1:]), **kwargs)
            return args[0]
        w = next(a for a in args if isinstance(a, cls))
        if w.key != w._version:
            w.cache = w.elem.half().float()
            w.key = w._version
            w.rebuilds += 1
        return func(*tree_map(lambda t: t.cache if isinstance(t, cls) else t, args), **kwargs)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_cache_keyed_on_the_subclass_own_version(backend, fullgraph):
    def run(fn):
        torch.manual_seed(0)
        w = KeyedOnItsVersion(torch.randn(3, 3))
        seen = []
        for _ in range(3):
            out = fn(torch.ones(2, 3), w)
            seen.append((out.tolist(), w.key, w.rebuilds))
            with torch.no_grad():
                w.add_(1.0)
        return seen

    torch._dynamo.reset()
    eager = run(lambda x, w: x @ w)
    compiled = run(torch.compile(lambda x, w: x @ w, backend=backend, fullgraph=fullgraph))
    assert compiled == eager


class KeyedOnInnerVersions(torch.Tensor):
    """An int8 weight caching its dequantized copy, keyed on its inner tensors' versions."""

    @staticmethod
    def __new__(cls, q, s):
        r = torch.Tensor._make_wrapper_subclass(cls, q.shape, dtype=s.dtype)
        r.q, r.s, r.cache, r.key, r.misses = q, s, None, None, 0
        return r

    def __init__(self, *args):
        pass

    def __tensor_flatten__(self):
        return ["q", "s"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return KeyedOnInnerVersions(inner["q"], inner["s"])

    def dequantized(self):
        key = (self.q._version, self.s._version)
        if self.cache is None or self.key != key:
            self.cache = self.q.to(self.s.dtype) * self.s
            self.key = key
            self.misses += 1
        return self.cache

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        f = lambda t: t.dequantized() if isinstance(t, cls) else t  # noqa: E731
        return func(*tree_map(f, args), **tree_map(f, kwargs or {}))


def _int8():
    torch.manual_seed(0)
    w = torch.randn(3, 4)
    s = w.abs().amax(1, keepdim=True) / 127
    return KeyedOnInnerVersions(torch.round(w / s).to(torch.int8), s)


def rescaled_between_two_uses(x, w, factor):
    y1 = x @ w.t()
    w.s.mul_(factor)
    return y1, x @ w.t()


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_an_inner_version_read_after_the_function_changed_it_in_place(backend, fullgraph):
    """Read after an in-place change in the same function, never the stale key. The program
    changes ``w.s`` (a graph input of its own) in place before an op on ``w``: refused (See Note
    [An inner tensor the compiled function changes in place]), and under ``fullgraph=False`` the
    whole frame runs eagerly (a graph break there kept the change compiled, whose write-back
    bumped the version twice)."""

    def run(fn):
        w = _int8()
        try:
            y1, y2 = fn(torch.ones(2, 4), w, torch.tensor(2.0))
        except torch._dynamo.exc.Unsupported as e:
            assert "dynamo_ext: unsupported_state_read" in str(e), e
            assert (w.key, w.misses) == (None, 0)
            return "refused"
        return y1.tolist(), y2.tolist(), w.key, w.misses

    torch._dynamo.reset()
    eager = run(rescaled_between_two_uses)
    compiled = run(torch.compile(rescaled_between_two_uses, backend=backend, fullgraph=fullgraph))
    assert compiled == ("refused" if fullgraph else eager)


class NotesItsGradient(KeyedOnItsVersion):
    """A parameter whose dispatch notes whether it holds a gradient."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, requires_grad=True)
        r.elem = elem
        return r

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return NotesItsGradient(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in args:
            if isinstance(a, cls) and func is torch.ops.aten.mm.default:
                a.had_grad = a.grad is not None
        out = func(*tree_map(lambda t: t.elem if isinstance(t, cls) else t, args), **kwargs)
        return cls(out) if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) else out


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_dispatch_reading_whether_its_tensor_holds_a_gradient(backend, fullgraph):
    """``self.grad is not None`` in dispatch: the traced tensor has none; a real gradient is
    refused (it was replayed as traced, unguarded), its absence guarded."""

    def run(fn):
        torch.manual_seed(0)
        w = torch.nn.Parameter(NotesItsGradient(torch.randn(4, 4)))
        seen = []
        for step in range(3):
            if step == 2:
                w.grad = None
            try:
                out = fn(torch.ones(2, 4), w)
            except torch._dynamo.exc.Unsupported as e:
                assert "unsupported_state_read" in str(e), e
                seen.append(("refused", w.had_grad))
                continue
            if step == 0:
                out.backward()
            seen.append(w.had_grad)
        return seen

    torch._dynamo.reset()
    eager = run(lambda x, w: (x @ w).sum())
    compiled = run(torch.compile(lambda x, w: (x @ w).sum(), backend=backend, fullgraph=fullgraph))
    if fullgraph:
        assert compiled == [False, ("refused", False), False]
    else:
        assert compiled == eager == [False, True, False]


class ScaledBy(torch.Tensor):
    """A weight multiplied by a plain scale tensor its caller hands in; dispatch caches the
    scaled copy keyed on the scale's version counter and counts its ops."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)
        r.elem = elem
        return r

    def __init__(self, *args):
        pass

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return ScaledBy(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w = args[0]
        w.ops = getattr(w, "ops", 0) + 1
        if func is torch.ops.aten.mul.Tensor:
            scale = args[1]
            w.seen = scale._version
            if getattr(w, "key", None) != scale._version:
                w.scaled = w.elem * scale
                w.key = scale._version
                w.misses = getattr(w, "misses", 0) + 1
            return w.scaled.clone()
        return func(*tree_map(lambda t: t.elem if isinstance(t, cls) else t, args), **(kwargs or {}))


def _state(w, out):
    return out.tolist(), w.ops, w.seen, w.key, w.misses


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_cache_keyed_on_a_plain_argument_version(backend, fullgraph):
    """The caller changes the scale in place between some calls. Each pass answers the read from
    the real scale: AOTAutograd's passes read their functional tensor's own counter, 0, and on
    the call after a recompile the cache was replayed as missed with the key 0 (an outside
    tester's find, silent)."""

    def run(fn):
        w, scale = ScaledBy(torch.arange(3.0)), torch.ones(3)
        seen = []
        for step in range(5):
            seen.append(_state(w, fn(w, scale)))
            if step in (1, 2):
                with torch.no_grad():
                    scale.add_(1.0)
        return seen

    torch._dynamo.reset()
    eager = run(lambda w, s: w * s + 1)
    compiled = run(torch.compile(lambda w, s: w * s + 1, backend=backend, fullgraph=fullgraph))
    assert compiled == eager


def changes_the_scale_first(w, s):
    s.add_(1.0)
    return w * s


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_plain_argument_version_read_after_the_function_changed_it(backend, fullgraph):
    """Note [A plain argument's version counter]: read after the function's own ``s.add_(1)``,
    the counter counts it. It counted from when dispatch was first handed the scale, so the read
    was one behind eager's. Each call is handed a scale changed in place a different number of
    times before (equal in eager and compiled)."""

    def run(fn):
        w = ScaledBy(torch.arange(3.0))
        seen = []
        for before in (0, 0, 2, 1, 1):
            scale = torch.ones(3)
            for _ in range(before):
                scale.mul_(1.0)
            seen.append(_state(w, fn(w, scale)) + (scale.tolist(),))
        return seen

    torch._dynamo.reset()
    eager = run(changes_the_scale_first)
    compiled = run(torch.compile(changes_the_scale_first, backend=backend, fullgraph=fullgraph))
    assert compiled == eager


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
def test_the_same_scale_changed_by_the_function_every_call_on_the_eager_backend(fullgraph):
    """On ``backend="eager"`` the graph changes the real scale once per call, as eager does: the
    counter, what dispatch keeps from it and the cache match eager call after call. (AOTAutograd
    counts an input its graph changes twice per call; see the README's limits.)"""

    def run(fn):
        w, scale = ScaledBy(torch.arange(3.0)), torch.ones(3)
        seen = []
        for _ in range(4):
            seen.append(_state(w, fn(w, scale)) + (scale._version,))
        return seen

    torch._dynamo.reset()
    eager = run(changes_the_scale_first)
    compiled = run(torch.compile(changes_the_scale_first, backend="eager", fullgraph=fullgraph))
    assert compiled == eager


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_gradient_read_warns_only_where_eager_warns(backend, fullgraph):
    """The traced stand-in for a leaf parameter is no leaf: reading its ``.grad`` gave torch's
    non-leaf warning where eager's read of the parameter gives none."""
    import warnings

    def run(fn):
        torch.manual_seed(0)
        w = torch.nn.Parameter(NotesItsGradient(torch.randn(4, 4)))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fn(torch.ones(2, 4), w)
        return [str(m.message)[:60] for m in seen if "non-leaf" in str(m.message)]

    torch._dynamo.reset()
    assert run(lambda x, w: (x @ w).sum()) == []
    assert run(torch.compile(lambda x, w: (x @ w).sum(), backend=backend, fullgraph=fullgraph)) == []
