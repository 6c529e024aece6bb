"""Version counters dispatch reads of tensors that are not themselves the subclass's inputs
(outside round 40): a view of an input the compiled function made, a tensor the subclass holds
outside its flatten list or in a registered state object, a result kept from an earlier call,
an inner tensor read in the backward. Each matches eager call after call, with the caller
changing the tensor in place between calls, or is refused with nothing touched (eager under
``fullgraph=False``). A backward counting through ``self.__dict__`` after the forward added
an attribute runs (it was refused with nothing changed)."""

from __future__ import annotations

import pytest
import torch

import dynamo_ext

BACKENDS = ["eager", "aot_eager"]


class _Wrapper(torch.Tensor):
    """A wrapper of one plain tensor, ``elem``."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)
        r.elem = elem
        return r

    def __init__(self, *args):
        pass

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])


class Masked(_Wrapper):
    """An embedding-like weight caching a processed mask keyed on the mask tensor's version
    (a DTensor-style vocab mask, refilled in place each step)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w, m = args[0], args[1]
        if getattr(w, "key", None) != m._version:
            w.mask = (m > 1.5).float()
            w.key = m._version
            w.builds = getattr(w, "builds", 0) + 1
        return func(w.elem, w.mask)


def first_row(w, s):
    return w * s[0]


def sliced(w, s):
    return w * s[:, :4][1]


def detached(w, s):
    return w * s.detach()[0]


def _run_views(fn):
    w, s = Masked(torch.arange(1.0, 5.0)), torch.ones(2, 4)
    seen = []
    for _ in range(4):
        try:
            out = fn(w, s)
        except torch._dynamo.exc.Unsupported as e:
            assert "dynamo_ext: unsupported_state_read" in str(e), e
            seen.append(("refused", dict(vars(w))))
            break
        seen.append((out.tolist(), w.key, w.builds, s._version))
        with torch.no_grad():
            s.add_(1.0)
    return seen


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn", [first_row, sliced, detached], ids=lambda f: f.__name__)
def test_the_version_of_a_view_of_an_input_the_function_made(fn, backend, fullgraph):
    """The view shares the input's counter in eager; its fake counted from 0, and the mask was
    never rebuilt on aot_eager (the outputs stale). Refused; eager under ``fullgraph=False``."""
    torch._dynamo.reset()
    eager = _run_views(fn)
    compiled = _run_views(torch.compile(fn, backend=backend, fullgraph=fullgraph))
    if fullgraph:
        assert compiled == [("refused", {"elem": compiled[0][1]["elem"]})]
    else:
        assert compiled == eager


@dynamo_ext.register_ctx_state
class Placement:
    """A registered state object holding a buffer the training loop updates in place."""

    def __init__(self):
        self.buf = torch.ones(4)
        self.key = -1


class Buffered(torch.Tensor):
    """A weight caching ``2 * buffer`` keyed on the buffer's version; the buffer is held by the
    placement in its ctx (``HOLDER = "ctx"``) or as an attribute outside the flatten list."""

    HOLDER = "ctx"

    @staticmethod
    def __new__(cls, elem, placement):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)
        r.elem, r.placement = elem, placement
        return r

    def __init__(self, *args):
        pass

    def __tensor_flatten__(self):
        return ["elem"], self.placement

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w = args[0]
        holder, buf = (w.placement, w.placement.buf) if cls.HOLDER == "ctx" else (w, w.side)
        if holder.key != buf._version:
            holder.key = buf._version
            w.cache = buf * 2.0
        return func(w.elem, w.cache)


class BufferedOutside(Buffered):
    HOLDER = "attribute"


def _run_buffers(cls, fn):
    placement = Placement()
    w = cls(torch.arange(4.0), placement)
    w.side, w.key = torch.ones(4), -1
    holder, buf = (placement, placement.buf) if cls.HOLDER == "ctx" else (w, w.side)
    seen = []
    for _ in range(4):
        out = fn(w, torch.zeros(4))
        seen.append((out.tolist(), holder.key, w.cache.tolist()))
        with torch.no_grad():
            buf.add_(1.0)
    return seen


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [Buffered, BufferedOutside], ids=["ctx_state", "outside_flatten"])
def test_a_cache_keyed_on_a_buffer_the_subclass_holds(cls, backend, fullgraph):
    """The buffer is a graph input of its own: its read answered from the real one and guarded
    (it read 0 each call, the cache never rebuilt)."""

    def fn(w, x):
        return w + x

    torch._dynamo.reset()
    eager = _run_buffers(cls, fn)
    compiled = _run_buffers(cls, torch.compile(fn, backend=backend, fullgraph=fullgraph))
    assert compiled == eager


class KeepsResult(_Wrapper):
    """A cache refreshed from the result the compiled function kept on it (``w.last = out``,
    an activation or EMA cache), keyed on that result's version."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w = args[0]
        if "last" in w.__dict__:
            if w.__dict__.get("lkey") != w.last._version:
                w.lkey = w.last._version
                w.prev = w.last * 1.0
            return func(w.elem + w.prev, *args[1:])
        return func(w.elem, *args[1:])


def keeps_its_result(w, s):
    out = w + s
    w.last = out
    return out


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cache_keyed_on_a_kept_result_the_caller_changes(backend, fullgraph):
    """The caller scales the kept result in place after each call: the next call's read of its
    version was the trace's (0, or eager's 1 from the first call on), and the output used the
    stale cache on one backend and a twice-scaled one on the other."""

    def run(f):
        w, s = KeepsResult(torch.zeros(2)), torch.ones(2)
        seen = []
        for _ in range(4):
            out = f(w, s)
            prev = w.__dict__.get("prev")
            seen.append((out.tolist(), w.__dict__.get("lkey"), None if prev is None else prev.tolist()))
            with torch.no_grad():
                out.mul_(10.0)
        return seen

    torch._dynamo.reset()
    eager = run(keeps_its_result)
    compiled = run(torch.compile(keeps_its_result, backend=backend, fullgraph=fullgraph))
    assert compiled == eager


class BackwardKeyed(_Wrapper):
    """A weight whose backward op records its inner tensor's version and counts rebuilds."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mul.Tensor and isinstance(args[1], cls):  # the backward's grad * w
            w = args[1]
            if w.__dict__.get("bkey", -1) != w.elem._version:
                w.bkey = w.elem._version
                w.rebuilds = w.__dict__.get("rebuilds", 0) + 1
        elif func is torch.ops.aten.mul.Tensor:  # the forward's w * x
            w = args[0]
            w.forwards = w.__dict__.get("forwards", 0) + 1
        plain = [a.elem if isinstance(a, cls) else a for a in args]
        return func(*plain, **(kwargs or {}))


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_inner_version_the_backward_reads(backend, fullgraph):
    """Read in the traced backward, it answered None, which every backward replayed."""

    def fn(w, x):
        return (w * x).sum()

    def run(f):
        w = BackwardKeyed(torch.arange(1.0, 5.0))
        seen = []
        for _ in range(3):
            x = torch.ones(4, requires_grad=True)
            f(w, x).backward()
            seen.append((x.grad.tolist(), dict((k, v) for k, v in vars(w).items() if k != "elem")))
            with torch.no_grad():
                w.elem.add_(1.0)
        return seen

    torch._dynamo.reset()
    eager = run(fn)
    compiled = run(torch.compile(fn, backend=backend, fullgraph=fullgraph))
    assert compiled == eager


class CountsThroughItsDict(_Wrapper):
    """Forward and backward count through ``self.__dict__.get``."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mul.Tensor and isinstance(args[0], cls):
            args[0].forwards = args[0].__dict__.get("forwards", 0) + 1
        elif func is torch.ops.aten.mul.Tensor and isinstance(args[1], cls):
            args[1].backwards = args[1].__dict__.get("backwards", 0) + 1
        plain = [a.elem if isinstance(a, cls) else a for a in args]
        return func(*plain, **(kwargs or {}))


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backward_counting_through_the_instance_dict(backend, fullgraph):
    """The names the forward added are set by Dynamo's replay after the compiled forward
    returns: the backward's check of the names took them for a change before ``backward()``."""

    def fn(w, x):
        return (w * x).sum()

    def run(f):
        w = CountsThroughItsDict(torch.arange(1.0, 5.0))
        seen = []
        for _ in range(3):
            x = torch.ones(4, requires_grad=True)
            f(w, x).backward()
            seen.append((x.grad.tolist(), w.__dict__.get("forwards"), w.__dict__.get("backwards")))
        return seen

    torch._dynamo.reset()
    eager = run(fn)
    compiled = run(torch.compile(fn, backend=backend, fullgraph=fullgraph))
    assert compiled == eager


def test_a_deleted_forward_attribute_is_still_a_change_before_backward():
    """The names Dynamo replays are added to what the forward left, nothing more: an attribute
    the user deletes between the forward and ``backward()`` is still refused."""
    from dynamo_ext.errors import SubclassWriteError

    def fn(w, x):
        return (w * x).sum()

    torch._dynamo.reset()
    f = torch.compile(fn, backend="aot_eager", fullgraph=True)
    w = CountsThroughItsDict(torch.arange(1.0, 5.0))
    x = torch.ones(4, requires_grad=True)
    out = f(w, x)
    assert w.forwards == 1
    del w.forwards
    with pytest.raises(SubclassWriteError, match="changed_before_backward"):
        out.backward()
