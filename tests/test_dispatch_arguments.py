"""What dispatch is given while traced is what eager gives it (See Note [Numbers dispatch is
given] in capture.py), and the refusals and values around it found by writing subclasses
from scratch: numbers Dynamo made dynamic, keyword arguments equal to their default, a
symbolic nan, a tensor read inside an ``autograd.Function``.

Every case runs eager and compiled on separate, equal inputs and compares outputs and every
attribute after each call (``harness.assert_same_state``).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.utils._pytree import tree_map

from dynamo_ext import RefusalKind
from harness import assert_same_outputs, assert_same_state, leaked_fakes

BACKENDS = ["eager", "aot_eager"]


class Recorder(torch.Tensor):
    """A debugging wrapper that records how each op was called."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem
        self.alpha_sum = 0.0
        self.saw_alpha = False
        self.scalar_ops = 0
        self.tensor_ops = 0
        self.last_scalar = None
        self.scale = 1.0
        self.seen = 0.0

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Recorder(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = next(a for a in args if isinstance(a, Recorder))
        if func is torch.ops.aten.add.Tensor and "alpha" in kwargs:
            me.saw_alpha = True
            me.alpha_sum = me.alpha_sum + kwargs["alpha"]
        if func is torch.ops.aten.mul.Tensor:
            other = args[1]
            if isinstance(other, (int, float)):
                me.scalar_ops += 1
                me.last_scalar = other
            else:
                me.tensor_ops += 1
        if func is torch.ops.aten.mm.default:
            me.seen = me.scale * args[0].shape[0]
        unwrapped = tree_map(lambda t: t.elem if isinstance(t, Recorder) else t, (args, kwargs))
        return func(*unwrapped[0], **unwrapped[1])


def _run(fn, calls, backend, fullgraph=True, dynamic=True):
    """One Recorder each side, kept over the calls; ``calls``: the numbers of each call."""
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=fullgraph, dynamic=dynamic)
    e, c = Recorder(torch.ones(3)), Recorder(torch.ones(3))
    for k, numbers in enumerate(calls):
        assert_same_outputs(fn(e, *numbers), compiled(c, *numbers))
        assert_same_state(e, c, f"call {k} {numbers}")
        assert not leaked_fakes(c)
    return counter


def add_with_alpha(b, alpha):
    return torch.add(torch.ones(3), b, alpha=alpha)


@pytest.mark.parametrize("dynamic", [True, None])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_keyword_argument_equal_to_its_default_is_left_out(backend, dynamic):
    """``alpha=1`` reaches eager's dispatch without ``alpha``; a dynamic ``alpha`` too."""
    calls = [(1,), (2,), (3,), (1,), (2,)]
    _run(add_with_alpha, calls, backend, dynamic=dynamic)


def scaled(b, k):
    return b * k


@pytest.mark.parametrize("dynamic", [True, None])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_number_operand_is_a_number(backend, dynamic):
    """``isinstance(other, (int, float))`` holds for a number Dynamo made dynamic."""
    calls = [(2,), (3,), (4,), (2.5,)]
    _run(scaled, calls, backend, dynamic=dynamic)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_number_compiles_once(backend):
    counter = _run(scaled, [(2,)] * 4, backend)
    assert counter.frame_count == 1


def sliced(b, x):
    n = x.shape[0]
    return b[:n] * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_sizes_stay_symbolic(backend):
    """Sizes and indices given to dispatch stay symbolic: new sizes do not recompile."""
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(sliced, backend=counter, fullgraph=True, dynamic=True)
    for n in (3, 4, 5, 6):
        e, c = Recorder(torch.ones(8)), Recorder(torch.ones(8))
        assert_same_outputs(sliced(e, torch.ones(n)), compiled(c, torch.ones(n)))
        assert_same_state(e, c)
    assert counter.frame_count == 1


def matmul(x, w):
    return torch.mm(x, w)


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_times_a_symbolic_size(backend, fullgraph):
    """``scale * x.shape[0]`` with ``scale`` nan: a SymFloat whose value is nan whatever the size."""
    compiled = torch.compile(matmul, backend=backend, fullgraph=fullgraph, dynamic=True)
    e, c = Recorder(torch.ones(2, 2)), Recorder(torch.ones(2, 2))
    e.scale = c.scale = float("nan")
    for rows in (3, 5):
        assert_same_outputs(matmul(torch.ones(rows, 2), e), compiled(torch.ones(rows, 2), c))
        assert math.isnan(e.seen) and math.isnan(c.seen) and type(c.seen) is float
    e.scale = c.scale = 0.5
    assert_same_outputs(matmul(torch.ones(4, 2), e), compiled(torch.ones(4, 2), c))
    assert e.seen == c.seen == 2.0


class AmaxWeight(torch.Tensor):
    """A float8-style weight recording the running amax of what it is multiplied with."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem):
        self.elem = elem
        self.amax = torch.zeros(())

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return AmaxWeight(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            args[1].amax = torch.maximum(args[1].amax, args[0].abs().amax())
        unwrapped = tree_map(lambda t: t.elem if isinstance(t, AmaxWeight) else t, (args, kwargs or {}))
        return func(*unwrapped[0], **unwrapped[1])


class MyMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        return torch.mm(x, w)

    @staticmethod
    def backward(ctx, g):
        return g, None


def through_function(x, w):
    return MyMM.apply(x, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tensor_read_inside_an_autograd_function(backend):
    """Refused under fullgraph=True as ``unsupported_state_read`` (an Exception naming it),
    the input untouched; under fullgraph=False the frame runs with eager's semantics."""
    x = torch.tensor([[3.0, -4.0], [1.0, 2.0]], requires_grad=True)
    w = AmaxWeight(torch.eye(2))
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(through_function, backend=backend, fullgraph=True)(x, w)
    assert RefusalKind.UNSUPPORTED_STATE_READ.gb_type in str(info.value) and "'amax'" in str(info.value)
    assert torch.equal(w.amax, torch.zeros(()))
    torch._dynamo.reset()
    e, c = AmaxWeight(torch.eye(2)), AmaxWeight(torch.eye(2))
    compiled = torch.compile(through_function, backend=backend)
    for _ in range(2):
        assert_same_outputs(through_function(x, e), compiled(x, c))
        assert_same_state(e, c)


Step = __import__("collections").namedtuple("Step", "step tag")


class StepLogger(torch.Tensor):
    """Keeps its last step as a namedtuple."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem):
        self.elem = elem
        self.k = 0
        self.info = None

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return StepLogger(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            w = args[1]
            w.k += 1
            w.info = Step(w.k, "mm")
        unwrapped = tree_map(lambda t: t.elem if isinstance(t, StepLogger) else t, (args, kwargs or {}))
        return func(*unwrapped[0], **unwrapped[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_namedtuple_holding_a_symbolic_count(backend):
    """Constant fields are replayed; once the count is symbolic (its first change) the
    namedtuple is refused as ``opaque_value`` under fullgraph=True, the input untouched, and
    runs with eager's semantics under fullgraph=False."""
    full = torch.compile(matmul, backend=backend, fullgraph=True)
    w = StepLogger(torch.eye(2))
    full(torch.ones(2, 2), w)
    assert w.info == Step(1, "mm") and type(w.info) is Step
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        full(torch.ones(2, 2), w)
    assert RefusalKind.OPAQUE_VALUE.gb_type in str(info.value) and "'info'" in str(info.value)
    assert w.k == 1 and w.info == Step(1, "mm")
    torch._dynamo.reset()
    compiled = torch.compile(matmul, backend=backend)
    e, c = StepLogger(torch.eye(2)), StepLogger(torch.eye(2))
    for _ in range(4):
        assert_same_outputs(matmul(torch.ones(2, 2), e), compiled(torch.ones(2, 2), c))
        assert_same_state(e, c)
        assert type(c.info) is Step and type(c.info.step) is int


def times_rows(b, x):
    return b * x.shape[0]


def plus_rows(b, x):
    return b + x.shape[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_number_made_from_a_size_is_a_number(backend):
    """``b * x.shape[0]``: dispatch counts scalar operands (``isinstance(other, (int, float))``),
    so it is given the size's value, eager's int, and that program compiles per size."""
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(times_rows, backend=counter, fullgraph=True, dynamic=True)
    e, c = Recorder(torch.ones(7)), Recorder(torch.ones(7))  # not a size n has (duck sizing)
    for n in (3, 4, 3, 5):
        assert_same_outputs(times_rows(e, torch.ones(n)), compiled(c, torch.ones(n)))
        assert_same_state(e, c, f"rows {n}")
        assert type(c.last_scalar) is int
    assert counter.frame_count == 3


def sliced_and_scaled(b, x):
    return b[: x.shape[0]] * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_slice_by_a_size_stays_dynamic(backend):
    """A size in a SymInt position (a slice end) stays symbolic: one compile for all sizes."""
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(sliced_and_scaled, backend=counter, fullgraph=True, dynamic=True)
    e, c = Recorder(torch.ones(9)), Recorder(torch.ones(9))
    for n in (3, 4, 5, 6):
        assert_same_outputs(sliced_and_scaled(e, torch.ones(n)), compiled(c, torch.ones(n)))
        assert_same_state(e, c, f"rows {n}")
    assert counter.frame_count == 1


class Activations(torch.Tensor):
    """Records the arguments its activations were called with."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem):
        self.elem = elem
        self.calls = ()

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Activations(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        me = args[0]
        numbers = tuple(a for a in args[1:] if isinstance(a, (int, float)))
        me.calls = me.calls + ((func.__name__, len(args), numbers, tuple(sorted(kwargs or {}))),)
        unwrapped = tree_map(lambda t: t.elem if isinstance(t, Activations) else t, (args, kwargs or {}))
        return cls(func(*unwrapped[0], **unwrapped[1]))


def activations(x, slope, lo, hi):
    return torch.nn.functional.hardtanh(torch.nn.functional.leaky_relu(x, slope), lo, hi)


@pytest.mark.parametrize("dynamic", [True, None])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_trailing_positional_argument_equal_to_its_default_is_left_out(backend, dynamic):
    """``leaky_relu(x, 0.01)`` and ``hardtanh(x, -1, 1)`` reach eager's dispatch as ``(x,)``."""
    compiled = torch.compile(activations, backend=backend, fullgraph=True, dynamic=dynamic)
    for slope, lo, hi in [(0.01, -1, 1), (0.2, -2, 1), (0.01, -1, 2), (0.3, -1, 1)]:
        e, c = Activations(torch.linspace(-3, 3, 7)), Activations(torch.linspace(-3, 3, 7))
        assert_same_outputs(activations(e, slope, lo, hi), compiled(c, slope, lo, hi))
        assert_same_state(e, c, f"{(slope, lo, hi)}")


class CountsCalls(torch.Tensor):
    """Counts its ops in the flatten ctx and notes the numbers and sizes each op was given,
    as text (a debugging wrapper)."""

    @staticmethod
    def __new__(cls, elem, calls=0, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, dtype=elem.dtype, device=elem.device, requires_grad=requires_grad
        )

    def __init__(self, elem, calls=0, requires_grad=False):
        self.elem = elem
        self.calls = calls
        self.given = ""

    def __tensor_flatten__(self):
        return ["elem"], self.calls

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return CountsCalls(inner["elem"], ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in args:
            if isinstance(a, CountsCalls):
                a.calls += 1
                a.given = f"{func.__name__}{[x for x in args if not isinstance(x, torch.Tensor)]}"
        unwrapped = tree_map(lambda t: t.elem if isinstance(t, CountsCalls) else t, (args, kwargs))
        out = func(*unwrapped[0], **unwrapped[1])
        return tree_map(lambda t: CountsCalls(t) if isinstance(t, torch.Tensor) else t, out)


def divided_by_rows(w, x):
    return (x @ w) / x.shape[0]


def ones_of_rows(w, x):
    return w.new_ones(x.shape[0], 4) + x


def mean_of_product(w, x):
    return (x @ w).mean()


def divided_in_a_helper(w, x):
    y = torch.relu(x) @ w  # Dynamo inlines the helper: the frame it compiles is this one
    return divided_by_rows(w, y) + y


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("program", [divided_by_rows, ones_of_rows, mean_of_product, divided_in_a_helper])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_size_marked_dynamic_that_dispatch_gets_as_a_number(backend, program, fullgraph):
    """``mark_dynamic`` promises the size stays symbolic; dispatch, given eager's int (or text
    made from it), would specialize it and Dynamo raise ``ConstraintViolationError``, also
    under ``fullgraph=False`` (an outside tester's find). The op is refused instead: under
    ``fullgraph=False`` the frame runs eagerly, under ``fullgraph=True`` an error names the
    kind, with nothing written. ``mean``'s backward divides by the numel: only a backend
    that traces the backward gives dispatch that number while compiling."""
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(program, backend=counter, fullgraph=fullgraph)
    refused = fullgraph and (program is not mean_of_product or backend == "aot_eager")
    for n in (3, 5, 4):
        e, c = CountsCalls(torch.ones(4, 4), requires_grad=True), CountsCalls(torch.ones(4, 4), requires_grad=True)
        x = torch.arange(4.0 * n).reshape(n, 4)
        xc = x.clone()
        torch._dynamo.mark_dynamic(xc, 0)
        expected = program(e, x)
        if refused:
            with pytest.raises(Exception, match="dynamo_ext: unsupported_state_read") as raised:
                compiled(c, xc)
            assert "maybe_mark_dynamic" in str(raised.value) and "L['x'].size()[0]" in str(raised.value)
            assert (c.calls, c.given) == (0, "")
            return
        got = compiled(c, xc)
        assert_same_outputs(expected, got)
        assert_same_state(e, c, f"rows {n}")
        assert_same_state(expected, got, f"rows {n}, output")
        assert got.requires_grad == expected.requires_grad
        if expected.requires_grad:
            (expected.sum() if expected.dim() else expected).backward()
            (got.sum() if got.dim() else got).backward()
            assert torch.equal(e.grad.elem, c.grad.elem)
            assert_same_state(e, c, f"rows {n}, after backward")
        assert not leaked_fakes(c) and not leaked_fakes(got)
    # the frame ran eagerly (its refusal counted), but where no marked size reaches dispatch
    compiles = program is mean_of_product and backend == "eager"
    assert bool(counters["graph_break"]["dynamo_ext: unsupported_state_read"]) != compiles
    assert counter.frame_count == (1 if compiles or program is mean_of_product else 0)
