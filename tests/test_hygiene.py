"""Hygiene: repeated enable/disable, Dynamo's side-effect policy, nothing kept alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import dynamo_ext
import subclasses as S
from harness import differential, stock_torch


def mul3(x):
    return x * 3


def test_enable_disable_interleaved_with_compiles():
    for i in range(100):
        on = i % 2 == 0
        (dynamo_ext.enable if on else dynamo_ext.disable)()
        torch._dynamo.reset()
        x = S.CounterTensor(torch.arange(4.0))
        torch.compile(mul3, backend="aot_eager", fullgraph=True)(x)
        assert x.tag == (1 if on else 0)  # dynamo_ext when enabled, stock (write lost) when not
    dynamo_ext.enable()


@pytest.mark.parametrize("policy", ["silent", "info", "warn", "error"])
def test_side_effect_replay_policy_is_honoured(policy):
    with torch._dynamo.config.patch(side_effect_replay_policy=policy):
        _check_replay_policy(policy)


def _check_replay_policy(policy):
    x = S.CounterTensor(torch.arange(4.0))
    compiled = torch.compile(mul3, backend="aot_eager", fullgraph=True)
    if policy == "error":
        with pytest.raises(Exception, match="(?i)side effect"):
            compiled(x)
        assert x.tag == 0
    elif policy == "warn":
        with pytest.warns(UserWarning):
            compiled(x)
        assert x.tag == 1
    else:
        compiled(x)
        assert x.tag == 1


def _traced_instances_alive_after_reset():
    x = S.CachingTensor(torch.arange(4.0))
    torch.compile(mul3, backend="aot_eager", fullgraph=True)(x)
    refs = [weakref.ref(o) for o in gc.get_objects() if type(o) is S.CachingTensor and o is not x]
    torch._dynamo.reset()
    gc.collect()
    return sum(r() is not None for r in refs)


def test_no_more_traced_instances_kept_alive_than_stock():
    # Stock torch 2.13 itself keeps one fake input alive (a TrackedFake held past reset);
    # dynamo_ext must not add to that.
    with stock_torch():
        stock = _traced_instances_alive_after_reset()
    assert _traced_instances_alive_after_reset() <= stock


def test_many_calls_stay_flat():
    """1,000 compiled calls with writes: no recompiles after warm-up, no growth of live objects."""
    outcome = differential(mul3, lambda: [S.OutOfCtxConstants(torch.arange(4.0))], backend="aot_eager", calls=2)
    assert outcome.frames == 1
    x = S.OutOfCtxConstants(torch.arange(4.0))
    compiled = torch.compile(mul3, backend="aot_eager", fullgraph=True)
    compiled(x)
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(1000):
        compiled(x)
    gc.collect()
    assert len(gc.get_objects()) - before < 200
    assert x.mode is S.Mode.COLD and x.summary == S.Stats(1, "mul")


def test_a_library_named_like_torch_is_not_torch():
    """torchao's files (``.../site-packages/torchao/...``) start with torch's directory name:
    code there is a user's (its attribute reads are answered from the real object), and
    ``torch/_refs``' are torch's. The prefix was taken without the separator."""
    import os

    from dynamo_ext import capture

    ns: dict = {}
    where = os.path.dirname(torch.__file__) + "ao" + os.sep + "float8" + os.sep + "weight.py"
    exec(compile("def probe(check):\n    return check(1)\n", where, "exec"), ns)
    assert ns["probe"](capture._called_from_user)
    assert not ns["probe"](capture._called_from_torch)
    exec(compile("def probe(check):\n    return check(1)\n", torch._refs.__file__, "exec"), ns)
    assert not ns["probe"](capture._called_from_user)
    assert ns["probe"](capture._called_from_torch)
