"""What users see: Dynamo's side_effects log, the residual bytecode, the graph."""

from __future__ import annotations

import logging

import torch

import subclasses as S
from dynamo_ext.handoff import read_attr
from dynamo_ext.introspect import residual_writes


def mul3(x):
    return x * 3


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_side_effects_log_shows_dispatch_write_with_user_stack():
    torch._logging.set_logs(side_effects=True)
    logger = logging.getLogger("torch._dynamo.side_effects.__side_effects")
    handler = _Collect()
    logger.addHandler(handler)
    try:
        torch.compile(mul3, backend="aot_eager", fullgraph=True)(S.CounterTensor(torch.arange(4.0)))
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
    text = "\n".join(handler.lines)
    assert "Mutating object of type CounterTensor (source name: L['x'])" in text
    assert "return x * 3" in text  # the user's stack, not dynamo_ext's


def test_residual_bytecode_stores_written_attributes():
    with residual_writes() as frames:
        torch.compile(mul3, backend="aot_eager", fullgraph=True)(S.CounterTensor(torch.arange(4.0)))
        torch.compile(mul3, backend="aot_eager", fullgraph=True)(S.CachingTensor(torch.arange(4.0)))
    assert [f.stores for f in frames] == [["tag"], ["cache"]]


def test_tensor_write_becomes_graph_output():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(mul3, backend=backend, fullgraph=True)(S.CachingTensor(torch.arange(4.0)))
    (gm,) = graphs
    reads = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is read_attr]
    assert len(reads) == 1 and reads[0].args[2] == "cache"
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert reads[0] in output.args[0]


def test_unused_program_has_no_residual_writes():
    with residual_writes() as frames:
        torch.compile(mul3, backend="aot_eager", fullgraph=True)(S.QuietTensor(torch.arange(4.0)))
    assert [f.stores for f in frames] == [[]]
