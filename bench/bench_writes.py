"""Per-call cost of a small compiled function, with and without dispatch writes,
stock torch.compile vs dynamo_ext, measured side by side in one run.

    python -m bench.bench_writes [--reps 31] [--calls 1000] [--backend aot_eager]

Each variant is compiled once; then the variants are timed in interleaved rounds
(every round times every variant for --calls calls), and the table reports the
median per-call time and spread (min-max over rounds); ratios and per-write
costs are paired round by round, then the median is taken.  Stock and dynamo_ext compile the same function and inputs;
on programs that write, stock loses the writes (that is the bug), so its time
is the floor the replay is compared against.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time
import types

import torch
from torch.utils._pytree import tree_map_only

import dynamo_ext


class _Wrapper(torch.Tensor):
    @staticmethod
    def __new__(cls, elem, **attrs):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        r.elem = elem
        r.__dict__.update(attrs)
        return r

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def write(cls, first):
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mul.Tensor:
            cls.write(next(a for a in args if isinstance(a, cls)))
        out = func(*tree_map_only(cls, lambda t: t.elem, args), **(kwargs or {}))
        return tree_map_only(torch.Tensor, cls, out)


class Quiet(_Wrapper):
    pass


def _constant_writer(n):
    class ConstantWriter(_Wrapper):
        @classmethod
        def write(cls, first):
            for i in range(n):
                setattr(first, f"c{i}", "mul")

    ConstantWriter.__name__ = f"Constants{n}"
    return ConstantWriter


def _tensor_writer(n):
    class TensorWriter(_Wrapper):
        @classmethod
        def write(cls, first):
            for i in range(n):
                setattr(first, f"t{i}", first.elem + i)

    TensorWriter.__name__ = f"Tensors{n}"
    return TensorWriter


def fn(x):
    return x * 3 + 1


PROGRAMS = [
    ("plain tensor, no writes", lambda: torch.randn(64)),
    ("subclass, no writes", lambda: Quiet(torch.randn(64))),
    *[(f"subclass, {n} constant write(s)", (lambda c: lambda: c(torch.randn(64)))(_constant_writer(n))) for n in (1, 4, 16)],
    *[(f"subclass, {n} tensor write(s)", (lambda c: lambda: c(torch.randn(64)))(_tensor_writer(n))) for n in (1, 4, 16)],
]


def _fresh_fn(tag):
    # Dynamo caches compiled code per code object: each variant gets its own copy
    # of fn's code so stock and dynamo_ext never share a cache entry.
    return types.FunctionType(fn.__code__.replace(co_name=f"fn_{tag}"), fn.__globals__, f"fn_{tag}")


def _compile(make, backend, ours, tag):
    if ours:
        dynamo_ext.enable()
    else:
        dynamo_ext.disable()
    compiled = torch.compile(_fresh_fn(tag), backend=backend, fullgraph=True)
    x = make()
    compiled(x)  # compile now; later calls hit the cache (the writes do not change guards)
    compiled(x)
    return compiled, x


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=31)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--backend", default="aot_eager")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 64

    variants = []
    for name, make in PROGRAMS:
        variants.append((name, "eager", fn, make(), []))
        for ours in (False, True):
            compiled, x = _compile(make, args.backend, ours, len(variants))
            variants.append((name, ours, compiled, x, []))
    dynamo_ext.disable()

    gc.collect()
    gc.disable()  # a collection inside one variant's window would bias that variant only
    try:
        for _ in range(args.reps):
            for name, ours, compiled, x, samples in variants:
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    compiled(x)
                samples.append((time.perf_counter() - t0) / args.calls * 1e6)
    finally:
        gc.enable()

    print(f"torch {torch.__version__}, backend {args.backend}, {platform.processor() or platform.machine()}, "
          f"{args.reps} interleaved rounds x {args.calls} calls, 1 thread")
    print()
    print("| program | eager µs/call | stock compile µs/call | dynamo_ext µs/call | dynamo_ext / stock | dynamo_ext / eager | extra µs per write |")
    print("|---|---|---|---|---|---|---|")
    by_name = {}
    for name, ours, _, _, samples in variants:
        by_name.setdefault(name, {})[ours] = samples
    quiet_stock = by_name["subclass, no writes"][False]

    def paired(a, b, f):
        # Ratios and differences are taken round by round (the variants of one round ran
        # back to back), then the median over rounds: drift between rounds cancels.
        return statistics.median(f(x, y) for x, y in zip(a, b))

    for name, d in by_name.items():
        e, s, o = (statistics.median(d[k]) for k in ("eager", False, True))
        spread = lambda xs: f"{min(xs):.1f}-{max(xs):.1f}"  # noqa: E731
        n = int(name.split(", ")[1].split()[0]) if "write(s)" in name else 0
        per_write = f"{paired(d[True], quiet_stock, lambda x, y: x - y) / n:.2f}" if n else "-"
        r_stock = paired(d[True], d[False], lambda x, y: x / y)
        r_eager = paired(d[True], d["eager"], lambda x, y: x / y)
        print(
            f"| {name} | {e:.1f} ({spread(d['eager'])}) | {s:.1f} ({spread(d[False])}) "
            f"| {o:.1f} ({spread(d[True])}) | {r_stock:.3f} | {r_eager:.3f} | {per_write} |"
        )
    print()
    print("extra µs per write = (dynamo_ext on the writing program - stock on the subclass program without writes) / writes;")
    print("stock compile loses the writes (and skips computing the written tensors), so it is a floor, not a peer.")


if __name__ == "__main__":
    main()
