"""A partial result handed to the code after a graph break, whose placement holds a registered
mask buffer with the real pending mask. Dynamo fakes it (with its autograd history, through
the class's own dispatch) to trace the resumed code; that dispatch applies the real mask.
Under ``fullgraph=False`` the program runs as eager does (outside round 42: FakeTensor's
"Please convert all Tensors to FakeTensors first", where eager runs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import dynamo_ext

aten = torch.ops.aten
BACKENDS = ["eager", "aot_eager"]


@dynamo_ext.register_ctx_state
@dataclasses.dataclass
class MaskBuffer:
    data: torch.Tensor | None = None
    refcount: int = 0

    def fill(self, mask):
        if self.refcount == 0:
            self.data = mask
        self.refcount += 1

    def release(self):
        self.refcount -= 1
        if self.refcount == 0:
            self.data = None


@dataclasses.dataclass(frozen=True)
class RowShard:
    buffer: MaskBuffer = dataclasses.field(default_factory=MaskBuffer, compare=False)


@dataclasses.dataclass(frozen=True)
class Pending:
    buffer: MaskBuffer = dataclasses.field(default_factory=MaskBuffer, compare=False)


@dataclasses.dataclass(frozen=True)
class Whole:
    pass


class Local(torch.Tensor):
    """A vocabulary-sharded weight (rank 0 of 2) and the partial results of its lookups."""

    @staticmethod
    def __new__(cls, local, placement, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(cls, local.shape, dtype=local.dtype, requires_grad=requires_grad)

    def __init__(self, local, placement, requires_grad=False):
        self.local, self.placement = local, placement

    def __tensor_flatten__(self):
        return ["local"], self.placement

    @staticmethod
    def __tensor_unflatten__(inner, placement, outer_size, outer_stride):
        return Local(inner["local"], placement)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.embedding.default and isinstance(args[0].placement, RowShard):
            w, ids = args[0], args[1]
            rows = w.local.shape[0]
            mask = ids >= rows
            out = func(w.local, ids.masked_fill(mask, 0), *args[2:], **kwargs)
            p = Pending(w.placement.buffer)
            p.buffer.fill(mask)
            return Local(out, p)

        def unwrap(t):
            if not isinstance(t, Local):
                return t
            if isinstance(t.placement, Pending):
                out = t.local.masked_fill(t.placement.buffer.data.unsqueeze(-1), 0.0)
                t.placement.buffer.release()
                return out
            return t.local

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func._schema.is_mutable:
            return args[0]
        flat, _ = tree_flatten(args)
        first = next(a for a in flat if isinstance(a, Local))
        placement = Whole() if isinstance(first.placement, Pending) else first.placement
        return tree_map(lambda t: Local(t, placement) if type(t) is torch.Tensor else t, out)


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(Local(torch.randn(5, 4, generator=torch.Generator().manual_seed(0)), RowShard()))

    def forward(self, ids):
        return torch.nn.functional.embedding(ids, self.weight), ids.float().sum()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pending_partial_handed_to_the_resumed_code(backend):
    def run(model):
        buffer = model.weight.placement.buffer
        seen = []
        for n in (3, 4, 3):
            ids = torch.randint(0, 10, (2, n), generator=torch.Generator().manual_seed(n))
            e, b = model(ids)
            held = (buffer.refcount, buffer.data.tolist())
            reduced = e * 1.0
            (reduced.sum() + b).backward()
            seen.append((held, reduced.local.tolist(), b.item(), buffer.refcount, buffer.data, model.weight.grad.local.tolist()))
            model.weight.grad = None
        return seen

    torch._dynamo.reset()
    eager = run(Embed())
    compiled = run(torch.compile(Embed(), backend=backend, fullgraph=False))
    assert compiled == eager
