"""Dispatch stamps the time or draws an id (``self.stamp = time.time()``, ``uuid.uuid4()``):
the call answers anew every time and changes no state a guard sees, so the compiled program
replayed the traced value on backend="eager" (an outside tester's find). Refused
(``unsupported_state_read``) with nothing touched; under ``fullgraph=False`` the op runs
eagerly and stamps anew each call."""

from __future__ import annotations

import datetime
import time
import uuid
from time import perf_counter

import pytest
import torch

from dynamo_ext.testing import WrapperTensor
from harness import assert_same_state


class Stamped(WrapperTensor):
    WRAP_OUTPUTS = False
    HOW = "time"

    @classmethod
    def on_op(cls, func, first):
        first.n = first.__dict__.get("n", 0) + 1
        if cls.HOW == "time":
            first.stamp = time.time()
        elif cls.HOW == "perf_counter":
            first.stamp = perf_counter()
        elif cls.HOW == "datetime":
            first.stamp = datetime.datetime.now().isoformat()
        elif cls.HOW == "uuid":
            first.stamp = str(uuid.uuid4())


def step(w, x):
    return w * x


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("how", ["time", "perf_counter", "datetime", "uuid"])
def test_a_clock_or_fresh_id_dispatch_reads_is_refused(how, backend, fullgraph):
    cls = type(f"Stamped_{how}", (Stamped,), {"HOW": how})
    w = cls(torch.ones(3))
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=fullgraph)
    if fullgraph:
        untouched = cls(torch.ones(3))
        with pytest.raises(torch._dynamo.exc.Unsupported, match="dynamo_ext: unsupported_state_read"):
            compiled(w, torch.ones(3))
        assert_same_state(untouched, w, "refused input")
        return
    stamps = []
    for _ in range(3):
        torch.testing.assert_close(compiled(w, torch.ones(3)), torch.ones(3))
        stamps.append(w.stamp)
        time.sleep(0.002)
    assert len(set(stamps)) == 3, f"the stamp must change every call, as in eager: {stamps}"
    assert w.n == 3
