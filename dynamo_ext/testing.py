"""A small traceable wrapper subclass to build writing subclasses from: the project's tests,
benchmarks and demo share it, and it is a starting point for users' own tests.

``WrapperTensor`` wraps one inner tensor (``elem``); ``INNER`` names further inner tensors
(flattened when set), ``CTX`` the attributes carried in the flatten ctx. Dispatch unwraps
the arguments, runs the op on the inner tensors and wraps tensor outputs (carrying the
first argument's ctx), after calling ``before_op`` - the place a subclass writes its state:

    class CallCounter(WrapperTensor):
        @classmethod
        def on_op(cls, func, first):
            if func is torch.ops.aten.mul.Tensor:
                first.calls = getattr(first, "calls", 0) + 1
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten

_ALIASING = (aten.detach.default, aten.alias.default)


class WrapperTensor(torch.Tensor):
    INNER: tuple[str, ...] = ("elem",)
    CTX: tuple[str, ...] = ()
    #: Wrap every tensor output (True), or only ``detach``/``alias`` and the ops in ``WRAP_OPS``.
    WRAP_OUTPUTS: bool = True
    WRAP_OPS: tuple = (aten.t.default, aten.view.default)
    #: ``detach``/``alias`` keep every attribute (a parameter's state survives
    #: ``nn.Parameter``, which detaches its data), not only the ctx.
    ALIAS_KEEPS_STATE: bool = False

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool = False, **attrs: Any) -> "WrapperTensor":
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=elem.device,
            requires_grad=requires_grad,
        )
        r.elem = elem
        for name in cls.CTX:
            setattr(r, name, cls.default(name))
        for name, value in attrs.items():
            setattr(r, name, value)
        return r

    @classmethod
    def default(cls, name: str) -> Any:
        """The value a ctx attribute starts from."""
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.elem!r})"

    def inner_names(self) -> list[str]:
        return [n for n in self.INNER if n == "elem" or getattr(self, n, None) is not None]

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return self.inner_names(), tuple(getattr(self, n) for n in self.CTX)

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, ctx: tuple, outer_size: Any, outer_stride: Any) -> "WrapperTensor":
        r = cls(inner["elem"], **dict(zip(cls.CTX, ctx)))
        for name, t in inner.items():
            if name != "elem":
                r.__dict__[name] = t
        return r

    def __coerce_same_metadata_as_tangent__(self, expected_metadata: Any, expected_type: Any = None) -> Any:
        # Tangents take the ctx AOTAutograd traced the output with (the ctx holds
        # bookkeeping, not values that change the math).
        return type(self)(self.elem, **dict(zip(self.CTX, expected_metadata)))

    @classmethod
    def on_op(cls, func: Any, first: "WrapperTensor") -> None:
        """Called before ``func`` runs, with the first argument of this class."""

    @classmethod
    def before_op(cls, func: Any, args: tuple, kwargs: dict) -> None:
        first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, cls)), None)
        if first is not None:
            cls.on_op(func, first)

    @classmethod
    def wrap(cls, out: torch.Tensor, first: "WrapperTensor | None") -> "WrapperTensor":
        ctx = {n: getattr(first, n) for n in cls.CTX} if first is not None else {}
        return cls(out, **ctx)

    @classmethod
    def alias(cls, out: torch.Tensor, first: "WrapperTensor") -> "WrapperTensor":
        """``detach``/``alias`` (``nn.Parameter`` detaches its data): the same state."""
        r = cls.wrap(out, first)
        for name, value in vars(first).items():
            if name != "elem" and name not in r.__dict__:
                r.__dict__[name] = value
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        cls.before_op(func, args, kwargs)
        first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, cls)), None)
        out = func(*tree_map_only(cls, lambda t: t.elem, args), **tree_map_only(cls, lambda t: t.elem, kwargs))
        if not isinstance(out, (torch.Tensor, tuple, list)):
            return out
        if func in _ALIASING and isinstance(out, torch.Tensor) and first is not None:
            return cls.alias(out, first) if cls.ALIAS_KEEPS_STATE else cls.wrap(out, first)
        if not cls.WRAP_OUTPUTS and func not in cls.WRAP_OPS:
            return out
        return tree_map_only(torch.Tensor, lambda t: cls.wrap(t, first), out)
