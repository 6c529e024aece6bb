"""Programs shared by the benchmarks: a small function over wrapper subclasses whose
dispatch writes 0-16 attributes per call (constants or tensors)."""

from __future__ import annotations

import types

import torch
from torch.utils._pytree import tree_map_only


class _Wrapper(torch.Tensor):
    @staticmethod
    def __new__(cls, elem, **attrs):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        r.elem = elem
        r.__dict__.update(attrs)
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def write(cls, first):
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mul.Tensor:
            cls.write(next(a for a in args if isinstance(a, cls)))
        out = func(*tree_map_only(cls, lambda t: t.elem, args), **(kwargs or {}))
        return tree_map_only(torch.Tensor, cls, out)


class Quiet(_Wrapper):
    pass


def _constant_writer(n):
    class ConstantWriter(_Wrapper):
        @classmethod
        def write(cls, first):
            for i in range(n):
                setattr(first, f"c{i}", "mul")

    ConstantWriter.__name__ = f"Constants{n}"
    return ConstantWriter


def _tensor_writer(n):
    class TensorWriter(_Wrapper):
        @classmethod
        def write(cls, first):
            for i in range(n):
                setattr(first, f"t{i}", first.elem + i)

    TensorWriter.__name__ = f"Tensors{n}"
    return TensorWriter


def fn(x):
    return x * 3 + 1


PROGRAMS = [
    ("plain tensor, no writes", lambda: torch.randn(64)),
    ("subclass, no writes", lambda: Quiet(torch.randn(64))),
    *[(f"subclass, {n} constant write(s)", (lambda c: lambda: c(torch.randn(64)))(_constant_writer(n))) for n in (1, 4, 16)],
    *[(f"subclass, {n} tensor write(s)", (lambda c: lambda: c(torch.randn(64)))(_tensor_writer(n))) for n in (1, 4, 16)],
]


def fresh_fn(tag):
    # Dynamo caches compiled code per code object: each variant gets its own copy
    # of fn's code so stock and dynamo_ext never share a cache entry.
    return types.FunctionType(fn.__code__.replace(co_name=f"fn_{tag}"), fn.__globals__, f"fn_{tag}")
