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


class Packed(torch.Tensor):
    """The inner subclass of ``Quantized``: int8 data and a scale; with ``CACHES`` its own
    dispatch dequantizes through a cache keyed on ``data._version``, counting hits and misses."""

    CACHES = False

    @staticmethod
    def __new__(cls, data, scale):
        r = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32, device=data.device)
        r.data_, r.scale = data, scale
        return r

    def __tensor_flatten__(self):
        return ["data_", "scale"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["data_"], inner["scale"])

    def dequantize(self):
        version = self.data_._version
        if self.__dict__.get("version") != version:
            self.cache = self.data_.float() * self.scale
            self.version = version
            self.misses = self.__dict__.get("misses", 0) + 1
        else:
            self.hits = self.__dict__.get("hits", 0) + 1
        return self.cache

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if not cls.CACHES:
            raise NotImplementedError(func)
        unpack = lambda a: a.dequantize() if isinstance(a, Packed) else a  # noqa: E731
        return func(*[unpack(a) for a in args], **(kwargs or {}))


class CachingPacked(Packed):
    CACHES = True


class Quantized(torch.Tensor):
    """Holds a ``Packed`` (a subclass nested in a subclass). With ``CACHES`` its dispatch keeps
    the dequantized weight keyed on the nested data's ``_version``; otherwise it hands the op to
    the nested subclass, whose dispatch keeps it."""

    CACHES = True

    @staticmethod
    def __new__(cls, inner):
        r = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=torch.float32, device=inner.device)
        r.inner = inner
        return r

    def __tensor_flatten__(self):
        return ["inner"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if not cls.CACHES:
            return func(*[a.inner if isinstance(a, Quantized) else a for a in args], **(kwargs or {}))
        unpack = lambda a: Packed.dequantize(a.inner) if isinstance(a, Quantized) else a  # noqa: E731
        w = next(a for a in args if isinstance(a, Quantized))
        out = func(*[unpack(a) for a in args], **(kwargs or {}))
        w.ops = w.__dict__.get("ops", 0) + 1
        return out


class PassingOn(Quantized):
    CACHES = False


def bump_nested_then_ops(x, w, bump):
    if bump:
        w.inner.data_.add_(1)
    return (w * x) + (w * 2)


def _nested_state(w):
    found = {k: v for k, v in w.__dict__.items() if not isinstance(v, torch.Tensor) or k == "inner"}
    inner = {k: v for k, v in w.inner.__dict__.items() if not isinstance(v, torch.Tensor)}
    return {k: v for k, v in found.items() if k != "inner"}, inner, w.inner.data_.tolist()


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("outer,inner", [(Quantized, Packed), (PassingOn, CachingPacked)], ids=["outer_caches", "nested_caches"])
def test_the_program_changing_a_nested_inner_tensor_then_an_op_on_the_subclass(outer, inner, backend, fullgraph):
    """An outside tester's find: the nested subclass's data changed in place by the compiled
    function, then two ops on the outer one. On ``backend="eager"`` the compiled state counted
    a phantom cache hit; on ``aot_eager`` the recompile was refused after the first call."""

    def make():
        return outer(inner(torch.arange(6, dtype=torch.int8).view(2, 3), torch.tensor(0.5)))

    def run(f, w, calls):
        seen = []
        for i in range(calls):
            out = f(torch.ones(2, 3) * (i + 1), w, i % 2 == 1)
            seen.append((out.tolist(), _nested_state(w)))
        return seen

    w_e, w_c = make(), make()
    expected = run(bump_nested_then_ops, w_e, 4)
    torch._dynamo.reset()
    compiled = torch.compile(bump_nested_then_ops, backend=backend, fullgraph=fullgraph)
    if fullgraph:
        assert run(compiled, w_c, 1) == expected[:1]
        before = _nested_state(w_c)
        with pytest.raises(torch._dynamo.exc.Unsupported, match="dynamo_ext: unsupported_state_read"):
            compiled(torch.ones(2, 3), w_c, True)
        assert _nested_state(w_c) == before, "a refusal changed the input"
        return
    assert run(compiled, w_c, 4) == expected
    assert not leaked_fakes(w_c) and not leaked_fakes(w_c.inner)
