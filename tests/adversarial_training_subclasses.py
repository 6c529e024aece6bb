"""Writing tensor subclasses used by test_adversarial_training.py, written from scratch.

- ``AmaxWeight`` and its variants: a float8-style weight. Every mm / addmm / matmul /
  linear that sees the weight itself records the amax of the activation and of the weight
  into a rolling ``amax_history`` tensor and bumps an int ``step``. The weight is stored
  (in_features, out_features) and used as ``x @ w`` so the matmul sees the parameter itself
  (``F.linear`` would first ``t()`` it and the write would land on a temporary).
  Variants: history in the flatten list or in ``__dict__``; step in the flatten ctx or in
  ``__dict__``; history rolled with ``torch.roll`` + setitem, built out of place with
  ``torch.cat``, or updated in place in the existing tensor.
- ``CountingParam``: a parameter that counts the in-place updates applied to it
  (``add_``, ``mul_``, ``addcdiv_``, ``lerp_``, ``_foreach_*_`` ...) in ``n_updates`` and
  remembers the last update's op name in ``last_update``.
- ``Int8Weight``: int8 data + per-row scale; dispatch dequantizes and caches the dequantized
  weight in ``_dq_cache`` keyed by ``_dq_version`` (the int8 tensor's ``_version``).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten

_MATMULS = {
    aten.mm.default,
    aten.addmm.default,
    aten.matmul.default,
    aten.linear.default,
    aten.bmm.default,
}

_ALIASING = {aten.detach.default, aten.alias.default}


def _is_inplace(func) -> bool:
    schema = func._schema
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


# --------------------------------------------------------------------------- float8-style
class AmaxWeightBase(torch.Tensor):
    HIST_IN_FLATTEN = False
    STEP_IN_CTX = False
    UPDATE = "roll"  # "roll" | "cat" | "inplace"
    DELAYED = False  # delayed scaling: the op uses a scale derived from the history so far

    @staticmethod
    def __new__(cls, data, amax_history=None, step=None, **_):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data, amax_history=None, step=None, **_):
        self._data = data
        if amax_history is not None:
            self.amax_history = amax_history
        if step is not None:
            self.step = step

    @classmethod
    def make(cls, data, history_len=4):
        return cls(data, torch.zeros(history_len, 2), 0)

    def __repr__(self):
        return f"{type(self).__name__}({self._data!r}, step={getattr(self, 'step', None)})"

    def __tensor_flatten__(self):
        names = ["_data"]
        if self.HIST_IN_FLATTEN:
            names.append("amax_history")
        ctx = {"step": self.step} if self.STEP_IN_CTX else {}
        return names, ctx

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        # Only what the flatten names: state outside it lives in __dict__ of the real object.
        return cls(inner["_data"], inner.get("amax_history"), ctx.get("step"))

    def _state_kwargs(self):
        return {"amax_history": self.__dict__.get("amax_history"), "step": self.__dict__.get("step")}

    def _record(self, act: torch.Tensor) -> None:
        amax = torch.stack([act.detach().abs().amax(), self._data.detach().abs().amax()]).to(torch.float32)
        if self.UPDATE == "roll":
            hist = torch.roll(self.amax_history, 1, 0)
            hist[0] = amax
            self.amax_history = hist
        elif self.UPDATE == "cat":
            self.amax_history = torch.cat([amax[None], self.amax_history[:-1]])
        else:  # in place, in the existing tensor: no attribute write at all
            self.amax_history.copy_(torch.roll(self.amax_history, 1, 0))
            self.amax_history[0] = amax
        self.step = self.step + 1

    def _fake_quantized(self) -> torch.Tensor:
        """The weight as the op uses it under delayed scaling: scaled by the amax history
        recorded so far (before this op's record), rounded on a coarse grid, unscaled."""
        w_amax = self.amax_history[:, 1].max().clamp(min=1e-4)
        scale = 8.0 / w_amax
        return torch.round(self._data * scale) / scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        used = {}
        if func in _MATMULS:
            ws = [a for a in args if isinstance(a, AmaxWeightBase)]
            acts = [a for a in args if isinstance(a, torch.Tensor) and not isinstance(a, AmaxWeightBase)]
            for w in ws:
                if w.DELAYED and w.step > 0:
                    used[id(w)] = w._fake_quantized()
                w._record(acts[-1] if acts else w._data)
        if func in _ALIASING:
            self = args[0]
            return type(self)(func(self._data), **self._state_kwargs())
        unwrapped_args = tree_map(
            lambda t: used.get(id(t), t._data) if isinstance(t, AmaxWeightBase) else t, args
        )
        unwrapped_kwargs = tree_map(lambda t: t._data if isinstance(t, AmaxWeightBase) else t, kwargs)
        out = func(*unwrapped_args, **unwrapped_kwargs)
        if _is_inplace(func) and args and isinstance(args[0], AmaxWeightBase):
            return args[0]
        return out


def _variant(name, hist_in_flatten, step_in_ctx, update, delayed=False):
    return type(name, (AmaxWeightBase,), {
        "HIST_IN_FLATTEN": hist_in_flatten, "STEP_IN_CTX": step_in_ctx, "UPDATE": update,
        "DELAYED": delayed, "__module__": __name__,
    })


AmaxDictDict = _variant("AmaxDictDict", False, False, "roll")  # history and step in __dict__
AmaxDictCtx = _variant("AmaxDictCtx", False, True, "roll")  # history in __dict__, step in ctx
AmaxFlatDict = _variant("AmaxFlatDict", True, False, "roll")  # history flattened, step in __dict__
AmaxFlatCtx = _variant("AmaxFlatCtx", True, True, "roll")  # history flattened, step in ctx
AmaxDictDictCat = _variant("AmaxDictDictCat", False, False, "cat")
AmaxFlatDictCat = _variant("AmaxFlatDictCat", True, False, "cat")
AmaxDictInplace = _variant("AmaxDictInplace", False, False, "inplace")
AmaxFlatInplace = _variant("AmaxFlatInplace", True, False, "inplace")
# delayed scaling: outputs depend on the history earlier steps wrote
AmaxDelayedDict = _variant("AmaxDelayedDict", False, False, "roll", delayed=True)
AmaxDelayedFlat = _variant("AmaxDelayedFlat", True, False, "cat", delayed=True)

AMAX_VARIANTS = {
    c.__name__: c
    for c in (AmaxDictDict, AmaxDictCtx, AmaxFlatDict, AmaxFlatCtx, AmaxDictDictCat, AmaxFlatDictCat,
              AmaxDictInplace, AmaxFlatInplace, AmaxDelayedDict, AmaxDelayedFlat)
}


class Float8StyleLinear(torch.nn.Module):
    def __init__(self, cls, in_f, out_f, *, use="matmul"):
        super().__init__()
        w = torch.randn(in_f, out_f) / in_f ** 0.5
        self.weight = torch.nn.Parameter(cls.make(w))
        self.bias = torch.nn.Parameter(torch.randn(out_f) * 0.1)
        self.use = use

    def forward(self, x):
        if self.use == "addmm":
            return torch.addmm(self.bias, x, self.weight)
        if self.use == "mm":
            return torch.mm(x, self.weight) + self.bias
        return torch.matmul(x, self.weight) + self.bias


class Float8TiedMLP(torch.nn.Module):
    """One square float8-style layer applied twice per forward: two records per step on the
    same parameter in one graph."""

    def __init__(self, cls, d=6, d_out=3):
        super().__init__()
        self.fc = Float8StyleLinear(cls, d, d, use="mm")
        self.head = torch.nn.Linear(d, d_out)

    def forward(self, x):
        return self.head(torch.relu(self.fc(torch.relu(self.fc(x)))))


class Float8MLP(torch.nn.Module):
    def __init__(self, cls, d_in=6, d_hidden=8, d_out=3):
        super().__init__()
        self.fc1 = Float8StyleLinear(cls, d_in, d_hidden, use="addmm")
        self.fc2 = Float8StyleLinear(cls, d_hidden, d_out, use="matmul")

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


# --------------------------------------------------------------------------- update counting
class CountingParam(torch.Tensor):
    """Counts in-place updates applied to it (the optimizer's), in ``n_updates`` (ctx or
    ``__dict__``, per class), and the last update's op (overload packet) in ``last_update``."""

    COUNT_IN_CTX = False

    @staticmethod
    def __new__(cls, data, n_updates=None, last_update=None):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data, n_updates=None, last_update=None):
        self._data = data
        if n_updates is not None:
            self.n_updates = n_updates
        if last_update is not None:
            self.last_update = last_update

    @classmethod
    def make(cls, data):
        return cls(data, 0, "none")

    def __repr__(self):
        return f"{type(self).__name__}({self._data!r}, n_updates={getattr(self, 'n_updates', None)})"

    def __tensor_flatten__(self):
        ctx = {"n_updates": self.n_updates, "last_update": self.last_update} if self.COUNT_IN_CTX else {}
        return ["_data"], ctx

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["_data"], ctx.get("n_updates"), ctx.get("last_update"))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIASING:
            self = args[0]
            return type(self)(func(self._data), self.__dict__.get("n_updates"), self.__dict__.get("last_update"))
        unwrap = lambda t: t._data if isinstance(t, CountingParam) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if _is_inplace(func) and func not in (aten.copy_.default,):
            # the mutated arguments: the first one, or every param of a foreach list
            first = args[0]
            targets = [t for t in (first if isinstance(first, (list, tuple)) else [first]) if isinstance(t, CountingParam)]
            for t in targets:
                t.n_updates = t.n_updates + 1
                # the op's name without the overload: a compiled optimizer may pick another
                # overload of the same op (torch's choice, not a state question)
                t.last_update = func.overloadpacket.__name__
            if isinstance(first, CountingParam):
                return first
        return out


class CountingParamCtx(CountingParam):
    COUNT_IN_CTX = True


# --------------------------------------------------------------------------- int8 weight-only
class Int8Weight(torch.Tensor):
    """int8 ``qdata`` and per-row ``scale`` (both flattened). Dispatch dequantizes and caches
    the dequantized weight in ``_dq_cache`` with ``_dq_version`` = ``qdata._version`` at the
    time of caching; a later op reuses the cache only while the version matches."""

    @staticmethod
    def __new__(cls, qdata, scale, shape_dtype=torch.float32):
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, dtype=shape_dtype, device=qdata.device, requires_grad=False,
        )

    def __init__(self, qdata, scale, shape_dtype=torch.float32):
        self.qdata = qdata
        self.scale = scale

    @classmethod
    def quantize(cls, w: torch.Tensor):
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-6) / 127.0
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return cls(q, scale, w.dtype)

    def __repr__(self):
        return f"Int8Weight({self.qdata!r})"

    def __tensor_flatten__(self):
        return ["qdata", "scale"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["qdata"], inner["scale"])

    def dequantize(self) -> torch.Tensor:
        version = self.qdata._version
        cache = getattr(self, "_dq_cache", None)
        if cache is not None and getattr(self, "_dq_version", None) == version:
            return cache
        dq = self.qdata.to(torch.float32) * self.scale
        self._dq_cache = dq
        self._dq_version = version
        return dq

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIASING:
            self = args[0]
            return type(self)(func(self.qdata), func(self.scale))
        unwrap = lambda t: t.dequantize() if isinstance(t, Int8Weight) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


class Int8WeightNoVersion(Int8Weight):
    """Same, but the cache key is a user-bumped ``data_version`` attribute in ``__dict__``
    (the user increments it after updating ``qdata`` in place)."""

    def dequantize(self) -> torch.Tensor:
        version = getattr(self, "data_version", 0)
        cache = getattr(self, "_dq_cache", None)
        if cache is not None and getattr(self, "_dq_version", None) == version:
            return cache
        dq = self.qdata.to(torch.float32) * self.scale
        self._dq_cache = dq
        self._dq_version = version
        return dq
