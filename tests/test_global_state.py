"""State dispatch reaches through its globals that is not a plain container: an object's
instance dict taken whole, a module found in ``sys.modules``, attributes set on torch's own
objects, a method's default argument or cache, library objects changed in place (a numpy
array, an ``array.array``, a ``deque`` in a list, a ``StringIO`` log, a ``ContextVar``), a
generator. An outside tester found each left as the traces made it (counted once per trace,
a guard failing on the frame it was made by, or a count stuck at 1 with no error). Each
compiles to eager's state, or is refused with everything as it was, and runs eagerly under
``fullgraph=False``."""

from __future__ import annotations

import array
import builtins
import collections
import contextvars
import functools
import io
import sys
import types

import pytest
import torch

from dynamo_ext.testing import WrapperTensor
from harness import leaked_fakes

np = pytest.importorskip("numpy")


class _Holder:
    pass


_HOLD = _Holder()
_STORE_MODULE = "dynamo_ext_test_store"
_store = types.ModuleType(_STORE_MODULE)
_store.__file__ = __file__  # user code, not a library's
_store.STORE = {}
sys.modules[_STORE_MODULE] = _store
_TORCH_NAME = "_dynamo_ext_test_count"
_BUILTINS_NAME = "_dynamo_ext_test_cache"


class _Helper:
    @staticmethod
    def hook(key, _seen={}):  # noqa: B006 - the idiom under test
        _seen[key] = _seen.get(key, 0) + 1


class _Quant:
    @functools.lru_cache(maxsize=4)  # noqa: B019 - the idiom under test
    def scale(self, n):
        return 1.0 / n


_QUANT = _Quant()
_LOG = io.StringIO()
_NPA = np.zeros(4)
_ARR = array.array("i")
_IN_LIST = [collections.deque()]
_CV = contextvars.ContextVar("dynamo_ext_test_cv", default=0)
_GEN = [None]


def _ticks():
    n = 0
    while True:
        yield n
        n += 1


def _vars_of_a_global_object(w, func, n):
    vars(_HOLD)["n"] = vars(_HOLD).get("n", 0) + 1


def _dict_update_on_a_global_object(w, func, n):
    _HOLD.__dict__.update(op="mm", calls=_HOLD.__dict__.get("calls", 0) + 1)


def _object_setattr_on_a_global_object(w, func, n):
    object.__setattr__(_HOLD, "n", getattr(_HOLD, "n", 0) + 1)


def _module_from_sys_modules(w, func, n):
    st = sys.modules["dynamo_ext_test_store"].STORE
    st["n"] = st.get("n", 0) + 1


def _attribute_on_torch(w, func, n):
    torch._dynamo_ext_test_count = getattr(torch, "_dynamo_ext_test_count", 0) + 1


def _attribute_on_builtins(w, func, n):
    cache = getattr(builtins, "_dynamo_ext_test_cache", None)
    if cache is None:
        cache = builtins._dynamo_ext_test_cache = {}
    cache[n] = cache.get(n, 0) + 1


def _attribute_on_the_op(w, func, n):
    func._dynamo_ext_test_count = getattr(func, "_dynamo_ext_test_count", 0) + 1


def _static_method_default(w, func, n):
    _Helper.hook(n)


def _method_lru_cache(w, func, n):
    w.scale = _QUANT.scale(n)


def _string_io_log(w, func, n):
    _LOG.write(f"mm{n};")


def _numpy_array(w, func, n):
    _NPA[n % 4] += 1


def _array_array(w, func, n):
    _ARR.append(n)


def _deque_in_a_list(w, func, n):
    _IN_LIST[0].append(n)


def _context_var(w, func, n):
    _CV.set(_CV.get() + 1)


def _generator(w, func, n):
    w.tick = next(_GEN[0])


def _clear_builtins():
    vars(builtins).pop(_BUILTINS_NAME, None)


def _reset_generator():
    _GEN[0] = _ticks()


# name: (dispatch's code, the state it changes, a reset, compiled matches eager without a refusal)
CASES = {
    "vars_of_a_global_object": (_vars_of_a_global_object, lambda: dict(vars(_HOLD)), lambda: vars(_HOLD).clear(), True),
    "dict_update_on_a_global_object": (_dict_update_on_a_global_object, lambda: dict(vars(_HOLD)),
                                       lambda: vars(_HOLD).clear(), True),
    "object_setattr_on_a_global_object": (_object_setattr_on_a_global_object, lambda: dict(vars(_HOLD)),
                                          lambda: vars(_HOLD).clear(), True),
    "module_from_sys_modules": (_module_from_sys_modules, lambda: dict(_store.STORE), _store.STORE.clear, False),
    "attribute_on_torch": (_attribute_on_torch, lambda: getattr(torch, _TORCH_NAME, None),
                           lambda: vars(torch).pop(_TORCH_NAME, None), False),
    "attribute_on_builtins": (_attribute_on_builtins, lambda: dict(getattr(builtins, _BUILTINS_NAME, {})),
                              _clear_builtins, False),
    "attribute_on_the_op": (_attribute_on_the_op, lambda: getattr(torch.ops.aten.mm.default, _TORCH_NAME, None),
                            lambda: vars(torch.ops.aten.mm.default).pop(_TORCH_NAME, None), False),
    "static_method_default": (_static_method_default, lambda: dict(_Helper.hook.__defaults__[0]),
                              lambda: _Helper.hook.__defaults__[0].clear(), False),
    "method_lru_cache": (_method_lru_cache, lambda: _Quant.scale.cache_info().currsize, _Quant.scale.cache_clear, False),
    "string_io_log": (_string_io_log, _LOG.getvalue, lambda: (_LOG.seek(0), _LOG.truncate()), False),
    "numpy_array": (_numpy_array, lambda: _NPA.tolist(), lambda: _NPA.fill(0), False),
    "array_array": (_array_array, lambda: _ARR.tolist(), lambda: _ARR.__delitem__(slice(None)), False),
    "deque_in_a_list": (_deque_in_a_list, lambda: list(_IN_LIST[0]), lambda: _IN_LIST[0].clear(), False),
    "context_var": (_context_var, _CV.get, lambda: _CV.set(0), False),
    "generator": (_generator, lambda: next(_GEN[0]), _reset_generator, False),
}


class OnMatmul(WrapperTensor):
    """A weight whose dispatch runs ``before_mm(w, func, rows)`` before each ``x @ w`` and
    hands its result through ``after_mm``."""

    @classmethod
    def before_mm(cls, w, func, rows):
        pass

    @classmethod
    def after_mm(cls, out):
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plain = [a.elem if isinstance(a, cls) else a for a in args]
        mm = func is torch.ops.aten.mm.default and isinstance(args[1], cls)
        if mm:
            cls.before_mm(args[1], func, plain[0].shape[0])
        out = func(*plain, **kwargs)
        return cls.after_mm(out) if mm else out


class ReachesGlobalState(OnMatmul):
    """A weight whose matmul runs one of ``CASES`` with the batch's row count."""

    case = "vars_of_a_global_object"

    @classmethod
    def before_mm(cls, w, func, rows):
        CASES[cls.case][0](w, func, rows)


@pytest.fixture(autouse=True)
def _no_generator_held():
    """Dispatch code that can reach a generator is refused before its op runs, whichever case
    runs (``CASES`` is one registry its code reaches): the generator is held for its case only."""
    yield
    _GEN[0] = None


def _picture(case):
    # the generator's picture draws from it: taken once, at the end
    return None if case == "generator" else CASES[case][1]()


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dispatch_reaches_through_its_globals(case, backend, fullgraph):
    cls = type(f"ReachesGlobalState_{case}", (ReachesGlobalState,), {"case": case})
    compiles = CASES[case][3]

    def run(fn):
        CASES[case][2]()
        torch.manual_seed(0)
        w = cls(torch.randn(4, 4))
        seen = []
        for rows in (3, 3, 5, 2):
            before = (_picture(case), dict(vars(w)))
            try:
                out = fn(torch.randn(rows, 4), w)
            except torch._dynamo.exc.Unsupported as e:
                assert "global_state_write" in str(e) or "unsupported_state_read" in str(e), e
                assert (_picture(case), dict(vars(w))) == before  # nothing touched
                seen.append("refused")
                continue
            assert not leaked_fakes(w) and not leaked_fakes(_picture(case)), vars(w)
            seen.append((out.tolist(), {k: v for k, v in vars(w).items() if k != "elem"}, _picture(case)))
        seen.append(CASES[case][1]())
        return seen

    def f(x, w):
        return x @ w + 1

    torch._dynamo.reset()
    eager = run(f)
    compiled = run(torch.compile(f, backend=backend, fullgraph=fullgraph))
    if fullgraph and not compiles:
        assert compiled[:-1] == ["refused"] * 4
        assert compiled[-1] == (0 if case == "generator" else CASES[case][1]())
    else:
        assert compiled == eager
    CASES[case][2]()


def test_a_method_cache_hit_while_traced_is_statistics_only():
    """A hit of an ``lru_cache`` while traced changes its statistics, not what it holds: not
    refused (``cache_info().hits`` counts the traces too)."""
    cls = type("ReachesGlobalState_hit", (ReachesGlobalState,), {"case": "method_lru_cache"})
    _Quant.scale.cache_clear()
    _QUANT.scale(3)  # filled eagerly first
    w = cls(torch.randn(4, 4))
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: x @ w, backend="aot_eager", fullgraph=True)
    fn(torch.randn(3, 4), w)
    assert w.scale == 1.0 / 3 and _Quant.scale.cache_info().currsize == 1
    _Quant.scale.cache_clear()


_TABLES: dict = {}


class CountsInATableAddedLater(OnMatmul):
    """Counts its matmuls by row count in ``_TABLES["mm"]``, once eager code made that table."""

    @classmethod
    def before_mm(cls, w, func, rows):
        table = _TABLES.get("mm")
        if table is not None:
            table[rows] = table.get(rows, 0) + 1


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
def test_a_container_eager_code_adds_between_compiles_is_watched(fullgraph):
    """The watch walks a module's containers once and reuses the walk while they hold what it
    found: a table eager code adds between two compiles is walked again, and dispatch filling
    it while traced is refused (not left holding the traces' counts)."""

    def run(fn):
        _TABLES.clear()
        w = CountsInATableAddedLater(torch.randn(4, 4))
        seen = [fn(torch.randn(3, 4), w).shape]
        _TABLES["mm"] = {}  # eager code, between calls
        for rows in (3, 5):
            try:
                seen.append(fn(torch.randn(rows, 4), w).shape)
            except torch._dynamo.exc.Unsupported as e:
                assert "global_state_write" in str(e), e
                seen.append("refused")
        return seen, dict(_TABLES["mm"])

    torch._dynamo.reset()
    eager = run(lambda x, w: x @ w)
    compiled = run(torch.compile(lambda x, w: x @ w, backend="aot_eager", fullgraph=fullgraph))
    if fullgraph:
        assert compiled == ([torch.Size([3, 4]), "refused", "refused"], {})
    else:
        assert compiled == eager == ([torch.Size([3, 4])] * 2 + [torch.Size([5, 4])], {3: 1, 5: 1})
    _TABLES.clear()


# Outside round 25: a shared object counted on in the backward, a ``__slots__`` object and one
# reached through a weak reference, and config read by paths the guards missed.

import copy  # noqa: E402
import logging  # noqa: E402
import weakref  # noqa: E402


class _Stats:
    def __init__(self):
        self.fwd = 0
        self.bwd = 0


class _SlotStats:
    __slots__ = ("calls",)

    def __init__(self):
        self.calls = 0


_STATS = _Stats()
_SLOTS = _SlotStats()
_METER = _Stats()
_METER_REF = weakref.ref(_METER)


class CountsInTheBackward(WrapperTensor):
    """Counts its matmuls on ``_STATS.fwd`` and its transposes (the backward's) as ``how`` says."""

    how = "write"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.mm.default:
            _STATS.fwd += 1
        elif func is torch.ops.aten.t.default and cls.how == "write":
            _STATS.bwd += 1
        elif func is torch.ops.aten.t.default and cls.how == "read" and _STATS.fwd > 100:
            raise RuntimeError("too many calls")
        plain = [a.elem if isinstance(a, cls) else a for a in args]
        out = func(*plain, **kwargs)
        return cls(out) if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) else out


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("how", ["write", "read"])
def test_a_global_object_the_backward_counts_on_or_reads(how, fullgraph):
    """The backward sets (or reads) an attribute of an object dispatch reaches through a
    global, which the forward sets on every call: the compiled backward could neither make the
    write again (the count stuck at 1) nor read each call's value (refused at every
    ``backward()``, under ``fullgraph=False`` too). Refused when compiling, nothing touched."""
    cls = type(f"CountsInTheBackward_{how}", (CountsInTheBackward,), {"how": how})

    def run(fn):
        _STATS.__init__()
        torch.manual_seed(0)
        w = torch.nn.Parameter(cls(torch.randn(4, 3)))
        seen = []
        for _ in range(3):
            x = torch.randn(2, 4, requires_grad=True)
            try:
                fn(x, w).backward()
            except Exception as e:  # the compile's refusal
                assert ("write_in_backward" if how == "write" else "unsupported_state_read") in str(e), e
                assert (_STATS.fwd, _STATS.bwd) == (0, 0)
                seen.append("refused")
                continue
            seen.append((_STATS.fwd, _STATS.bwd, x.grad.tolist()))
        return seen

    def f(x, w):
        return torch.mm(x, w).tanh().sum()

    torch._dynamo.reset()
    eager = run(f)
    compiled = run(torch.compile(f, backend="aot_eager", fullgraph=fullgraph))
    assert compiled == (["refused"] * 3 if fullgraph else eager)


def _slots_count(w, func, n):
    _SLOTS.calls += 1


def _weakref_count(w, func, n):
    _METER_REF().fwd += 1


class CountsOnAnObjectHeldOtherwise(OnMatmul):
    count = staticmethod(_slots_count)

    @classmethod
    def before_mm(cls, w, func, rows):
        cls.count(w, func, rows)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("held", ["slots", "weakref"])
def test_a_count_on_a_slots_object_or_one_a_weak_reference_leads_to(held, backend, fullgraph):
    """A ``__slots__`` object's count is refused and put back (its state is no instance dict
    to replay); one reached through ``weakref.ref`` is tracked through the reference and
    replayed. Both were counted once per trace and never again."""
    count, picture, reset = {
        "slots": (_slots_count, lambda: _SLOTS.calls, _SLOTS.__init__),
        "weakref": (_weakref_count, lambda: _METER.fwd, _METER.__init__),
    }[held]
    cls = type(f"CountsOnAnObjectHeldOtherwise_{held}", (CountsOnAnObjectHeldOtherwise,), {"count": staticmethod(count)})

    def run(fn):
        reset()
        w = cls(torch.randn(4, 4))
        seen = []
        for rows in (3, 3, 5):
            try:
                seen.append((fn(torch.randn(rows, 4), w).shape, picture()))
            except torch._dynamo.exc.Unsupported as e:
                assert "global_state_write" in str(e), e
                seen.append(("refused", picture()))
        return seen

    torch._dynamo.reset()
    eager = run(lambda x, w: x @ w)
    compiled = run(torch.compile(lambda x, w: x @ w, backend=backend, fullgraph=fullgraph))
    if fullgraph and held == "slots":
        assert compiled == [("refused", 0)] * 3
    else:
        assert compiled == eager == [(torch.Size([3, 4]), 1), (torch.Size([3, 4]), 2), (torch.Size([5, 4]), 3)]


class _Cfg:
    def __init__(self):
        self.scale = 1.0


class _HoldsFactor:
    factor = 1.0


_CFG = _Cfg()  # read through copy.copy
_CFG_DEFAULT = _Cfg()  # reached through a default argument only
_CFG_BY_REF = _Cfg()
_CFG_REF = weakref.ref(_CFG_BY_REF)  # reached through the weak reference only
X = 1.0
_LOGGER = logging.getLogger("dynamo_ext_test_global_state")


def _scale_from_default(cfg=_CFG_DEFAULT):
    return cfg.scale


READ_PATHS = {
    "globals_item": lambda: globals()["X"],
    "module_from_sys_modules": lambda: getattr(sys.modules[__name__], "X"),
    "default_argument": lambda: _scale_from_default(),
    "logger_level": lambda: 2.0 if _LOGGER.isEnabledFor(logging.DEBUG) else 1.0,
    "class_dict": lambda: _HoldsFactor.__dict__["factor"],
    "weak_reference": lambda: _CFG_REF().scale,
    "copy_of_an_object": lambda: copy.copy(_CFG).scale,
}


def _set_x(v):
    globals()["X"] = v


def _setter(name):
    def set_scale(v):
        vars(globals()[name])["scale"] = v

    return set_scale


# kept apart from what dispatch reaches, so that only the read path leads dispatch to the value
SETTERS = {
    "globals_item": _set_x,
    "module_from_sys_modules": _set_x,
    "default_argument": _setter("_CFG_DEFAULT"),
    "logger_level": lambda v: logging.getLogger("dynamo_ext_test_global_state").setLevel(
        logging.DEBUG if v == 2.0 else logging.WARNING),
    "class_dict": lambda v: type.__setattr__(vars(sys.modules[__name__])["_HoldsFactor"], "factor", v),
    "weak_reference": _setter("_CFG_BY_REF"),
    "copy_of_an_object": _setter("_CFG"),
}


class ScalesByConfig(OnMatmul):
    """Multiplies its matmul's result by a config value read one of ``READ_PATHS``' ways."""

    path = "globals_item"

    @classmethod
    def after_mm(cls, out):
        return out * READ_PATHS[cls.path]()


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("path", sorted(READ_PATHS))
def test_config_read_by_other_paths_takes_effect(path, fullgraph):
    """Config dispatch reads through ``globals()``, ``sys.modules``, a default argument, a
    logger's level, a class's ``__dict__``, a weak reference or a copy, changed between calls:
    the compiled program follows it, as eager (it kept the first value on AOT backends)."""
    cls = type(f"ScalesByConfig_{path}", (ScalesByConfig,), {"path": path})
    set_value = SETTERS[path]

    def run(fn):
        torch.manual_seed(0)
        w = cls(torch.randn(4, 4))
        x = torch.randn(3, 4)
        out = []
        for value in (1.0, 1.0, 2.0, 1.0):
            set_value(value)
            out.append(fn(x, w))
        set_value(1.0)
        return out

    torch._dynamo.reset()
    eager = run(lambda x, w: x @ w)
    compiled = run(torch.compile(lambda x, w: x @ w, backend="aot_eager", fullgraph=fullgraph))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)
    assert not torch.equal(eager[2], eager[1])  # the value mattered


class _Schedule:
    """A user iterator: its position is an attribute, tracked like any user object's."""

    def __init__(self):
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.step += 1
        return 0.1 * self.step


_SCHEDULE = _Schedule()


class TakesItsRateFromASchedule(OnMatmul):
    @classmethod
    def before_mm(cls, w, func, rows):
        w.rate = next(_SCHEDULE)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
def test_a_user_iterator_dispatch_advances_is_tracked_not_refused(fullgraph):
    """A generator reached through globals is refused before the op; an iterator of a user
    class keeps its position in attributes, which are tracked and replayed as eager's."""

    def run(fn):
        _SCHEDULE.__init__()
        w = TakesItsRateFromASchedule(torch.randn(4, 4))
        return [(fn(torch.randn(3, 4), w).shape, w.rate, _SCHEDULE.step) for _ in range(3)]

    torch._dynamo.reset()
    eager = run(lambda x, w: x @ w)
    compiled = run(torch.compile(lambda x, w: x @ w, backend="aot_eager", fullgraph=fullgraph))
    assert compiled == eager


class ScalesByTorchFlag(OnMatmul):
    """Scales its matmul's result by whether mkldnn is enabled, a torch global flag."""

    @classmethod
    def after_mm(cls, out):
        return out * (2.0 if torch.backends.mkldnn.enabled else 1.0)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_torch_flag_dispatch_reads_takes_effect(backend, fullgraph):
    """torch's global numerics flags dispatch reads (``torch.backends.mkldnn.enabled``,
    ``torch.get_float32_matmul_precision()``), changed between calls through torch's own
    context manager: the compiled program follows them (they were replayed stale)."""

    def run(fn):
        torch.manual_seed(0)
        w = ScalesByTorchFlag(torch.randn(4, 4))
        x = torch.randn(3, 4)
        out = []
        for enabled in (True, True, False, True):
            with torch.backends.mkldnn.flags(enabled=enabled):
                out.append(fn(x, w))
        return out

    torch._dynamo.reset()
    eager = run(lambda x, w: x @ w)
    compiled = run(torch.compile(lambda x, w: x @ w, backend=backend, fullgraph=fullgraph))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)
    assert not torch.equal(eager[2], eager[1])
