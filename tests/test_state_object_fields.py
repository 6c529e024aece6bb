"""A registered state object whose fields carry a tensor's state names (outside round 41):
DTensor's ``MaskBuffer`` keeps its pending mask in ``data``. Dispatch storing a mask there in the
embedding lookup and reading and clearing it in a later op was refused as a tensor's ``.data``
change (``inner_metadata_mutation``) under ``fullgraph=True``, and failed on a real tensor in
fake propagation under ``fullgraph=False``, where eager runs. The names are a tensor's only on
a tensor."""

from __future__ import annotations

import pytest
import torch

import dynamo_ext

aten = torch.ops.aten
FIELDS = ["data", "grad", "requires_grad", "_version"]


def _buffer_class(field):
    @dynamo_ext.register_ctx_state
    class PendingMask:
        def __init__(self):
            setattr(self, field, None)
            self.pending = 0

    PendingMask.__qualname__ = PendingMask.__name__ = f"PendingMask_{field.strip('_')}"
    return PendingMask


BUFFERS = {field: _buffer_class(field) for field in FIELDS}


class VocabShard(torch.Tensor):
    """A vocab-parallel embedding weight: the lookup masks out-of-range ids and leaves the
    mask pending on its placement; the next op applies and releases it."""

    FIELD = "data"

    @staticmethod
    def __new__(cls, elem, placement):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, requires_grad=elem.requires_grad)

    def __init__(self, elem, placement):
        self.elem, self.placement = elem, placement

    def __tensor_flatten__(self):
        return ["elem"], self.placement

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w = args[0]
        if func is aten.embedding.default:
            ids = args[1]
            mask = ids >= w.elem.shape[0]
            setattr(w.placement, cls.FIELD, mask)
            w.placement.pending += 1
            return cls(torch.embedding(w.elem, torch.where(mask, 0, ids)), w.placement)
        mask = getattr(w.placement, cls.FIELD)
        elem = w.elem.masked_fill(mask.unsqueeze(-1), 0.0) if mask is not None else w.elem
        setattr(w.placement, cls.FIELD, None)
        if func is aten.detach.default:
            return cls(w.elem.detach(), w.placement)
        return func(elem, *args[1:], **(kwargs or {}))


def lookup(w, ids):
    return torch.nn.functional.embedding(ids, w).relu()


def _run(fn, field, grad):
    torch.manual_seed(0)
    cls = type(f"VocabShard_{field.strip('_')}", (VocabShard,), {"FIELD": field})
    placement = BUFFERS[field]()
    w = cls(torch.randn(4, 3).requires_grad_(grad), placement)
    seen = []
    for step, ids in enumerate([[[0, 5, 2], [3, 1, 7]], [[6, 1, 2], [3, 3, 0]], [[0, 1, 2], [9, 9, 9]]]):
        out = fn(w, torch.tensor(ids))
        seen.append((out.tolist(), getattr(placement, field), placement.pending))
        if grad:
            out.sum().backward()
            g = w.grad
            seen.append((g.elem if isinstance(g, VocabShard) else g).tolist())
    return seen


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("field", FIELDS)
def test_a_state_object_field_named_like_tensor_state(field, backend, fullgraph, grad):
    torch._dynamo.reset()
    eager = _run(lookup, field, grad)
    compiled = _run(torch.compile(lookup, backend=backend, fullgraph=fullgraph), field, grad)
    assert compiled == eager
