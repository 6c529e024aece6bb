"""No change when unused: programs that write nothing compile exactly as on stock torch."""

from __future__ import annotations

import pytest
import torch

import subclasses as S
from harness import assert_same_outputs, stock_torch


class Recorder:
    """A backend that keeps each graph's code, then runs it eagerly."""

    def __init__(self):
        self.codes = []
        self.ops = 0

    def __call__(self, gm, example_inputs):
        self.codes.append(gm.code)
        self.ops += sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
        return gm.forward


def quiet_subclass(x):
    y = x * 3 + x.sin()
    return y.sum(), x.tag


def plain_tensor(x):
    return torch.relu(x @ x.T).sum(dim=0) * 2


def with_break(x):
    y = x.cos()
    torch._dynamo.graph_break()
    return y * x


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.nn.functional.gelu(self.lin(x))


PROGRAMS = [
    ("quiet_subclass", quiet_subclass, lambda: [S.QuietTensor(torch.arange(4.0), tag=5)], True),
    ("plain_tensor", plain_tensor, lambda: [torch.randn(4, 4, generator=torch.Generator().manual_seed(0))], True),
    ("graph_break", with_break, lambda: [torch.arange(4.0)], False),
    ("module", Net(), lambda: [torch.ones(2, 4)], True),
]


def _compile(fn, make, fullgraph):
    rec = Recorder()
    compiled = torch.compile(fn, backend=rec, fullgraph=fullgraph)
    outs = [compiled(*make()) for _ in range(3)]
    return rec, outs


@pytest.mark.parametrize("name,fn,make,fullgraph", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_same_graphs_frames_and_outputs_as_stock(name, fn, make, fullgraph):
    with stock_torch():
        stock, stock_outs = _compile(fn, make, fullgraph)
    torch._dynamo.reset()
    ours, our_outs = _compile(fn, make, fullgraph)
    assert len(ours.codes) == len(stock.codes)  # frames
    assert ours.ops == stock.ops
    assert ours.codes == stock.codes
    for s, o in zip(stock_outs, our_outs):
        assert_same_outputs(s, o)
