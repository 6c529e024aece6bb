"""State that dispatch changes on every call compiles once: symbolic counters.

An int dispatch reads and writes (a step counter, a call count) becomes a symbolic input of
the graph after its first change, the way Dynamo's automatic dynamic treats an int
attribute user code reads; the new value is computed by the graph and replayed. In the
``__dict__`` or in the flatten ctx (See Note [Symbolic ints in a flatten ctx]), on every
backend: at most two compiles, state equal to eager after every call.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._pytree import tree_map_only

from harness import assert_same_outputs, assert_same_state

aten = torch.ops.aten


class StepTensor(torch.Tensor):
    """A float8-style wrapper: ``step`` set in ``__new__``, bumped by every mul; in the
    flatten ctx or in the instance dict (``IN_CTX``)."""

    IN_CTX = False

    @staticmethod
    def __new__(cls, elem: torch.Tensor, step: int = 0) -> "StepTensor":
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        r.elem = elem
        r.step = step
        return r

    def __tensor_flatten__(self):
        return ["elem"], (self.step,) if self.IN_CTX else None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], *(ctx or ()))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(a for a in args if isinstance(a, cls))
        if func is aten.mul.Tensor:
            first.step = first.step + 1
        out = func(*tree_map_only(cls, lambda t: t.elem, args), **tree_map_only(cls, lambda t: t.elem, kwargs))
        return tree_map_only(torch.Tensor, lambda t: cls(t, first.step), out)


class StepInCtx(StepTensor):
    IN_CTX = True


def mul3(x):
    return x * 3


def _run(cls, backend, calls):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(mul3, backend=counter, fullgraph=True)
    e, c = cls(torch.arange(4.0)), cls(torch.arange(4.0))
    for call in range(calls):
        assert_same_outputs(mul3(e), compiled(c))
        assert_same_state(e, c, f"call {call}")
    assert c.step == calls
    return counter


@pytest.mark.parametrize("cls", [StepTensor, StepInCtx], ids=["dict", "ctx"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_counter_1000_calls_two_compiles(cls, backend):
    assert _run(cls, backend, 1000).frame_count <= 2


@pytest.mark.inductor
@pytest.mark.parametrize("cls", [StepTensor, StepInCtx], ids=["dict", "ctx"])
def test_counter_1000_calls_two_compiles_inductor(cls):
    assert _run(cls, "inductor", 1000).frame_count <= 2


def test_specialize_int_keeps_the_counter_a_guarded_constant():
    """``specialize_int=True`` (Dynamo's own switch for user ints): one graph per value."""
    with torch._dynamo.config.patch(specialize_int=True):
        assert _run(StepTensor, "aot_eager", 4).frame_count == 4


def test_automatic_dynamic_off_keeps_the_counter_a_guarded_constant():
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        assert _run(StepTensor, "aot_eager", 4).frame_count == 4


class ParityStep(StepTensor):
    """Dispatch branches on the counter: its value decides the graph."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        first = next(a for a in args if isinstance(a, cls))
        if func is aten.mul.Tensor and first.step % 2:
            return cls(out.elem + 1, first.step)
        return out


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_counter_dispatch_branches_on_recompiles_with_a_reason_naming_it():
    torch._logging.set_logs(recompiles=True)
    logger = logging.getLogger("torch._dynamo.guards.__recompiles")
    handler = _Collect()
    logger.addHandler(handler)
    try:
        counter = _run(ParityStep, "aot_eager", 6)
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
    assert counter.frame_count <= 3  # static, then symbolic with the parity guarded
    reasons = "\n".join(handler.lines)
    assert "x.step" in reasons, reasons


# --------------------------------------------------------------------------- a float8-style linear layer


class Float8Weight(torch.Tensor):
    """A parameter that records the input's amax into a rolling history on every matmul and
    counts its steps (the state delayed scaling keeps)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, history: torch.Tensor | None = None, step: int = 0) -> "Float8Weight":
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=data.dtype, device=data.device, requires_grad=data.requires_grad
        )

    def __init__(self, data, history=None, step=0):
        self.data_ = data
        self.amax_history = torch.zeros(8) if history is None else history
        self.step = step

    def __tensor_flatten__(self):
        return ["data_", "amax_history"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["data_"], inner["amax_history"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.mm.default, aten.addmm.default) and any(isinstance(a, cls) for a in args):
            w = next(a for a in args if isinstance(a, cls))
            act = args[1] if func is aten.addmm.default else args[0]
            act = act.data_ if isinstance(act, cls) else act
            w.amax_history = torch.roll(w.amax_history, 1)
            w.amax_history[0] = act.detach().abs().amax()
            w.step = w.step + 1
        unwrap = lambda t: t.data_ if isinstance(t, cls) else t  # noqa: E731
        out = func(*tree_map_only(torch.Tensor, unwrap, args), **tree_map_only(torch.Tensor, unwrap, kwargs))
        if func in (aten.t.default, aten.detach.default, aten.alias.default) and isinstance(args[0], cls):
            return cls(out, args[0].amax_history, args[0].step)
        return out


class Float8MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = torch.nn.Parameter(Float8Weight(torch.randn(8, 16) * 0.3))
        self.w2 = torch.nn.Parameter(Float8Weight(torch.randn(16, 4) * 0.3))

    def forward(self, x):
        return torch.relu(x @ self.w1) @ self.w2


def _loss(model, x, y):
    return F.mse_loss(model(x), y)


def _state(model):
    return {
        name: (p.data_.clone(), p.amax_history.clone(), p.step)
        for name, p in model.named_parameters()
    }


def _train(backend, steps):
    torch._dynamo.reset()
    eager, compiled_model = Float8MLP(), Float8MLP()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(_loss, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        for model, fn in ((eager, _loss), (compiled_model, compiled)):
            loss = fn(model, x, y)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.data_.sub_(0.05 * p.grad.data_ if isinstance(p.grad, Float8Weight) else 0.05 * p.grad)
                    p.grad = None
            model.last_loss = loss.detach()
        torch.testing.assert_close(compiled_model.last_loss, eager.last_loss, msg=lambda m: f"step {step} loss: {m}")
        es, cs = _state(eager), _state(compiled_model)
        for name in es:
            torch.testing.assert_close(cs[name][0], es[name][0], msg=lambda m: f"step {step} {name} weight: {m}")
            torch.testing.assert_close(cs[name][1], es[name][1], msg=lambda m: f"step {step} {name} history: {m}")
            assert cs[name][2] == es[name][2] == step + 1, f"step {step} {name}: step {cs[name][2]} vs {es[name][2]}"
            assert type(cs[name][1]) is torch.Tensor
    return counter


def test_float8_linear_200_training_steps_two_compiles():
    assert _train("aot_eager", 200).frame_count <= 2


@pytest.mark.inductor
def test_float8_linear_20_training_steps_two_compiles_inductor():
    assert _train("inductor", 20).frame_count <= 2


class _Holder:
    def __init__(self) -> None:
        self.step = 0


def _build(x, holder):
    """User code (no subclass input) builds a subclass from a count it keeps elsewhere."""
    out = StepInCtx(x * 2, holder.step)
    holder.step = holder.step + 1
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_subclass_user_code_builds_from_a_symbolic_count_holds_its_value(backend):
    """Once automatic dynamic makes ``holder.step`` a symbolic input, the output's ctx is built
    from it. AOTAutograd rebuilds that output from the ctx it traced (stock leaves the trace's
    SymInt there); the graph has no subclass input, yet its output gets the run-time value."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(_build, backend=counter, fullgraph=True)
    he, hc = _Holder(), _Holder()
    for call in range(5):
        x = torch.arange(4.0) + call
        e, c = _build(x, he), compiled(x.clone(), hc)
        assert type(c.step) is int, f"call {call}: {type(c.step).__name__} in the output's ctx"
        assert_same_outputs(e, c)
        assert_same_state(e, c, f"call {call}: output")
        assert hc.step == he.step == call + 1
    assert counter.frame_count == 2


class TaggedStep(StepTensor):
    """The step also kept in a tuple with a name: ``("mul", step)``."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        first = next(a for a in args if isinstance(a, cls))
        if func is aten.mul.Tensor:
            first.last = ("mul", first.step)
        return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_counter_kept_in_a_tuple_with_a_name(backend):
    """Once the step is symbolic the tuple holds a SymInt: the graph returns it, the residual
    bytecode builds the tuple (it raised Dynamo's "torch.* op returned non-Tensor")."""
    counter = _run(TaggedStep, backend, 6)
    assert counter.frame_count == 2
