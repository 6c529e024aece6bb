"""torch's process-wide settings dispatch reads (outside round 47): anomaly mode,
``warn_always``, the print options, and every other setting dispatch may set (the backend
flags, ``fill_uninitialized_memory``, ...), read through ``torch.``, a name imported from
torch, or a global holding torch's getter. Dynamo's own global-state guard covers the
default dtype, deterministic algorithms, the thread count; these were replayed stale after
the caller changed them between calls. Each now recompiles and matches eager.

AOTAutograd traces under anomaly mode: on the AOT backends a read of it is refused with
nothing touched (eager under ``fullgraph=False``); the write a debug wrapper made only in
anomaly mode was replayed there, where eager's mode was off."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch._dynamo.testing
import torch.utils.deterministic
from torch import is_warn_always_enabled
from torch._tensor_str import PRINT_OPTS
from torch.utils._pytree import tree_map_only

BACKENDS = ["eager", "aot_eager"]

# how dispatch reads the setting: through torch, through a name it imported, or through a
# global holding torch's getter
READ_BY = {
    "anomaly": lambda: torch.is_anomaly_enabled(),
    "anomaly_held": lambda: GETTER(),
    "warn_always": lambda: torch.is_warn_always_enabled(),
    "warn_always_imported": lambda: is_warn_always_enabled(),
    "precision": lambda: torch._tensor_str.PRINT_OPTS.precision,
    "precision_imported": lambda: PRINT_OPTS.precision,
    "fill_memory": lambda: torch.utils.deterministic.fill_uninitialized_memory,
    "nnpack": lambda: torch._C._get_nnpack_enabled(),
    "mkldnn_deterministic": lambda: torch.backends.mkldnn.deterministic,
}
GETTER = torch.is_anomaly_enabled


class Recorder(torch.Tensor):
    """A debug wrapper recording a setting at each op (``READER``: each class holds only its
    own, as a user's class names only what it reads)."""

    READER = None

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)
        r.elem = elem
        r.seen = None
        return r

    def __init__(self, *args):
        pass

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        for a in args:
            if isinstance(a, Recorder):
                a.seen = cls.READER()
        args = tree_map_only(Recorder, lambda t: t.elem, args)
        return func(*args, **(kwargs or {}))


def _values(setting):
    if setting.startswith("anomaly") or setting.startswith("warn_always") or setting in ("fill_memory", "nnpack", "mkldnn_deterministic"):
        base = {"anomaly": torch.is_anomaly_enabled, "warn_always": torch.is_warn_always_enabled}
        now = base.get(setting.split("_held")[0].split("_imported")[0], lambda: None)()
        if setting == "fill_memory":
            now = torch.utils.deterministic.fill_uninitialized_memory
        if setting == "nnpack":
            now = torch._C._get_nnpack_enabled()
        if setting == "mkldnn_deterministic":
            now = torch.backends.mkldnn.deterministic
        return [now, not now, now]
    now = torch._tensor_str.PRINT_OPTS.precision
    return [now, now + 2, now]


@contextlib.contextmanager
def _set(setting, value):
    """The setting at ``value`` for the block, with torch's own context manager where it has
    one, put back after."""
    if setting.startswith("anomaly"):
        with torch.autograd.set_detect_anomaly(value):
            yield
    elif setting.startswith("precision"):
        with torch._tensor_str.printoptions(precision=value):
            yield
    elif setting == "nnpack":
        with torch.backends.nnpack.flags(enabled=value):
            yield
    elif setting == "mkldnn_deterministic":
        mkldnn = torch.backends.mkldnn
        with mkldnn.flags(enabled=mkldnn.enabled, deterministic=value, allow_tf32=mkldnn.allow_tf32):
            yield
    elif setting == "fill_memory":
        before = torch.utils.deterministic.fill_uninitialized_memory
        torch.utils.deterministic.fill_uninitialized_memory = value
        try:
            yield
        finally:
            torch.utils.deterministic.fill_uninitialized_memory = before
    else:
        before = torch.is_warn_always_enabled()
        torch.set_warn_always(value)
        try:
            yield
        finally:
            torch.set_warn_always(before)


def fn(w, x):
    return w * x


def _run(f, setting):
    cls = type(f"Recorder_{setting}", (Recorder,), {"READER": staticmethod(READ_BY[setting])})
    w, x = cls(torch.arange(4.0)), torch.ones(4)
    seen = []
    for value in _values(setting):
        with _set(setting, value):
            try:
                out = f(w, x)
            except Exception as e:  # noqa: BLE001 - a refusal, checked by the caller
                seen.append(("refused", str(e), w.__dict__["seen"]))
                continue
        seen.append((out.tolist(), w.__dict__["seen"]))
    return seen


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "setting",
    ["anomaly", "anomaly_held", "warn_always", "warn_always_imported", "precision", "precision_imported", "fill_memory", "nnpack", "mkldnn_deterministic"],
)
def test_a_setting_dispatch_reads_changed_between_calls(setting, backend, fullgraph):
    torch._dynamo.reset()
    eager = _run(fn, setting)
    cnt = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = _run(torch.compile(fn, backend=cnt, fullgraph=fullgraph), setting)
    if setting.startswith("anomaly") and backend == "aot_eager" and fullgraph:
        # AOTAutograd traces under anomaly mode: refused, nothing touched
        before = None
        for c in compiled:
            assert c[0] == "refused" and "dynamo_ext: unsupported_state_read" in c[1] and "anomaly" in c[1], c
            assert c[2] is before
        return
    assert compiled == eager
    if not (setting.startswith("anomaly") and backend == "aot_eager"):
        assert cnt.frame_count == 2  # one compile per value, the third call reuses the first


class AnomalyDebug(Recorder):
    """A debug wrapper counting, and sanitising NaNs, only in anomaly mode."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        plain = tree_map_only(AnomalyDebug, lambda t: t.elem, args)
        out = func(*plain, **(kwargs or {}))
        if torch.is_anomaly_enabled():
            for a in args:
                if isinstance(a, AnomalyDebug):
                    a.anomaly_ops = a.__dict__.get("anomaly_ops", 0) + 1
            out = torch.nan_to_num(out, nan=0.0)
        return out


@pytest.mark.parametrize("anomaly", [False, True], ids=["off", "on"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_write_made_only_in_anomaly_mode(backend, fullgraph, anomaly):
    """Eager with anomaly mode off counts nothing and keeps the NaN; the AOT backends traced
    under anomaly mode and replayed a count of 1."""
    torch._dynamo.reset()

    def run(f):
        w, x = AnomalyDebug(torch.ones(3)), torch.tensor([1.0, math.nan, 2.0])
        with torch.autograd.set_detect_anomaly(anomaly):
            try:
                out = f(w, x)
            except Exception as e:  # noqa: BLE001 - a refusal, checked below
                return ("refused", "dynamo_ext: unsupported_state_read" in str(e), dict(vars(w)).get("anomaly_ops"))
        return (str(out.tolist()), dict(vars(w)).get("anomaly_ops"))

    eager = run(fn)
    compiled = run(torch.compile(fn, backend=backend, fullgraph=fullgraph))
    if backend == "aot_eager" and fullgraph and not anomaly:
        assert compiled == ("refused", True, None)
    elif backend == "aot_eager" and fullgraph and anomaly:
        # AOTAutograd traces under (True, check_nan=False); the caller's check_nan is True
        assert compiled in (eager, ("refused", True, None))
    else:
        assert compiled == eager


def test_a_write_made_only_in_anomaly_mode_direct_aot_function():
    """AOTAutograd called directly traces the joint under anomaly mode too: the class's own
    code names the getter, and the pass is refused with nothing touched."""
    from functorch.compile import aot_function, nop

    import dynamo_ext

    def run(f):
        w = AnomalyDebug(torch.ones(3, requires_grad=True))
        x = torch.tensor([1.0, math.nan, 2.0], requires_grad=True)
        try:
            out = f(w, x)
        except dynamo_ext.SubclassWriteError as e:
            return ("refused", e.kind.gb_type, dict(vars(w)).get("anomaly_ops"))
        return (str(out.tolist()), dict(vars(w)).get("anomaly_ops"))

    eager = run(fn)
    compiled = run(aot_function(fn, fw_compiler=nop, bw_compiler=nop))
    assert eager[1] is None
    assert compiled in (eager, ("refused", "dynamo_ext: unsupported_state_read", None)), compiled
