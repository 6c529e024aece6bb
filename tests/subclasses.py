"""Wrapper subclasses whose ``__torch_dispatch__`` writes attributes on its inputs.

``WritingTensor`` is a plain traceable wrapper subclass (inner tensor ``elem``,
ctx = the values of ``CTX``).  Each test subclass sets ``CTX`` and overrides
``on_op(func, first)``, which runs in dispatch before the op, on the first
argument of the subclass type.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map_only  # noqa: F401

from dynamo_ext.testing import WrapperTensor

aten = torch.ops.aten


class WritingTensor(WrapperTensor):
    """The project's shared wrapper base (``dynamo_ext.testing``): ctx = the values of ``CTX``;
    ``on_op(func, first)`` runs in dispatch before the op."""


# ----------------------------------------------------------------- the two


class CounterTensor(WritingTensor):
    """ctx = (tag,); every mul bumps tag."""

    CTX = ("tag",)

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.tag += 1


class GrowingCacheTensor(WritingTensor):
    """``cache`` is listed in __tensor_flatten__ once set (the flatten list grows)."""

    cache = None  # class default: instances start without a cache

    def inner_names(self):
        return ["elem", "cache"] if self.cache is not None else ["elem"]

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor and first.cache is None:
            first.cache = first.elem * 2


# ----------------------------------------------------------------- more kinds of write


class CachingTensor(WritingTensor):
    """Tensor cache outside the flatten contract."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor and getattr(first, "cache", None) is None:
            first.cache = first.elem * 2


class CallCounter(WritingTensor):
    """Plain __dict__ counter outside the flatten contract."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.calls = getattr(first, "calls", 0) + 1


class Mode(enum.Enum):
    COLD = 1
    WARM = 2


@dataclasses.dataclass(frozen=True)
class Stats:
    n: int
    name: str


class ConstantsTensor(WritingTensor):
    """Writes one constant of each replayable kind, all in the flatten ctx."""

    CTX = ("i", "f", "s", "b", "n", "e", "tup", "dt", "dev", "sz", "dc")

    @classmethod
    def default(cls, name):
        return None

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.i = 3
            first.f = 0.5
            first.s = "seen"
            first.b = True
            first.n = None
            first.e = Mode.WARM
            first.tup = (1, "a", (2.0, None))
            first.dt = torch.float16
            first.dev = torch.device("cpu")
            first.sz = torch.Size([2, 3])
            first.dc = Stats(7, "x")


class OutOfCtxConstants(WritingTensor):
    """Same constants, outside the ctx (plain __dict__)."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.mode = Mode.COLD
            first.last_dtype = first.elem.dtype
            first.summary = Stats(1, "mul")


class LastWinsTensor(WritingTensor):
    """Several writes of one attribute in one graph, from several ops."""

    CTX = ("tag",)

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.tag = first.tag * 10 + 1
        elif func is aten.add.Tensor:
            first.tag = first.tag * 10 + 2


class ReadBackTensor(WritingTensor):
    """A later op's result depends on what an earlier op wrote."""

    CTX = ("scale",)

    @classmethod
    def default(cls, name):
        return 1

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.scale = first.scale + 1

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is aten.add.Tensor:
            first = next(a for a in args if isinstance(a, cls))
            return cls(out.elem * first.scale, scale=first.scale)
        return out


class IntermediateCacheTensor(WritingTensor):
    """Caches an intermediate of the op (its output), not derived from elem alone."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is aten.mul.Tensor:
            first = next(a for a in args if isinstance(a, cls))
            first.last_out = out.elem.sin()
        return out


class AliasTensor(WritingTensor):
    """Writes aliases: the inner tensor, the instance itself; and None."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.inner_alias = first.elem
            first.me = first
            first.gone = None


class ResetTensor(WritingTensor):
    """Resets an existing tensor attribute to None."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.cache = None


class TwoInputTensor(WritingTensor):
    """Writes on every subclass argument, not only the first."""

    CTX = ("seen",)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            for i, a in enumerate(args):
                if isinstance(a, cls):
                    a.seen = a.seen + 1 + i
        return super().__torch_dispatch__(func, types, args, kwargs)


class QuietTensor(WritingTensor):
    """Writes nothing: the unused path."""

    CTX = ("tag",)


# ----------------------------------------------------------------- refused kinds


class ListWriter(WritingTensor):
    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.history = [1, 2]


class InPlaceWriter(WritingTensor):
    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.notes.append("mul")


class Handle:
    """An arbitrary (non-dataclass) object; equal by value so eager and compiled can be compared."""

    def __init__(self, n):
        self.n = n

    def __eq__(self, other):
        return type(other) is Handle and other.n == self.n


class OpaqueWriter(WritingTensor):
    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.handle = Handle(1)


GLOBAL_REAL = torch.ones(4)


class RealTensorWriter(WritingTensor):
    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.borrowed = GLOBAL_REAL


class DirectDictReader(WritingTensor):
    """Reads state through ``__dict__`` instead of attribute syntax."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.seen = first.__dict__.get("seen", 0) + 1


class DeleteWriter(WritingTensor):
    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor and hasattr(first, "cache"):
            del first.cache


class UserScaled(WritingTensor):
    """Dispatch reads a user-set constant outside the ctx and its result depends on it."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is aten.mul.Tensor:
            first = next(a for a in args if isinstance(a, cls))
            first.used = getattr(first, "scale", 1.0)
            return cls(out.elem * first.used)
        return out


class RebindInner(WritingTensor):
    """Rebinds its inner tensor (named by __tensor_flatten__) before the op uses it."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.elem = first.elem + 1


class ShapeRecorder(WritingTensor):
    """Writes a size (a SymInt under dynamic shapes) and a tensor of that size."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.n = first.elem.shape[0]
            first.window = first.elem[: first.n - 1] * 2


class UnseenByDynamo(WritingTensor):
    """Writes everywhere except in Dynamo's fake propagation (its inner tensor is a
    FakeTensor only there): a stand-in for writes only AOTAutograd's passes trigger."""

    CTX = ("traced",)

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor and type(first.elem) is not FakeTensor:
            first.traced = first.traced + 1
            first.snapshot = first.elem * 10


class CountingSets(WritingTensor):
    """Counts assignments to the attributes of the instances in ``counted`` (real inputs)."""

    CTX = ("tag",)
    sets: list = []
    counted: list = []  # the instances whose assignments are counted

    def __setattr__(self, name, value):
        # test instrumentation: the real inputs are told apart by identity (``is``: ``id``
        # in a writing class is refused)
        if any(self is c for c in CountingSets.counted):
            CountingSets.sets.append(name)
        super().__setattr__(name, value)

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.tag = first.tag + 1
            first.cache = first.elem * 2


class RestrideInner(WritingTensor):
    """Rebinds its inner tensor to one with other strides (column-major copy)."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor and first.elem.is_contiguous():
            first.elem = first.elem.t().contiguous().t()


class InPlaceRestride(WritingTensor):
    """Changes its inner tensor's strides in place."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.elem.t_()


class BackwardMarker(WritingTensor):
    """Records on its saved inputs that a backward multiplication used them."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor and torch._C._current_graph_task_id() != -1:
            for a in args[1:]:
                if isinstance(a, cls):
                    a.used_in_backward = "mul"
        return super().__torch_dispatch__(func, types, args, kwargs)


class MarkOnAdd(WritingTensor):
    """Writes a constant and a tensor on whatever tensor comes first in an add."""

    CTX = ("adds",)

    @classmethod
    def on_op(cls, func, first):
        if func is aten.add.Tensor:
            first.marked = "add"
            first.adds = first.adds + 1
            first.plus_one = first.elem + 1


class PlainArgKeeper(WritingTensor):
    """Keeps a plain tensor operand it recognises with ``type(t) is torch.Tensor``: while
    traced that operand is a FakeTensor or FunctionalTensor (the idiom is refused)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if len(args) > 1 and isinstance(args[0], cls) and type(args[1]) is torch.Tensor:
            args[0].other = args[1]
        return super().__torch_dispatch__(func, types, args, kwargs)


class IdKeyedCache(WritingTensor):
    """Rebuilds ``cache`` when ``elem`` is another object than the one it was built from, by
    ``id``: while traced ``elem`` is a fake, so an identity taken then is not the run's (the
    idiom is refused)."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor and getattr(first, "cache_key", None) != id(first.elem):
            first.cache = first.elem * 2
            first.cache_key = id(first.elem)
            first.builds = getattr(first, "builds", 0) + 1


class IdKeyedText(WritingTensor):
    """The same key as text (``f"elem@{id(elem):x}"``)."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor and getattr(first, "cache_key", None) != f"elem@{id(first.elem):x}":
            first.cache = first.elem * 2
            first.cache_key = f"elem@{id(first.elem):x}"


class IdKeyedTuple(WritingTensor):
    """The same key in a tuple with the inner tensor's shape."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor and getattr(first, "cache_key", None) != (id(first.elem), 4):
            first.cache = first.elem * 2
            first.cache_key = (id(first.elem), 4)


class IdWithinOneCall(WrapperTensor):
    """Finds an operand again by ``id`` within one dispatch call (as float8 code finds the
    weights it scaled) and counts the ops: consistent while traced, compiled."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        scaled = {id(a): a.elem * 1 for a in args if isinstance(a, cls)}
        for a in args:
            if isinstance(a, cls) and id(a) in scaled:
                a.ops = getattr(a, "ops", 0) + 1
        return super().__torch_dispatch__(func, types, args, kwargs)


class IdInRepr(WritingTensor):
    """Uses ``id`` in ``__repr__`` only and bumps a ctx count: compiled like any counter."""

    CTX = ("tag",)

    def __repr__(self):
        return f"IdInRepr(tag={self.tag}, at {id(self):#x})"

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            first.tag += 1


class PlainArgCounter(WrapperTensor):
    """The same check in a class that writes nothing: compiled as stock compiles it."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        plain = sum(1 for a in args if type(a) is torch.Tensor)
        del plain
        return super().__torch_dispatch__(func, types, args, kwargs)
