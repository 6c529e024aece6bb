"""Warm caches replay the same writes as a cold compile (two processes, one cache dir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import subclasses as S

pytestmark = pytest.mark.inductor

CHILD = os.path.join(os.path.dirname(__file__), "_cache_child.py")


def _eager_state():
    state = {}
    for cls in (S.CounterTensor, S.CachingTensor, S.UnseenByDynamo):
        x = cls(torch.arange(4.0))
        x * 3
        state[cls.__name__] = {
            k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in sorted(x.__dict__.items())
        }
    return state


@pytest.mark.parametrize("mode", ["both_layers", "aot_only"])
def test_second_process_with_warm_cache_replays_the_same_writes(tmp_path, mode):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), PYTHONPATH=os.getcwd())
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, CHILD, mode], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["state"] == warm["state"] == _eager_state()
    assert warm["fxgraph_hits"] > cold["fxgraph_hits"]  # the warm run did hit the cache
