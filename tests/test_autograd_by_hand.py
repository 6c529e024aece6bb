"""Dispatch sets autograd state by hand on a tensor that is not one of an input's inner
tensors: on a plain tensor the op is handed (``args[1].requires_grad_()``, ``.grad =``,
``.data =``, a hook, ``detach_()``), on the input itself through the unbound method
(``torch.Tensor.requires_grad_(self)``, past the attribute hook), on an inner tensor of the
op's result (``out.requires_grad_()``), or on a tensor it writes to an attribute
(``self.cache = out.clone().requires_grad_()``, an ``nn.Parameter``). Dispatch runs below
autograd, so such state is never torch's doing. The AOT backends dropped it silently (stock
alike; outside testers' finds). Refused (``inner_metadata_mutation``) with nothing touched
under ``fullgraph=True``; under ``fullgraph=False`` the op runs eagerly and every tensor ends
as in eager. Tensors that carry such state already (a plain input that requires grad, written
to an attribute) still compile."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map_only

import dynamo_ext
from harness import assert_same_state

aten = torch.ops.aten

HOWS = [
    "arg_requires_grad",
    "arg_grad",
    "arg_data",
    "arg_hook",
    "arg_detach_",
    "self_unbound_requires_grad",
    "self_unbound_grad",
    "result_requires_grad",
    "result_grad",
    "outer_result_requires_grad",
    "outer_result_grad",
    "plain_result_requires_grad",
    "written_requires_grad",
    "written_grad",
    "written_parameter",
    "written_subclass_requires_grad",
    "written_subclass_inner_requires_grad",
    # eager leaves no autograd state here: these compile and match
    "arg_detach_",
    "written_input_that_requires_grad",
    "result_requires_grad_false",
    "written_plain_result",
]
#: below autograd ``detach_`` changes no autograd state; the written input carried its own; a
#: plain result dispatch returns and writes is recorded by autograd (a grad_fn) after dispatch
COMPILES = {"arg_detach_", "written_input_that_requires_grad", "result_requires_grad_false", "written_plain_result"}
#: the plain input requires grad (a hook needs it; ``detach_`` changes it)
ARG_NEEDS_GRAD = {"arg_hook", "arg_detach_", "written_input_that_requires_grad", "written_plain_result"}


class Scaled(torch.Tensor):
    """A weight with a scale, the way a quantized or float8 weight is written."""

    HOW = "arg_requires_grad"
    AT = 2

    @staticmethod
    def __new__(cls, elem, scale=1.0):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        r.elem = elem
        r.scale = scale
        return r

    def __init__(self, elem, scale=1.0):
        pass

    def __tensor_flatten__(self):
        return ["elem"], (self.scale,)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["elem"], *ctx)

    def __repr__(self):
        return f"Scaled({self.elem})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*tree_map_only(cls, lambda t: t.elem * t.scale, args), **tree_map_only(cls, lambda t: t.elem, kwargs))
        if func is aten.mul.Tensor:
            w, other = args
            w.calls = w.__dict__.get("calls", 0) + 1
            if w.calls == cls.AT:
                out = cls._by_hand(w, other, out)
        if func is aten.mul.Tensor and cls.HOW == "written_plain_result":
            args[0].cache = out
            return out
        if func is not aten.mul.Tensor:
            return out
        if cls.HOW == "plain_result_requires_grad" and args[0].calls == cls.AT:
            return out.requires_grad_()  # returned unwrapped
        r = cls(out)
        if args[0].calls == cls.AT:
            if cls.HOW == "outer_result_requires_grad":
                r.requires_grad_()
            elif cls.HOW == "outer_result_grad":
                r.grad = torch.ones(r.shape)
        return r

    @classmethod
    def _by_hand(cls, w, other, out):
        how = cls.HOW
        if how == "arg_requires_grad":
            other.requires_grad_()
        elif how == "arg_grad":
            other.grad = torch.full(other.shape, 5.0)
        elif how == "arg_data":
            other.data = torch.zeros(other.shape)
        elif how == "arg_hook":
            other.register_hook(lambda g: g * 3)
        elif how == "arg_detach_":
            other.detach_()
        elif how == "self_unbound_requires_grad":
            torch.Tensor.requires_grad_(w)
        elif how == "self_unbound_grad":
            torch._C.TensorBase.grad.__set__(w, torch.full(w.shape, 5.0))
        elif how == "result_requires_grad":
            out = out.requires_grad_()
        elif how == "result_grad":
            out.grad = torch.ones(out.shape)
        elif how == "written_requires_grad":
            w.cache = out.clone().requires_grad_()
        elif how == "written_grad":
            cache = out.clone()
            cache.grad = torch.ones(out.shape)
            w.cache = cache
        elif how == "written_parameter":
            w.cache = torch.nn.Parameter(out.clone())
        elif how == "written_subclass_requires_grad":
            w.cache = Scaled(out.clone()).requires_grad_()
        elif how == "written_subclass_inner_requires_grad":
            w.cache = Scaled(out.clone().requires_grad_())
        elif how == "written_input_that_requires_grad":
            w.cache = other
        elif how == "result_requires_grad_false":
            out = out.requires_grad_(False)
        return out


def _values(t):
    return (t.elem if isinstance(t, Scaled) else t).detach().tolist()


def _autograd(t):
    return (t.requires_grad, None if t.grad is None else _values(t.grad), len(t._backward_hooks or {}), _values(t))


def _picture(w, y, out):
    cache = w.__dict__.get("cache")
    return (
        _autograd(w), _autograd(y), _autograd(out), _autograd(out.elem if isinstance(out, Scaled) else out),
        w.__dict__.get("calls"),
        None if cache is None else (
            type(cache).__name__, _autograd(cache), cache.elem.requires_grad if isinstance(cache, Scaled) else None
        ),
    )


def _inputs(how):
    return Scaled(torch.arange(3.0)), torch.full((3,), 2.0, requires_grad=how in ARG_NEEDS_GRAD)


def step(w, y):
    return w * y


@pytest.mark.parametrize("at", [1, 2], ids=["first_call", "second_call"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("how", HOWS)
def test_dispatch_setting_autograd_state_by_hand(how, backend, fullgraph, at):
    cls = type(f"Scaled_{how}", (Scaled,), {"HOW": how, "AT": at})
    eager = _run_with(cls, step, how)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=fullgraph)
    if fullgraph and how not in COMPILES:
        w, y = _with(cls, how)
        w.calls = at - 1  # the traced op is the one that sets it
        untouched_w, untouched_y = _with(cls, how)
        untouched_w.calls = at - 1
        with pytest.raises(torch._dynamo.exc.Unsupported, match="dynamo_ext: inner_metadata_mutation"):
            compiled(w, y)
        assert_same_state(untouched_w, w, "refused input")
        assert _autograd(w) == _autograd(untouched_w)
        assert _autograd(y) == _autograd(untouched_y)
        return
    assert _run_with(cls, compiled, how) == eager


def _with(cls, how):
    w, y = _inputs(how)
    return cls(w.elem), y


def _run_with(cls, f, how, calls=3):
    w, y = _with(cls, how)
    seen = []
    for _ in range(calls):
        out = f(w, y)
        seen.append(_picture(w, y, out))
    return seen


@pytest.mark.parametrize("how", HOWS)
def test_direct_aot_function_use(how):
    """AOTAutograd used directly (``aot_function``): the fallback's pass sees the same."""
    from functorch.compile import aot_function, nop

    cls = type(f"Scaled_{how}", (Scaled,), {"HOW": how, "AT": 1})
    eager = _run_with(cls, step, how, calls=1)
    compiled = aot_function(step, nop)
    if how not in COMPILES:
        w, y = _with(cls, how)
        untouched_w, untouched_y = _with(cls, how)
        with pytest.raises(dynamo_ext.SubclassWriteError, match="inner_metadata_mutation"):
            compiled(w, y)
        assert_same_state(untouched_w, w, "refused input")
        assert _autograd(w) == _autograd(untouched_w)
        assert _autograd(y) == _autograd(untouched_y)
        return
    assert _run_with(cls, compiled, how, calls=1) == eager


# -- a tensor dispatch reaches through a global ---------------------------------------------

BUFFER = torch.ones(3)
SCALES = {"w": torch.ones(3)}


class Registry:
    SHARED = torch.ones(3)


GLOBAL_HOWS = [
    "global_requires_grad", "global_grad", "global_hook", "global_data",
    "dict_item_requires_grad", "class_attribute_grad",
]


def _global_tensor(how):
    if how.startswith("dict_item"):
        return SCALES["w"]
    if how.startswith("class_attribute"):
        return Registry.SHARED
    return BUFFER


class Reaching(Scaled):
    """Dispatch sets the autograd state of a tensor a global holds (a buffer, a registry of
    scales) once it has counted ``AT`` calls."""

    @classmethod
    def _by_hand(cls, w, other, out):
        t = _global_tensor(cls.HOW)
        what = cls.HOW.rpartition("_")[2] if not cls.HOW.endswith("requires_grad") else "requires_grad"
        if what == "requires_grad":
            t.requires_grad_()
        elif what == "grad":
            t.grad = torch.full((3,), float(w.calls))
        elif what == "hook":
            t.requires_grad_()
            t.register_hook(lambda g: g * 2)
        elif what == "data":
            t.data = torch.full((3,), 4.0)
        return out


def _global_picture(how):
    return _autograd(_global_tensor(how))


def _reset_globals():
    for t in (BUFFER, SCALES["w"], Registry.SHARED):
        t.requires_grad_(False)
        t.grad = None
        t._backward_hooks = None
        t.data = torch.ones(3)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("how", GLOBAL_HOWS)
def test_dispatch_setting_a_global_tensors_autograd_state(how, backend, fullgraph):
    cls = type(f"Reaching_{how}", (Reaching,), {"HOW": how, "AT": 2})

    def run(f):
        _reset_globals()
        w, y = _with(cls, how)
        seen = []
        for _ in range(3):
            out = f(w, y)
            seen.append((_picture(w, y, out), _global_picture(how)))
        return seen

    try:
        eager = run(step)
        torch._dynamo.reset()
        compiled = torch.compile(step, backend=backend, fullgraph=fullgraph)
        if fullgraph:
            _reset_globals()
            w, y = _with(cls, how)
            w.calls = 1  # the traced op is the one that sets it
            before = _global_picture(how)
            # ``.data =`` a tensor dispatch made computes with the real tensor: refused as that
            kinds = "global_state_write|unsupported_state_read" if how.endswith("data") else "global_state_write"
            with pytest.raises(torch._dynamo.exc.Unsupported, match=f"dynamo_ext: ({kinds})"):
                compiled(w, y)
            assert _global_picture(how) == before, "the refusal left the global tensor changed"
            return
        assert run(compiled) == eager
    finally:
        _reset_globals()


# -- a tensor the input holds outside its flatten list ---------------------------------------


class HoldsAScale(torch.Tensor):
    """A weight keeping its ``nn.Parameter`` scale outside ``__tensor_flatten__`` (its
    ``__new__`` defaults it, so the traced instance's answer comes from the caller's)."""

    HOW = "held_grad"

    @staticmethod
    def __new__(cls, elem, scale=None):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        r.elem = elem
        r.scale = scale
        return r

    def __init__(self, elem, scale=None):
        pass

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*tree_map_only(cls, lambda t: t.elem, args), **(kwargs or {}))
        if func is aten.mul.Tensor and args[0].scale is not None:
            scale = args[0].scale
            if cls.HOW == "held_grad":
                scale.grad = torch.ones(1)
            elif cls.HOW == "held_hook":
                scale.register_hook(lambda g: g)
            elif cls.HOW == "held_data":
                scale.data = torch.zeros(1)
            elif cls.HOW == "held_requires_grad":
                scale.requires_grad_(False)
            elif cls.HOW == "held_in_place":
                with torch.no_grad():
                    scale.add_(1)
        return tree_map_only(torch.Tensor, cls, out) if func is aten.mul.Tensor else out


HELD_HOWS = ["held_grad", "held_hook", "held_data", "held_requires_grad", "held_in_place"]


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("how", HELD_HOWS)
def test_autograd_state_of_a_tensor_held_outside_the_flatten_list(how, backend, fullgraph):
    """Outside round 38: ``self.scale.grad = g`` (a hook, ``.data =``) on an ``nn.Parameter``
    the input holds outside its flatten list: lost on ``aot_eager``, silently. Refused; an
    in-place change of its data compiles."""
    cls = type(f"HoldsAScale_{how}", (HoldsAScale,), {"HOW": how})

    def run(f):
        w = cls(torch.arange(3.0), torch.nn.Parameter(torch.ones(1)))
        seen = []
        for _ in range(3):
            f(w, torch.ones(3))
            s = w.scale
            seen.append((s.requires_grad, s.grad is not None, len(s._backward_hooks or {}), s.detach().tolist()))
        return seen

    eager = run(step)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=fullgraph)
    if fullgraph and how != "held_in_place":
        w = cls(torch.arange(3.0), torch.nn.Parameter(torch.ones(1)))
        with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed), match="dynamo_ext"):
            compiled(w, torch.ones(3))
        s = w.scale
        assert (s.requires_grad, s.grad, len(s._backward_hooks or {}), s.detach().tolist()) == (True, None, 0, [1.0])
        return
    assert run(compiled) == eager
