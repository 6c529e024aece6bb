"""Long runs: 10,000 compiled calls with writes stay flat.

- memory: ``tracemalloc`` snapshots after 1,000 calls (warm-up) and after 10,000, on a
  program whose dispatch writes constants and tensors on every call (aot_eager);
  live tensor objects counted with ``gc`` at both points;
- no FakeTensor / FunctionalTensor kept alive by compiling and calling, beyond what
  stock torch keeps for the same program (stock 2.13 keeps a few: tracing contexts
  held by the compiled code, and a TrackedFake held past ``torch._dynamo.reset()``);
- Dynamo's cache: one entry per stable program, as many as stock;
- DTensor's sharding-propagation caches after N compiled calls of a vocab-parallel
  embedding and its reduction are no larger than after N eager calls.

Run with ``-s`` to see the measured figures.
"""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

import catalogue_subclasses as C
import subclasses as S
from harness import assert_same_state, differential, stock_torch

MEMORY_BOUND = 256 * 1024  # bytes of growth allowed between call 1,000 and call 10,000


def mul3(x):
    return x * 3


def _count(types) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), types))


def _entries(fn) -> int:
    return len(_debug_get_cache_entry_list(fn.__code__))


# --------------------------------------------------------------------------- memory


def test_10000_calls_with_writes_memory_flat():
    # Same state as eager first, so the long run repeats something correct.
    assert differential(mul3, lambda: [C.MixedWriter(torch.arange(4.0))], calls=2).frames == 1
    torch._dynamo.reset()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(mul3, backend=counter, fullgraph=True)
    x = C.MixedWriter(torch.arange(4.0))
    compiled(x)  # the compile itself is not measured
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    tracemalloc.start()
    try:
        for _ in range(999):
            compiled(x)
        tensors_warm = _count(torch.Tensor)
        warm = tracemalloc.take_snapshot().filter_traces(ignore)
        for _ in range(9000):
            compiled(x)
        tensors_end = _count(torch.Tensor)
        end = tracemalloc.take_snapshot().filter_traces(ignore)
    finally:
        tracemalloc.stop()
    diff = end.compare_to(warm, "lineno")
    growth = sum(d.size_diff for d in diff)
    print(
        f"\n10,000 calls (aot_eager, 3 constant + 2 tensor writes per call): "
        f"traced memory growth from call 1,000 to 10,000: {growth} B ({growth / 1024:.1f} KiB); "
        f"live tensors {tensors_warm} -> {tensors_end}"
    )
    top = "\n".join(str(d) for d in diff[:5])
    assert growth < MEMORY_BOUND, f"grew by {growth} B; largest:\n{top}"
    assert tensors_end <= tensors_warm
    assert counter.frame_count == 1
    e = C.MixedWriter(torch.arange(4.0))
    mul3(e)
    assert_same_state(e, x)  # the 10,000th call left what one eager call leaves


# --------------------------------------------------------------------------- trace-time tensors


def _trace_time_tensors_alive(calls: int):
    """(after compile + 10 calls, after ``calls`` more, after reset): fakes and functional
    tensors alive beyond those alive before the compile."""
    torch._dynamo.reset()
    base = _count((FakeTensor, FunctionalTensor))
    base_functional = _count(FunctionalTensor)  # earlier stock compiles in the process may hold some
    compiled = torch.compile(mul3, backend="aot_eager", fullgraph=True)
    x = C.MixedWriter(torch.arange(4.0))
    for _ in range(10):
        compiled(x)
    after_compile = _count((FakeTensor, FunctionalTensor)) - base
    for _ in range(calls):
        compiled(x)
    after_calls = _count((FakeTensor, FunctionalTensor)) - base
    functional = _count(FunctionalTensor) - base_functional
    del compiled
    torch._dynamo.reset()
    after_reset = _count((FakeTensor, FunctionalTensor)) - base
    return after_compile, after_calls, after_reset, functional


def test_no_more_trace_time_tensors_alive_than_stock():
    # The first compile in a process leaves a few fakes in torch's own one-time state
    # (stock included): do it before measuring.
    torch.compile(mul3, backend="aot_eager", fullgraph=True)(S.QuietTensor(torch.arange(4.0)))
    ours = _trace_time_tensors_alive(1000)
    with stock_torch():
        stock = _trace_time_tensors_alive(1000)
    print(f"\ntrace-time tensors alive (after compile, after 1,000 more calls, after reset, functional): "
          f"dynamo_ext {ours}, stock {stock}")
    assert ours[1] == ours[0], "calls created trace-time tensors"
    assert ours[0] <= stock[0] and ours[2] <= stock[2]
    assert ours[3] == 0 and ours[3] <= stock[3]


# --------------------------------------------------------------------------- Dynamo's cache

STABLE = [
    ("plain_tensor", lambda: torch.arange(4.0)),
    ("writes_nothing", lambda: S.QuietTensor(torch.arange(4.0))),
    ("constant_writes", lambda: S.OutOfCtxConstants(torch.arange(4.0))),
    ("constant_and_tensor_writes", lambda: C.MixedWriter(torch.arange(4.0))),
    ("tensor_from_op_output", lambda: S.IntermediateCacheTensor(torch.arange(4.0))),
]


def _cache_entries_after(make, calls: int, fresh: bool) -> int:
    torch._dynamo.reset()

    def program(x):
        return x * 3 + 1

    compiled = torch.compile(program, backend="aot_eager", fullgraph=True)
    x = make()
    for _ in range(calls):
        compiled(make() if fresh else x)
    return _entries(program)


@pytest.mark.parametrize("fresh", [False, True], ids=["same_input", "fresh_inputs"])
@pytest.mark.parametrize("name,make", STABLE, ids=[s[0] for s in STABLE])
def test_one_cache_entry_per_stable_program_as_stock(name, make, fresh):
    ours = _cache_entries_after(make, 200, fresh)
    with stock_torch():
        stock = _cache_entries_after(make, 200, fresh)
    assert ours == stock == 1


def test_cache_bounded_when_every_call_recompiles():
    """A ctx counter that changes every call recompiles every call (documented) up to
    Dynamo's recompile_limit; then the frame runs eagerly, with eager state."""
    torch._dynamo.reset()
    compiled = torch.compile(mul3, backend="aot_eager")
    x = S.CounterTensor(torch.arange(4.0))
    for _ in range(50):
        compiled(x)
    assert x.tag == 50
    assert 1 < _entries(mul3) <= torch._dynamo.config.recompile_limit


# --------------------------------------------------------------------------- DTensor's sharding-propagation caches


@pytest.fixture(scope="module")
def mesh():
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _embedding_and_reduction(ids, w):
    return torch.nn.functional.embedding(ids, w).full_tensor()


def _embedding(ids, w):
    return torch.nn.functional.embedding(ids, w)


def _sharding_cache_after(mesh, fn, reduce_after, calls, backend):
    """(python cache entries, fast-path cache entries inserted (its misses)) after
    ``calls`` calls, eagerly (backend None) or compiled."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import (
        _clear_sharding_prop_cache,
        _get_fast_path_sharding_prop_cache_stats,
        _get_python_sharding_prop_cache_info,
    )

    torch.manual_seed(0)
    w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    ids = distribute_tensor(torch.tensor([[1, 5, 7, 2], [0, 3, 6, 4]]), mesh, [Replicate()])
    expected = _embedding_and_reduction(ids, w)
    torch._dynamo.reset()
    _clear_sharding_prop_cache()
    f = fn if backend is None else torch.compile(fn, backend=backend, fullgraph=True)
    sizes = []
    for i in range(calls):
        out = f(ids, w)
        if reduce_after:
            out = out.full_tensor()
        if i in (0, calls - 1):
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
            sizes.append((_get_python_sharding_prop_cache_info().currsize, _get_fast_path_sharding_prop_cache_stats()[1]))
    _clear_sharding_prop_cache()
    return sizes  # [after the first call, after the last]


@pytest.mark.parametrize(
    "fn,reduce_after",
    [(_embedding_and_reduction, False), (_embedding, True)],
    ids=["reduced_inside", "partial_returned_reduced_in_eager"],
)
def test_dtensor_sharding_cache_not_larger_than_eager(mesh, fn, reduce_after):
    calls = 1000
    eager = _sharding_cache_after(mesh, fn, reduce_after, calls, None)
    compiled = _sharding_cache_after(mesh, fn, reduce_after, calls, "aot_eager")
    print(f"\nsharding cache (python entries, fast-path entries) after 1 and {calls} calls: "
          f"eager {eager}, compiled {compiled}")
    assert compiled[1] == compiled[0], "the cache grew with compiled calls"
    assert compiled[1][0] <= eager[1][0] and compiled[1][1] <= eager[1][1]


# --------------------------------------------------------------------------- module state after reset()


def _containers() -> dict[str, int]:
    """The size of every container the package keeps at module level (and inside its
    module-level helper objects), and of its memoizing caches."""
    import collections
    import importlib
    import pkgutil
    import weakref

    import dynamo_ext

    kinds = (dict, set, list, collections.deque, weakref.WeakValueDictionary, weakref.WeakKeyDictionary, weakref.WeakSet)
    sizes: dict[str, int] = {}
    for info in pkgutil.iter_modules(dynamo_ext.__path__):
        module = importlib.import_module(f"dynamo_ext.{info.name}")
        for name, value in vars(module).items():
            where = f"{info.name}.{name}"
            if getattr(value, "__module__", module.__name__) != module.__name__ and not isinstance(value, kinds):
                continue  # imported, not the module's own
            if isinstance(value, kinds) and name not in ("__all__",):
                sizes[where] = len(value)
            elif hasattr(value, "cache_info"):
                sizes[where] = value.cache_info().currsize
            elif type(value).__module__ == module.__name__ and hasattr(value, "__dict__") and not isinstance(value, type):
                for attr, held in vars(value).items():
                    if isinstance(held, kinds):
                        sizes[f"{where}.{attr}"] = len(held)
    return sizes


def _writing_class(k: int) -> type:
    class Fresh(S.WritingTensor):
        """A new class each time (a model built again), writing a counter and a tensor."""

        CTX = ("tag",)

        @classmethod
        def on_op(cls, func, first):
            if func is torch.ops.aten.mul.Tensor:
                first.tag += 1
                first.calls = getattr(first, "calls", 0) + 1
                first.cache = first.elem * 2

    Fresh.__name__ = f"Fresh{k}"
    return Fresh


def test_fifty_compiles_then_reset_leave_module_state_as_before():
    def run(k: int) -> None:
        if k % 6 == 5:
            torch._dynamo.reset()  # one code object, a new class each time: stay under the recompile limit
        cls = _writing_class(k)
        x = cls(torch.arange(4.0) + k, requires_grad=k % 2 == 0)
        backend = ("eager", "aot_eager")[k % 2]
        compiled = torch.compile(lambda t: (t * 2).sum(), backend=backend, fullgraph=k % 3 == 0)
        out = compiled(x)
        if x.requires_grad:
            out.backward()
        assert x.tag == 1 and x.calls == 1 and type(x.cache) is torch.Tensor
        if k % 5 == 0:  # a refusal on the way (a write no epilogue can replay)
            with pytest.raises(Exception, match="unreplayable_entry"):
                torch.export.export(_Mul3(), (S.CachingTensor(torch.arange(4.0)),))

    for k in range(-30, -24):  # first uses fill what is filled once per process (each path once)
        run(k)
    torch._dynamo.reset()
    gc.collect()
    before = _containers()
    for k in range(50):
        run(k)
    torch._dynamo.reset()
    gc.collect()
    after = _containers()
    grown = {name: (before.get(name), n) for name, n in after.items() if n != before.get(name)}
    assert not grown, f"module state grew over 50 compiles and reset(): {grown}"


class _Mul3(torch.nn.Module):
    def forward(self, x):
        return x * 3
