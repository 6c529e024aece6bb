"""Cost of the AOTAutograd layer: its run-time epilogue and its compile-time analysis,
side by side with stock torch.compile in one run.

    python -m bench.bench_aot [--reps 31] [--calls 1000] [--compile-reps 5]

Three ways to compile the same program (backend aot_eager):
  stock       dynamo_ext disabled (writes are lost);
  both        dynamo_ext, writes recorded in Dynamo and replayed by its residual bytecode;
  aot_only    dynamo_ext with config.dynamo_layer = False: AOTAutograd's passes plan the
              writes and the run-time epilogue replays them.

Per call: interleaved rounds, median, ratios paired round by round. "epilogue µs per
write" = (aot_only on the writing program - stock on the same program) / writes, i.e.
what replaying one write in the epilogue adds to a call (for tensor writes this includes
computing the tensor, which stock skips). Compile: first-call time after
torch._dynamo.reset(), interleaved over --compile-reps repetitions, median.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dynamo_ext

from .programs import PROGRAMS, fresh_fn
from .timing import interleaved, paired, ratio, spread

MODES = ("stock", "both", "aot_only")
SELECTED = [p for p in PROGRAMS if p[0] != "plain tensor, no writes"]


def _set_mode(mode: str) -> None:
    if mode == "stock":
        dynamo_ext.disable()
    else:
        dynamo_ext.enable()
        dynamo_ext.config.dynamo_layer = mode == "both"


def _compile(make, mode, tag):
    _set_mode(mode)
    compiled = torch.compile(fresh_fn(tag), backend="aot_eager", fullgraph=True)
    x = make()
    t0 = time.perf_counter()
    compiled(x)
    elapsed = time.perf_counter() - t0
    compiled(x)
    return compiled, x, elapsed


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=31)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--compile-reps", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 64

    # Compile time: every (program, mode) compiled afresh, interleaved.
    compile_s: dict[tuple[str, str], list[float]] = {}
    tag = 0
    for name, make in SELECTED:  # warm-up round, discarded: first compiles pay imports
        for mode in MODES:
            tag += 1
            _compile(make, mode, tag)
    for _ in range(args.compile_reps):
        for name, make in SELECTED:
            for mode in MODES:
                tag += 1
                compile_s.setdefault((name, mode), []).append(_compile(make, mode, tag)[2])

    # Per call.
    variants = []
    for name, make in SELECTED:
        for mode in MODES:
            tag += 1
            compiled, x, _ = _compile(make, mode, tag)
            variants.append((name, mode, compiled, x))
    dynamo_ext.disable()
    dynamo_ext.config.dynamo_layer = True
    samples = interleaved([(lambda c=c, x=x: c(x)) for _, _, c, x in variants], args.reps, args.calls)
    per_call = {(name, mode): got for (name, mode, _, _), got in zip(variants, samples)}

    print(f"torch {torch.__version__}, backend aot_eager, {args.reps} interleaved rounds x {args.calls} calls, "
          f"{args.compile_reps} compiles per variant, 1 thread")
    print()
    print("| program | stock µs/call | both layers µs/call | AOT only µs/call | AOT only / stock | epilogue µs per write "
          "| compile stock ms | compile both / stock | compile AOT only / stock |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, _ in SELECTED:
        st, bo, ao = (per_call[(name, m)] for m in MODES)
        n = int(name.split(", ")[1].split()[0]) if "write(s)" in name else 0
        per_write = f"{paired(ao, st, lambda x, y: x - y) / n:.2f}" if n else "-"
        cs = [compile_s[(name, m)] for m in MODES]
        print(
            f"| {name} | {statistics.median(st):.1f} ({spread(st)}) | {statistics.median(bo):.1f} ({spread(bo)}) "
            f"| {statistics.median(ao):.1f} ({spread(ao)}) | {ratio(ao, st):.3f} | {per_write} "
            f"| {statistics.median(cs[0]) * 1e3:.0f} | {ratio(cs[1], cs[0]):.2f} | {ratio(cs[2], cs[0]):.2f} |"
        )


if __name__ == "__main__":
    main()
