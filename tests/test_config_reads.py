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

import dataclasses
import os
import random
import sys
import types

import pytest
import torch
from torch.utils._pytree import tree_map_only

import dynamo_ext
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
