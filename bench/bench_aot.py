"""Cost of the AOTAutograd layer alone: its run-time epilogue and its compile time, side by
side with stock torch.compile and with both layers (the default) in one run.

    python -m bench.bench_aot [--reps 31] [--compile-reps 9] [--backend aot_eager]
    python -m bench --sections replay      (the suite: this table is part of section 2)

Three ways to compile the same program:
  stock       dynamo_ext disabled (writes are lost);
  both        dynamo_ext, writes recorded in Dynamo and replayed by its residual bytecode;
  aot_only    dynamo_ext with config.dynamo_layer = False: AOTAutograd's passes plan the
              writes and the run-time epilogue replays them.

Per call: interleaved rounds, median, ratios paired round by round. "epilogue µs per
write" = (aot_only - stock on the same program) / writes (for tensor writes this includes
computing the tensor, which stock skips); "AOT only - both" is what the epilogue costs
per call over the residual-bytecode replay of the same writes. Compile: first-call time of a
fresh function after torch._dynamo.reset(), interleaved cold compiles, median ratio.
"""

from __future__ import annotations

import argparse

from . import settings as presets
from .report import Table
from .settings import Settings
from .timing import Summary, differences, ratios


def aot_table(s: Settings, data: dict) -> Table:
    pc, cs = data["per_call"], data["compile_s"]
    t = Table(
        "replay_aot_only",
        "AOTAutograd layer alone (config.dynamo_layer = False): run-time epilogue and compile time",
        [
            "program",
            "stock µs/call",
            "both layers µs/call",
            "AOT only µs/call",
            "AOT only / stock",
            "epilogue µs per write",
            "AOT only - both, µs/call",
            "compile stock ms",
            "compile both / stock",
            "compile AOT only / stock",
        ],
    )
    for name, n, kind, _ in data["programs"]:
        st, bo, ao = (pc[(name, m)] for m in ("stock", "dynamo_ext", "aot_only"))
        per_write = Summary.of(differences(ao, st, per=n))
        over_both = Summary.of(differences(ao, bo))
        c_st, c_bo, c_ao = (cs[(name, m)] for m in ("stock", "dynamo_ext", "aot_only"))
        r_bo, r_ao = Summary.of(ratios(c_bo, c_st)), Summary.of(ratios(c_ao, c_st))
        t.add(
            [
                name,
                Summary.of(st).fmt(1),
                Summary.of(bo).fmt(1),
                Summary.of(ao).fmt(1),
                f"{Summary.of(ratios(ao, st)).median:.3f}",
                per_write.fmt(2),
                over_both.fmt(2),
                f"{Summary.of(c_st).median * 1e3:.0f}",
                f"{r_bo.median:.2f} ({r_bo.q1:.2f}-{r_bo.q3:.2f})",
                f"{r_ao.median:.2f} ({r_ao.q1:.2f}-{r_ao.q3:.2f})",
            ],
            {
                "program": name,
                "kind": kind,
                "writes": n,
                **Summary.of(st).csv("stock_us"),
                **Summary.of(bo).csv("both_us"),
                **Summary.of(ao).csv("aot_only_us"),
                **per_write.csv("epilogue_us_per_write"),
                **over_both.csv("aot_only_minus_both_us"),
                **Summary.of(c_st).csv("stock_compile_s"),
                **r_bo.csv("compile_both_ratio"),
                **r_ao.csv("compile_aot_only_ratio"),
            },
        )
    t.notes.append(
        "The default path (both layers) replays through Dynamo's residual bytecode and has no epilogue; "
        "AOT only is the path for writes Dynamo never sees and for `config.dynamo_layer = False`."
    )
    return t


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=31, help="interleaved rounds")
    p.add_argument("--compile-reps", type=int, default=9)
    p.add_argument("--backend", default="aot_eager", choices=["aot_eager", "inductor"])
    args = p.parse_args(argv)
    from .runner import setup
    from .bench_writes import measure

    s = presets.full(args.backend)
    s.rounds, s.compile_reps_small = args.reps, args.compile_reps
    setup(s)
    data = measure(s, aot_only=True)
    print(aot_table(s, data).markdown())
    for x in data["problems"]:
        print("check failed:", x)


if __name__ == "__main__":
    main()
