"""Configuration dispatch reads from outside the tensors, changed by the user between calls.

A float8 or quantization library keeps its switches where users can flip them: a class
attribute (``Float8Linear.enabled``), a module-level config object (a dataclass instance, a
``SimpleNamespace``), a module's ``training`` flag, ``os.environ``, a helper function held in
a closure. Dispatch reads them while it is traced; the compiled program must be guarded on
what it read, so a change is a recompile (eager's numbers and state), never a stale graph.

Each test runs eager and compiled side by side on equal, separate weights, flips the switch
between calls, and compares outputs and every attribute of the weight after each call.
"""

from __future__ import annotations

import array
import collections
import contextvars
import dataclasses
import functools
import os
import random
import sys
import threading
import types

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_map_only

import dynamo_ext
from dynamo_ext import RefusalKind, SubclassWriteError
from harness import assert_same_state

aten = torch.ops.aten
BACKENDS = ["eager", "aot_eager"]


class ScaledWeight(torch.Tensor):
    """A weight whose matmul output dispatch scales by ``scale_of(w)`` and records it."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)

    def __init__(self, data):
        self._data = data
        self.used = 0.0
        self.updates = 0

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = next(a for a in args if isinstance(a, ScaledWeight))
        out = func(*tree_map_only(ScaledWeight, lambda t: t._data, args), **tree_map_only(ScaledWeight, lambda t: t._data, kwargs))
        if func is aten.mm.default:
            s = cls.scale_of(w)
            w.used = s
            if s:
                w.updates = w.updates + 1
            out = out * s
        return out

    @classmethod
    def scale_of(cls, w):
        return 1.0


def mm(x, w):
    return torch.mm(x, w)


def run_side_by_side(cls, flip, values, backend, fullgraph=False):
    """Eager and compiled on equal weights; ``flip(v)`` sets the switch before each call."""
    torch._dynamo.reset()
    compiled = torch.compile(mm, backend=backend, fullgraph=fullgraph)
    we, wc = cls(torch.ones(2, 2)), cls(torch.ones(2, 2))
    x = torch.ones(2, 2)
    for call, v in enumerate(values):
        flip(v)
        oe = mm(x, we)
        oc = compiled(x, wc)
        torch.testing.assert_close(oc, oe, msg=lambda m: f"call {call + 1} (switch {v!r}): {m}")
        assert_same_state(we, wc, f"call {call + 1} (switch {v!r})")


# --------------------------------------------------------------- class attributes


class ClassSwitch(ScaledWeight):
    enabled = True
    factor = 2.0

    @classmethod
    def scale_of(cls, w):
        return cls.factor if cls.enabled else 0.0


class ReadsTypeOf(ScaledWeight):
    factor = 2.0

    @classmethod
    def scale_of(cls, w):
        return type(w).factor


class ReadsClassByName(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return Knobs.factor


class Knobs:
    factor = 2.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_class_attribute_read_through_cls(backend, fullgraph):
    def flip(v):
        ClassSwitch.enabled = v

    try:
        run_side_by_side(ClassSwitch, flip, [True, False, True, False], backend, fullgraph)
    finally:
        ClassSwitch.enabled = True


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls,holder", [(ReadsTypeOf, ReadsTypeOf), (ReadsClassByName, Knobs)])
def test_a_class_attribute_read_through_type_or_a_global_class(backend, cls, holder):
    def flip(v):
        holder.factor = v

    try:
        run_side_by_side(cls, flip, [2.0, 3.0, 2.0, 5.0], backend)
    finally:
        holder.factor = 2.0


# --------------------------------------------------------------- module-level config objects


@dataclasses.dataclass
class Config:
    scale: float = 1.0


CONFIG = Config()
NAMESPACE = types.SimpleNamespace(scale=1.0)
SETTINGS = {"scale": 1.0}
MODEL = torch.nn.Linear(2, 2)


class ReadsConfig(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return CONFIG.scale


class ReadsNamespace(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return NAMESPACE.scale


class ReadsDict(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return SETTINGS["scale"]


class ReadsTraining(ScaledWeight):
    """A float8-style amax update only while the model trains."""

    @classmethod
    def scale_of(cls, w):
        return 2.0 if MODEL.training else 0.0


class ReadsEnviron(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return 3.0 if os.environ.get("DYNAMO_EXT_TEST_FP8", "off") == "on" else 1.0


def _set_environ(v):
    os.environ["DYNAMO_EXT_TEST_FP8"] = v


CASES = {
    "dataclass": (ReadsConfig, lambda v: setattr(CONFIG, "scale", v), [1.0, 3.0, 1.0, 5.0]),
    "namespace": (ReadsNamespace, lambda v: setattr(NAMESPACE, "scale", v), [1.0, 3.0, 1.0, 5.0]),
    "dict": (ReadsDict, lambda v: SETTINGS.__setitem__("scale", v), [1.0, 3.0, 1.0, 5.0]),
    "module_training": (ReadsTraining, lambda v: MODEL.train(v), [True, False, True, False]),
    "environ": (ReadsEnviron, _set_environ, ["off", "on", "off", "on"]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_module_level_config_object(backend, case):
    cls, flip, values = CASES[case]
    try:
        run_side_by_side(cls, flip, values, backend)
    finally:
        flip(values[0])
        os.environ.pop("DYNAMO_EXT_TEST_FP8", None)


class ReadsSysModules(ScaledWeight):
    """A library probing what is imported (``sys.modules`` holds modules: not comparable by value)."""

    @classmethod
    def scale_of(cls, w):
        return 2.0 if "numpy" in sys.modules else 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_container_of_modules_dispatch_reads(backend):
    run_side_by_side(ReadsSysModules, lambda v: None, [None, None, None], backend, fullgraph=True)


# --------------------------------------------------------------- helpers held in closures

GAIN = 1.0


def make_weight_class(getter):
    class ReadsThroughGetter(ScaledWeight):
        @classmethod
        def scale_of(cls, w):
            return getter()

    return ReadsThroughGetter


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_getter_function_held_in_a_closure(backend):
    """The helper dispatch calls is a closure variable (a lambda reading a global)."""
    global GAIN

    def flip(v):
        global GAIN
        GAIN = v

    try:
        run_side_by_side(make_weight_class(lambda: GAIN), flip, [1.0, 3.0, 1.0, 5.0], backend)
    finally:
        GAIN = 1.0


def make_gain_class(gain):
    """A class and a setter for the gain its dispatch reads from the factory's closure: each
    class made by the factory shares the dispatch code object, with cells of its own."""

    def set_gain(v):
        nonlocal gain
        gain = v

    class ReadsFactoryGain(ScaledWeight):
        @classmethod
        def scale_of(cls, w):
            return gain

    return ReadsFactoryGain, set_gain


def mm2(x, w1, w2):
    return torch.mm(x, w1) + torch.mm(x, w2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_classes_of_one_factory_in_one_graph(backend):
    """Both weights' classes come from one factory (their code is one object): the second
    class's own closure is guarded too, so changing its gain recompiles."""
    first, _ = make_gain_class(1.5)
    second, set_second = make_gain_class(2.5)
    torch._dynamo.reset()
    compiled = torch.compile(mm2, backend=backend)
    e, c = [first(torch.ones(2, 2)), second(torch.ones(2, 2))], [first(torch.ones(2, 2)), second(torch.ones(2, 2))]
    x = torch.ones(2, 2)
    for call, gain in enumerate([2.5, 2.5, 7.0, 2.5]):
        set_second(gain)
        oe, oc = mm2(x, *e), compiled(x, *c)
        torch.testing.assert_close(oc, oe, msg=lambda m: f"call {call + 1}: {m}")
        for we, wc in zip(e, c):
            assert_same_state(we, wc, f"call {call + 1} (second gain {gain})")


def make_gain_hook(gain):
    def set_gain(v):
        nonlocal gain
        gain = v

    def gain_hook(w):
        return gain

    return gain_hook, set_gain


GAIN_HOOKS = types.SimpleNamespace(scale=None)


class ReadsHookOfNamespace(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return GAIN_HOOKS.scale(w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_factory_made_hook_replaced_by_its_sibling(backend):
    """The hook dispatch calls through a namespace is made by a factory; the user installs a
    second hook of the same factory with the same gain (a recompile: the hook is another
    function), then changes the second hook's gain. Its closure is guarded, not the first's
    (whose cells held the same values)."""
    first, _ = make_gain_hook(1.5)
    second, set_second = make_gain_hook(1.5)
    steps = [(first, None), (second, None), (second, 7.0), (second, 3.0)]

    def flip(step):
        hook, gain = step
        GAIN_HOOKS.scale = hook
        if gain is not None:
            set_second(gain)

    try:
        run_side_by_side(ReadsHookOfNamespace, flip, steps, backend)
    finally:
        GAIN_HOOKS.scale = None


class CallsClassHook(ScaledWeight):
    """Dispatch calls a hook held on its class, which the user replaces between calls."""

    @staticmethod
    def gain_hook():
        return 1.0

    @classmethod
    def scale_of(cls, w):
        return cls.gain_hook()


class CallsHookOnWeight(ScaledWeight):
    def gain_hook(self):
        return 1.0

    @classmethod
    def scale_of(cls, w):
        return w.gain_hook()


class ReadsClassProperty(ScaledWeight):
    @property
    def gain(self):
        return 1.0

    @classmethod
    def scale_of(cls, w):
        return w.gain


def _as_static(v):
    return staticmethod(lambda: v)


def _as_classmethod(v):
    return classmethod(lambda cls: v)


def _as_function(v):
    return lambda self: v


def _as_property(v):
    return property(lambda self: v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "cls,name,make",
    [
        (CallsClassHook, "gain_hook", _as_static),
        (CallsClassHook, "gain_hook", _as_classmethod),
        (CallsHookOnWeight, "gain_hook", _as_function),
        (ReadsClassProperty, "gain", _as_property),
    ],
    ids=["staticmethod", "classmethod", "method", "property"],
)
def test_a_hook_on_the_class_replaced_between_calls(backend, cls, name, make):
    """``Q.quant = staticmethod(floor)``: what the class attribute is, is guarded (a traced
    backend replayed the first hook's answer on every call)."""
    original = vars(cls)[name]

    def flip(v):
        setattr(cls, name, make(v))

    try:
        run_side_by_side(cls, flip, [2.0, 3.0, 3.0, 0.5], backend)
    finally:
        setattr(cls, name, original)


PER_THREAD = threading.local()
PER_THREAD.gain = 1.0


class ReadsThreadLocal(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return PER_THREAD.gain


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_thread_local_setting(backend):
    """A per-thread setting (``threading.local``) dispatch reads: guarded in the calling
    thread (the compile used to crash reading its state)."""

    def flip(v):
        PER_THREAD.gain = v

    try:
        run_side_by_side(ReadsThreadLocal, flip, [2.0, 2.0, 4.0], backend)
    finally:
        PER_THREAD.gain = 1.0


class _PlainConfig:
    pass


ABSENT_NS = types.SimpleNamespace()
ABSENT_OBJ = _PlainConfig()


class ReadsOptionalNamespace(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return getattr(ABSENT_NS, "margin", 1.0) * (2.0 if hasattr(ABSENT_NS, "boost") else 1.0)


class ReadsOptionalObject(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return getattr(ABSENT_OBJ, "margin", 1.0) * (2.0 if hasattr(ABSENT_OBJ, "boost") else 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls,holder", [(ReadsOptionalNamespace, ABSENT_NS), (ReadsOptionalObject, ABSENT_OBJ)], ids=["namespace", "object"])
def test_an_optional_setting_the_user_adds_later(backend, cls, holder):
    """``getattr(cfg, "margin", 1.0)`` and ``hasattr(cfg, "boost")`` on a config object that
    lacks them at first: their absence is guarded, so adding them recompiles."""

    def flip(step):
        for name, value in step.items():
            setattr(holder, name, value)

    try:
        run_side_by_side(cls, flip, [{}, {"margin": 5.0}, {"boost": True}, {}], backend)
    finally:
        vars(holder).clear()


class _LazyConfig:
    """Settings served by a user ``__getattr__`` from a dict it holds."""

    def __init__(self):
        self._d = {}

    def __getattr__(self, name):
        return self.__dict__["_d"].get(name, 1.0)


LAZY_CONFIG = _LazyConfig()


class ReadsLazyConfig(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return LAZY_CONFIG.margin


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_config_object_with_its_own_getattr(backend):
    """Its ``__getattr__`` reads a dict it holds through ``self.__dict__`` (no attribute hook
    sees that): every entry of the object's dict is answered and guarded first."""

    def flip(v):
        LAZY_CONFIG._d["margin"] = v

    try:
        run_side_by_side(ReadsLazyConfig, flip, [1.0, 4.0, 2.0, 2.0], backend)
    finally:
        LAZY_CONFIG._d.clear()


BACKWARD_GAIN = 1.0
BACKWARD_CONFIG = types.SimpleNamespace(gain=1.0)
BACKWARD_GAINS = {"gain": 1.0}
FORWARD_ONLY_GAIN = 1.0


class BackwardGains:
    gain = 1.0


class _RecordsBackwardState(torch.Tensor):
    """The backward's dispatch (grad mode off) records some state outside the tensors on
    the weight; the forward's records FORWARD_ONLY_GAIN."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)

    def __init__(self, data):
        self._data = data

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        un = lambda t: t._data if isinstance(t, _RecordsBackwardState) else t  # noqa: E731
        out = func(*tree_map_only(torch.Tensor, un, args), **tree_map_only(torch.Tensor, un, kwargs or {}))
        if func is aten.mul.Tensor:
            if torch.is_grad_enabled():
                args[-1].forward_gain = FORWARD_ONLY_GAIN
            else:
                args[-1].backward_gain = cls.gain_now()
        return tree_map_only(torch.Tensor, cls, out)


class GainFromGlobal(_RecordsBackwardState):
    @classmethod
    def gain_now(cls):
        return BACKWARD_GAIN


class GainFromNamespace(_RecordsBackwardState):
    @classmethod
    def gain_now(cls):
        return BACKWARD_CONFIG.gain


class GainFromDict(_RecordsBackwardState):
    @classmethod
    def gain_now(cls):
        return BACKWARD_GAINS["gain"]


class GainFromClass(_RecordsBackwardState):
    @classmethod
    def gain_now(cls):
        return BackwardGains.gain


def _gain_from_closure():
    box = {"gain": 1.0}

    class GainFromClosure(_RecordsBackwardState):
        @classmethod
        def gain_now(cls):
            return box["gain"]

    return GainFromClosure, box


GainFromClosure, CLOSURE_BOX = _gain_from_closure()


def _set_gain(cls, value):
    global BACKWARD_GAIN
    if cls is GainFromGlobal:
        BACKWARD_GAIN = value
    elif cls is GainFromNamespace:
        BACKWARD_CONFIG.gain = value
    elif cls is GainFromDict:
        BACKWARD_GAINS["gain"] = value
    elif cls is GainFromClass:
        BackwardGains.gain = value
    else:
        CLOSURE_BOX["gain"] = value


def _grads(x):
    g = x.grad
    return g._data.tolist() if isinstance(g, _RecordsBackwardState) else g.tolist()


GAIN_CLASSES = [GainFromGlobal, GainFromNamespace, GainFromDict, GainFromClass, GainFromClosure]


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("cls", GAIN_CLASSES, ids=lambda c: c.__name__)
def test_state_only_the_backward_reads_changed_before_backward(cls, fullgraph):
    """Note [State the traced backward reads outside the tensors]: the compiled backward was
    traced with the gain as it was then; set anew between the forward and ``backward()``, it
    is refused there (nothing accumulated, nothing written), never replayed as traced. Set
    back before ``backward()``, or set before the forward, it runs as eager."""
    global FORWARD_ONLY_GAIN

    def loss(x, w):
        return (x * w).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=fullgraph)
    try:
        for f in (loss, compiled):
            x, w = torch.ones(3, requires_grad=True), cls(torch.full((3,), 0.5))
            _set_gain(cls, 1.0)
            f(x, w).backward()
            assert w.backward_gain == 1.0 and w.forward_gain == 1.0
            out = f(x, w)
            _set_gain(cls, 3.0)
            _set_gain(cls, 1.0)  # set back: nothing changed
            out.backward()
            assert w.backward_gain == 1.0
            out = f(x, w)
            _set_gain(cls, 3.0)
            if f is loss:
                out.backward()
                assert w.backward_gain == 3.0 and _grads(x) == [1.5] * 3
            else:
                with pytest.raises(SubclassWriteError) as info:
                    out.backward()
                assert info.value.kind is RefusalKind.CHANGED_BEFORE_BACKWARD
                assert "gain" in str(info.value).lower() and "3.0" in str(info.value)
                assert w.backward_gain == 1.0 and _grads(x) == [1.0] * 3  # nothing accumulated
            x.grad = None
            # set before the forward: a compile for the new value, eager's record
            out = f(x, w)
            out.backward()
            assert w.backward_gain == 3.0 and _grads(x) == [0.5] * 3
            # What only the forward's branch reads, changed before backward(): the code the
            # backward runs is analysed statically, both branches of it, so this is refused
            # too (a README limit), never replayed as traced.
            x.grad = None
            out = f(x, w)
            FORWARD_ONLY_GAIN = 2.0
            if f is loss:
                out.backward()
            else:
                with pytest.raises(SubclassWriteError) as info:
                    out.backward()
                assert "FORWARD_ONLY_GAIN" in str(info.value) and x.grad is None
            assert w.forward_gain == 1.0 and w.backward_gain == 3.0
            FORWARD_ONLY_GAIN = 1.0
    finally:
        _set_gain(cls, 1.0)
        FORWARD_ONLY_GAIN = 1.0


# --------------------------------------------------------------- set by the compiled function itself

MARGIN = 0.0
MARGINS = {"m": 0.0}
class _MarginBox:
    m = 0.0


MARGIN_BOX = _MarginBox()  # a user object (Dynamo itself cannot trace a SimpleNamespace's setattr)


class ReadsMarginGlobal(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return MARGIN


class ReadsMarginDict(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return MARGINS["m"]


class ReadsMarginBox(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return MARGIN_BOX.m


class ReadsOverride(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return getattr(w, "override", 1.0)


def _set_global(w, v):
    global MARGIN
    MARGIN = v


def _set_dict(w, v):
    MARGINS["m"] = v


def _set_box(w, v):
    MARGIN_BOX.m = v


def _set_on_weight(w, v):
    w.override = v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_breaks", "fullgraph"])
@pytest.mark.parametrize(
    "cls,setter",
    [(ReadsMarginGlobal, _set_global), (ReadsMarginDict, _set_dict), (ReadsMarginBox, _set_box), (ReadsOverride, _set_on_weight)],
    ids=["global", "dict_item", "object_attribute", "weight_attribute"],
)
def test_state_the_compiled_function_sets_before_the_op(backend, fullgraph, cls, setter):
    """``w.override = k; w @ x`` (or a global, a dict item, a namespace attribute set the same
    way): Dynamo applies the user's write after the graph, so while traced the op would see
    the value from before the call. Refused (unsupported_state_read, nothing touched) under
    fullgraph=True; under fullgraph=False the op runs eagerly and sees the new value."""
    global MARGIN
    from fuzz_parts import refusal_kind

    def fn(x, w, k):
        setter(w, k)
        return torch.mm(x, w)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=fullgraph)
    we, wc = cls(torch.ones(2, 2)), cls(torch.ones(2, 2))
    x = torch.ones(2, 2)
    try:
        for call, k in enumerate([3.0, 5.0]):
            MARGIN, MARGINS["m"], MARGIN_BOX.m = 0.0, 0.0, 0.0
            oe = fn(x, we, k)
            MARGIN, MARGINS["m"], MARGIN_BOX.m = 0.0, 0.0, 0.0
            if fullgraph:
                before = dict(vars(wc))
                with pytest.raises(Exception) as info:
                    compiled(x, wc, k)
                assert refusal_kind(info.value) is dynamo_ext.RefusalKind.UNSUPPORTED_STATE_READ, info.value
                assert vars(wc).keys() == before.keys() and wc.used == before["used"], "the input was touched"
                return
            oc = compiled(x, wc, k)
            torch.testing.assert_close(oc, oe)
            assert_same_state(we, wc, f"call {call + 1}")
            assert we.used == k
    finally:
        MARGIN, MARGINS["m"], MARGIN_BOX.m = 0.0, 0.0, 0.0


# --------------------------------------------------------------- Python's random module


class RandomRounding(ScaledWeight):
    """Stochastic rounding with Python's ``random``: a draw per op, recorded."""

    @classmethod
    def scale_of(cls, w):
        return 1.0 + random.random()


@pytest.mark.parametrize("backend", BACKENDS)
def test_python_random_in_dispatch_runs_eagerly(backend):
    """A draw from Python's ``random`` module cannot be replayed by the compiled program
    (it would be baked): the op runs eagerly under ``fullgraph=False``, drawing as eager."""
    random.seed(0)
    state = random.getstate()
    torch._dynamo.reset()
    compiled = torch.compile(mm, backend=backend)
    we, wc = RandomRounding(torch.ones(2, 2)), RandomRounding(torch.ones(2, 2))
    x = torch.ones(2, 2)
    for call in range(3):
        random.setstate(state)
        oe = mm(x, we)
        after_eager = random.getstate()
        random.setstate(state)
        oc = compiled(x, wc)
        assert random.getstate() == after_eager, f"call {call + 1}: the compiled call drew otherwise than eager"
        torch.testing.assert_close(oc, oe)
        assert_same_state(we, wc, f"call {call + 1}")
        state = after_eager


@pytest.mark.parametrize("backend", BACKENDS)
def test_python_random_in_dispatch_is_refused_under_fullgraph(backend):
    from fuzz_parts import refusal_kind

    torch._dynamo.reset()
    compiled = torch.compile(mm, backend=backend, fullgraph=True)
    w = RandomRounding(torch.ones(2, 2))
    before = random.getstate()
    with pytest.raises(Exception) as info:
        compiled(torch.ones(2, 2), w)
    # a draw changes the module's generator: global state no compiled program replays
    assert refusal_kind(info.value) is dynamo_ext.RefusalKind.GLOBAL_STATE_WRITE
    assert "random" in str(info.value)
    assert random.getstate() == before  # the trace's draws are undone
    assert w.used == 0.0 and w.updates == 0


# --------------------------------------------------------------- which attributes are guarded


class Schedule:
    """A schedule class: the training loop bumps ``step``; dispatch reads only ``enabled``."""

    enabled = True
    step = 0


class CountsSteps(ScaledWeight):
    """Has a ``step`` of its own, which dispatch reads too (the same name as Schedule's)."""

    def __init__(self, data):
        super().__init__(data)
        self.step = 0

    @classmethod
    def scale_of(cls, w):
        w.step = w.step + 1
        return 2.0 if Schedule.enabled else 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_class_attribute_the_loop_bumps_and_dispatch_does_not_read(backend):
    """``Schedule.enabled`` is guarded, not ``Schedule.step``: the loop bumping it recompiles
    nothing (the weight's own count compiles twice, as any counter)."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(mm, backend=counter)
    we, wc = CountsSteps(torch.ones(2, 2)), CountsSteps(torch.ones(2, 2))
    x = torch.ones(2, 2)
    try:
        for call in range(8):
            Schedule.step += 1
            Schedule.enabled = call < 5
            torch.testing.assert_close(compiled(x, wc), mm(x, we))
            assert_same_state(we, wc, f"call {call + 1}")
    finally:
        Schedule.enabled, Schedule.step = True, 0
    assert counter.frame_count <= 3  # static, the count dynamic, enabled flipped


def _hook_reads_the_class(w):
    return type(w).FACTOR


HOOKS = {"scale": _hook_reads_the_class}


class UsesRegisteredHook(ScaledWeight):
    """A library calls a hook the user registered in its table; the hook reads a class attribute
    without naming the class."""

    FACTOR = 2.0

    @classmethod
    def scale_of(cls, w):
        return HOOKS["scale"](w)


class _Options:
    def __init__(self):
        self.factor = 2.0

    def apply(self, w):
        return self.factor


OPTIONS = _Options()
REGISTRY = {"args": types.SimpleNamespace(factor=2.0), "apply": OPTIONS.apply}
APPLY = OPTIONS.apply


class ReadsThroughRegistry(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return REGISTRY["args"].factor


class CallsRegisteredMethod(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return REGISTRY["apply"](w)


class CallsBoundMethod(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return APPLY(w)


def _set_factor(v):
    UsesRegisteredHook.FACTOR = v
    REGISTRY["args"].factor = v
    OPTIONS.factor = v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [UsesRegisteredHook, ReadsThroughRegistry, CallsRegisteredMethod, CallsBoundMethod])
def test_config_reached_through_a_registry_or_a_method(backend, cls):
    """A hook held in a dict, an object held in a dict, a bound method (in a dict or a global)
    whose owner holds the config: each flip recompiles, as eager reads the new value."""
    try:
        run_side_by_side(cls, _set_factor, [2.0, 3.0, 3.0, 5.0], backend)
    finally:
        _set_factor(2.0)


class _TiedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(FakeQuantInTraining(torch.randn(6, 4)))
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, ids):
        return torch.nn.functional.linear(self.lin(torch.nn.functional.embedding(ids, self.w)), self.w)


ROOT = None  # the model being compiled, as a library keeps a handle to it


class FakeQuantInTraining(torch.Tensor):
    """Fake-quantizes (doubles) its data while the root model trains; reads nothing else."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, requires_grad=data.requires_grad)

    def __init__(self, data):
        self._data = data

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (aten.detach.default, aten.alias.default):
            return cls(args[0]._data.detach())

        def unwrap(t):
            return t._data * 2 if ROOT.training else t._data

        return func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs or {}))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatch_reads_the_compiled_model_s_training_flag(backend):
    """The root model, reached through a global, is guarded by its attributes, not hooked: the
    tied weight's model trains with every gradient eager gives (they were lost)."""
    global ROOT
    grads = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        ROOT = model = _TiedModel()
        run = torch.compile(model, backend=backend) if compiled else model
        outs = []
        for training in (True, False, True):
            model.train(training)
            out = run(torch.tensor([1, 2, 3]))
            outs.append(out.detach().clone())
            if training:
                out.sum().backward()
        grads.append((outs, {n: p.grad for n, p in model.named_parameters()}))
    ROOT = None
    (e_outs, e_grads), (c_outs, c_grads) = grads
    for e, c in zip(e_outs, c_outs):
        torch.testing.assert_close(c, e)
    for name, g in e_grads.items():
        assert c_grads[name] is not None, f"{name}: gradient lost"
        torch.testing.assert_close(c_grads[name], g)


# --------------------------------------------------------------- globals advanced through their methods

import collections  # noqa: E402
import itertools  # noqa: E402

OP_IDS = itertools.count()
RECENT = collections.deque(maxlen=4)
RNG = random.Random(0)


class NumbersItsOps(ScaledWeight):
    """Gives every matmul an id from a module-level counter, logs it in a bounded deque and
    jitters by a draw from its own generator."""

    @classmethod
    def scale_of(cls, w):
        w.op_id = next(OP_IDS)
        RECENT.append(w.op_id)
        return 1.0 + RNG.random()


def _stateful_globals():
    return repr(OP_IDS), tuple(RECENT), RNG.getstate()


@pytest.mark.parametrize("backend", BACKENDS)
def test_globals_advanced_through_their_methods(backend):
    """``next(counter)``, ``deque.append`` and an own ``random.Random``'s draw change global
    state no compiled program replays: refused under fullgraph with the state as it was;
    without fullgraph the op runs eagerly and advances them as eager does."""
    from fuzz_parts import refusal_kind

    global OP_IDS
    torch._dynamo.reset()
    before = _stateful_globals()
    with pytest.raises(Exception) as info:
        torch.compile(mm, backend=backend, fullgraph=True)(torch.ones(2, 2), NumbersItsOps(torch.ones(2, 2)))
    assert refusal_kind(info.value) is dynamo_ext.RefusalKind.GLOBAL_STATE_WRITE
    assert _stateful_globals() == before

    torch._dynamo.reset()
    compiled = torch.compile(mm, backend=backend)
    we, wc = NumbersItsOps(torch.ones(2, 2)), NumbersItsOps(torch.ones(2, 2))
    for call in range(3):
        start = _stateful_globals()
        oe = mm(torch.ones(2, 2), we)
        after_eager = _stateful_globals()
        OP_IDS = itertools.count(int(start[0][6:-1]))
        RECENT.clear(), RECENT.extend(start[1])
        RNG.setstate(start[2])
        oc = compiled(torch.ones(2, 2), wc)
        assert _stateful_globals() == after_eager, f"call {call + 1}"
        torch.testing.assert_close(oc, oe)
        assert wc.op_id == we.op_id


# ------------------------------------------- settings held by library objects and odd config classes
# (an outside tester's finds: each was replayed as first traced, silently)

ENV_GAIN = "DYNAMO_EXT_TEST_GAIN"
GAIN_ARRAY = np.array([2.0])
GAIN_CARRAY = array.array("d", [2.0])
GAIN_VAR = contextvars.ContextVar("dynamo_ext_test_gain", default=2.0)
GAIN_QUEUE = collections.deque([2.0], maxlen=1)
LRU_SETTINGS = {"gain": 2.0}


@functools.lru_cache(None)
def lru_gain():
    return LRU_SETTINGS["gain"]


class EasyDict(dict):
    """A config dict read by attribute (the easydict package's shape)."""

    __getattr__ = dict.__getitem__


class SlottedConfig:
    __slots__ = ("gain",)

    def __init__(self):
        self.gain = 2.0


EASY = EasyDict(gain=2.0)
SLOTTED = SlottedConfig()


class ReadsGetenv(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return float(os.getenv(ENV_GAIN, "2.0"))


class ReadsArray(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return float(GAIN_ARRAY[0])


class ReadsCArray(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return GAIN_CARRAY[0]


class ReadsContextVar(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return GAIN_VAR.get()


class ReadsDeque(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return GAIN_QUEUE[0]


class ReadsCachedGetter(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return lru_gain()


class ReadsEasyDict(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return EASY.gain


class ReadsSlots(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return SLOTTED.gain


def _set_library_gain(cls, v):
    if cls is ReadsGetenv:
        os.environ[ENV_GAIN] = str(v)
    elif cls is ReadsArray:
        GAIN_ARRAY[0] = v
    elif cls is ReadsCArray:
        GAIN_CARRAY[0] = v
    elif cls is ReadsContextVar:
        GAIN_VAR.set(v)
    elif cls is ReadsDeque:
        GAIN_QUEUE.append(v)
    elif cls is ReadsCachedGetter:
        LRU_SETTINGS["gain"] = v
        lru_gain.cache_clear()
    elif cls is ReadsEasyDict:
        EASY["gain"] = v
    else:
        SLOTTED.gain = v


LIBRARY_HOLDERS = [ReadsGetenv, ReadsArray, ReadsCArray, ReadsContextVar, ReadsDeque, ReadsCachedGetter, ReadsEasyDict, ReadsSlots]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", LIBRARY_HOLDERS, ids=lambda c: c.__name__)
def test_a_setting_a_library_object_holds(backend, cls):
    """``os.getenv``, a numpy array or ``array.array`` changed in place, a ``ContextVar``, a
    ``deque``, an ``lru_cache`` getter cleared when its setting changes, an EasyDict, a
    ``__slots__`` config: each is guarded (by what it holds, or through the function it
    calls), so a change recompiles where it was replayed as first traced."""
    try:
        run_side_by_side(cls, lambda v: _set_library_gain(cls, v), [2.0, 3.0, 3.0, 5.0, 2.0], backend, fullgraph=True)
    finally:
        _set_library_gain(cls, 2.0)
        os.environ.pop(ENV_GAIN, None)


class AttrConfig:
    """Settings in a dict its own ``__getattr__`` serves (OmegaConf and ml_collections' shape)."""

    def __init__(self, **kw):
        object.__setattr__(self, "_d", dict(kw))

    def __getattr__(self, name):
        try:
            return self._d[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self._d[name] = value


class PropertyConfig:
    def __init__(self):
        self._g = 1.0

    @property
    def gain(self):
        return self._g

    @gain.setter
    def gain(self, v):
        self._g = v


BACKWARD_HOLDERS = {
    "attr_config": AttrConfig(gain=1.0),
    "property": PropertyConfig(),
    "slots": SlottedConfig(),
    "easydict": EasyDict(gain=1.0),
}


class GainFromHolder(_RecordsBackwardState):
    @classmethod
    def gain_now(cls):
        return CURRENT_HOLDER.gain


CURRENT_HOLDER = BACKWARD_HOLDERS["attr_config"]


@pytest.mark.parametrize("kind", sorted(BACKWARD_HOLDERS))
def test_a_config_setting_served_indirectly_changed_before_backward(kind):
    """A setting the backward reads through a property, the config's own ``__getattr__``,
    a slot or a dict subclass, changed between the forward and ``backward()``: refused
    there, where the traced value was used silently (gradients off)."""
    global CURRENT_HOLDER

    def loss(x, w):
        return (x * w).sum()

    CURRENT_HOLDER = holder = BACKWARD_HOLDERS[kind]
    torch._dynamo.reset()
    try:
        for f in (loss, torch.compile(loss, backend="aot_eager", fullgraph=False)):
            x, w = torch.ones(3, requires_grad=True), GainFromHolder(torch.full((3,), 0.5))
            holder.gain = 1.0
            out = f(x, w)
            holder.gain = 3.0
            if f is loss:
                out.backward()
                assert w.backward_gain == 3.0
            else:
                with pytest.raises(SubclassWriteError) as info:
                    out.backward()
                assert info.value.kind is RefusalKind.CHANGED_BEFORE_BACKWARD and x.grad is None
    finally:
        holder.gain = 1.0
        CURRENT_HOLDER = BACKWARD_HOLDERS["attr_config"]


THREAD_SETTINGS = threading.local()
THREAD_SETTINGS.gain = 1.0


class GainFromThread(_RecordsBackwardState):
    @classmethod
    def gain_now(cls):
        return THREAD_SETTINGS.gain


def test_a_thread_local_setting_the_backward_reads_unchanged():
    """A ``threading.local`` setting is read in this thread when the backward runs, as
    traced: nothing changed, nothing refused (it was refused as changed)."""

    def loss(x, w):
        return (x * w).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    for f in (loss, compiled):
        x, w = torch.ones(3, requires_grad=True), GainFromThread(torch.full((3,), 0.5))
        f(x, w).backward()
        assert w.backward_gain == 1.0 and _grads(x) == [0.5] * 3


class RecordsInferenceMode(ScaledWeight):
    """Dispatch records whether inference mode is on and scales by it."""

    @classmethod
    def scale_of(cls, w):
        w.inference = torch.is_inference_mode_enabled()
        return 2.0 if w.inference else 1.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
def test_inference_mode_dispatch_reads(backend, fullgraph):
    """Note [Inference mode while traced]: Dynamo compiles with inference mode off. A call
    under ``torch.inference_mode`` refuses the op (eager under ``fullgraph=False``); a
    graph compiled outside it is guarded, so a later call under it is not served by it."""
    torch._dynamo.reset()
    compiled = torch.compile(mm, backend=backend, fullgraph=fullgraph)
    x = torch.ones(2, 2)
    for mode in (False, True, False, True):
        we, wc = RecordsInferenceMode(torch.ones(2, 2)), RecordsInferenceMode(torch.ones(2, 2))
        with torch.inference_mode(mode):
            oe = mm(x, we)
            if mode and fullgraph:
                with pytest.raises(torch._dynamo.exc.Unsupported, match="dynamo_ext: unsupported_state_read"):
                    compiled(x, wc)
                assert not hasattr(wc, "inference")  # untouched
                continue
            oc = compiled(x, wc)
        torch.testing.assert_close(oc, oe)
        assert_same_state(we, wc, f"inference_mode({mode})")


GAIN_TENSOR = torch.tensor(2.0)


class ComputesWithAGlobalTensor(ScaledWeight):
    """Its matmul result is multiplied by a module-level gain tensor."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        return out * GAIN_TENSOR if func is aten.mm.default else out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
def test_a_global_tensor_dispatch_computes_with(backend, fullgraph):
    """A real tensor dispatch reaches through a global cannot be an input of the traced
    program: refused by name (``unsupported_state_read``), so under ``fullgraph=False`` the op
    runs eagerly where torch's fake/real mix error was raised."""
    if fullgraph:
        torch._dynamo.reset()
        w = ComputesWithAGlobalTensor(torch.ones(2, 2))
        with pytest.raises(torch._dynamo.exc.Unsupported, match="unsupported_state_read") as info:
            torch.compile(mm, backend=backend, fullgraph=True)(torch.ones(2, 2), w)
        assert "GAIN_TENSOR" in str(info.value) and w.used == 0.0
        return
    run_side_by_side(ComputesWithAGlobalTensor, lambda v: GAIN_TENSOR.fill_(v), [2.0, 3.0, 2.0], backend)


class ScalesByAGlobalTensor(ScaledWeight):
    @classmethod
    def scale_of(cls, w):
        return GAIN_TENSOR * 1.0  # a real scalar tensor made outside the inputs: a graph constant


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_global_scalar_tensor_dispatch_records(backend):
    """Fake propagation keeps a real scalar computed from a global tensor as a constant of the
    graph (it reads the live tensor at run time); the value dispatch records is one too,
    a plain trace tensor holding torch's own attributes only (none is taken for a tag)."""
    run_side_by_side(ScalesByAGlobalTensor, lambda v: GAIN_TENSOR.fill_(v), [2.0, 3.0, 2.0], backend, fullgraph=True)


class _GainModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("gain", torch.tensor(2.0))


GAIN_MODULE = _GainModule()


class ComputesWithAModuleBuffer(ScaledWeight):
    """Its matmul result is multiplied by a buffer of a module a global holds (delayed
    scaling keeping its amax in a module-level nn.Module)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        return out * GAIN_MODULE.gain if func is aten.mm.default else out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
def test_a_module_buffer_dispatch_computes_with(backend, fullgraph):
    """A buffer (or parameter) of a module a global holds is a real tensor reached through
    the module's ``__getattr__``: refused by name like a global tensor (an outside tester's
    find: torch's fake/real mix error, raised under ``fullgraph=False`` too)."""
    if fullgraph:
        torch._dynamo.reset()
        w = ComputesWithAModuleBuffer(torch.ones(2, 2))
        with pytest.raises(torch._dynamo.exc.Unsupported, match="unsupported_state_read") as info:
            torch.compile(mm, backend=backend, fullgraph=True)(torch.ones(2, 2), w)
        assert "gain" in str(info.value) and w.used == 0.0
        return
    run_side_by_side(ComputesWithAModuleBuffer, lambda v: GAIN_MODULE.gain.fill_(v), [2.0, 3.0, 2.0], backend)


LOG_BUFFER = __import__("io").StringIO()
DEBUG = False


class MentionsLibraryObjects(ScaledWeight):
    """Dispatch code naming ``sys.stderr`` behind a debug flag, a module-level ``StringIO``
    log and ``sys.version_info``: objects of C classes (an outside tester's find: the
    compile crashed trying to hook them, under ``fullgraph=False`` too)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        import sys

        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is aten.mm.default:
            w = next(a for a in args if isinstance(a, cls))
            if DEBUG:
                print("mm", file=sys.stderr)
                LOG_BUFFER.write("mm\n")
            w.calls = getattr(w, "calls", 0) + (1 if sys.version_info >= (3, 8) else 2)
        return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
def test_dispatch_naming_objects_of_c_classes(backend, fullgraph):
    torch._dynamo.reset()
    compiled = torch.compile(mm, backend=backend, fullgraph=fullgraph)
    we, wc = MentionsLibraryObjects(torch.ones(2, 2)), MentionsLibraryObjects(torch.ones(2, 2))
    for _ in range(3):
        x = torch.randn(2, 2)
        torch.testing.assert_close(compiled(x, wc), mm(x, we))
        assert_same_state(we, wc)
    assert wc.calls == 3
