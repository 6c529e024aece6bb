"""Dispatch calls code an attribute holds: a getter stored on the tensor, a bound method of a
config object, a class kept on the instance, a function a registered state object holds. What
that code reads (a closure cell, a global, a default, the owner's attributes, class state) was
found by no static walk from the class's code and stayed baked into the compiled program,
silently, under every backend (an outside tester's find; stock fails loudly). It is followed
and guarded as code a global names: a change between calls recompiles."""

from __future__ import annotations

import types

import pytest
import torch

import dynamo_ext
from dynamo_ext.testing import WrapperTensor
from harness import assert_same_state, leaked_fakes


class Held(WrapperTensor):
    """Scales each result by what the code it holds answers, and logs it."""

    WRAP_OUTPUTS = False

    @classmethod
    def __torch_dispatch__(cls, func, types_, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types_, args, kwargs)
        w = next(a for a in args if isinstance(a, Held))
        s = w.scale_now()
        w.last_s = s
        return out * s

    def scale_now(self):
        return self.get_scale()


class HeldScheme(Held):
    def scale_now(self):
        return self.scheme.SCALE


class Shared:
    """A registered state object holding a getter."""

    def __init__(self, getter):
        self.getter = getter

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)


dynamo_ext.register_ctx_state(Shared)


class HeldInCtx(WrapperTensor):
    CTX = ("shared",)
    WRAP_OUTPUTS = False

    @classmethod
    def __torch_dispatch__(cls, func, types_, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types_, args, kwargs)
        w = next(a for a in args if isinstance(a, HeldInCtx))
        s = w.shared.getter()
        w.last_s = s
        return out * s


class Config:
    def __init__(self):
        self.scale = 1.0

    def get(self):
        return self.scale


class Scheme:
    SCALE = 1.0


def by_attribute():
    return 0


# Each case: (make the input, change what the held code answers), fresh objects per run.


def dict_in_closure():
    box = {"v": 1.0}
    w = Held(torch.ones(3))
    w.get_scale = lambda: box["v"]
    return w, lambda: box.update(v=3.0)


def rebound_cell():
    v = 1.0

    def get():
        return v

    def change():
        nonlocal v
        v = 3.0

    w = Held(torch.ones(3))
    w.get_scale = get
    return w, change


def own_attribute():
    w = Held(torch.ones(3))
    w.knob = 1.0
    w.get_scale = lambda: w.knob
    return w, lambda: setattr(w, "knob", 3.0)


def config_method():
    cfg = Config()
    w = Held(torch.ones(3))
    w.get_scale = cfg.get
    return w, lambda: setattr(cfg, "scale", 3.0)


def method_on_the_tensor():
    w = Held(torch.ones(3))
    w.knob = 1.0
    w.get_scale = types.MethodType(lambda self: self.knob, w)
    return w, lambda: setattr(w, "knob", 3.0)


def mutable_default():
    def get(box=[1.0]):  # noqa: B006 - the state under test
        return box[0]

    w = Held(torch.ones(3))
    w.get_scale = get
    return w, lambda: get.__defaults__[0].__setitem__(0, 3.0)


def nested_closure():
    def outer():
        table = [1.0]

        def inner():
            return table[0]

        return inner, table

    inner, table = outer()
    w = Held(torch.ones(3))
    w.get_scale = inner
    return w, lambda: table.__setitem__(0, 3.0)


def class_on_the_instance():
    scheme = type("Scheme", (Scheme,), {"SCALE": 1.0})
    w = HeldScheme(torch.ones(3))
    w.scheme = scheme
    return w, lambda: setattr(scheme, "SCALE", 3.0)


def getter_in_ctx_state():
    box = {"v": 1.0}
    w = HeldInCtx(torch.ones(3), shared=Shared(lambda: box["v"]))
    return w, lambda: box.update(v=3.0)


CASES = [
    dict_in_closure, rebound_cell, own_attribute, config_method, method_on_the_tensor,
    mutable_default, nested_closure, class_on_the_instance, getter_in_ctx_state,
]


def step(w, x):
    return w * x


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_what_code_an_attribute_holds_reads_is_guarded(case, backend, fullgraph):
    def run(f):
        w, change = case()
        seen = []
        for i in range(4):
            if i == 2:
                change()
            out = f(w, torch.ones(3))
            seen.append((out.tolist(), w.last_s))
        assert not leaked_fakes(w)
        return seen, w

    eager, w_e = run(step)
    assert eager[-1][1] == 3.0
    torch._dynamo.reset()
    compiled, w_c = run(torch.compile(step, backend=backend, fullgraph=fullgraph))
    assert compiled == eager
    assert w_c.last_s == w_e.last_s


LOG: list = []


def bumps_a_cell():
    n = 0

    def bump():
        nonlocal n
        n += 1
        return 1.0

    w = Held(torch.ones(3))
    w.get_scale = bump
    return w, lambda: n


def appends_to_a_global():
    del LOG[:]
    w = Held(torch.ones(3))
    w.get_scale = lambda: (LOG.append(1), 1.0)[1]
    return w, lambda: len(LOG)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", [bumps_a_cell, appends_to_a_global], ids=lambda c: c.__name__)
def test_code_an_attribute_holds_that_changes_state_is_refused_before_it_runs(case, backend, fullgraph):
    """Found while the op ran, the code had changed the cell or list once before its watch
    began: refused then, with the count one ahead of eager's under fullgraph=False."""
    w, count = case()
    for _ in range(3):
        step(w, torch.ones(3))
    assert count() == 3
    w, count = case()
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=fullgraph)
    if fullgraph:
        with pytest.raises(torch._dynamo.exc.Unsupported, match="dynamo_ext: global_state_write"):
            compiled(w, torch.ones(3))
        assert count() == 0 and "last_s" not in w.__dict__, "a refusal changed state"
        return
    for i in range(3):
        compiled(w, torch.ones(3))
        assert count() == i + 1
