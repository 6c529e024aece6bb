"""Subclasses for the bad-input catalogue (test_catalogue.py) and the long-run tests.

Most build on ``subclasses.WritingTensor``: ``on_op(func, first)`` runs in dispatch
before the op on the first argument of the subclass type.
"""

from __future__ import annotations

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils._pytree import tree_map_only

import subclasses as S

aten = torch.ops.aten


# ----------------------------------------------------------------- values that cannot be rebuilt


@dataclasses.dataclass
class Box:
    """A non-frozen dataclass: mutable."""

    n: int


class DictWriter(S.WritingTensor):
    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.table = {"op": "mul"}


class SetWriter(S.WritingTensor):
    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.names = {"mul"}


class DataclassWriter(S.WritingTensor):
    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.box = Box(1)


class TupleOfListWriter(S.WritingTensor):
    """A tuple holding a list is not an immutable constant."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.pair = (1, [2])


class FunctionWriter(S.WritingTensor):
    """A function object: opaque to the replay."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.hook = len


# ----------------------------------------------------------------- in-place container mutation


class DictInPlace(S.WritingTensor):
    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.table["mul"] = first.table.get("mul", 0) + 1


class SetInPlace(S.WritingTensor):
    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.seen.add("mul")


# ----------------------------------------------------------------- writes that depend on the tracing pass


def _proxy_mode_active() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


class ProxyModeProbe(S.WritingTensor):
    """Writes whether make_fx's proxy mode is active, outside Dynamo's fake propagation.

    AOTAutograd's metadata pass runs without the proxy mode and its graph trace with it,
    so the passes write different values; Dynamo (inner tensor a FakeTensor) never sees
    the write. Eager writes False.
    """

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor and type(first.elem) is not FakeTensor:
            first.under_proxy = _proxy_mode_active()


class FunctionalProbe(S.WritingTensor):
    """Writes whether its inner tensor is a FunctionalTensor: False in eager and in
    Dynamo's fake propagation, True in every AOTAutograd pass."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.functional = isinstance(first.elem, FunctionalTensor)


class InnerTypeProbe(S.WritingTensor):
    """Writes the type name of its inner tensor: 'Tensor' in eager, 'FakeTensor' in
    Dynamo's fake propagation, 'FunctionalTensor' in AOTAutograd's passes."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.inner_type = type(first.elem).__name__


# ----------------------------------------------------------------- flatten / unflatten that do not round-trip


class CtxDroppedOnUnflatten(S.WritingTensor):
    """``tag`` is in the ctx, but unflatten ignores the ctx: rebuilt instances start at 0."""

    CTX = ("tag",)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.tag = first.tag + 1


class CtxUnsetOnUnflatten(CtxDroppedOnUnflatten):
    """``tag`` is in the ctx, but unflatten leaves the attribute unset (flatten of a
    rebuilt instance then fails)."""

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        r = super().__tensor_unflatten__(inner, ctx, outer_size, outer_stride)
        del r.tag
        return r

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.tag = getattr(first, "tag", 0) + 1


class InnerIgnoredOnUnflatten(S.WritingTensor):
    """Flatten names ``cache`` once set; unflatten ignores it (rebuilt instances fall
    back to the class default None). Dispatch creates the cache, then bumps it."""

    cache = None

    def inner_names(self):
        return ["elem", "cache"] if self.cache is not None else ["elem"]

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.cache = first.elem * 2 if first.cache is None else first.cache + 1


class InnerIgnoredConstant(InnerIgnoredOnUnflatten):
    """As above, but what differs is a constant written from whether the cache exists."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.cached_before = first.cache is not None
            if first.cache is None:
                first.cache = first.elem * 2


# ----------------------------------------------------------------- backward


class BackwardTensorMarker(S.WritingTensor):
    """Records a tensor on its saved inputs when a backward multiplication uses them."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor and torch._C._current_graph_task_id() != -1:
            for a in args[1:]:
                if isinstance(a, cls):
                    a.grad_scale = a.elem * 2
        return super().__torch_dispatch__(func, types, args, kwargs)


# ----------------------------------------------------------------- no __tensor_flatten__


class NonTraceableCounter(torch.Tensor):
    """A wrapper subclass without ``__tensor_flatten__`` / ``__tensor_unflatten__``
    (Dynamo cannot trace through it) whose dispatch counts multiplications."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        r.elem = elem
        r.tag = 0
        return r

    def __repr__(self):
        return f"NonTraceableCounter({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mul.Tensor:
            first = next(a for a in args if isinstance(a, cls))
            first.tag += 1
        out = func(*tree_map_only(cls, lambda t: t.elem, args), **tree_map_only(cls, lambda t: t.elem, kwargs))
        return tree_map_only(torch.Tensor, lambda t: cls(t), out)


# ----------------------------------------------------------------- long runs


class MixedWriter(S.WritingTensor):
    """Writes constants and tensors on every multiplication, none of which dispatch reads
    (so a stable program compiles once)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is aten.mul.Tensor:
            first = next(a for a in args if isinstance(a, cls))
            first.mode = S.Mode.WARM
            first.last_op = "mul"
            first.summary = S.Stats(2, "mul")
            first.doubled = first.elem * 2  # from the input
            first.last_out = out.elem.sin()  # from the op's output
        return out
