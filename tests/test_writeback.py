"""Data mutations of subclass inputs written back per inner tensor (dynamo_ext.writeback).

AOTAutograd writes an input's data mutation back with the subclass's own ``copy_``;
a subclass may have no rule for it (DTensor: ``_MaskPartial``). ``NoCopyTensor``
refuses ``copy_`` the same way, so stock compile fails where eager works.
"""

from __future__ import annotations

import pytest
import torch

from harness import plain, stock_torch
from subclasses import WritingTensor

aten = torch.ops.aten


class NoCopyTensor(WritingTensor):
    CTX = ("tag",)

    @classmethod
    def on_op(cls, func, first):
        if func is aten.copy_.default:
            raise RuntimeError("NoCopyTensor: copy_ has no rule for this layout")


def bump(x):
    x.add_(1)
    return x * 2


def _pair():
    base = torch.arange(6.0).reshape(2, 3)
    return NoCopyTensor(base.clone(), tag=3), NoCopyTensor(base.clone(), tag=3)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_input_data_mutation_written_back_per_inner_tensor(backend):
    x_eager, x = _pair()
    expected = bump(x_eager)
    out = torch.compile(bump, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(plain(out), plain(expected), rtol=0, atol=0)
    torch.testing.assert_close(x.elem, x_eager.elem, rtol=0, atol=0)  # the mutation landed
    assert type(x.elem) is torch.Tensor and x.tag == 3


def test_stock_cannot_write_it_back():
    _, x = _pair()
    with stock_torch():
        with pytest.raises(Exception, match="copy_ has no rule"):
            torch.compile(bump, backend="aot_eager", fullgraph=True)(x)


def test_subclass_that_can_copy_is_written_back_as_eager_mutated_it():
    """Eager's ``x.add_(1)`` mutates the inner tensor in dispatch; no copy_ reaches the
    subclass. The compiled write-back copies the inner tensor too, where stock would run
    the subclass's own copy_ (whose dispatch may do something else: copy only some inner
    tensors, or write state eager never wrote)."""
    calls = []

    class Copying(WritingTensor):
        @classmethod
        def on_op(cls, func, first):
            if func is aten.copy_.default:
                calls.append(func)

    x_eager, x = Copying(torch.ones(3)), Copying(torch.ones(3))
    bump(x_eager)
    assert not calls
    torch.compile(bump, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(x.elem, x_eager.elem)
    assert not calls
    with stock_torch():
        torch.compile(bump, backend="aot_eager", fullgraph=True)(Copying(torch.ones(3)))
    assert calls  # stock: the outer copy_


class KeepsHistory(WritingTensor):
    """A float8-style history as a second inner tensor, rolled in place by every forward mul
    on the weight; its dispatch unwraps ``elem`` alone (a copy_ of the outer tensor copies
    ``elem`` only)."""

    INNER = ("elem", "history")
    ALIAS_KEEPS_STATE = True  # nn.Parameter detaches its data: the history stays

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor and torch.is_grad_enabled() and getattr(first, "history", None) is not None:
            first.history.copy_(torch.roll(first.history, 1))
            first.history[0] = first.elem.abs().max()


def _mul_sum(x):
    return (x * 2).sum()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_an_inner_history_updated_in_place_without_grad(backend):
    """The history's in-place update reaches the real weight (stock's outer copy_ dropped it:
    the history stayed zeros)."""
    torch._dynamo.reset()
    compiled = torch.compile(_mul_sum, backend=backend, fullgraph=True)
    we = KeepsHistory(torch.arange(4.0), history=torch.zeros(3))
    wc = KeepsHistory(torch.arange(4.0), history=torch.zeros(3))
    for call in range(3):
        we.elem.add_(1), wc.elem.add_(1)
        torch.testing.assert_close(plain(compiled(wc)), plain(_mul_sum(we)))
        torch.testing.assert_close(wc.history, we.history, msg=lambda m: f"call {call + 1}: {m}")


def test_an_inner_history_updated_in_place_on_a_parameter_is_refused():
    """On a parameter in a training graph torch cannot write it back (the compiled function
    returned None, stock too): refused, the weight untouched; without fullgraph the frame
    runs eagerly and matches."""
    w = torch.nn.Parameter(KeepsHistory(torch.arange(4.0), history=torch.zeros(3)))
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="inner_metadata_mutation"):
        torch.compile(_mul_sum, backend="aot_eager", fullgraph=True)(w)
    assert torch.equal(w.history, torch.zeros(3)) and w.grad is None
    torch._dynamo.reset()
    we = torch.nn.Parameter(KeepsHistory(torch.arange(4.0), history=torch.zeros(3)))
    compiled = torch.compile(_mul_sum, backend="aot_eager")
    for call in range(2):
        _mul_sum(we).backward()
        compiled(w).backward()
        torch.testing.assert_close(w.history, we.history)
        torch.testing.assert_close(plain(w.grad), plain(we.grad))


def test_grad_recording_write_back_is_not_done_per_inner_tensor():
    """A mutated non-leaf input that requires grad is written back at run time, where
    autograd must record the copy on the outer tensor: no inner-wise fallback there,
    the subclass's own error surfaces instead of a gradient that silently misses it."""
    x = NoCopyTensor(torch.arange(6.0), requires_grad=True) * 1  # non-leaf
    with pytest.raises(Exception, match="copy_ has no rule"):
        torch.compile(bump, backend="aot_eager", fullgraph=True)(x)


def test_runtime_epilogue_source_is_rewritten():
    from dynamo_ext import writeback

    src = (
        "def _apply_mutations(orig_inputs, updated_inputs):\n"
        "    if orig_inputs[0].requires_grad: orig_inputs[0].detach().copy_(updated_inputs[0])\n"
        "    else: orig_inputs[0].copy_(updated_inputs[0])\n"
        "    orig_inputs[12].copy_(updated_inputs[1])\n"
    )
    out = writeback._EPILOGUE_COPY.sub(rf"{writeback._COPY_NAME}(\1, ", src)
    assert ".copy_(" not in out
    assert f"{writeback._COPY_NAME}(orig_inputs[0].detach(), updated_inputs[0])" in out
    assert f"{writeback._COPY_NAME}(orig_inputs[12], updated_inputs[1])" in out


def test_runtime_epilogue_writes_back_per_inner_tensor():
    """aot_function keeps input mutations out of the graph: the run-time epilogue writes
    them back, through the same fallback."""
    from functorch.compile import aot_function, nop

    x_eager, x = _pair()
    expected = bump(x_eager)
    out = aot_function(bump, nop)(x)
    torch.testing.assert_close(plain(out), plain(expected), rtol=0, atol=0)
    torch.testing.assert_close(x.elem, x_eager.elem, rtol=0, atol=0)


class _HistoryUnderNoGrad(torch.Tensor):
    """A float8-style weight: its transpose records the weight's amax in a history rolled in
    place under ``no_grad`` (delayed scaling), and its ``copy_`` rule unwraps the data tensor
    alone."""

    @staticmethod
    def __new__(cls, data, history):
        r = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=data.dtype, device=data.device, requires_grad=data.requires_grad
        )
        r.data_t, r.history = data, history
        return r

    def __init__(self, data, history):
        pass

    def __tensor_flatten__(self):
        return ["data_t", "history"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["data_t"], inner["history"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w = next(a for a in args if isinstance(a, cls))
        if func is torch.ops.aten.t.default:
            with torch.no_grad():
                w.history.copy_(torch.roll(w.history, 1))
                w.history[0] = w.data_t.abs().max()
            return w.data_t.t()
        if func is torch.ops.aten.detach.default:
            return cls(w.data_t.detach(), w.history)
        unwrap = lambda t: t.data_t if isinstance(t, cls) else t  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_history_rolled_under_no_grad_on_a_parameter(backend, fullgraph):
    """Outside round 39: AOTAutograd writes a mutation made under no_grad back under no_grad,
    so inner tensor by inner tensor; through the outer ``copy_`` the history stayed zero on
    ``aot_eager`` (stock alike). A training loop matches eager."""

    def run(f):
        torch.manual_seed(0)
        w = torch.nn.Parameter(_HistoryUnderNoGrad(torch.randn(2, 3), torch.zeros(3)))
        seen = []
        for i in range(3):
            loss = f(w, torch.full((1, 3), float(i + 1)))
            loss.backward()
            seen.append((w.history.tolist(), w.grad.data_t.tolist() if hasattr(w.grad, "data_t") else w.grad.tolist()))
            w.grad = None
        return seen

    def fn(w, x):
        return torch.nn.functional.linear(x, w).sum()

    eager = run(fn)
    assert eager[0][0][0] > 0
    torch._dynamo.reset()
    assert run(torch.compile(fn, backend=backend, fullgraph=fullgraph)) == eager
