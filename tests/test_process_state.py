"""Dispatch sets state of the whole process: torch's global generator (``torch.manual_seed``),
its default dtype, a numerics flag, deterministic algorithms, its print options (a symbolic
count landed there), a logger's level, numpy's seed (hooking Cython's function type failed the
compile), or registers a ``weakref.finalize`` on the instance. Traced, that happened once on the trace's objects: the
seed at compile time only (later draws differed from eager's), the default dtype not at all on
the AOT backends, a finalizer firing when the trace's objects died and failing the next compile
(outside testers' finds). Refused (``global_state_write``) with nothing changed under
``fullgraph=True``; under ``fullgraph=False`` the op runs eagerly and the process ends as in
eager. Each test puts back what it changes (torch's own context manager for the flag)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import tempfile
import threading
import weakref

import numpy as np

import pytest
import torch

from dynamo_ext.testing import WrapperTensor
from harness import assert_same_state

FIRED: list = []


def _set(how, n):
    if how == "manual_seed":
        torch.manual_seed(1000 + n)
    elif n != 2:
        return
    elif how == "default_dtype":
        torch.set_default_dtype(torch.float64)
    elif how == "mkldnn_flag":
        torch.backends.mkldnn.enabled = False
    elif how == "deterministic":
        torch.use_deterministic_algorithms(True, warn_only=True)
    elif how == "printoptions":
        torch.set_printoptions(precision=2 + 2 * n)
    elif how == "logger_level":
        LOG.setLevel(logging.DEBUG)
    elif how == "numpy_seed":
        np.random.seed(n)
    elif how == "recursion_limit":
        sys.setrecursionlimit(sys.getrecursionlimit() + 100)
    elif how == "switch_interval":
        sys.setswitchinterval(0.001 * n)
    elif how == "int_max_str_digits":
        sys.set_int_max_str_digits(10000 + n)
    elif how == "gc_threshold":
        gc.set_threshold(1000 + n, 20, 20)
    elif how == "gc_disable":
        gc.disable()
    elif how == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    elif how == "numpy_seterr":
        np.seterr(divide="raise")
    elif how == "numpy_printoptions":
        np.set_printoptions(precision=2 + n)
    elif how == "signal":
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    elif how == "excepthook":
        sys.excepthook = _hook
    elif how == "chdir":
        os.chdir(tempfile.gettempdir())
    elif how == "attention_kernel":
        torch.backends.cuda.enable_math_sdp(False)
    elif how == "warn_always":
        torch.set_warn_always(True)
    elif how == "mha_fastpath":
        torch.backends.mha.set_fastpath_enabled(False)
    elif how == "quantized_engine":
        torch.backends.quantized.engine = "qnnpack" if torch.backends.quantized.engine != "qnnpack" else "x86"
    elif how == "cudnn_benchmark":
        torch.backends.cudnn.benchmark = True
    elif how == "fill_uninitialized_memory":
        torch.utils.deterministic.fill_uninitialized_memory = False
    elif how == "autograd_multithreading":
        torch.autograd.set_multithreading_enabled(False)
    elif how == "mkldnn_conv_fp32_precision":
        torch.backends.mkldnn.conv.fp32_precision = "tf32"
    elif how == "gc_debug":
        gc.set_debug(gc.DEBUG_STATS)
    elif how == "signal_mask":
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    elif how == "thread_stack_size":
        threading.stack_size(1 << 20)
    elif how == "numpy_seterrcall":
        np.seterrcall(_hook)
    elif how == "numpy_bufsize":
        np.setbufsize(16384)
    elif how == "sys_path":
        sys.path.append("/nonexistent/dynamo_ext_tests")
    elif how == "gc_callback":
        gc.callbacks.append(_hook)
    elif how == "logger_handler":
        LOG.addHandler(logging.NullHandler())
    # set without the logging API's setters, and a handler that is a function
    elif how == "logger_level_attribute":
        LOG.level = logging.DEBUG
    elif how == "logger_propagate":
        LOG.propagate = False
    elif how == "logger_disabled":
        LOG.disabled = True
    elif how == "logger_filter":
        LOG.addFilter(lambda record: True)
    elif how == "logger_handlers_replaced":
        LOG.handlers = [logging.NullHandler()]
    elif how == "signal_function":
        signal.signal(signal.SIGUSR2, _hook)


def _hook(*args):
    return sys.__excepthook__(*args)


class Setting(WrapperTensor):
    WRAP_OUTPUTS = False
    HOW = "manual_seed"

    @classmethod
    def on_op(cls, func, first):
        first.n = first.__dict__.get("n", 0) + 1
        if cls.HOW == "finalize":
            weakref.finalize(first, FIRED.append, first.n)
        else:
            _set(cls.HOW, first.n)


HOWS = [
    "manual_seed", "default_dtype", "mkldnn_flag", "deterministic", "printoptions", "logger_level", "numpy_seed",
    "finalize",
    # the interpreter's, numpy's and torch's other settings (outside round 37)
    "recursion_limit", "switch_interval", "int_max_str_digits", "gc_threshold", "gc_disable", "anomaly",
    "numpy_seterr", "numpy_printoptions", "signal", "excepthook", "chdir",
    # torch.backends' other flags
    "attention_kernel", "warn_always", "mha_fastpath", "quantized_engine", "cudnn_benchmark",
    # outside round 38
    "fill_uninitialized_memory", "autograd_multithreading", "mkldnn_conv_fp32_precision", "gc_debug",
    "signal_mask", "thread_stack_size", "numpy_seterrcall", "numpy_bufsize", "sys_path", "gc_callback",
    "logger_handler", "logger_level_attribute", "logger_propagate", "logger_disabled", "logger_filter",
    "logger_handlers_replaced", "signal_function",
]
LOG = logging.getLogger("dynamo_ext_tests.process_state")


@contextlib.contextmanager
def _guard(how):
    """Puts back what the test changes, with torch's own context manager where it has one."""
    if how == "mkldnn_flag":
        with torch.backends.mkldnn.flags(enabled=torch.backends.mkldnn.enabled):
            yield
        return
    dtype = torch.get_default_dtype()
    deterministic = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    precision = torch._tensor_str.PRINT_OPTS.precision
    level = LOG.level
    interpreter = _interpreter()
    handlers = list(LOG.handlers)
    try:
        with torch.autograd.set_detect_anomaly(torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()):
            yield
    finally:
        _put_interpreter(interpreter)
        LOG.handlers[:] = handlers
        torch.set_default_dtype(dtype)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch.set_printoptions(precision=precision)
        LOG.setLevel(level)


def _interpreter():
    return (
        torch.utils.deterministic.fill_uninitialized_memory, torch.autograd.is_multithreading_enabled(),
        torch.backends.mkldnn.conv.fp32_precision, gc.get_debug(),
        sorted(int(x) for x in signal.pthread_sigmask(signal.SIG_BLOCK, [])), threading.stack_size(),
        np.geterrcall(), np.getbufsize(), list(sys.path), list(gc.callbacks), len(LOG.handlers),
        torch.backends.cuda.math_sdp_enabled(), torch.is_warn_always_enabled(), torch.backends.mha.get_fastpath_enabled(),
        torch.backends.quantized.engine, torch.backends.cudnn.benchmark,
        sys.getrecursionlimit(), sys.getswitchinterval(), sys.get_int_max_str_digits(), gc.get_threshold(),
        gc.isenabled(), torch.is_anomaly_enabled(), np.geterr(), np.get_printoptions(),
        signal.getsignal(signal.SIGUSR1), sys.excepthook, os.getcwd(),
        LOG.propagate, LOG.disabled, len(LOG.filters), [type(h).__name__ for h in LOG.handlers],
        signal.getsignal(signal.SIGUSR2),
    )


def _put_interpreter(v):
    torch.utils.deterministic.fill_uninitialized_memory = v[0]
    torch.autograd.set_multithreading_enabled(v[1])
    torch.backends.mkldnn.conv.fp32_precision = v[2]
    gc.set_debug(v[3])
    signal.pthread_sigmask(signal.SIG_SETMASK, v[4])
    threading.stack_size(v[5])
    np.seterrcall(v[6])
    np.setbufsize(v[7])
    sys.path[:] = v[8]
    gc.callbacks[:] = v[9]
    del LOG.handlers[v[10]:]
    v = v[11:]
    torch.backends.cuda.enable_math_sdp(v[0])
    torch.set_warn_always(v[1])
    torch.backends.mha.set_fastpath_enabled(v[2])
    torch.backends.quantized.engine = v[3]
    torch.backends.cudnn.benchmark = v[4]
    v = v[5:]
    sys.setrecursionlimit(v[0])
    sys.setswitchinterval(v[1])
    sys.set_int_max_str_digits(v[2])
    gc.set_threshold(*v[3])
    (gc.enable if v[4] else gc.disable)()
    np.seterr(**v[6])
    np.set_printoptions(**v[7])
    signal.signal(signal.SIGUSR1, v[8])
    sys.excepthook = v[9]
    os.chdir(v[10])
    LOG.propagate, LOG.disabled = v[11], v[12]
    del LOG.filters[v[13]:]
    signal.signal(signal.SIGUSR2, v[15])


def _process():
    precision = torch._tensor_str.PRINT_OPTS.precision
    return (
        torch.get_default_dtype(), torch.backends.mkldnn.enabled, torch.are_deterministic_algorithms_enabled(),
        (type(precision).__name__, precision), LOG.level, np.random.get_state()[1][:2].tolist(),
        _interpreter(), torch.rand(2).tolist(), list(FIRED),
    )


def step(w, x):
    return w * x


def _run(f, cls, calls=3):
    torch.manual_seed(0)
    np.random.seed(0)
    FIRED.clear()
    w = cls(torch.ones(3))
    seen = []
    for i in range(calls):
        out = f(w, torch.full((3,), 2.0) + i)
        seen.append((out.tolist(), {k: v for k, v in vars(w).items() if k != "elem"}, _process()))
    seen.append(vars(w).get("n"))
    return seen, w


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("how", HOWS)
def test_dispatch_setting_process_state(how, backend, fullgraph):
    cls = type(f"Setting_{how}", (Setting,), {"HOW": how})
    with _guard(how):
        eager, _ = _run(step, cls)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=fullgraph)
    with _guard(how):
        if fullgraph:
            torch.manual_seed(0)
            np.random.seed(0)
            FIRED.clear()
            w = cls(torch.ones(3))
            w.n = 1  # the traced op is the one that sets it
            untouched = cls(torch.ones(3))
            untouched.n = 1
            before = _process()[:7]
            generator = torch.get_rng_state()
            with pytest.raises(torch._dynamo.exc.Unsupported, match="dynamo_ext: global_state_write"):
                compiled(w, torch.ones(3))
            assert torch.equal(torch.get_rng_state(), generator), "the refusal left the generator changed"
            assert _process()[:7] == before
            import gc

            gc.collect()
            assert FIRED == [], "a finalizer registered on a traced object ran"
            assert_same_state(untouched, w, "refused input")
            return
        got, _ = _run(compiled, cls)
    assert got == eager


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_setting_whose_read_raises_as_the_process_stands(backend):
    """With torch's new ``fp32_precision`` flags set beside the legacy ones (the flags' own
    context manager does), ``torch.get_float32_matmul_precision()`` raises: the watch read it
    before every traced dispatch call and the compile failed where eager runs."""
    import inspect

    if "fp32_precision" not in inspect.signature(torch.backends.mkldnn.flags).parameters:
        pytest.skip("this torch has no fp32_precision flags")
    cls = type("Setting_none", (Setting,), {"HOW": "none"})
    torch._dynamo.reset()
    torch.compile(step, backend=backend)(cls(torch.ones(3)), torch.ones(3))  # the watch's settings read as they stand
    with torch.backends.mkldnn.flags(enabled=torch.backends.mkldnn.enabled, fp32_precision="bf16"):
        eager, _ = _run(step, cls, calls=2)
        torch._dynamo.reset()
        got, _ = _run(torch.compile(step, backend=backend, fullgraph=True), cls, calls=2)
    assert got == eager
