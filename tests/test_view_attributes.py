"""A tensor attribute outside the flatten list that is a view of an inner tensor
(``self.recent = self.hist[:1]``, ``self.row0 = self.elem[0]``), and the compiled function
changing an inner tensor in place itself (``w.elem.mul_(2)``). Made graph inputs of their own,
such tensors were ones AOTAutograd did not know alias the subclass's inner tensor: a change on
one side was not seen through the other (a NaN output, a stat from before ``w.mul_(s)``, an
amax history read stale), or AOTAutograd failed on aliased inputs that are mutated, under
``fullgraph=False`` too (an outside tester's finds). The view is taken in the graph from the
inner tensor; the program's own in-place change of an inner tensor, followed by an op on the
subclass, is refused, and runs eagerly under ``fullgraph=False``."""

from __future__ import annotations

import pytest
import torch

from harness import leaked_fakes

aten = torch.ops.aten


class Viewed(torch.Tensor):
    """Keeps ``recent``, a view of its amax history, and ``row0``, a view of its data."""

    MODE = "history"

    @staticmethod
    def __new__(cls, elem, hist=None):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device, strides=elem.stride())
        r.elem = elem
        r.hist = hist if hist is not None else torch.ones(3)
        r.recent = r.hist[:1]
        r.row0 = elem[0]
        return r

    def __tensor_flatten__(self):
        return ["elem", "hist"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["elem"], inner["hist"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = next(a for a in args if isinstance(a, Viewed))
        if cls.MODE == "history" and func is aten.mm.default:
            w.hist[0] = w.elem.abs().amax()  # the inner tensor in place, read through the view
            scaled = w.elem / w.recent
        elif cls.MODE == "through_view" and func is aten.mm.default:
            w.recent.fill_(w.elem.abs().amax())  # in place through the view, read off the inner
            scaled = w.elem * w.hist.max()
        else:
            scaled = w.elem
        out = func(*[scaled if a is w else a for a in args], **kwargs)
        if func is aten.mul_.Tensor:
            w.row0_sum = w.row0.sum()  # the view, after the op changed the inner tensor
            return w
        return out


class ThroughView(Viewed):
    MODE = "through_view"


def matmul(x, w):
    return torch.mm(x, w)


def scale_in_place(w, s):
    w.mul_(s)
    return w.row0_sum * 1


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("cls", [Viewed, ThroughView], ids=["read_through_view", "write_through_view"])
def test_a_view_attribute_sees_the_inner_tensor_changed_in_place(cls, backend, fullgraph):
    torch.manual_seed(0)
    x, base = torch.randn(2, 4), torch.randn(4, 3)
    w_e, w_c = cls(base.clone()), cls(base.clone())
    torch._dynamo.reset()
    compiled = torch.compile(matmul, backend=backend, fullgraph=fullgraph)
    for _ in range(3):
        expected = matmul(x, w_e)
        torch.testing.assert_close(compiled(x, w_c), expected)
        torch.testing.assert_close(w_c.hist, w_e.hist)
    assert w_c.recent.untyped_storage()._cdata == w_c.hist.untyped_storage()._cdata, "still a view of hist"
    assert not leaked_fakes(w_c)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_view_attribute_read_after_an_in_place_op_on_the_subclass(backend, fullgraph):
    base, s = torch.randn(3, 2), torch.tensor(2.0)
    w_e, w_c = Viewed(base.clone()), Viewed(base.clone())
    torch._dynamo.reset()
    compiled = torch.compile(scale_in_place, backend=backend, fullgraph=fullgraph)
    for _ in range(3):
        torch.testing.assert_close(compiled(w_c, s), scale_in_place(w_e, s))
        torch.testing.assert_close(w_c.row0_sum, w_e.row0_sum)
        torch.testing.assert_close(w_c.elem, w_e.elem)


def change_inner_then_op(w, y):
    w.elem.mul_(2)
    return w * y


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_the_program_changing_an_inner_tensor_then_an_op_on_the_subclass(backend, fullgraph):
    torch.manual_seed(0)
    base, y = torch.randn(3, 4), torch.randn(3, 4)
    w_e, w_c = Viewed(base.clone()), Viewed(base.clone())
    torch._dynamo.reset()
    compiled = torch.compile(change_inner_then_op, backend=backend, fullgraph=fullgraph)
    if fullgraph:
        with pytest.raises(torch._dynamo.exc.Unsupported, match="dynamo_ext: unsupported_state_read"):
            compiled(w_c, y)
        torch.testing.assert_close(w_c.elem, base), "a refusal changed the input"
        return
    for _ in range(3):
        torch.testing.assert_close(compiled(w_c, y), change_inner_then_op(w_e, y))
        torch.testing.assert_close(w_c.elem, w_e.elem)


class SeesInput(torch.Tensor):
    """Reads, at each op, the sum of a view of a plain tensor the caller gave it."""

    @staticmethod
    def __new__(cls, elem, view):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        r.elem, r.view = elem, view
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, size, stride):
        return SeesInput(inner["elem"], None)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w = next(a for a in args if isinstance(a, SeesInput))
        w.seen = w.view.sum()
        return func(*[a.elem if isinstance(a, SeesInput) else a for a in args], **(kwargs or {}))


def change_input_then_op(w, y):
    y.add_(1)
    return w * 2


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_view_attribute_of_a_plain_input_the_program_changes_in_place(backend, fullgraph):
    """AOTAutograd failed on aliased inputs that are mutated (under fullgraph=False too)."""

    def run(f):
        y = torch.zeros(4)
        w = SeesInput(torch.ones(3), y[:2])
        seen = []
        for _ in range(3):
            f(w, y)
            seen.append(float(w.seen))
        return seen, y.tolist()

    eager = run(change_input_then_op)
    torch._dynamo.reset()
    assert run(torch.compile(change_input_then_op, backend=backend, fullgraph=fullgraph)) == eager
