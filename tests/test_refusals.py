"""Writes that cannot be replayed exactly are refused, never silently wrong."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

import subclasses as S
from dynamo_ext import RefusalKind
from harness import attr_state, differential


def mul3(x):
    return x * 3


def in_checkpoint(x):
    return torch.utils.checkpoint.checkpoint(mul3, x, use_reentrant=False) + 1


REFUSED = [
    # (subclass, input attrs, function, kind, attribute named in the message)
    (S.ListWriter, {}, mul3, RefusalKind.MUTABLE_VALUE, "history"),
    (S.InPlaceWriter, {"notes": []}, mul3, RefusalKind.IN_PLACE_MUTATION, "notes"),
    (S.OpaqueWriter, {}, mul3, RefusalKind.OPAQUE_VALUE, "handle"),
    (S.RealTensorWriter, {}, mul3, RefusalKind.OPAQUE_VALUE, "borrowed"),
    (S.DeleteWriter, {"cache": 1}, mul3, RefusalKind.DELETED_ATTRIBUTE, "cache"),
    (S.CounterTensor, {}, in_checkpoint, RefusalKind.WRITE_IN_HOP, "tag"),
]


def _ids(p):
    return p[0].__name__ + "-" + p[3].value


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", REFUSED, ids=_ids)
def test_fullgraph_refuses_with_clear_error(case, backend):
    cls, attrs, fn, kind, attr = case
    x = cls(torch.arange(4.0), **attrs)
    before = attr_state(x)
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(fn, backend=backend, fullgraph=True)(x)
    msg = str(info.value)
    assert kind.gb_type in msg
    assert cls.__name__ in msg and repr(attr) in msg
    assert "Hint:" in msg
    after = attr_state(x)
    assert before.keys() == after.keys()
    for k in before:  # the user's input is untouched
        if before[k][0] == "tensor":
            assert torch.equal(before[k][2], after[k][2])
        else:
            assert before[k] == after[k]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", REFUSED, ids=_ids)
def test_breakable_graph_breaks_and_matches_eager(case, backend):
    cls, attrs, fn, kind, attr = case

    def with_work_around(x):
        return x.sin() + fn(x)  # an op before the refused one, so there is a graph to break

    differential(with_work_around, lambda: [cls(torch.arange(4.0), **attrs)], backend=backend, fullgraph=False, calls=2)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(with_work_around)(cls(torch.arange(4.0), **attrs))
    reasons = " ".join(str(r.reason) for r in explained.break_reasons)
    assert kind.gb_type in reasons


def test_subclass_write_error_names_kind():
    from dynamo_ext import SubclassWriteError

    err = SubclassWriteError(RefusalKind.MUTABLE_VALUE, "MyTensor", "history", "list")
    assert err.kind is RefusalKind.MUTABLE_VALUE
    assert "MyTensor" in str(err) and "'history'" in str(err) and "list" in str(err)
