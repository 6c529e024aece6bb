"""A coerced incoming gradient that feeds only gradients the backward does not keep.

The compiled backward coerces an incoming gradient whose flatten ctx is not the traced one
(``__coerce_same_metadata_as_tangent__``); where the traced backward read what the coercion
changed, the backward is refused (See Note [A gradient coerced to the traced metadata]).
That is needed only where the coerced gradient reaches a gradient this backward keeps:
with ``backward(inputs=[x])`` or ``autograd.grad(..., [x])``, eager's engine never runs the
backward of an output whose graph reaches only other inputs, and the compiled backward's use
of the coerced value ends in gradients the engine drops (See Note [A coerced gradient no
wanted gradient depends on]). A long fuzz run found the refusal there (``x0 + x0`` and
``x1 * x1`` behind a graph break, ``backward(inputs=[x0])``).

Each case runs eager and compiled on equal, separate inputs and compares gradients and
every input's state, or expects the refusal with no gradient accumulated.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

import dynamo_ext
from dynamo_ext.errors import RefusalKind

aten = torch.ops.aten


class Quant(torch.Tensor):
    """A per-tensor scaled wrapper: ``scale`` in the flatten ctx, a ``mul`` multiplies its
    result by its first argument's scale, results take that scale, and each ``mul`` records
    the scale it used on its first argument. A gradient with another ctx is coerced to the
    traced one, as torch asks of a subclass."""

    @staticmethod
    def __new__(cls, elem, scale=1.0, requires_grad=False):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, requires_grad=requires_grad)
        r.elem = elem
        r.scale = scale
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return f"Quant({self.elem!r}, scale={self.scale})"

    def __tensor_flatten__(self):
        return ["elem"], self.scale

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], ctx)

    def __coerce_same_metadata_as_tangent__(self, expected_metadata, expected_type=None):
        return type(self)(self.elem, expected_metadata)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(a for a in pytree.tree_leaves(args) if isinstance(a, cls))
        out = func(*pytree.tree_map_only(cls, lambda t: t.elem, args), **pytree.tree_map_only(cls, lambda t: t.elem, kwargs))
        if func is aten.mul.Tensor:
            out = out * first.scale
            if torch.is_grad_enabled():
                first.used = first.scale
        return pytree.tree_map_only(torch.Tensor, lambda o: cls(o, first.scale), out)


def _separate(x, w):
    return x * 3, w * 2


def _first_shared(x, w):
    return x * w, w * 2


def _second_shared(x, w):
    return x * 3, x * w


def _inputs():
    return (
        Quant(torch.tensor([0.5, 1.0, 2.0]), requires_grad=True),
        Quant(torch.tensor([1.5, -1.0, 0.25]), requires_grad=True),
    )


def _gradients(scale_of_second):
    # the second output's gradient holds another scale than the traced tangent (1.0)
    return Quant(torch.ones(3)), Quant(torch.full((3,), 0.5), scale_of_second)


def _run(fn, how, scale_of_second=2.0):
    x, w = _inputs()
    outs = fn(x, w)
    grads = _gradients(scale_of_second)
    if how == "backward_inputs_x":
        torch.autograd.backward(outs, grads, inputs=[x])
        got = (x.grad, w.grad)
    elif how == "backward_inputs_w":
        torch.autograd.backward(outs, grads, inputs=[w])
        got = (x.grad, w.grad)
    elif how == "grad_of_x":
        got = (torch.autograd.grad(outs, [x], grads)[0], None)
    else:  # every input
        torch.autograd.backward(outs, grads)
        got = (x.grad, w.grad)
    return got, (x, w)


def _state(t):
    return {k: v for k, v in vars(t).items() if not isinstance(v, torch.Tensor)}


def _same(eager, compiled):
    (eg, e_in), (cg, c_in) = eager, compiled
    for e, c in zip(eg, cg):
        assert (e is None) == (c is None), (e, c)
        if e is not None:
            assert type(c) is type(e)
            torch.testing.assert_close(c.elem, e.elem, rtol=0, atol=0)
    for e, c in zip(e_in, c_in):
        assert _state(c) == _state(e)


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("how", ["backward_inputs_x", "grad_of_x"])
@pytest.mark.parametrize("fn", [_separate, _first_shared], ids=["separate", "first_shared"])
def test_a_coerced_gradient_of_an_output_reaching_only_an_unwanted_input(fn, how, fullgraph):
    """``(x * 3, w * 2)`` or ``(x * w, w * 2)``, the second output's gradient with scale 2.0
    where the traced tangent held 1.0, only ``x``'s gradient wanted: eager never runs
    ``w * 2``'s backward; the compiled backward runs, with eager's gradient of ``x`` and no
    gradient of ``w`` (refused before)."""
    torch._dynamo.reset()
    eager = _run(fn, how)
    compiled = _run(torch.compile(fn, backend="aot_eager", fullgraph=fullgraph), how)
    _same(eager, compiled)
    assert compiled[0][1] is None


@pytest.mark.parametrize(
    "fn,how",
    [
        (_separate, "backward_inputs_w"),  # the coerced gradient reaches w's gradient
        (_separate, "every_input"),
        (_second_shared, "backward_inputs_x"),  # x * w: the coerced gradient reaches x's too
        (_second_shared, "grad_of_x"),
    ],
    ids=["separate-inputs_w", "separate-every_input", "shared-inputs_x", "shared-grad_of_x"],
)
def test_a_coerced_gradient_reaching_a_kept_gradient_is_still_refused(fn, how):
    """Where the coerced gradient reaches a gradient the backward keeps (through the
    output's autograd graph), eager's backward computes with the gradient's scale and the
    compiled one would with the traced one: refused when backward() runs, nothing
    accumulated, the inputs as the forward left them."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x, w = _inputs()
    outs = compiled(x, w)
    before = (_state(x), _state(w))
    with pytest.raises(dynamo_ext.SubclassWriteError) as info:
        if how == "grad_of_x":
            torch.autograd.grad(outs, [x], _gradients(2.0))
        else:
            torch.autograd.backward(outs, _gradients(2.0), inputs={"backward_inputs_x": [x], "backward_inputs_w": [w]}.get(how))
    assert info.value.kind is RefusalKind.CHANGED_BEFORE_BACKWARD
    assert "__coerce_same_metadata_as_tangent__" in str(info.value)
    assert x.grad is None and w.grad is None
    assert (_state(x), _state(w)) == before


@pytest.mark.parametrize("how", ["backward_inputs_x", "every_input"])
def test_the_traced_ctx_is_not_coerced_and_runs(how):
    """The same gradients with the traced scale: nothing is coerced, every backward runs."""
    torch._dynamo.reset()
    eager = _run(_second_shared, how, scale_of_second=1.0)
    compiled = _run(torch.compile(_second_shared, backend="aot_eager", fullgraph=True), how, scale_of_second=1.0)
    _same(eager, compiled)
