"""A partial result handed to compiled code (after a graph break, or to the next call), whose
placement holds a registered mask buffer with the real pending mask. Dynamo fakes it, with its
autograd history, through the class's own ``detach``, which here reduces the partial: the fake
copy applied the real mask (outside round 42: FakeTensor's "Please convert all Tensors to
FakeTensors first", where eager runs), and then held a replicated placement with no mask, so
the compiled reduction skipped the mask while the buffer's release was replayed (outside round
43: the masked rows not zeroed on aot_eager, silently; a crash under ``dynamic=True``)."""

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
    """A vocabulary-sharded weight (rank 0 of 2) and the partial results of its lookups; the
    lookup fills the weight's buffer, or (``FRESH``) a buffer of its own."""

    FRESH = False

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
            p = Pending(MaskBuffer() if cls.FRESH else w.placement.buffer)
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
        return tree_map(lambda t: Local(t, placement) if isinstance(t, torch.Tensor) and not isinstance(t, Local) else t, out)


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


@dataclasses.dataclass(frozen=True)
class Sharded:
    pass


@dataclasses.dataclass(frozen=True)
class PartialSum:
    pass


class Vocab(torch.Tensor):
    """A vocabulary-sharded weight whose lookups return partials each holding a fresh mask
    buffer (``mask``, beside the placement in the ctx); an op on a partial reduces it, strictly
    (the mask must be there, as DTensor's ``_MaskPartial`` requires)."""

    @staticmethod
    def __new__(cls, local, placement, mask=None, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(cls, local.shape, dtype=local.dtype, requires_grad=requires_grad)

    def __init__(self, local, placement, mask=None, requires_grad=False):
        self.local, self.placement, self.mask = local, placement, mask

    def __tensor_flatten__(self):
        return ["local"], (self.placement, self.mask)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Vocab(inner["local"], ctx[0], ctx[1])

    @classmethod
    def _reduce(cls, t):
        if isinstance(t.placement, PartialSum):
            out = t.local.masked_fill(t.mask.data.unsqueeze(-1), 0.0)
            t.mask.release()
            return out
        return t.local

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.embedding.default:
            w, ids = args[0], args[1]
            mask = ids >= w.local.shape[0]
            buffer = MaskBuffer()
            buffer.fill(mask)
            return Vocab(func(w.local, ids.masked_fill(mask, 0)), PartialSum(), buffer)
        if func is aten.embedding_dense_backward.default:
            grad, ids = cls._reduce(args[0]) if isinstance(args[0], Vocab) else args[0], args[1]
            mask = ids >= args[2] // 2
            return Vocab(func(grad.masked_fill(mask.unsqueeze(-1), 0.0), ids.masked_fill(mask, 0), *args[2:], **kwargs), Sharded())
        unwrap = lambda t: cls._reduce(t) if isinstance(t, Vocab) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        return tree_map(lambda t: Vocab(t, Whole()) if isinstance(t, torch.Tensor) and not isinstance(t, Vocab) else t, out)


def lookup_and_reduce(w, ids, prev):
    out = torch.nn.functional.embedding(ids, w)
    return out, (prev * 2.0 if prev is not None else None)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_partial_reduced_in_the_next_call(backend, fullgraph, dynamic):
    def run(f):
        w = Vocab(torch.randn(5, 4, generator=torch.Generator().manual_seed(1)), Sharded(), requires_grad=True)
        g = torch.Generator().manual_seed(2)
        seen, prev = [], None
        for n in (5, 3, 4):
            out, reduced = f(w, torch.randint(0, 10, (n,), generator=g), prev)
            seen.append((out.local.tolist(), out.mask.refcount, out.mask.data.tolist(),
                         None if reduced is None else reduced.local.tolist(),
                         None if prev is None else (prev.mask.refcount, prev.mask.data)))
            prev = out
        return seen

    torch._dynamo.reset()
    eager = run(lookup_and_reduce)
    compiled = run(torch.compile(lookup_and_reduce, backend=backend, fullgraph=fullgraph, dynamic=dynamic))
    assert compiled == eager
