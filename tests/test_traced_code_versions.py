"""Version counters that code Dynamo traces itself reads: a subclass method such as
``dequantize`` called from ``__torch_function__`` (a frame of its own once a refused op
graph-breaks there), or the compiled function reading a subclass input's inner counter. The
cache keyed on the counter is rebuilt where eager rebuilds it, with the user changing the
tensor in place between calls (outside round 42: the cache stayed stale on aot_eager and the
outputs were computed with the old weights)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

BACKENDS = ["eager", "aot_eager"]


@dataclasses.dataclass
class Layout:
    """A torchao-style layout: a plain (not frozen) dataclass in the flatten ctx. Dispatch
    reading it is refused; under ``fullgraph=False`` the op graph-breaks."""

    group: int = 4


class Quantized(torch.Tensor):
    """int8 data and a scale; ``F.linear`` handled in ``__torch_function__`` with a dequantized
    copy cached on the weight and keyed on ``int_data._version``."""

    @staticmethod
    def __new__(cls, int_data, scale, layout):
        return torch.Tensor._make_wrapper_subclass(cls, int_data.shape, dtype=scale.dtype)

    def __init__(self, int_data, scale, layout):
        self.int_data, self.scale, self._layout = int_data, scale, layout
        self._deq, self._deq_ver, self.builds = None, None, 0

    def __tensor_flatten__(self):
        return ["int_data", "scale"], self._layout

    @staticmethod
    def __tensor_unflatten__(inner, layout, outer_size, outer_stride):
        return Quantized(inner["int_data"], inner["scale"], layout)

    def dequantize(self):
        version = self.int_data._version
        if self._deq is not None and self._deq_ver == version and self._layout.group == 4:
            return self._deq
        self._deq_ver = version
        self.builds = self.builds + 1
        self._deq = self.int_data.to(self.scale.dtype) * self.scale
        return self._deq

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and isinstance(args[1], Quantized):
            return F.linear(args[0], args[1].dequantize(), *args[2:], **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            w = args[0]
            return Quantized(w.int_data.detach(), w.scale.detach(), w._layout)
        unwrap = lambda t: t.dequantize() if isinstance(t, Quantized) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def _weight():
    g = torch.Generator().manual_seed(0)
    data = torch.randint(-100, 100, (3, 4), generator=g, dtype=torch.int8)
    return Quantized(data, torch.tensor(0.01), Layout())


def _state(w):
    return (w._deq_ver, w.builds, w.int_data._version, None if w._deq is None else w._deq.tolist())


def _requantize(w, step):
    with torch.no_grad():
        if step % 2:
            w.int_data.copy_(w.int_data // 2)
        else:
            w.int_data.add_(3)


def _run(fn, change_at=(2, 3, 5)):
    w, x = _weight(), torch.ones(2, 4)
    seen = []
    for i in range(6):
        if i in change_at:
            _requantize(w, i)
        out = fn(x, w)
        seen.append((out.tolist(), _state(w)))
    return seen


def linear(x, w):
    return F.linear(x, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dequantize_cache_after_a_refused_read_graph_breaks(backend):
    """The layout read is refused, ``F.linear`` graph-breaks, and Dynamo compiles
    ``dequantize`` as a frame of its own: its version key is the real counter, guarded."""
    torch._dynamo.reset()
    eager = _run(linear)
    compiled = _run(torch.compile(linear, backend=backend, fullgraph=False))
    assert compiled == eager


def reads_inner_version(x, w):
    """The compiled function keeps the cache itself (a user-side quantized linear)."""
    if w._deq is None or w._deq_ver != w.int_data._version:
        w._deq = w.int_data.float() * w.scale
        w._deq_ver = w.int_data._version
        w.builds = w.builds + 1
    return x @ w._deq.t()


def reads_after_changing(x, w):
    """The function changes the inner tensor in place, then reads its counter."""
    w.int_data.add_(1)
    w._deq_ver = w.int_data._version
    return x * w.int_data._version


def reads_own_counter(x, w):
    """A subclass's own counter (a cache keyed on ``self._version``)."""
    w._deq_ver = w._version
    return x + w._version


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_compiled_function_reads_an_inner_counter(backend, fullgraph):
    torch._dynamo.reset()
    eager = _run(reads_inner_version)
    compiled = _run(torch.compile(reads_inner_version, backend=backend, fullgraph=fullgraph))
    assert compiled == eager


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_counter_read_after_the_function_changed_it(backend, fullgraph):
    """The read counts the frame's own change: one past the counter the call began with.
    (AOTAutograd bumps an input its graph changes twice per call, torch's own count, so the
    counters are compared with where each call began rather than with eager's.)"""

    def run(fn):
        w, x, seen = _weight(), torch.ones(2), []
        for i in range(5):
            if i in (2, 3):
                _requantize(w, i)
            began = w.int_data._version
            out = fn(x, w)
            seen.append((out.tolist(), w._deq_ver - began, w.int_data.tolist()))
        return seen

    torch._dynamo.reset()
    eager = run(reads_after_changing)
    compiled = run(torch.compile(reads_after_changing, backend=backend, fullgraph=fullgraph))
    assert [s[1:] for s in compiled] == [s[1:] for s in eager]
    assert all(s[1] == 1 for s in compiled)
    if backend == "eager":
        assert compiled == eager


def _run_own(fn):
    w, x = _weight(), torch.ones(2)
    seen = []
    for i in range(4):
        if i in (1, 3):
            with torch.no_grad():
                w.int_data.add_(1)
                torch._C._autograd._unsafe_set_version_counter((w,), (w._version + 2,))
        out = fn(x, w)
        seen.append((out.tolist(), w._deq_ver, w._version))
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_compiled_function_reads_a_subclass_counter(backend):
    torch._dynamo.reset()
    eager = _run_own(reads_own_counter)
    compiled = _run_own(torch.compile(reads_own_counter, backend=backend, fullgraph=False))
    assert compiled == eager


class QLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(_weight(), requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.weight)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_module_weight_requantized_between_calls(backend):
    """The weight a module holds as a parameter, requantized in place between calls."""

    def run(model):
        x, seen = torch.ones(2, 4), []
        for i in range(5):
            if i in (2, 4):
                _requantize(model.weight, i)
            seen.append((model(x).tolist(), _state(model.weight)))
        return seen

    torch._dynamo.reset()
    eager = run(QLinear())
    compiled = run(torch.compile(QLinear(), backend=backend, fullgraph=False))
    assert compiled == eager


def test_a_plain_tensor_counter_in_user_code_stays_torch():
    """Only a subclass input's counters are answered from the real tensor: a plain tensor's
    read in the user's own code is torch's op, with no guard added (no recompile)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def fn(t):
        return t * 2, t._version

    f = torch.compile(fn, backend=counter, fullgraph=True)
    t = torch.ones(2)
    f(t)
    t.add_(1)
    f(t)
    assert counter.frame_count == 1
