"""Side-by-side timing: interleaved rounds, medians, paired ratios.

Every figure the suite reports comes from samples taken in interleaved rounds: each
round runs every variant once (back to back, order reversed every other round, so
neither drift nor position favours one variant), and ratios and differences are
taken round by round before the median, so load that changes between rounds cancels.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def _no_sync() -> None:
    pass


def interleaved(
    calls: Sequence[Callable[[], object]],
    reps: int,
    per_round: int | Sequence[int],
    *,
    alternate: bool = True,
    warmup: int = 0,
    sync: Callable[[], object] = _no_sync,
) -> list[list[float]]:
    """µs per call of each callable, one sample per round; every round runs every callable.

    ``per_round``: calls per round, one number for all or one per callable.
    ``sync``: called before reading the clock (``torch.cuda.synchronize`` on a GPU,
    where calls only enqueue work). ``warmup`` rounds run first and are discarded.
    """
    counts = [per_round] * len(calls) if isinstance(per_round, int) else list(per_round)
    samples: list[list[float]] = [[] for _ in calls]
    order = list(range(len(calls)))
    gc.collect()
    gc.disable()  # a collection inside one callable's window would bias that one only
    try:
        for r in range(warmup + reps):
            for i in order[::-1] if alternate and r % 2 else order:
                run, n = calls[i], counts[i]
                sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    run()
                sync()
                if r >= warmup:
                    samples[i].append((time.perf_counter() - t0) / n * 1e6)
    finally:
        gc.enable()
    return samples


def calls_per_round(run: Callable[[], object], target_s: float, sync: Callable[[], object] = _no_sync) -> int:
    """How many calls of ``run`` fill about ``target_s`` seconds (at least 1)."""
    run()
    sync()
    n, elapsed = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            run()
        sync()
        elapsed = time.perf_counter() - t0
        if elapsed >= target_s / 4 or n >= 1 << 16:
            break
        n *= 4
    return max(1, round(n * target_s / max(elapsed, 1e-9)))


def cold_compiles(
    variants: Sequence[Callable[[], Callable[[], object]]],
    reps: int,
    *,
    warmup: int = 1,
    reset: Callable[[], object] | None = None,
    sync: Callable[[], object] = _no_sync,
    budget_s: float | None = None,
) -> list[list[float]]:
    """Seconds per cold compile of each variant, interleaved: ``reps`` rounds, each compiling
    every variant once, order reversed every other round.

    Each variant is a ``prepare()`` that builds a fresh function and its inputs (untimed)
    and returns ``go()``, which compiles and runs it once (timed). ``reset`` (default
    ``torch._dynamo.reset``) runs before each prepare, untimed. ``warmup`` throwaway
    compiles of the first variant run first (the first compiles of a process pay for
    imports and lazy initialisation). With ``budget_s``, no new round starts once that
    many seconds have passed (at least one round runs).
    """
    if reset is None:
        import torch

        reset = torch._dynamo.reset

    def once(i: int) -> float:
        reset()
        go = variants[i]()
        gc.collect()
        sync()
        t0 = time.perf_counter()
        go()
        sync()
        return time.perf_counter() - t0

    for _ in range(warmup if variants else 0):
        once(0)
    samples: list[list[float]] = [[] for _ in variants]
    order = list(range(len(variants)))
    start = time.perf_counter()
    for r in range(reps):
        if r and budget_s is not None and time.perf_counter() - start > budget_s:
            break
        for i in order[::-1] if r % 2 else order:
            samples[i].append(once(i))
    return samples


# --------------------------------------------------------------------------- #
# Summaries
# --------------------------------------------------------------------------- #


def quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return math.nan
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    """Median and spread of one sample list (times, or per-round ratios/differences)."""

    median: float
    q1: float
    q3: float
    lo: float
    hi: float
    ci_lo: float  # distribution-free ~95% confidence interval of the median
    ci_hi: float
    n: int

    @classmethod
    def of(cls, xs: Sequence[float]) -> Summary:
        xs = [x for x in xs if not math.isnan(x)]
        if not xs:
            nan = math.nan
            return cls(nan, nan, nan, nan, nan, nan, nan, 0)
        s = sorted(xs)
        n = len(s)
        # Order statistics bracketing the median with ~95% coverage (binomial, normal approx.).
        half = 0.98 * math.sqrt(n)
        j = max(0, math.floor(n / 2 - half) - 1)
        k = min(n - 1, math.ceil(1 + n / 2 + half) - 1)
        return cls(statistics.median(s), quantile(s, 0.25), quantile(s, 0.75), s[0], s[-1], s[j], s[max(j, k)], n)

    def fmt(self, digits: int = 1, scale: float = 1.0) -> str:
        """``median (q1-q3)``: the spread shown is the interquartile range over rounds."""
        f = f"{{:.{digits}f}}"
        return f"{f.format(self.median * scale)} ({f.format(self.q1 * scale)}-{f.format(self.q3 * scale)})"

    def csv(self, prefix: str, scale: float = 1.0) -> dict[str, float]:
        return {
            f"{prefix}_median": self.median * scale,
            f"{prefix}_q1": self.q1 * scale,
            f"{prefix}_q3": self.q3 * scale,
            f"{prefix}_min": self.lo * scale,
            f"{prefix}_max": self.hi * scale,
            f"{prefix}_ci95_lo": self.ci_lo * scale,
            f"{prefix}_ci95_hi": self.ci_hi * scale,
            f"{prefix}_n": self.n,
        }


def per_round(a: Sequence[float], b: Sequence[float], f: Callable[[float, float], float]) -> list[float]:
    """f(a[r], b[r]) for every round r: the samples of one round ran back to back."""
    return [f(x, y) for x, y in zip(a, b)]


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    return per_round(a, b, lambda x, y: x / y)


def differences(a: Sequence[float], b: Sequence[float], per: float = 1.0) -> list[float]:
    return per_round(a, b, lambda x, y: (x - y) / per)


# --------------------------------------------------------------------------- #
# The original helpers (bench_writes / bench_aot / bench_tp used them)
# --------------------------------------------------------------------------- #


def paired(a: Sequence[float], b: Sequence[float], f: Callable[[float, float], float]) -> float:
    """Median over rounds of f(a[r], b[r]): the samples of one round ran back to back, so
    drift between rounds cancels."""
    return statistics.median(f(x, y) for x, y in zip(a, b))


def ratio(a: Sequence[float], b: Sequence[float]) -> float:
    return paired(a, b, lambda x, y: x / y)


def spread(xs: Sequence[float]) -> str:
    return f"{min(xs):.1f}-{max(xs):.1f}"
