"""Every row of the patch table is live on this torch: its hook ran in a compile that needs it.

Resolving a name is not enough: torch 2.14 moved the epilogue codegen, leaving the old name
importable and never called. Each scenario below is one the row exists for; after all of
them, every row that applies to this torch has counted calls (``_patches.HITS``).
"""

from __future__ import annotations

import pytest
import torch
from functorch.compile import nop
from torch._dynamo.backends.common import aot_autograd

import dynamo_ext
import subclasses as S
from dynamo_ext import _compat, _patches


def mul3(x):
    return x * 3


def _writes_and_guards():
    # fake propagation, compile_subgraph, the ctx guard (and its deepcopy), the AOT passes,
    # stage 2, the joint forward+backward, tangent coercion
    x = S.CounterTensor(torch.arange(4.0) + 1, requires_grad=True)
    out = torch.compile(mul3, backend="aot_eager", fullgraph=True)(x)
    out.sum().backward()


def _float_zero():
    class Box:
        a = 0.0

    # an unspecialized float (dynamic=True) that is a zero: specialized, its sign guarded
    torch.compile(lambda t, b: t * b.a, backend="eager", dynamic=True)(torch.ones(2), Box())


def _cache_save_and_load():
    from torch._inductor.utils import fresh_cache

    with fresh_cache():  # a miss that saves, then a hit
        for _ in range(2):
            torch._dynamo.reset()
            torch.compile(mul3, backend="inductor", fullgraph=True)(S.UnseenByDynamo(torch.arange(4.0)))


def _aot_function():
    from torch._functorch.aot_autograd import aot_function

    aot_function(mul3, fw_compiler=nop)(S.CounterTensor(torch.arange(4.0)))


def _export():
    class M(torch.nn.Module):
        def forward(self, x):
            return x * 3

    torch.export.export(M(), (S.QuietTensor(torch.arange(4.0)),), strict=False)


def _input_mutations():
    def bump(x):
        x.add_(1)
        return x * 2

    # kept in the graph (aot_eager) and written back by the generated epilogue (nop compiler)
    torch.compile(bump, backend="aot_eager", fullgraph=True)(S.QuietTensor(torch.arange(4.0)))
    torch._dynamo.reset()
    torch.compile(bump, backend=aot_autograd(fw_compiler=nop), fullgraph=True)(S.QuietTensor(torch.arange(4.0)))


def _partial_dtensor_requiring_grad():
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        w = distribute_tensor(torch.randn(16, 4), mesh, [Shard(0)]).requires_grad_()
        ids = distribute_tensor(torch.tensor([[1, 9, 12, 2]]), mesh, [Replicate()])
        partial = F.embedding(ids, w)
        torch.compile(lambda p: p.full_tensor(), backend="aot_eager", fullgraph=True)(partial).sum().backward()
    finally:
        dist.destroy_process_group()


def _what_dynamo_rewrites():
    # iteration, a tensor property, torch functions and methods with handlers of Dynamo's own
    def fn(x):
        y = sum(r for r in x) + x.T.sum() + torch.addcdiv(x, x, x + 1, value=0.5)
        return y.addcmul_(x, x, value=0.5).addcdiv_(x, x + 1, value=0.5).add_(x, alpha=2)

    torch.compile(fn, backend="eager", fullgraph=True)(S.CounterTensor(torch.ones(2, 2)))


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def _backward_code_traced_with_the_forward():
    # an autograd.Function's backward and a hook on an intermediate
    def fn(x):
        h = _Twice.apply(x) * 1
        h.register_hook(lambda g: g * 2)
        return h.sum()

    torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(2, requires_grad=True))


SCENARIOS = [
    _writes_and_guards, _float_zero, _cache_save_and_load, _aot_function, _export, _input_mutations,
    _what_dynamo_rewrites, _backward_code_traced_with_the_forward,
]
if _compat.HAS_DISTRIBUTED:
    SCENARIOS.append(_partial_dtensor_requiring_grad)


@pytest.mark.inductor  # AOTAutogradCache saves only what inductor compiled
def test_every_row_ran():
    _patches.HITS.clear()
    for scenario in SCENARIOS:
        torch._dynamo.reset()
        try:
            scenario()
        except Exception as e:  # the scenario's purpose is to reach the hooks
            if "dynamo_ext" not in str(e):
                raise
    dead = [p.target for p in dynamo_ext._PATCHES.rows() if _patches.HITS[p.target] == 0]
    assert not dead, f"rows whose hook never ran on torch {_compat.TORCH_VERSION}: {dead}"


@pytest.mark.parametrize("row", [p.target for p in dynamo_ext.TABLE], ids=str)
def test_row_applies_to_the_release_lines_it_names(row):
    patch = next(p for p in dynamo_ext.TABLE if p.target == row)
    assert (patch in dynamo_ext._PATCHES.rows()) == _compat.applies(patch.versions)


def test_each_target_in_one_row():
    """Two rows on one target would each capture torch's original and the later one would
    silently replace the other's hook: a target is patched by one row, for every version."""
    from collections import Counter

    counts = Counter(row.target for row in dynamo_ext._PATCHES.table)
    assert [t for t, n in counts.items() if n > 1] == []
