"""The benchmark suite, one command:

    python -m bench                       # --full (default): every section, backend aot_eager
    python -m bench --quick               # CI smoke: tiny rep counts, checks everything runs
    python -m bench --backend inductor --out bench/results
    python -m bench --sections unused,replay

Sections (``--sections`` takes their keys):
    unused      1. programs that write nothing: per call and compile time, dynamo_ext vs stock
    replay      2. cost of replaying 1/4/16 constant and tensor writes per call (and the AOT-only epilogue)
    workarounds 3. eager vs keeping the writing op out of the graph vs per-block vs whole-graph compile
    scaling     4. compile and per-call time vs subclass inputs and vs attributes written per instance
    profile     per-call cProfile of a compiled call with 16 constant + 16 tensor writes
    counters    5. a float8-style model trained step by step: symbolic counters vs recompiles and workarounds

Results go to ``--out`` (default bench/results; bench/results/quick for --quick) as markdown,
CSV and PNG, one set per section, file names ending in the backend (and mode), plus
``summary_<backend>.md``. Exit status 1 if a check failed (a crash, or dynamo_ext's results
differing from eager); timings are never asserted. bench/gpu.py runs sections 1-3 on a CUDA device.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import settings as presets
from .report import Writer, plots_available
from .runner import SECTIONS, run_sections, setup

def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="CI smoke run: tiny rep counts, no timing assertions")
    mode.add_argument("--full", action="store_true", help="the full run (default)")
    p.add_argument("--backend", default="aot_eager", choices=["aot_eager", "inductor", "eager"])
    p.add_argument(
        "--out", type=Path, default=None, help="results directory (default bench/results, or bench/results/quick)"
    )
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--compile-reps", type=int, default=None, help="cold compiles per variant in section 1")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds for per-call timings")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)

    s = presets.quick(args.backend) if args.quick else presets.full(args.backend)
    s.out = args.out or (Path("bench/results/quick") if args.quick else Path("bench/results"))
    if args.compile_reps:
        s.compile_reps = args.compile_reps
    if args.rounds:
        s.rounds = args.rounds
    keys = [k.strip() for k in args.sections.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")

    plots = not args.no_plots
    if plots and not plots_available():
        if not args.quick:
            p.error('matplotlib is needed for the plots: pip install -e ".[bench]" (or pass --no-plots)')
        print("matplotlib is not installed: plots skipped")
        plots = False

    t0 = time.perf_counter()
    setup(s)
    writer = Writer(s.out, s, plots)
    done = run_sections(s, keys, writer)
    total = time.perf_counter() - t0
    problems = [f"{sec.title}: {x}" for sec in done for x in sec.problems]
    print(f"\n{len(done)} section(s) in {total:.0f} s; results in {s.out}/ (summary_{s.suffix}.md)")
    if problems:
        print("\nChecks that failed:")
        for x in problems:
            print(f"  - {x}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
