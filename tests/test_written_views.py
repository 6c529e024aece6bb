"""Tensors dispatch changes in place, seen from elsewhere (outside testers' finds):

- a view of such a tensor written as an attribute (``self.recent = self.hist[:2]`` and the
  history rolled in place, before or after the write, in the same graph): eager's attribute
  follows every later change of the tensor; the AOT backends handed back a copy with the
  call's values, silently;
- one tensor two inputs hold (a scale shared by two weights), changed in place through one:
  stock loses the change silently, AOTAutograd with dynamo_ext failed on its own graph check,
  under ``fullgraph=False`` too.

Both are refused with nothing touched; under ``fullgraph=False`` the frame runs eagerly and
ends as eager. A written view of a tensor nothing changes in place stays a view, compiled."""

from __future__ import annotations

import pytest
import torch

from dynamo_ext.testing import WrapperTensor
from harness import assert_same_state

aten = torch.ops.aten

VIEWS = {
    "slice": lambda t: t[:2],
    "row": lambda t: t[0],
    "detach": lambda t: t.detach(),
    "reshape": lambda t: t.reshape(-1),
    "view": lambda t: t.view(t.shape),
}
ORDERS = ["change_then_write", "write_then_change", "same_op", "program_mul_"]


class History(WrapperTensor):
    """A float8-style weight: dispatch rolls its amax history in place and keeps a view of it."""

    WRAP_OUTPUTS = False
    INNER = ("elem", "hist")
    VIEW = "slice"
    ORDER = "change_then_write"

    @classmethod
    def _roll(cls, w):
        w.hist.copy_(torch.roll(w.hist, 1))
        w.hist[0] = w.elem.abs().max()

    @classmethod
    def _keep(cls, w):
        w.recent = VIEWS[cls.VIEW](w.hist)

    @classmethod
    def on_op(cls, func, first):
        order = cls.ORDER
        if func is aten.mul_.Tensor or func is aten.mul_.Scalar:
            cls._roll(first)
        elif func is aten.mul.Tensor:
            if order == "change_then_write":
                cls._roll(first)
            elif order == "write_then_change":
                cls._keep(first)
            elif order == "same_op":
                cls._roll(first)
                cls._keep(first)
        elif func is aten.add.Tensor:
            if order in ("change_then_write", "program_mul_"):
                cls._keep(first)
            elif order == "write_then_change":
                cls._roll(first)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul_.Tensor or func is aten.mul_.Scalar:
            kwargs = kwargs or {}
            cls.before_op(func, args, kwargs)
            func(args[0].elem, *args[1:], **kwargs)
            return args[0]
        return super().__torch_dispatch__(func, types, args, kwargs)


def _history(cls):
    w = cls(torch.arange(4.0) - 1.5)
    w.hist = torch.zeros(4)
    return w


def step(w, x):
    if type(w).ORDER == "program_mul_":
        w.mul_(0.5)
    else:
        x = w * x
    return w + x


def _after(w, x, f):
    with torch.no_grad():
        out = f(w, x)
        kept = w.recent.clone()
        w.hist.add_(10)  # an eager change later: the view follows it
    return out, kept, w.recent.clone(), w.recent.untyped_storage()._cdata == w.hist.untyped_storage()._cdata


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_a_written_view_of_a_tensor_dispatch_changes_in_place(view, order, backend, fullgraph):
    cls = type(f"History_{view}_{order}", (History,), {"VIEW": view, "ORDER": order})
    we, wc = _history(cls), _history(cls)
    eager = _after(we, torch.ones(4), step)
    assert eager[3], "in eager the attribute is a view of the history"
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=fullgraph)
    if fullgraph:
        untouched = _history(cls)
        with pytest.raises(torch._dynamo.exc.Unsupported, match="dynamo_ext: opaque_value"):
            with torch.no_grad():
                compiled(wc, torch.ones(4))
        assert_same_state(untouched, wc, "refused input")
        return
    got = _after(wc, torch.ones(4), compiled)
    for e, c in zip(eager, got):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(c, e)
        else:
            assert c == e
    assert_same_state(we, wc)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_a_written_view_of_a_tensor_nothing_changes_stays_a_view(view, backend):
    class Keeping(WrapperTensor):
        WRAP_OUTPUTS = False
        INNER = ("elem", "hist")

        @classmethod
        def on_op(cls, func, first):
            first.recent = VIEWS[view](first.hist)

    we, wc = Keeping(torch.ones(4)), Keeping(torch.ones(4))
    we.hist, wc.hist = torch.arange(4.0), torch.arange(4.0)
    torch._dynamo.reset()
    compiled = torch.compile(lambda w, x: w * x, backend=backend, fullgraph=True)
    e, c = _after(we, torch.ones(4), lambda w, x: w * x), _after(wc, torch.ones(4), compiled)
    for ev, cv in zip(e[:3], c[:3]):
        torch.testing.assert_close(cv, ev)
    assert c[3] and e[3], "the written attribute stays a view of the history"
    assert_same_state(we, wc)


class Scaled(WrapperTensor):
    """Weights of one model sharing a scale: dispatch of ``t`` raises it to the weight's amax in place."""

    WRAP_OUTPUTS = False
    INNER = ("elem", "scale")

    @classmethod
    def on_op(cls, func, first):
        if func is aten.t.default:
            first.scale.copy_(torch.maximum(first.scale, first.elem.abs().max()))
            first.calls = first.__dict__.get("calls", 0) + 1

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.t.default:
            cls.before_op(func, args, kwargs or {})
            w = args[0]
            return (w.elem / w.scale).t()
        return super().__torch_dispatch__(func, types, args, kwargs)


def _weights(shared):
    torch.manual_seed(0)
    s = torch.zeros(())
    w1, w2 = Scaled(torch.randn(4, 4)), Scaled(torch.randn(2, 4) * 3)
    w1.scale, w2.scale = s, (s if shared else torch.zeros(()))
    return w1, w2


def mlp(x, w1, w2):
    return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1)), w2)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "own"])
def test_a_tensor_two_inputs_hold_changed_in_place_by_dispatch(shared, backend, fullgraph):
    e1, e2 = _weights(shared)
    c1, c2 = _weights(shared)
    torch._dynamo.reset()
    compiled = torch.compile(mlp, backend=backend, fullgraph=fullgraph)
    x = torch.randn(3, 4)
    if fullgraph and shared:
        u1, u2 = _weights(shared)
        with pytest.raises(torch._dynamo.exc.Unsupported, match="dynamo_ext: unsupported_state_read"):
            with torch.no_grad():
                compiled(x, c1, c2)
        assert_same_state(u1, c1, "refused input")
        assert_same_state(u2, c2, "refused input")
        assert c1.scale is c2.scale
        return
    with torch.no_grad():
        for i in range(2):
            torch.testing.assert_close(compiled(x + i, c1, c2), mlp(x + i, e1, e2))
    assert_same_state(e1, c1)
    assert_same_state(e2, c2)
    assert (c1.scale is c2.scale) == shared


def test_one_weight_handed_twice_compiles():
    w = _weights(False)[0]
    we = _weights(False)[0]
    torch._dynamo.reset()
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, w, w), mlp(x, we, we))
    assert_same_state(we, w)


class TwoViews(WrapperTensor):
    """One input whose flatten list holds two tensors on one storage (``hist = elem[:]``):
    dispatch bumps ``hist`` in place and the next op reads ``elem``. AOTAutograd took each as an
    input of its own: the outputs stayed a step behind eager, silently (an outside tester's
    find). Refused; the same tensor under both names compiles."""

    WRAP_OUTPUTS = False
    INNER = ("elem", "hist")

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.hist.add_(1)


def two_views(x, y):
    return x * y + (x + 0)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("same", [False, True], ids=["view", "same_tensor"])
def test_two_inner_tensors_of_one_input_on_one_storage(same, backend, fullgraph):
    def make():
        b = torch.zeros(3)
        w = TwoViews(b)
        w.hist = b if same else b[:]
        return w

    def run(f, w):
        with torch.no_grad():
            outs = [f(w, torch.ones(3)).tolist() for _ in range(3)]
        return outs, w.elem.tolist(), w.hist.tolist()

    eager = run(two_views, make())
    torch._dynamo.reset()
    compiled = torch.compile(two_views, backend=backend, fullgraph=fullgraph)
    w = make()
    if fullgraph and not same:
        untouched = make()
        with pytest.raises(torch._dynamo.exc.Unsupported, match="dynamo_ext: unsupported_state_read"):
            with torch.no_grad():
                compiled(w, torch.ones(3))
        assert_same_state(untouched, w, "refused input")
        return
    assert run(compiled, w) == eager
