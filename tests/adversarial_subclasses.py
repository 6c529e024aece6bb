"""Wrapper subclasses for tests/test_adversarial.py, written the way float8 / int8 / logging
wrapper authors write them (each class from scratch, no shared base beyond two tiny helpers).

Every class keeps its dense data in ``elem`` (or ``inner`` for the nested ones) and writes
attributes on its inputs inside ``__torch_dispatch__``.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

import dynamo_ext

aten = torch.ops.aten


def _wrapper(cls, elem, requires_grad=False):
    return torch.Tensor._make_wrapper_subclass(
        cls,
        elem.shape,
        strides=elem.stride(),
        storage_offset=elem.storage_offset(),
        dtype=elem.dtype,
        device=elem.device,
        requires_grad=requires_grad,
    )


def _first(cls, args, kwargs=None):
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, cls):
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, cls):
                    return b
    return None


def _run(cls, func, args, kwargs, rewrap, inner="elem"):
    """Unwrap, run, rewrap; in-place ops return the mutated wrapper itself."""
    kwargs = kwargs or {}
    u_args = tree_map_only(cls, lambda t: getattr(t, inner), args)
    u_kwargs = tree_map_only(cls, lambda t: getattr(t, inner), kwargs)
    out = func(*u_args, **u_kwargs)
    if func._schema.is_mutable and args and isinstance(args[0], cls):
        return args[0]
    if not isinstance(out, (torch.Tensor, list, tuple)):
        return out
    return tree_map_only(torch.Tensor, rewrap, out)


# =========================================================================== 1. own state
# 1a: a default set in __new__, outside the flatten ctx, bumped in dispatch.


class StepTensor(torch.Tensor):
    """Counts the multiplications it took part in (``step`` starts at 0 in ``__new__``)."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r.step = 0
        return r

    def __repr__(self):
        return f"StepTensor({self.elem}, step={self.step})"

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            for a in args:
                if isinstance(a, cls):
                    a.step = a.step + 1
        return _run(cls, func, args, kwargs, cls)


# 1b: the author's __tensor_unflatten__ sets defaults for bookkeeping not in the ctx.


class UnflattenDefaultTensor(torch.Tensor):
    """``hits`` / ``last_op`` are not in the ctx; ``__tensor_unflatten__`` resets them."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        r = cls(inner["elem"])
        r.hits = 0
        r.last_op = None
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            x.hits = getattr(x, "hits", 0) + 1
            x.last_op = f"mul#{x.hits}"
        return _run(cls, func, args, kwargs, cls)


# 1c: attribute names that are also torch.Tensor methods (amax, values).


class RunningAmaxTensor(torch.Tensor):
    """float8-style running amax, stored in an attribute called ``amax`` (shadows Tensor.amax)."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r.amax = torch.zeros((), dtype=elem.dtype)
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            x.amax = torch.maximum(x.amax, x.elem.abs().max())
        return _run(cls, func, args, kwargs, cls)


class LazyAmaxTensor(torch.Tensor):
    """Same, lazily initialised: ``self.amax = None`` in __new__, the first mul sets it."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r.amax = None
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            cur = x.elem.abs().max()
            x.amax = cur if x.amax is None else torch.maximum(x.amax, cur)
        return _run(cls, func, args, kwargs, cls)


class ValuesAccumTensor(torch.Tensor):
    """Accumulates the inputs it saw in ``values`` (a Tensor method name), probed with getattr."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            prev = getattr(x, "values", None)  # the bound method Tensor.values until first set
            if isinstance(prev, torch.Tensor):
                x.values = prev + x.elem
            else:
                x.values = x.elem.clone()
        return _run(cls, func, args, kwargs, cls)


# 1d: class-level defaults.


class ClassDefaultCacheTensor(torch.Tensor):
    """Dequantized bf16 cache, ``cache = None`` on the class, not in the flatten list."""

    cache = None

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            if x.cache is None:
                x.cache = x.elem.to(torch.bfloat16).to(x.elem.dtype)
            # compute with the cached (rounded) weight, as a quantized kernel would
            u = [x.cache if a is x else (a.elem if isinstance(a, cls) else a) for a in args]
            return cls(func(*u, **kwargs))
        return _run(cls, func, args, kwargs, cls)


class ClassDefaultScaleTensor(torch.Tensor):
    """``scale = 1.0`` on the class; each mul decays the instance's scale (written to __dict__)."""

    scale = 1.0

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            x.scale = x.scale * 0.5
        return _run(cls, func, args, kwargs, cls)


class ProbeCacheTensor(torch.Tensor):
    """Cache probed with getattr(x, "cache", None), rebuilt when absent; the op uses it."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            if getattr(x, "cache", None) is None:
                x.cache = x.elem.to(torch.bfloat16).to(x.elem.dtype)
                x.builds = getattr(x, "builds", 0) + 1
            u = [x.cache if a is x else (a.elem if isinstance(a, cls) else a) for a in args]
            return cls(func(*u, **kwargs))
        return _run(cls, func, args, kwargs, cls)


# =========================================================================== 2. __getattr__


class MetaServedTensor(torch.Tensor):
    """Quantization params live in a ctx tuple; ``scale`` / ``zero_point`` served by __getattr__."""

    @staticmethod
    def __new__(cls, elem, meta=(1.0, 0), requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r._qmeta = tuple(meta)
        return r

    def __getattr__(self, name):
        if name == "scale":
            return self._qmeta[0]
        if name == "zero_point":
            return self._qmeta[1]
        raise AttributeError(name)

    def __tensor_flatten__(self):
        return ["elem"], self._qmeta

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        x = _first(cls, args, kwargs)
        meta = x._qmeta if x is not None else (1.0, 0)
        if func is aten.mul.Tensor:
            s = getattr(x, "scale", 1.0)
            x.applied_scale = s * 2
            x.applied_zp = getattr(x, "zero_point", None)
            out = _run(cls, func, args, kwargs, lambda t: cls(t, meta))
            return cls(out.elem * s, meta)
        return _run(cls, func, args, kwargs, lambda t: cls(t, meta))


class OverrideServedTensor(torch.Tensor):
    """``scale`` served by __getattr__ from a plain (non-ctx) attribute the user may set."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        return r

    def __getattr__(self, name):
        if name == "scale":
            try:
                return object.__getattribute__(self, "user_scale")
            except AttributeError:
                return 1.0
        raise AttributeError(name)

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            x.last_scale = getattr(x, "scale", 1.0)
        return _run(cls, func, args, kwargs, cls)


class ForwardingGetattrTensor(torch.Tensor):
    """A wrapper that forwards unknown attribute reads to the wrapped tensor (a common idiom)."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        return r

    def __getattr__(self, name):
        if name == "elem":
            raise AttributeError(name)
        return getattr(self.elem, name)

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            x.calls = getattr(x, "calls", 0) + 1
            x.last_tag = getattr(x, "tag", "untagged")  # forwarded to elem.tag when set there
        return _run(cls, func, args, kwargs, cls)


# =========================================================================== 3. outside reads


class VersionedQuantWeight(torch.Tensor):
    """int8 weight-only quantization with a dequantized cache, rebuilt when elem changes."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r.cache = None
        r.cache_version = -1
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @staticmethod
    def _dequant(w):
        scale = w.abs().amax() / 127.0
        return torch.clamp(torch.round(w / scale), -127, 127) * scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mm.default and isinstance(args[1], cls):
            w = args[1]
            if w.cache is None or w.cache_version != w.elem._version:
                w.cache = cls._dequant(w.elem)
                w.cache_version = w.elem._version
            a = args[0].elem if isinstance(args[0], cls) else args[0]
            return func(a, w.cache)
        return _run(cls, func, args, kwargs, cls)


# A module global, read in dispatch.
AMAX_MARGIN = 1.0
OUTPUT_GAIN = 1.0


class GlobalMarginTensor(torch.Tensor):
    """Records the amax scaled by the module global AMAX_MARGIN (output unaffected)."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            x.margin = AMAX_MARGIN
            x.scaled_amax = x.elem.abs().max() * AMAX_MARGIN
        return _run(cls, func, args, kwargs, cls)


class GlobalGainTensor(torch.Tensor):
    """Multiplies every mul output by the module global OUTPUT_GAIN and records it."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            x.gain = OUTPUT_GAIN
            out = _run(cls, func, args, kwargs, cls)
            return cls(out.elem * OUTPUT_GAIN)
        return _run(cls, func, args, kwargs, cls)


def make_clipping_class():
    """A class built in a factory; dispatch reads ``cfg`` and ``threshold`` from the closure."""
    cfg = {"clip": 1.0}
    threshold = 0.5

    def set_threshold(v):
        nonlocal threshold
        threshold = v

    class ClippingTensor(torch.Tensor):
        @staticmethod
        def __new__(cls, elem, requires_grad=False):
            r = _wrapper(cls, elem, requires_grad)
            r.elem = elem
            return r

        def __tensor_flatten__(self):
            return ["elem"], None

        @classmethod
        def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
            return cls(inner["elem"])

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            if func is aten.mul.Tensor:
                x = _first(cls, args)
                x.clip_used = cfg["clip"]
                x.mode = "strict" if threshold > 1.0 else "loose"
                x.clipped_frac = (x.elem.abs() > cfg["clip"]).to(x.elem.dtype).mean()
            return _run(cls, func, args, kwargs, cls)

    return ClippingTensor, cfg, set_threshold


# =========================================================================== 4. equal writes


class SameValueTensor(torch.Tensor):
    """Writes values that compare equal to what is already there (in and out of the ctx)."""

    @staticmethod
    def __new__(cls, elem, armed=True, n=1, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r.armed = armed  # ctx
        r.n = n  # ctx, an int at first
        r.enabled = True  # outside the ctx
        r.zero = 0.0  # outside the ctx
        r.cache = elem.clone()  # outside the ctx, equal to elem
        r.seen_dtype = elem.dtype
        return r

    def __tensor_flatten__(self):
        return ["elem"], (self.armed, self.n)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        x = _first(cls, args, kwargs)
        ctx = (x.armed, x.n) if x is not None else (True, 1)
        if func is aten.mul.Tensor:
            x.armed = True  # already True
            x.n = 1.0  # was the int 1
            x.enabled = 1  # was True
            x.zero = -0.0  # was 0.0
            x.cache = x.elem.clone()  # a new tensor, equal in value
            x.seen_dtype = torch.float32  # already float32
        return _run(cls, func, args, kwargs, lambda t: cls(t, *ctx))


# =========================================================================== 5. other objects
# 5a: nested subclasses.


class CountedInner(torch.Tensor):
    """Inner subclass that counts its own ops in its ctx (``ops``)."""

    @staticmethod
    def __new__(cls, elem, ops=0, seen=0):
        r = _wrapper(cls, elem)
        r.elem = elem
        r.ops = ops
        r.seen = seen
        return r

    def __tensor_flatten__(self):
        return ["elem"], (self.ops, self.seen)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            x.ops = x.ops + 1
        return _run(cls, func, args, kwargs, cls)


class PlainInner(torch.Tensor):
    """Inner subclass that writes nothing; its ctx ``seen`` is written by the outer one."""

    @staticmethod
    def __new__(cls, elem, seen=0):
        r = _wrapper(cls, elem)
        r.elem = elem
        r.seen = seen
        return r

    def __tensor_flatten__(self):
        return ["elem"], (self.seen,)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(cls, func, args, kwargs, cls)


class OuterTensor(torch.Tensor):
    """Outer wrapper over an inner subclass (``inner``); mul records on the inner one."""

    @staticmethod
    def __new__(cls, inner, requires_grad=False):
        r = _wrapper(cls, inner, requires_grad)
        r.inner = inner
        return r

    def __tensor_flatten__(self):
        return ["inner"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            x.inner.seen = x.inner.seen + 1
            x.outer_calls = getattr(x, "outer_calls", 0) + 1
        return _run(cls, func, args, kwargs, cls, inner="inner")


class QuietOuterTensor(OuterTensor):
    """Outer wrapper that writes only on itself: writes on the inner subclass come from the
    inner subclass's own dispatch."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            x.outer_calls = getattr(x, "outer_calls", 0) + 1
        return _run(cls, func, args, kwargs, cls, inner="inner")


# 5b: nn.Parameter subclasses.


class TrackedWeight(torch.Tensor):
    """A weight that records forward matmuls and optimizer updates on itself."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mm.default and isinstance(args[1], cls):
            w = args[1]
            w.fwd_calls = getattr(w, "fwd_calls", 0) + 1
            a = args[0].elem if isinstance(args[0], cls) else args[0]
            w.act_amax = a.abs().max()
        elif func in (aten.add_.Tensor, aten.sub_.Tensor) and isinstance(args[0], cls):
            w = args[0]
            w.updates = getattr(w, "updates", 0) + 1
            g = args[1].elem if isinstance(args[1], cls) else args[1]
            w.last_update_norm = g.norm()
        return _run(cls, func, args, kwargs, cls)


# 5c: an object reachable from the ctx, registered with dynamo_ext.


@dynamo_ext.register_ctx_state
class LayerStats:
    """Shared per-layer statistics (like DTensor's MaskBuffer): a counter and a tensor."""

    def __init__(self):
        self.count = 0
        self.last_amax = None
        self.ops = ()


class StatsTensor(torch.Tensor):
    @staticmethod
    def __new__(cls, elem, stats, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r.stats = stats
        return r

    def __tensor_flatten__(self):
        return ["elem"], self.stats

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        x = _first(cls, args, kwargs)
        stats = x.stats
        if func in (aten.mul.Tensor, aten.add.Tensor):
            stats.count += 1
            stats.last_amax = x.elem.abs().max()
            stats.ops = stats.ops + (func.__name__,)
        return _run(cls, func, args, kwargs, lambda t: cls(t, stats))


class EveryOpStatsTensor(StatsTensor):
    """Logs every op it is handed into the shared holder, outputs included (an op trace)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        stats = _first(cls, args, kwargs).stats
        stats.ops = stats.ops + (func.overloadpacket.__name__,)
        return _run(cls, func, args, kwargs, lambda t: cls(t, stats))


class OpLogTensor(torch.Tensor):
    """Logs every op on each of its instances the op is handed (``ops``, a tuple set in
    __new__), outputs rewrapped: a logging/profiling wrapper."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r.ops = ()
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        for a in tree_leaves((args, kwargs or {})):
            if isinstance(a, cls):
                a.ops = a.ops + (func.overloadpacket.__name__,)
        return _run(cls, func, args, kwargs, cls)


class TupleCtxStatsTensor(StatsTensor):
    """Same, with the holder inside a ctx tuple."""

    def __tensor_flatten__(self):
        return ["elem"], (self.stats,)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], ctx[0])


class UnregisteredStats:
    """The same holder, but the author forgot register_ctx_state. All holders compare equal
    (a ctx must compare equal to its copy for Dynamo's metadata guard, stock requirement)."""

    def __init__(self):
        self.count = 0

    def __eq__(self, other):
        return type(other) is type(self)

    def __hash__(self):
        return hash(type(self))


class UnregisteredStatsTensor(torch.Tensor):
    @staticmethod
    def __new__(cls, elem, stats):
        r = _wrapper(cls, elem)
        r.elem = elem
        r.stats = stats
        return r

    def __tensor_flatten__(self):
        return ["elem"], self.stats

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        x = _first(cls, args, kwargs)
        if func is aten.mul.Tensor:
            x.stats.count += 1
        return _run(cls, func, args, kwargs, lambda t: cls(t, x.stats))


# 5d: a counter written by a backward op on a saved input.


class BwdCountedWeight(torch.Tensor):
    """``aten.t`` on this weight only happens in mm's backward (grad_x = grad @ w.t())."""

    @staticmethod
    def __new__(cls, elem, bwd=0):
        r = _wrapper(cls, elem)
        r.elem = elem
        r.bwd = bwd
        return r

    def __tensor_flatten__(self):
        return ["elem"], (self.bwd,)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        x = _first(cls, args, kwargs)
        if func is aten.t.default and x is args[0]:
            x.bwd = x.bwd + 1
        return _run(cls, func, args, kwargs, cls)


class BwdCountedWeightOutOfCtx(torch.Tensor):
    """Same, the counter outside the ctx (plain __dict__, set in __new__)."""

    @staticmethod
    def __new__(cls, elem):
        r = _wrapper(cls, elem)
        r.elem = elem
        r.bwd = 0
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        x = _first(cls, args, kwargs)
        if func is aten.t.default and x is args[0]:
            x.bwd = x.bwd + 1
        return _run(cls, func, args, kwargs, cls)


# =========================================================================== 6. shapes


class ShapeRecorder(torch.Tensor):
    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r.total_rows = 0
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            x.last_shape = x.elem.shape
            x.numel_seen = x.elem.numel()
            x.rows2 = x.elem.shape[0] * 2
            x.total_rows = x.total_rows + x.elem.shape[0]
            x.row_ids = torch.arange(x.elem.shape[0])
            x.desc = f"{x.elem.shape[0]}x{x.elem.shape[1]}"
        return _run(cls, func, args, kwargs, cls)


# =========================================================================== 7. float8-style

FP8_MAX = 448.0


class Float8Weight(torch.Tensor):
    """Delayed-scaling float8 weight: ``step`` from __new__, an amax history rolled per matmul.

    With ``hist_inner=True`` the history is an inner tensor (listed by __tensor_flatten__),
    otherwise a plain attribute outside the flatten contract."""

    HIST_INNER = False

    @staticmethod
    def __new__(cls, elem, history=None, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r.amax_history = history if history is not None else torch.zeros(4, dtype=elem.dtype)
        r.step = 0
        return r

    def __tensor_flatten__(self):
        return (["elem", "amax_history"] if self.HIST_INNER else ["elem"]), None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], inner.get("amax_history"))

    @staticmethod
    def _fake_quant(w, scale):
        return torch.clamp(w * scale, -FP8_MAX, FP8_MAX).to(torch.bfloat16).to(w.dtype) / scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mm.default and isinstance(args[1], cls):
            w = args[1]
            hist = w.amax_history
            # delayed scaling: scale from the history before this step's amax
            scale = FP8_MAX / torch.clamp(hist.max(), min=1e-12)
            scale = torch.where(hist.max() > 0, scale, torch.ones_like(scale))
            new_hist = torch.roll(hist, 1)
            new_hist[0] = w.elem.abs().max()
            w.amax_history = new_hist
            w.step = w.step + 1
            w.last_scale = scale
            a = args[0].elem if isinstance(args[0], cls) else args[0]
            return func(a, cls._fake_quant(w.elem, scale))
        return _run(cls, func, args, kwargs, lambda t: cls(t, None))


class Float8WeightInnerHist(Float8Weight):
    HIST_INNER = True


class OtherOperandAmaxWeight(torch.Tensor):
    """float8 delayed scaling of the other operand: each op the weight is handed counts
    (``n_seen``, set in __new__), and a ``mul``/``mm`` records the other operand's amax, the
    activation's in the forward and the incoming gradient's in the backward. Results are
    plain tensors (the weight is not differentiated)."""

    @staticmethod
    def __new__(cls, elem):
        r = _wrapper(cls, elem)
        r.elem = elem
        r.n_seen = 0
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w = _first(cls, args)
        w.n_seen = w.n_seen + 1
        if func in (aten.mul.Tensor, aten.mm.default):
            other = args[1] if args[0] is w else args[0]
            w.other_amax = other.abs().max()
        rewrap = cls if func is aten.detach.default else (lambda t: t)
        return _run(cls, func, args, kwargs, rewrap)


class SlotScaledWeight(torch.Tensor):
    """A quantized-style weight keeping its dequantization ``scale`` in ``__slots__`` (set by
    the user, absent until then) and counting its uses in a slot: results are scaled."""

    __slots__ = ("elem", "scale", "uses")

    @staticmethod
    def __new__(cls, elem):
        r = _wrapper(cls, elem)
        r.elem = elem
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w = _first(cls, args)
        out = _run(cls, func, args, kwargs, lambda t: t)
        if func is aten.detach.default:
            return cls(out)
        if func is aten.mm.default:
            return out * getattr(w, "scale", 1.0)
        return out


class SlotCountedWeight(SlotScaledWeight):
    """Same, counting each ``mm`` in its ``uses`` slot."""

    __slots__ = ()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mm.default:
            w = _first(cls, args)
            w.uses = 1
        return super().__torch_dispatch__(func, types, args, kwargs)


class SlotCtxWeight(torch.Tensor):
    """Its ``scale`` in a slot, carried by the flatten ctx (DTensor keeps its spec so)."""

    __slots__ = ("elem", "scale")

    @staticmethod
    def __new__(cls, elem, scale):
        r = _wrapper(cls, elem)
        r.elem = elem
        r.scale = scale
        return r

    def __tensor_flatten__(self):
        return ["elem"], (self.scale,)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], ctx[0])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w = _first(cls, args)
        out = _run(cls, func, args, kwargs, lambda t: t)
        if func is aten.detach.default:
            return cls(out, w.scale)
        return out * w.scale if func is aten.mm.default else out


# =========================================================================== 8. self-aliasing flatten


class AliasCacheTensor(torch.Tensor):
    """``cache`` starts as an alias of ``elem``; both are listed by __tensor_flatten__.

    mul toggles: an aliased cache is replaced by a rounded copy, a copy by the alias again."""

    @staticmethod
    def __new__(cls, elem, cache=None, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r.cache = elem if cache is None else cache
        return r

    def __tensor_flatten__(self):
        return ["elem", "cache"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], inner["cache"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            if x.cache is x.elem:
                x.cache = x.elem.to(torch.bfloat16).to(x.elem.dtype)
            else:
                x.cache = x.elem
            u = [a.cache if isinstance(a, cls) else a for a in args]
            return cls(func(*u, **kwargs))
        return _run(cls, func, args, kwargs, cls)


class AliasWriteTensor(torch.Tensor):
    """``cache`` (an inner tensor) starts as a copy; mul makes it an alias of ``elem``."""

    @staticmethod
    def __new__(cls, elem, cache=None, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r.cache = elem.clone() if cache is None else cache
        return r

    def __tensor_flatten__(self):
        return ["elem", "cache"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], inner["cache"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            x.cache = x.elem
        return _run(cls, func, args, kwargs, cls)


# =========================================================================== 9. graph breaks


class TwoOpTensor(torch.Tensor):
    """A call-counting wrapper: mul and add both write; ``calls`` and ``trace`` (a tuple) in
    the ctx, ``last`` (a tensor) outside it."""

    @staticmethod
    def __new__(cls, elem, calls=0, trace=(), requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r.calls = calls
        r.trace = trace
        return r

    def __tensor_flatten__(self):
        return ["elem"], (self.calls, self.trace)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        x = _first(cls, args, kwargs)
        ctx = (x.calls, x.trace) if x is not None else (0, ())
        if func in (aten.mul.Tensor, aten.add.Tensor) and isinstance(args[0], cls):
            x = args[0]
            x.calls = x.calls + 1
            x.trace = x.trace + (f"{func.__name__}@{x.calls}",)
            x.last = x.elem * x.calls
        return _run(cls, func, args, kwargs, lambda t: cls(t, *ctx))


class HistoryListTensor(torch.Tensor):
    """mul writes fine values (``n`` in the ctx, a tensor outside it); sub records a *list*
    history (refused: mutable_value)."""

    @staticmethod
    def __new__(cls, elem, n=0, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r.n = n
        return r

    def __tensor_flatten__(self):
        return ["elem"], (self.n,)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        x = _first(cls, args, kwargs)
        n = x.n if x is not None else 0
        if func is aten.mul.Tensor and isinstance(args[0], cls):
            x = args[0]
            x.n = x.n + 1
            x.scale_seen = x.elem.abs().max()
        elif func is aten.sub.Tensor and isinstance(args[0], cls):
            x = args[0]
            x.history = [x.n, "sub"]  # a fresh list: cannot be replayed
        return _run(cls, func, args, kwargs, lambda t: cls(t, n))


class HistoryListDictCounterTensor(HistoryListTensor):
    """Same, with ``n`` outside the ctx (set to 0 in __new__, a plain __dict__ entry)."""

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])


# =========================================================================== logging wrapper

OP_LOG: list[str] = []


class GlobalLoggingTensor(torch.Tensor):
    """Logs each op it sees to a module-level list (the LoggingTensor idiom)."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (aten.mul.Tensor, aten.add.Tensor):
            OP_LOG.append(func.__name__)
        return _run(cls, func, args, kwargs, cls)


class InstanceLogTensor(torch.Tensor):
    """Appends to a list it owns (``self.log``, created in __new__)."""

    @staticmethod
    def __new__(cls, elem, requires_grad=False):
        r = _wrapper(cls, elem, requires_grad)
        r.elem = elem
        r.log = []
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor:
            x = _first(cls, args)
            x.log.append(func.__name__)
        return _run(cls, func, args, kwargs, cls)
