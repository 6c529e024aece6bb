"""``__tensor_unflatten__`` changing the registered state object its ctx holds. Eager never
unflattens; torch does while compiling and, on the AOT backends, for the outputs of each
call. Refused with the object as it was under ``fullgraph=True``, eager under
``fullgraph=False`` (outside round 42: the caller's object counted every rebuild torch made,
silently). An unflatten that only reads the object compiles."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils._pytree import tree_map

import dynamo_ext

BACKENDS = ["eager", "aot_eager"]


@dynamo_ext.register_ctx_state
class Registry:
    def __init__(self):
        self.ops = 0
        self.rebuilds = 0
        self.scale = 2.0


class Counted(torch.Tensor):
    """Dispatch counts ops on the shared registry; ``REBUILD`` says what unflatten does."""

    REBUILD = "count"

    @staticmethod
    def __new__(cls, elem, reg):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem, reg):
        self.elem, self.reg = elem, reg

    def __tensor_flatten__(self):
        return ["elem"], self.reg

    @classmethod
    def __tensor_unflatten__(cls, inner, reg, outer_size, outer_stride):
        if cls.REBUILD == "count":
            reg.rebuilds += 1
        elif cls.REBUILD == "stamp":
            reg.last_rebuilt = cls.__name__
        return cls(inner["elem"], reg)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w = next(a for a in args if isinstance(a, Counted))
        w.reg.ops += 1
        unwrap = lambda t: t.elem * t.reg.scale if isinstance(t, Counted) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: cls(t, w.reg) if isinstance(t, torch.Tensor) else t, out)


class Stamped(Counted):
    REBUILD = "stamp"


class ReadsOnly(Counted):
    REBUILD = "read"


def fn(x, y):
    return (x * y).sin()


def _run(f, cls):
    reg = Registry()
    seen = []
    for i in range(3):
        try:
            out = f(cls(torch.full((3,), float(i)), reg), torch.ones(3))
        except torch._dynamo.exc.Unsupported as e:
            seen.append(("refused", str(e).splitlines()[0], dict(vars(reg))))
            break
        seen.append((out.elem.tolist(), dict(vars(reg))))
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [Counted, Stamped], ids=["counts", "stamps"])
def test_unflatten_changing_state_is_refused(cls, backend):
    torch._dynamo.reset()
    compiled = _run(torch.compile(fn, backend=backend, fullgraph=True), cls)
    assert compiled == [("refused", "dynamo_ext: global_state_write", dict(vars(Registry())))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [Counted, Stamped], ids=["counts", "stamps"])
def test_unflatten_changing_state_runs_eagerly_with_breaks(cls, backend):
    torch._dynamo.reset()
    eager = _run(fn, cls)
    compiled = _run(torch.compile(fn, backend=backend, fullgraph=False), cls)
    assert compiled == eager
    assert eager[-1][1]["rebuilds"] == 0 and "last_rebuilt" not in eager[-1][1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unflatten_reading_state_compiles(backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend(backend)
    torch._dynamo.reset()
    eager = _run(fn, ReadsOnly)
    compiled = _run(torch.compile(fn, backend=counter, fullgraph=True), ReadsOnly)
    assert compiled == eager
    assert counter.frame_count >= 1


CREATED = {"n": 0}
LIVE: list[int] = []


class Registered(torch.Tensor):
    """Counts its instances in a module global and keeps their ids (leak tracking): eager
    counts the tensors dispatch makes; torch's rebuilds while compiling are not the program's
    (outside round 43: the count moved before a refusal, and ended off under
    ``fullgraph=False``)."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem):
        self.elem = elem
        CREATED["n"] += 1
        LIVE.append(CREATED["n"])

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, Registered) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: cls(t) if isinstance(t, torch.Tensor) else t, out)


def two_ops(a, b):
    return a * b + 1


def _run_registered(f):
    a, b = Registered(torch.ones(3)), Registered(torch.full((3,), 2.0))
    CREATED["n"] = 0
    LIVE.clear()
    try:
        out = f(a, b).elem.tolist()
    except torch._dynamo.exc.Unsupported as e:
        out = str(e).splitlines()[0]
    return out, dict(CREATED), list(LIVE)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_constructor_counting_in_a_module_global(backend, fullgraph):
    torch._dynamo.reset()
    eager = _run_registered(two_ops)
    compiled = _run_registered(torch.compile(two_ops, backend=backend, fullgraph=fullgraph))
    if fullgraph:
        assert compiled == ("dynamo_ext: global_state_write", {"n": 0}, [])
    else:
        assert compiled == eager


UNFLATTENED = {"n": 0}


class CountsRebuilds(Registered):
    """Counts its rebuilds in a module global (outside round 44: failed inside Dynamo on
    aot_eager with the count moved; a graph break there left later graphs counting)."""

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        UNFLATTENED["n"] += 1
        return cls(inner["elem"])


def three_ops(x):
    return (x * 2).relu() + 1


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unflatten_counting_in_a_module_global(backend, fullgraph):
    def run(f):
        UNFLATTENED["n"] = 0
        seen = []
        for i in range(3):
            try:
                seen.append((f(CountsRebuilds(torch.tensor([1.0, -0.5, 3.0]) + i)).elem.tolist(), dict(UNFLATTENED)))
            except torch._dynamo.exc.Unsupported as e:
                seen.append((str(e).splitlines()[0], dict(UNFLATTENED)))
                break
        return seen

    torch._dynamo.reset()
    eager = run(three_ops)
    compiled = run(torch.compile(three_ops, backend=backend, fullgraph=fullgraph))
    if fullgraph:
        assert compiled == [("dynamo_ext: global_state_write", {"n": 0})]
    else:
        assert compiled == eager


_NEXT_UID = 0


class Minted(torch.Tensor):
    """An int8 weight the compiled function quantizes itself; ``__init__`` mints an id from a
    module-global counter (outside round 44: on ``backend="eager"`` the count moved twice per
    call, the fake the graph's constructor node made counting; ``aot_eager`` refused after it
    moved)."""

    @staticmethod
    def __new__(cls, int_data, scale, uid=None):
        r = torch.Tensor._make_wrapper_subclass(cls, int_data.shape, dtype=scale.dtype, device=int_data.device)
        r.int_data, r.scale = int_data, scale
        return r

    def __init__(self, int_data, scale, uid=None):
        global _NEXT_UID
        if uid is None:
            uid = _NEXT_UID
            _NEXT_UID += 1
        self.uid = uid

    def __tensor_flatten__(self):
        return ["int_data", "scale"], (self.uid,)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["int_data"], inner["scale"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return cls(args[0].int_data, args[0].scale, args[0].uid)
        unwrap = lambda t: t.int_data.float() * t.scale if isinstance(t, Minted) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class CountedAtClass(Minted):
    """Counts the instances it makes at class level."""

    made = 0

    def __init__(self, int_data, scale, uid=None):
        super().__init__(int_data, scale, uid if uid is not None else -1)
        if uid is None:
            type(self).made += 1


class _Registry:
    def __init__(self):
        self.created = 0
        self.live = []


REGISTRY = _Registry()


class RegistersItself(Minted):
    """Records each weight it builds on an object a module global holds, through a
    ``from_float`` classmethod (outside round 45: not refused, the count one over eager's and
    a fake left in the registry; a dirty refusal on ``aot_eager``)."""

    def __init__(self, int_data, scale, uid=None):
        super().__init__(int_data, scale, uid if uid is not None else -1)
        REGISTRY.created = REGISTRY.created + 1
        REGISTRY.live.append(self)

    @classmethod
    def from_float(cls, int_data, scale):
        return cls(int_data, scale)


class _Live:
    def __init__(self):
        self.weights = weakref.WeakSet()


LIVE_WEIGHTS = _Live()


class TracksLiveWeights(Minted):
    """Keeps the weights it builds in a weak set an object a global holds (outside round 45:
    the compile's fake stayed in it, and nothing was refused)."""

    def __init__(self, int_data, scale, uid=None):
        super().__init__(int_data, scale, uid if uid is not None else -1)
        LIVE_WEIGHTS.weights.add(self)

    @classmethod
    def from_float(cls, int_data, scale):
        return cls(int_data, scale)


def quantize_then_use(x, w, cls):
    s = w.abs().amax(1, keepdim=True) / 127
    build = cls.from_float if cls in (RegistersItself, TracksLiveWeights) else cls
    q = build(torch.round(w / s).to(torch.int8), s)
    return torch.nn.functional.linear(x, q), q


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "cls",
    [Minted, CountedAtClass, RegistersItself, TracksLiveWeights],
    ids=["module_global", "class_attribute", "object_a_global_holds", "weak_set_an_object_holds"],
)
def test_a_constructor_the_compiled_function_calls_counting(cls, backend, fullgraph):
    global _NEXT_UID

    def state():
        live = [(type(o.int_data).__name__, o.uid) for o in REGISTRY.live]
        gc.collect()  # what a weak set holds once nothing else does (a compile's frames hold some in cycles)
        weak = sorted(type(o.int_data).__name__ for o in LIVE_WEIGHTS.weights)
        return _NEXT_UID, CountedAtClass.made, REGISTRY.created, live, weak

    def run(f):
        global _NEXT_UID
        _NEXT_UID, CountedAtClass.made = 0, 0
        REGISTRY.created, REGISTRY.live = 0, []
        LIVE_WEIGHTS.weights = weakref.WeakSet()
        w = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
        seen = []
        for i in range(3):
            x = torch.full((2, 4), float(i + 1))
            try:
                y, q = f(x, w, cls)
            except torch._dynamo.exc.Unsupported as e:
                seen.append((str(e).splitlines()[0], state()))
                break
            seen.append((y.tolist(), q.uid, state()))
        return seen

    torch._dynamo.reset()
    eager = run(quantize_then_use)
    compiled = run(torch.compile(quantize_then_use, backend=backend, fullgraph=fullgraph))
    if fullgraph:
        assert compiled == [("dynamo_ext: global_state_write", (0, 0, 0, [], []))]
    else:
        assert compiled == eager


@dynamo_ext.register_ctx_state
class HeldMask:
    """A mask buffer a partial result holds in its ctx, counting the partials holding it."""

    def __init__(self, data=None):
        self.data = data
        self.holders = 0


class Sharded(torch.Tensor):
    """A row-sharded embedding weight (rows ``lo`` to ``hi``); the embedding returns a
    ``Pending`` partial with the mask of the ids it does not hold."""

    @staticmethod
    def __new__(cls, elem, lo, hi):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        r.elem, r.lo, r.hi = elem, lo, hi
        return r

    def __tensor_flatten__(self):
        return ["elem"], (self.lo, self.hi)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.embedding.default:
            w, ids = args[0], args[1]
            mask = (ids < w.lo) | (ids >= w.hi)
            out = func(w.elem, (ids - w.lo).masked_fill(mask, 0)).masked_fill(mask.unsqueeze(-1), 0.0)
            return Pending(out, HeldMask(mask))
        return func(*tree_map(lambda t: t.elem if isinstance(t, Sharded) else t, args), **(kwargs or {}))


class Pending(torch.Tensor):
    """A partial whose constructor counts its holders on the mask buffer (outside round 44:
    AOTAutograd rebuilds each output through it at run time, and the compiled call raised
    ``stale_plan`` at run time, under ``fullgraph=False`` too)."""

    @staticmethod
    def __new__(cls, elem, mb):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        r.elem, r.mb = elem, mb
        return r

    def __init__(self, elem, mb):
        mb.holders += 1

    def __tensor_flatten__(self):
        return ["elem"], (self.mb,)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def reduce(t):
            if not isinstance(t, Pending):
                return t
            mask, t.mb.data = t.mb.data, None
            return t.elem.masked_fill(mask.unsqueeze(-1), 0.0)

        return func(*tree_map(reduce, args), **tree_map(reduce, kwargs or {}))


def embed(ids, w):
    return torch.nn.functional.embedding(ids, w)


def reduce_partial(p):
    return p.sum(-1) * 2


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_partial_whose_constructor_changes_its_mask_buffer(backend, fullgraph):
    def run(e, r):
        w = Sharded(torch.randn(6, 3, generator=torch.Generator().manual_seed(0)), 2, 8)
        seen = []
        for i in range(3):
            try:
                p = e(torch.arange(4) + i, w)
                made = (p.mb.holders, p.mb.data is not None)
                out = r(p)
            except torch._dynamo.exc.Unsupported as err:
                seen.append(str(err).splitlines()[0])
                break
            seen.append((out.tolist(), made, (p.mb.holders, p.mb.data is not None)))
        return seen

    torch._dynamo.reset()
    eager = run(embed, reduce_partial)
    compiled = run(
        torch.compile(embed, backend=backend, fullgraph=fullgraph),
        torch.compile(reduce_partial, backend=backend, fullgraph=fullgraph),
    )
    if fullgraph:
        assert compiled == ["dynamo_ext: global_state_write"]
    else:
        assert compiled == eager


class Tracker:
    """A plain object (not registered) a subclass's ctx holds, counting builds and rebuilds."""

    def __init__(self):
        self.inits = 0
        self.unflattens = 0


class TracksBuilds(torch.Tensor):
    """``__init__`` and ``__tensor_unflatten__`` count on the tracker its ctx holds (outside
    round 45: refused only after Dynamo's rebuild of the input counted, and under
    ``fullgraph=False`` the counts ended over eager's)."""

    @staticmethod
    def __new__(cls, elem, tracker):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)
        r.elem, r.tracker = elem, tracker
        return r

    def __init__(self, elem, tracker):
        tracker.inits = tracker.inits + 1

    def __tensor_flatten__(self):
        return ["elem"], (self.tracker,)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        ctx[0].unflattens = ctx[0].unflattens + 1
        return cls(inner["elem"], ctx[0])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        tracker = next(a for a in args if isinstance(a, (TracksBuilds, HandsOutTracked))).tracker
        unwrap = lambda t: t.elem if isinstance(t, (TracksBuilds, HandsOutTracked)) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return TracksBuilds(out, tracker) if isinstance(out, torch.Tensor) else out


class HandsOutTracked(TracksBuilds):
    """Rebuilt without counting; its ops return ``TracksBuilds`` results, whose rebuild counts
    (the AOT backends rebuild each output through ``__tensor_unflatten__`` every call)."""

    def __init__(self, elem, tracker):
        pass

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], ctx[0])


def scale(a, x):
    return a * x


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [TracksBuilds, HandsOutTracked], ids=["input_rebuilt", "result_rebuilt"])
def test_a_rebuild_counting_on_an_unregistered_ctx_object(cls, backend, fullgraph):
    def run(f):
        tracker = Tracker()
        a = cls(torch.arange(4.0), tracker)
        seen = []
        for i in range(3):
            try:
                out = f(a, torch.full((4,), float(i)))
            except torch._dynamo.exc.Unsupported as e:
                seen.append((str(e).splitlines()[0], dict(vars(tracker))))
                break
            seen.append((out.elem.tolist(), dict(vars(tracker))))
        return seen

    torch._dynamo.reset()
    eager = run(scale)
    compiled = run(torch.compile(scale, backend=backend, fullgraph=fullgraph))
    if fullgraph:
        before = {"inits": 1 if cls is TracksBuilds else 0, "unflattens": 0}
        # dispatch reading the unregistered tracker off an input is refused first
        kind = "global_state_write" if cls is TracksBuilds else "unsupported_state_read"
        assert compiled == [(f"dynamo_ext: {kind}", before)]
    else:
        assert compiled == eager
