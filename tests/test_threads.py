"""Compiling from two threads at once.

What torch 2.13 guarantees: ``torch/_dynamo/convert_frame.py`` holds one process-wide
``compile_lock`` (a ``threading.RLock``) around the whole conversion of a frame:
Dynamo's trace, the backend compile and so AOTAutograd's tracing passes. Every
compile-time hook of dynamo_ext runs inside it, so two threads never trace at the
same time (``test_tracing_is_serialized`` checks it). Run time takes no lock and
dynamo_ext keeps no shared state there: Dynamo's residual bytecode, or the AOT
layer's epilogue, per compiled graph.

What still crosses threads: while one thread traces, dynamo_ext installs two
class-level hooks that other threads' eager code sees:

- ``__getattr__`` on the traced subclass (answers reads of state the fake lacks):
  it only answers for the fakes it watches, so eager dispatch in another thread on
  the same subclass is unaffected (``test_two_threads_compile_and_run``);
- ``__setattr__`` / ``__init__`` on classes registered with ``register_ctx_state``
  (DTensor's ``MaskBuffer`` by default): a journal only records assignments made by
  the thread that opened it, so another thread's eager writes to a shared state object
  while a trace is open are its own, never undone, and do not fail that compile
  (``test_other_threads_ctx_state_is_left_alone``).

``enable()`` / ``disable()`` take Dynamo's ``compile_lock``: called while another
thread compiles, they wait for that compile, which finishes as it started; later
compiles see the switch (``test_switching_while_another_thread_compiles_waits_for_it``).
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

import catalogue_subclasses as C
import dynamo_ext
import subclasses as S
from harness import assert_same_outputs, assert_same_state

aten = torch.ops.aten
WAIT_S = 60  # upper bound for any wait between the threads; never reached when all is well


def _run_threads(*targets):
    """Start the targets together (a Barrier), join them, re-raise the first failure."""
    barrier = threading.Barrier(len(targets))
    errors: list[BaseException] = []

    def wrap(target):
        def run():
            try:
                barrier.wait(WAIT_S)
                target()
            except BaseException as e:  # noqa: BLE001 - reported to the main thread
                errors.append(e)

        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 4)
        assert not t.is_alive(), "a thread did not finish"
    if errors:
        raise errors[0]


def _fresh_function(name: str, body: str):
    """A new code object per call: each one is a separate Dynamo compile."""
    namespace: dict = {}
    exec(f"def {name}(x):\n    return {body}\n", namespace)  # noqa: S102 - fixed test source
    return namespace[name]


def _worker(tag: str, programs, iterations: int, backend: str):
    """Compile each program, call it ``iterations`` times next to eager on equal inputs.

    ``programs``: (body, subclass, same input across calls?) triples.
    """

    def work():
        for p, (body, cls, persistent) in enumerate(programs):
            fn = _fresh_function(f"{tag}_{p}", body)
            compiled = torch.compile(fn, backend=backend, fullgraph=True)
            e, c = cls(torch.arange(4.0) + p), cls(torch.arange(4.0) + p)
            for i in range(iterations):
                if not persistent and i:
                    e, c = cls(torch.arange(4.0) + p), cls(torch.arange(4.0) + p)
                e_out, c_out = fn(e), compiled(c)
                assert_same_outputs(e_out, c_out)
                assert_same_state(e, c, f"thread {tag} program {p} call {i}")

    return work


# The same subclasses in both threads, so one thread's eager dispatch runs while the
# other thread traces that class (with its trace-time __getattr__ installed).
PROGRAMS_A = [
    ("x * 3 + 1", S.CachingTensor, False),
    ("x * 2 - x", S.CallCounter, True),  # a counter outside the ctx: recompiles per call
    ("(x * 5).sin()", C.MixedWriter, True),
    ("x * 7", S.GrowingCacheTensor, True),
]
PROGRAMS_B = [
    ("x * 4 + x * 2", S.CallCounter, True),
    ("(x + 1) * 3", S.CachingTensor, True),
    ("x * 6", S.CounterTensor, False),
    ("x * 2 * x", C.MixedWriter, False),
]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_two_threads_compile_and_run(backend):
    _run_threads(
        _worker("a", PROGRAMS_A, iterations=5, backend=backend),
        _worker("b", PROGRAMS_B, iterations=5, backend=backend),
    )


class _TraceClock(S.WritingTensor):
    """Records when its dispatch runs on trace-time tensors, from which thread."""

    CTX = ("tag",)

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            if isinstance(first.elem, (FakeTensor, FunctionalTensor)):
                _TRACE_SPANS.put(("in", threading.get_ident()))
                time.sleep(0.005)  # give the other thread a chance to run
                _TRACE_SPANS.put(("out", threading.get_ident()))
            first.tag = first.tag + 1


# The test's record of the order traced dispatch calls begin and end in, not the program's
# state: a queue (a class-level or module-level list mutated while tracing is global state,
# refused as global_state_write; a clock read is refused as well).
_TRACE_SPANS: "queue.SimpleQueue" = queue.SimpleQueue()


def test_tracing_is_serialized():
    """torch 2.13's compile_lock: no two threads are inside a trace at the same time."""
    while not _TRACE_SPANS.empty():
        _TRACE_SPANS.get()
    _run_threads(
        _worker("ta", [(f"x * {k}", _TraceClock, False) for k in (2, 3, 4)], iterations=2, backend="aot_eager"),
        _worker("tb", [(f"x * {k} + 1", _TraceClock, False) for k in (5, 6, 7)], iterations=2, backend="aot_eager"),
    )
    events = []
    while not _TRACE_SPANS.empty():
        events.append(_TRACE_SPANS.get())
    assert len({tid for _, tid in events}) == 2
    assert events and len(events) % 2 == 0
    for (kind_in, t_in), (kind_out, t_out) in zip(events[::2], events[1::2]):
        # each traced call ends before any other begins: in, out, in, out, ...
        assert (kind_in, kind_out) == ("in", "out") and t_in == t_out, "two threads were tracing at the same time"


# --------------------------------------------------------------------------- a trace paused in one thread


class _Pausing(S.WritingTensor):
    """Stops in its first traced multiplication (inner tensor of type ``pause_on``)
    until the test lets it go; counts multiplications in its ctx."""

    CTX = ("tag",)
    pause_on: type = FakeTensor
    reached = threading.Event()
    go = threading.Event()

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            if type(first.elem) is cls.pause_on and not cls.reached.is_set():
                cls.reached.set()
                assert cls.go.wait(WAIT_S)
            first.tag = first.tag + 1


def _two_muls(x):
    return x * 2 + x * 3  # eager leaves tag == 2


def _with_paused_compile(pause_on, backend, while_paused):
    """Compile ``_two_muls`` in a thread; run ``while_paused()`` in this one while that
    thread is stopped inside its trace; return (input, compile error or None, result)."""
    torch._dynamo.reset()
    _Pausing.pause_on = pause_on
    _Pausing.reached.clear()
    _Pausing.go.clear()
    x = _Pausing(torch.arange(4.0))
    outcome: dict = {}

    def compile_in_thread():
        try:
            torch.compile(_two_muls, backend=backend, fullgraph=True)(x)
        except Exception as e:  # noqa: BLE001 - reported to the test
            outcome["error"] = e

    t = threading.Thread(target=compile_in_thread)
    t.start()
    try:
        assert _Pausing.reached.wait(WAIT_S), "the trace never reached the pause"
        result = while_paused()
    finally:
        _Pausing.go.set()
        t.join(WAIT_S)
    assert not t.is_alive()
    return x, outcome.get("error"), result


def _materialize_mask():
    from torch.distributed.tensor._ops._mask_buffer import MaskBuffer

    buf = MaskBuffer()
    buf.materialize_mask(torch.tensor([True, False, True]))  # what eager embedding does
    return buf


@pytest.mark.parametrize(
    "pause_on",
    [pytest.param(FakeTensor, id="during_dynamo_trace"), pytest.param(FunctionalTensor, id="during_aot_pass")],
)
def test_other_threads_ctx_state_is_left_alone(pause_on):
    pytest.importorskip("torch.distributed.tensor._ops._mask_buffer")
    x, error, buf = _with_paused_compile(pause_on, "aot_eager", _materialize_mask)
    # The other thread's eager state is its own ...
    assert buf.refcount == 1 and buf.data is not None
    # ... and the compile in this thread is unaffected by it.
    assert error is None, error
    assert x.tag == 2


def _from_another_thread(fn):
    """Call ``fn`` in a new thread; wait briefly: it may return, block until the compile
    ends (enable/disable wait for Dynamo's compile lock), or raise."""
    result: dict = {}

    def run():
        try:
            fn()
            result["returned"] = True
        except Exception as e:  # noqa: BLE001 - reported to the test
            result["raised"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(1.0)
    return t, result


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("switch", ["disable", "enable"])
def test_switching_while_another_thread_compiles_waits_for_it(backend, switch):
    """enable()/disable() take Dynamo's compile lock: called while another thread is in
    the middle of a trace, they wait for that compile, which finishes as it started
    (eager's state with dynamo_ext, stock's without); later compiles see the new state."""
    before, after = (dynamo_ext.enable, dynamo_ext.disable) if switch == "disable" else (dynamo_ext.disable, dynamo_ext.enable)
    before()
    try:
        x, error, (switcher, result) = _with_paused_compile(FakeTensor, backend, lambda: _from_another_thread(after))
        switcher.join(WAIT_S)
        assert not switcher.is_alive() and result == {"returned": True}
        assert error is None, error
        stock_tag = 2 if backend == "eager" else 0  # stock: dispatch runs at run time, or the write is lost
        assert x.tag == (2 if switch == "disable" else stock_tag)  # the compile finished as it started
        assert dynamo_ext.is_enabled() == (switch == "enable")
        # A new compile after the switch.
        _Pausing.reached.set()  # no pause from now on
        torch._dynamo.reset()
        y = _Pausing(torch.arange(4.0))
        torch.compile(_two_muls, backend=backend, fullgraph=True)(y)
        assert y.tag == (stock_tag if switch == "disable" else 2)
    finally:
        dynamo_ext.enable()
