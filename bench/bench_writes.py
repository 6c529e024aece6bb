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
import platform
import statistics

import torch
import dynamo_ext

from .programs import PROGRAMS, fn, fresh_fn
from .timing import interleaved, paired, ratio, spread


def _compile(make, backend, ours, tag):
    if ours:
        dynamo_ext.enable()
    else:
        dynamo_ext.disable()
    compiled = torch.compile(fresh_fn(tag), backend=backend, fullgraph=True)
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

    samples = interleaved([(lambda c=c, x=x: c(x)) for _, _, c, x, _ in variants], args.reps, args.calls)
    for variant, got in zip(variants, samples):
        variant[4].extend(got)

    print(f"torch {torch.__version__}, backend {args.backend}, {platform.processor() or platform.machine()}, "
          f"{args.reps} interleaved rounds x {args.calls} calls, 1 thread")
    print()
    print("| program | eager µs/call | stock compile µs/call | dynamo_ext µs/call | dynamo_ext / stock | dynamo_ext / eager | extra µs per write |")
    print("|---|---|---|---|---|---|---|")
    by_name = {}
    for name, ours, _, _, samples in variants:
        by_name.setdefault(name, {})[ours] = samples
    quiet_stock = by_name["subclass, no writes"][False]
    for name, d in by_name.items():
        e, s, o = (statistics.median(d[k]) for k in ("eager", False, True))
        n = int(name.split(", ")[1].split()[0]) if "write(s)" in name else 0
        per_write = f"{paired(d[True], quiet_stock, lambda x, y: x - y) / n:.2f}" if n else "-"
        print(
            f"| {name} | {e:.1f} ({spread(d['eager'])}) | {s:.1f} ({spread(d[False])}) "
            f"| {o:.1f} ({spread(d[True])}) | {ratio(d[True], d[False]):.3f} | {ratio(d[True], d['eager']):.3f} "
            f"| {per_write} |"
        )
    print()
    print("extra µs per write = (dynamo_ext on the writing program - stock on the subclass program without writes) / writes;")
    print("stock compile loses the writes (and skips computing the written tensors), so it is a floor, not a peer.")


if __name__ == "__main__":
    main()
