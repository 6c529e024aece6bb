"""Warm caches replay the same writes as a cold compile (two processes, one cache dir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import subclasses as S

pytestmark = pytest.mark.inductor

CHILD = os.path.join(os.path.dirname(__file__), "_cache_child.py")


def _eager_state():
    state = {}
    for cls in (S.QuietTensor, S.CounterTensor, S.CachingTensor, S.UnseenByDynamo):
        x = cls(torch.arange(4.0))
        x * 3
        state[cls.__name__] = {
            k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in sorted(x.__dict__.items())
        }
    return state


@pytest.mark.parametrize("mode", ["both_layers", "aot_only"])
def test_second_process_with_warm_cache_replays_the_same_writes(tmp_path, mode):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), PYTHONPATH=os.getcwd())
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, CHILD, mode], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["state"] == warm["state"] == _eager_state()
    assert warm["fxgraph_hits"] > cold["fxgraph_hits"]  # the warm run did hit the cache
    # ... and AOTAutogradCache, for the subclass that writes nothing and for each writing one
    assert (cold["aot_hits"], warm["aot_hits"]) == (0, 4)
    assert cold["aot_bypasses"] == warm["aot_bypasses"] == 0


# --------------------------------------------------------------------------- #
# AOTAutogradCache in one process: a cold compile saves, a compile after
# torch._dynamo.reset() loads (See Note [A cache entry holds its plan]).
# --------------------------------------------------------------------------- #

import dataclasses  # noqa: E402

from torch._dynamo.utils import counters  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
from torch._inductor.utils import fresh_cache  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor  # noqa: E402

import dynamo_ext  # noqa: E402
from dynamo_ext import RefusalKind, SubclassWriteError  # noqa: E402
from harness import differential  # noqa: E402

aten = torch.ops.aten


def mul3(x):
    return x * 3


def _runs(fn, makers, *, backward=False, calls=2):
    """One differential run per input maker, in one fresh cache dir; the AOTAutogradCache
    counters of each run."""
    seen = []
    with fresh_cache():
        for make in makers:
            counters.clear()
            differential(fn, make, backend="inductor", backward=backward, calls=calls)
            seen.append(dict(counters["aot_autograd"]))
    return seen


def _saved_then_hit(seen):
    """Every entry the cold run saved is hit by the warm run (a recompile whose metadata
    holds a symbolic ctx int is not saved: torch cannot pickle it)."""
    cold, warm = seen
    assert cold.get("autograd_cache_saved", 0) >= 1 and not cold.get("autograd_cache_hit"), seen
    assert warm.get("autograd_cache_hit", 0) == cold["autograd_cache_saved"], seen
    assert not cold.get("autograd_cache_bypass") and not warm.get("autograd_cache_bypass"), seen


class BackwardCounter(S.WritingTensor):
    """Counts the backward multiplications it takes part in."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.mul.Tensor and torch._C._current_graph_task_id() != -1:
            for a in args:
                if isinstance(a, cls) and hasattr(a, "bw_muls"):  # the input, not intermediates
                    a.bw_muls = a.bw_muls + 1
        return super().__torch_dispatch__(func, types, args, kwargs)


class ModeOnlyTraced(S.WritingTensor):
    """Writes a snapshot scaled by a plain attribute outside the ctx, only in AOTAutograd's
    passes (Dynamo's graph is the same for every mode)."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor and type(first.elem) is not FakeTensor:
            first.snapshot = first.elem * (2 if first.mode == "double" else 3)


GAIN = 2.0


class GlobalGain(S.WritingTensor):
    """Scales every mul by the module global GAIN: Dynamo's graph does not show it."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is aten.mul.Tensor:
            args[0].gain = GAIN
            return cls(out.elem * GAIN)
        return out


@dataclasses.dataclass
class Stats:
    muls: int = 0


STATS = Stats()


class SharedStats(S.WritingTensor):
    """Counts its muls in a module-level object."""

    @classmethod
    def on_op(cls, func, first):
        if func is aten.mul.Tensor:
            STATS.muls += 1


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: [S.UnseenByDynamo(torch.arange(4.0))], id="writes-only-aot-sees"),
        pytest.param(lambda: [S.QuietTensor(torch.arange(4.0))], id="writes-nothing"),
        pytest.param(lambda: [S.CallCounter(torch.arange(4.0))], id="counter-dynamo-replays"),
        pytest.param(lambda: [S.CachingTensor(torch.arange(4.0))], id="tensor-cache"),
    ],
)
def test_forward_writes_hit_and_replay(make):
    _saved_then_hit(_runs(mul3, [make, make]))


def test_writes_the_aot_layer_alone_sees_hit_and_replay():
    make = lambda: [S.CallCounter(torch.arange(4.0))]  # noqa: E731
    with dynamo_ext.config.patch(dynamo_layer=False):
        _saved_then_hit(_runs(mul3, [make, make]))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: [S.BackwardMarker(torch.arange(4.0) + 1, requires_grad=True)], id="constant"),
        pytest.param(lambda: [BackwardCounter(torch.arange(4.0) + 1, requires_grad=True, bw_muls=0)], id="counter"),
    ],
)
def test_backward_writes_are_saved_at_the_first_backward_and_replayed(make):
    def f(x):
        return (x * x * 3).sum()

    _saved_then_hit(_runs(f, [make, make], backward=True, calls=3))


BACKWARD_SCALE = 1.0


class BackwardScaled(S.WritingTensor):
    """The backward's muls record the module global BACKWARD_SCALE; dispatch scales its
    number arguments with a lambda closing over a local of the call (not state)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        factor = 1.0
        pytree.tree_map_only(cls, lambda t: (t.elem, factor), args)  # touches t first
        args = pytree.tree_map_only(float, lambda v: v * factor, args)
        if func is aten.mul.Tensor and torch._C._current_graph_task_id() != -1:
            for a in args:
                if isinstance(a, cls) and hasattr(a, "bw_scale"):
                    a.bw_scale = BACKWARD_SCALE
        return super().__torch_dispatch__(func, types, args, kwargs)


def _scaled_loss(x):
    return (x * x * 3.0).sum()


def test_a_backward_reading_a_global_hits_and_still_checks_it():
    """The plan keeps what the traced backward read through globals (See Note [State the
    traced backward reads outside the tensors]): it pickles with the entry (a lambda's cell
    made per dispatch call is no state), and a hit checks it when the backward runs."""
    global BACKWARD_SCALE
    make = lambda: [BackwardScaled(torch.arange(4.0) + 1, requires_grad=True, bw_scale=0.0)]  # noqa: E731
    _saved_then_hit(_runs(_scaled_loss, [make, make], backward=True, calls=1))
    with fresh_cache():
        for warm in (False, True):
            counters.clear()
            torch._dynamo.reset()
            (x,) = make()
            out = torch.compile(_scaled_loss, backend="inductor", fullgraph=True)(x)
            assert bool(counters["aot_autograd"].get("autograd_cache_hit")) == warm, dict(counters["aot_autograd"])
            if not warm:  # saved at its first backward
                out.backward()
                assert x.bw_scale == 1.0
                continue
            BACKWARD_SCALE = 2.0
            try:
                with pytest.raises(SubclassWriteError) as info:
                    out.backward()
            finally:
                BACKWARD_SCALE = 1.0
            assert info.value.kind is RefusalKind.CHANGED_BEFORE_BACKWARD and "BACKWARD_SCALE" in str(info.value)
            assert x.bw_scale == 0.0 and x.grad is None


def test_an_entry_traced_from_other_state_is_a_miss():
    double = lambda: [ModeOnlyTraced(torch.arange(4.0), mode="double")]  # noqa: E731
    triple = lambda: [ModeOnlyTraced(torch.arange(4.0), mode="triple")]  # noqa: E731
    seen = _runs(mul3, [double, triple, double])
    assert seen[1].get("autograd_cache_miss") and not seen[1].get("autograd_cache_hit"), seen
    assert seen[2].get("autograd_cache_hit") or seen[2].get("autograd_cache_miss"), seen


def test_a_global_dispatch_reads_is_part_of_the_key():
    global GAIN
    make = lambda: [GlobalGain(torch.arange(4.0))]  # noqa: E731
    try:
        with fresh_cache():
            seen = []
            for gain in (2.0, 5.0, 2.0):
                GAIN = gain
                counters.clear()
                differential(mul3, make, backend="inductor", calls=2)
                seen.append(dict(counters["aot_autograd"]))
    finally:
        GAIN = 2.0
    assert not seen[1].get("autograd_cache_hit"), seen
    assert seen[2].get("autograd_cache_hit"), seen


def test_writes_on_objects_outside_the_inputs_bypass_the_cache_and_say_so():
    make = lambda: [SharedStats(torch.arange(4.0))]  # noqa: E731
    with fresh_cache():
        seen = []
        for _ in range(2):
            counters.clear()
            STATS.muls = 0
            torch._dynamo.reset()
            x = make()[0]
            torch.compile(mul3, backend="inductor", fullgraph=True)(x)
            assert STATS.muls == 1
            seen.append(dict(counters["aot_autograd"]))
    for run in seen:
        assert run.get("autograd_cache_bypass") and not run.get("autograd_cache_hit"), seen


class CountsBackwardCalls(torch.Tensor):
    """A weight that counts the backward's calls (ops it sees with grad off), records text
    made from the count and scales every second gradient: the compiled backward decides
    from the count, so each compile holds for counts that decide the same way."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        r.elem = elem
        r.bwd = 0
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, size, stride):
        return CountsBackwardCalls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        unwrap = lambda t: t.elem  # noqa: E731
        out = func(*pytree.tree_map_only(cls, unwrap, args), **pytree.tree_map_only(cls, unwrap, kwargs))
        for w in (a for a in args if isinstance(a, cls)):
            if not torch.is_grad_enabled():
                w.bwd += 1
                w.tag = f"bwd-{w.bwd}"
                if w.bwd % 2 == 0:
                    out = out * 2.0
        return out


def test_an_entry_whose_backward_decided_from_other_counts_is_a_miss():
    """The second compile's graph and key equal the first's; its backward decided from
    another count. A hit on the first entry ran that backward: refused when it ran
    (changed_before_backward) where eager just scaled the gradient."""

    def f(x, w):
        return (x * w).sin().sum()

    with fresh_cache():
        torch._dynamo.reset()
        compiled = torch.compile(f, backend="inductor")
        we, wc = CountsBackwardCalls(torch.arange(4.0)), CountsBackwardCalls(torch.arange(4.0))
        for call in range(4):
            x = torch.randn(2, 4)
            xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
            f(xe, we).backward()
            compiled(xc, wc).backward()
            assert (wc.bwd, wc.tag) == (we.bwd, we.tag) == (call + 1, f"bwd-{call + 1}")
            torch.testing.assert_close(xc.grad, xe.grad, msg=lambda m: f"call {call}: {m}")
