"""A small inductor subset (its first compile is slow on CPU)."""

from __future__ import annotations

import pytest
import torch

import subclasses as S
from harness import differential

pytestmark = pytest.mark.inductor


def mul3(x):
    return x * 3


def test_ctx_counter_and_growing_cache():
    assert differential(mul3, lambda: [S.CounterTensor(torch.arange(4.0))], backend="inductor", calls=2).frames == 2
    assert differential(mul3, lambda: [S.GrowingCacheTensor(torch.arange(4.0))], backend="inductor", calls=2).frames == 2


def test_cache_outside_ctx_with_grad():
    def fn(x):
        return (x * 3).sum() * 2

    differential(
        fn,
        lambda: [S.CachingTensor(torch.arange(4.0) + 1, requires_grad=True)],
        backend="inductor",
        calls=2,
        backward=True,
    )
