"""A result dispatch keeps on its input (``self.last = out``), read back by the next call.

The next call's dispatch reads the instance dict (``"keep" in self.__dict__``) or the kept
result by name, which makes it a graph input; the graph does not compute with it. Eager's
autograd never links to it, while AOTAutograd's compiled node took it as an edge: each call's
backward reached the previous call's graph, which its ``backward()`` had freed (an error eager
does not raise), or ran a retained one again, its hooks with it, and the kept results of every
earlier call stayed alive (an outside tester's finds; See Note [A tensor the graph takes in but
does not compute with] in plan.py). Each case runs eager and compiled on equal, separate inputs.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.utils._pytree as pytree

aten = torch.ops.aten

BACKENDS = ["eager", "aot_eager"]
TORCH_2_13 = torch.__version__.startswith("2.13.")


class _Wrapper(torch.Tensor):
    """A wrapper subclass of one inner tensor, no ctx."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, requires_grad=requires_grad)
        r.elem = elem
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])


class Keeps(_Wrapper):
    """Each ``mul`` keeps its result on its first argument when that holds ``keep``; with
    ``BY_NAME`` it also records the previous result's sum, read by name."""

    BY_NAME = False

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*pytree.tree_map_only(cls, lambda t: t.elem, args), **pytree.tree_map_only(cls, lambda t: t.elem, kwargs))
        out = pytree.tree_map_only(torch.Tensor, cls, out)
        s = args[0]
        if isinstance(s, cls) and func is aten.mul.Tensor and "keep" in s.__dict__:
            if cls.BY_NAME:
                prev = getattr(s, "last", None)
                s.calls = getattr(s, "calls", 0) + 1
                s.had_prev = prev is not None
            s.last = out
        return out


class KeepsByName(Keeps):
    BY_NAME = True


def _f(s, y):
    return (s * y).sum()


def _make(cls):
    s = cls(torch.tensor([1.0, 2.0, 3.0]), requires_grad=True)
    s.keep = True
    return s, torch.tensor([4.0, 5.0, 6.0], requires_grad=True)


def _plain(t):
    return t.elem if isinstance(t, Keeps) else t


@pytest.mark.parametrize("cls", [Keeps, KeepsByName], ids=["dict_read", "by_name"])
@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_training_loop_over_a_kept_result(backend, fullgraph, cls):
    """``out = fn(s, y); out.backward()`` four times: eager's gradients and state (the
    second ``backward()`` raised on the AOT backends before). torch 2.13 fails the second
    compile (the kept result changed the keys the graph is guarded on) of a frame whose
    input holds a subclass ``.grad``, stock alike (See Note [A recompile torch 2.13 fails on
    a subclass gradient] in dynamo_layer.py): under ``fullgraph=False`` the frame runs eagerly."""

    def run(fn):
        s, y = _make(cls)
        for _ in range(4):
            fn(s, y).backward()
        state = {k: v for k, v in vars(s).items() if not isinstance(v, torch.Tensor)}
        return _plain(s.grad), y.grad, _plain(s.last).detach(), type(s.last), state

    torch._dynamo.reset()
    eager = run(_f)
    if fullgraph and TORCH_2_13:
        with pytest.raises(Exception, match="SubclassSymbolicContext"):
            run(torch.compile(_f, backend=backend, fullgraph=fullgraph))
        return
    compiled = run(torch.compile(_f, backend=backend, fullgraph=fullgraph))
    for e, c in zip(eager, compiled):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(c, e, rtol=0, atol=0)
        else:
            assert c == e


@pytest.mark.parametrize("backend", BACKENDS)
def test_earlier_kept_results_are_freed(backend):
    """Without a backward, each call's kept result replaces the previous one, which is freed
    as in eager (the compiled node's edge, and its backward's hooks, kept every one alive)."""

    def run(fn):
        s, y = _make(Keeps)
        refs = []
        for _ in range(4):
            out = fn(s, y)
            refs.append(weakref.ref(s.last))
            del out
        gc.collect()
        return [r() is not None for r in refs]

    torch._dynamo.reset()
    assert run(_f) == [False, False, False, True]
    assert run(torch.compile(_f, backend=backend, fullgraph=True)) == [False, False, False, True]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_retained_earlier_graph_is_not_run_again(backend):
    """``backward(retain_graph=True)`` each call, a hook on each call's kept result: eager
    runs each hook in its own call's backward only. The compiled node's edge to the previous
    kept result ran the earlier graphs again, their hooks with them (six runs for three calls).
    (What the hook gets on the AOT backends is what stock gives a hook on a graph's output
    the loss reaches inside the graph: None, README limits.)"""

    def run(fn):
        s, y = _make(Keeps)
        fired = []
        for i in range(3):
            out = fn(s, y)
            s.last.register_hook(lambda g, i=i: fired.append(i))
            out.backward(retain_graph=True)
        return fired, _plain(s.last).detach()

    torch._dynamo.reset()
    eager = run(_f)
    # (torch 2.13 fails the recompile under fullgraph=True: see the training loop above)
    compiled = run(torch.compile(_f, backend=backend, fullgraph=TORCH_2_13 is False))
    assert eager[0] == [0, 1, 2]
    assert sorted(compiled[0]) == [0, 1, 2]
    torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=0)


class Counts(_Wrapper):
    """A weight counting the ops it is given (``calls``, where the caller set it)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        for a in args:
            if isinstance(a, cls) and "calls" in a.__dict__:
                a.calls = a.calls + 1
        out = func(*pytree.tree_map_only(cls, lambda t: t.elem, args), **pytree.tree_map_only(cls, lambda t: t.elem, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_training_steps_tensors_are_freed(backend):
    """A new weight and batch each step, forward and backward: once the caller drops them
    they are freed, as in eager. The compiled backward's hooks held its node, which held
    them, and the first call's weight and batch stayed alive until ``torch._dynamo.reset()``
    (one training step's tensors per compile; an outside tester's find)."""

    def fn(w, x):
        return (w * x).sin().sum()

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    refs = []
    for _ in range(3):
        w = Counts(torch.randn(4), requires_grad=True)
        w.calls = 0
        x = torch.randn(4)
        compiled(w, x).backward()
        assert w.calls == 1 and w.grad is not None
        refs.append((weakref.ref(w), weakref.ref(x)))
        del w, x
    gc.collect()
    assert [(a() is not None, b() is not None) for a, b in refs] == [(False, False)] * 3
