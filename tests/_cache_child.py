"""Child process for test_caches: compile with inductor, print the inputs' state as JSON."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import dynamo_ext  # noqa: E402
import subclasses as S  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402


def mul3(x):
    return x * 3


dynamo_ext.enable()
dynamo_ext.config.dynamo_layer = sys.argv[1] == "both_layers"
state = {}
for cls in (S.QuietTensor, S.CounterTensor, S.CachingTensor, S.UnseenByDynamo):
    torch._dynamo.reset()
    x = cls(torch.arange(4.0))
    torch.compile(mul3, backend="inductor", fullgraph=True)(x)
    state[cls.__name__] = {
        k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in sorted(x.__dict__.items())
    }
aot = counters["aot_autograd"]
print(json.dumps({
    "state": state,
    "fxgraph_hits": counters["inductor"]["fxgraph_cache_hit"],
    "aot_hits": aot["autograd_cache_hit"],
    "aot_bypasses": aot["autograd_cache_bypass"],
}))
