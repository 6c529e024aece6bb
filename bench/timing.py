"""Side-by-side timing: interleaved rounds, medians, paired ratios."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Sequence


def interleaved(calls: Sequence[Callable[[], object]], reps: int, per_round: int) -> list[list[float]]:
    """µs per call of each callable, one sample per round; every round runs every callable."""
    samples: list[list[float]] = [[] for _ in calls]
    gc.collect()
    gc.disable()  # a collection inside one callable's window would bias that one only
    try:
        for _ in range(reps):
            for run, out in zip(calls, samples):
                t0 = time.perf_counter()
                for _ in range(per_round):
                    run()
                out.append((time.perf_counter() - t0) / per_round * 1e6)
    finally:
        gc.enable()
    return samples


def paired(a: Sequence[float], b: Sequence[float], f: Callable[[float, float], float]) -> float:
    """Median over rounds of f(a[r], b[r]): the samples of one round ran back to back, so
    drift between rounds cancels."""
    return statistics.median(f(x, y) for x, y in zip(a, b))


def ratio(a: Sequence[float], b: Sequence[float]) -> float:
    return paired(a, b, lambda x, y: x / y)


def spread(xs: Sequence[float]) -> str:
    return f"{min(xs):.1f}-{max(xs):.1f}"
