"""Warm restart with inductor: a process that finds a warm cache dir, stock vs dynamo_ext.

    python -m bench.warm_restart [--rounds 3]

For each program (subclass weights that write nothing; weights whose dispatch writes a
counter and a tensor cache) and each mode (stock torch.compile, dynamo_ext), one process
fills a fresh cache dir, then ``--rounds`` processes start warm from it, the modes
interleaved round by round. Each child reports the seconds from ``torch.compile`` to the end
of its first call, AOTAutogradCache hits and bypasses, and whether the state the writes
left equals eager's. Stock loses the writes (its state column says so); the time ratio is
taken on the program that writes nothing, where both do the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from dynamo_ext.testing import WrapperTensor

MODES = ("stock", "dynamo_ext")
PROGRAMS = ("writes_nothing", "writes_counter_and_cache")


class QuietWeight(WrapperTensor):
    """A weight whose dispatch writes nothing (as a quantized weight-only tensor)."""


class WritingWeight(WrapperTensor):
    """A weight whose matmuls count and cache a transposed copy."""

    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.mm.default:
            first.uses = getattr(first, "uses", 0) + 1
            first.cache_t = first.elem.t() * 1


def child(mode: str, program: str) -> None:
    from torch._dynamo.utils import counters

    import dynamo_ext

    Weight = QuietWeight if program == "writes_nothing" else WritingWeight
    def model(x, w1, w2, w3, w4):
        for w in (w1, w2, w3, w4):
            x = torch.relu(x @ w)
        return x.sum()

    if mode == "dynamo_ext":
        dynamo_ext.enable()
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(32, 32, generator=g) for _ in range(5)]

    def inputs():
        return data[0].clone(), *(Weight(d.clone()) for d in data[1:])

    eager_in, compiled_in = inputs(), inputs()
    expected = model(*eager_in)
    start = time.perf_counter()
    out = torch.compile(model, backend="inductor", fullgraph=True)(*compiled_in)
    seconds = time.perf_counter() - start

    def state(ws):
        return [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in sorted(vars(w).items())} for w in ws]

    torch.testing.assert_close(out.elem if hasattr(out, "elem") else out, expected.elem if hasattr(expected, "elem") else expected)
    aot = counters["aot_autograd"]
    print(json.dumps({
        "seconds": seconds,
        "aot_hits": aot["autograd_cache_hit"],
        "aot_bypasses": aot["autograd_cache_bypass"],
        "state_as_eager": state(compiled_in[1:]) == state(eager_in[1:]),
    }))


def run(mode: str, program: str, cache_dir: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    done = subprocess.run(
        [sys.executable, "-m", "bench.warm_restart", "--child", mode, program],
        env=env, capture_output=True, text=True, timeout=900,
    )
    if done.returncode:
        raise RuntimeError(f"{mode} {program}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.warm_restart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", nargs=2, metavar=("MODE", "PROGRAM"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    print(f"torch {torch.__version__}, backend inductor, {args.rounds} warm processes per mode (interleaved)\n")
    print("| program | mode | cold s | warm s (median) | AOTAutogradCache hits (warm) | bypasses | state as eager |")
    print("|---|---|---|---|---|---|---|")
    medians: dict[tuple[str, str], float] = {}
    for program in PROGRAMS:
        dirs = {mode: tempfile.mkdtemp(prefix=f"warm_{mode}_") for mode in MODES}
        cold = {mode: run(mode, program, dirs[mode]) for mode in MODES}
        warm: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                warm[mode].append(run(mode, program, dirs[mode]))
        for mode in MODES:
            medians[program, mode] = statistics.median(r["seconds"] for r in warm[mode])
            last = warm[mode][-1]
            print(f"| {program} | {mode} | {cold[mode]['seconds']:.2f} | {medians[program, mode]:.2f} | "
                  f"{last['aot_hits']} | {last['aot_bypasses']} | {last['state_as_eager']} |")
    ratio = medians["writes_nothing", "dynamo_ext"] / medians["writes_nothing", "stock"]
    print(f"\nwarm restart, program that writes nothing: dynamo_ext / stock = {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
