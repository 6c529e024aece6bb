"""The compiled function reads an attribute its input lacks and handles the absence
(``try/except AttributeError``, ``getattr(x, name, default)``, ``hasattr``); an op's dispatch
then creates it, or the caller sets it between calls. The next call must take the attribute, as
eager does: Dynamo guarded no absence on ``try/except`` (the compiled code kept the absent
branch, an outside tester's find; stock alike where the caller sets it), so the absence is
guarded for a class that may write."""

from __future__ import annotations

import pytest
import torch

from dynamo_ext.testing import WrapperTensor
from harness import assert_same_state, leaked_fakes


class Tags(WrapperTensor):
    """Tags itself at every op (a write that reads nothing: no guard of dispatch's covers the
    absence)."""

    CREATES = True
    WRAP_OUTPUTS = False

    @classmethod
    def on_op(cls, func, first):
        if cls.CREATES:
            first.tag = 7


class SetByCaller(Tags):
    CREATES = False

    @classmethod
    def on_op(cls, func, first):
        first.ops = 1  # a class that writes, but not the tag


def caught(x):
    try:
        pre = x.tag
    except AttributeError:
        pre = -1
    return x * 2, pre


def with_default(x):
    pre = getattr(x, "tag", -1)
    return x * 2, pre


def asked(x):
    pre = x.tag if hasattr(x, "tag") else -1
    return x * 2, pre


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("cls", [Tags, SetByCaller], ids=["dispatch_creates", "caller_sets"])
@pytest.mark.parametrize("fn", [caught, with_default, asked], ids=lambda f: f.__name__)
def test_an_absent_attribute_read_is_read_again_once_it_exists(fn, cls, backend, fullgraph):
    def run(f, x):
        seen = []
        for i in range(4):
            out, pre = f(x)
            seen.append(int(pre))
            if cls is SetByCaller and i == 1:
                x.tag = 10
        return seen, out

    x_e, x_c = cls(torch.arange(3.0)), cls(torch.arange(3.0))
    eager_seen, eager_out = run(fn, x_e)
    torch._dynamo.reset()
    seen, out = run(torch.compile(fn, backend=backend, fullgraph=fullgraph), x_c)
    assert seen == eager_seen
    assert eager_seen[0] == -1 and eager_seen[-1] != -1
    torch.testing.assert_close(out, eager_out)
    assert_same_state(x_e, x_c, "input")
    assert not leaked_fakes(x_c)
