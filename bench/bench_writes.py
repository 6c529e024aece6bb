"""Section 2, replay cost: what 1, 4 and 16 dispatch writes per call (constants; tensors) add
to a compiled call of ``x * 3 + 1`` on a 64-element wrapper subclass, side by side in one run.

    python -m bench.bench_writes [--backend aot_eager|inductor] [--reps 31]
    python -m bench --sections replay                      (the same, inside the suite)

Variants, all timed in the same interleaved rounds:
  eager                    the program run eagerly (dispatch writes for real)
  stock                    stock torch.compile: the writes are lost (and the written tensors
                           never computed), so it is a floor, not a peer
  dynamo_ext               both layers (default): Dynamo's residual bytecode replays the writes
  AOT only                 dynamo_ext with config.dynamo_layer = False: the AOTAutograd layer's
                           run-time epilogue replays them (bench/bench_aot.py reports it)
  user-code writes, stock  the same writes made in user code (``x.c0 = "mul"``), which stock
                           torch.compile already replays with the same residual bytecode
  baseline                 stock on the same graph without writes (a subclass that writes nothing)

extra µs per write = (variant - baseline) / writes, per round, then the median. For tensor
writes it includes computing the tensor (one ``elem + i`` each) and returning it from the graph.
"""

from __future__ import annotations

import argparse

import torch

from . import settings as presets
from .programs import Quiet, fn, fresh, make, programs, user_writes_fn, written_state
from .report import SectionResult, Table
from .settings import Settings
from .timing import (
    Summary,
    calls_per_round,
    cold_compiles,
    differences,
    interleaved,
    ratios,
)
from .unused import restore, set_mode

CONSTANT_TARGET_US = 1.0
TENSOR_TARGET_US = 2.0
# Cited for scale, not measured here (their machine): google/flax pull request #4399,
# benchmarks/nnx_graph_overhead.py --depth=100: time per layer of a training step.
FLAX_NNX_US_PER_LAYER = 79.62
RAW_JAX_US_PER_LAYER = 17.90


def _compile(f, mode, backend):
    set_mode(mode)
    return torch.compile(f, backend=backend, fullgraph=True)


def bare_store_attr(s: Settings) -> dict[str, Summary]:
    """ns per plain Python ``STORE_ATTR``: 16 stores minus none, on a tensor and on an object."""
    src = "def store16(x):\n" + "".join(f"    x.a{i} = 1\n" for i in range(16)) + "def store0(x):\n    pass\n"
    scope: dict = {}
    exec(compile(src, "<bench store_attr>", "exec"), scope)

    class Plain:
        pass

    tensor, obj = Quiet(torch.zeros(4)), Plain()
    n = 2000 if s.smoke else 20000
    calls = [
        lambda: scope["store16"](tensor),
        lambda: scope["store0"](tensor),
        lambda: scope["store16"](obj),
        lambda: scope["store0"](obj),
    ]
    t16, t0, o16, o0 = interleaved(calls, s.rounds, n, warmup=1)
    return {
        "tensor": Summary.of(differences(t16, t0, per=16 / 1000)),  # ns
        "object": Summary.of(differences(o16, o0, per=16 / 1000)),
    }


def measure(s: Settings, aot_only: bool | None = None) -> dict:
    """Compile every variant, check each against eager, time them side by side."""
    if aot_only is None:
        aot_only = s.backend != "eager"
    progs = [p for p in programs(s.device, s.write_counts) if p[2] is not None]
    counter = iter(range(10**9))
    problems: list[str] = []
    calls, keys = [], []

    def add(key, f, x):
        calls.append(lambda f=f, x=x: f(x))
        keys.append(key)

    try:
        torch._dynamo.reset()
        base = _compile(fresh(fn, f"r{next(counter)}"), "stock", s.backend)
        xb = make(Quiet, s.device)()
        base(xb)
        base(xb)
        add(("baseline",), base, xb)
        for name, n, kind, mk in progs:
            ref = mk()
            fn(ref)
            expected = written_state(ref)
            add((name, "eager"), fn, mk())
            modes = ["stock", "dynamo_ext"] + (["aot_only"] if aot_only else [])
            for mode in modes:
                f = _compile(fresh(fn, f"r{next(counter)}"), mode, s.backend)
                x = mk()
                f(x)
                if mode != "stock" and written_state(x) != expected:
                    problems.append(f"{name}, {mode}: the input's attributes differ from eager's")
                f(x)
                add((name, mode), f, x)
            f = _compile(user_writes_fn(n, kind, f"r{next(counter)}"), "stock", s.backend)
            x = make(Quiet, s.device)()
            f(x)
            if written_state(x) != expected:
                problems.append(f"{name}, user-code writes on stock: attributes differ from eager's")
            f(x)
            add((name, "user"), f, x)
        restore()
        counts = [calls_per_round(c, s.round_s, s.sync) for c in calls]
        samples = interleaved(calls, s.rounds, counts, warmup=1, sync=s.sync)
        per_call = dict(zip(keys, samples))

        # Compile time of the writing programs: stock vs dynamo_ext (vs AOT only), cold, interleaved.
        modes = ["stock", "dynamo_ext"] + (["aot_only"] if aot_only else [])

        def variant(mk, mode):
            def prepare():
                f = _compile(fresh(fn, f"r{next(counter)}"), mode, s.backend)
                x = mk()
                return lambda: f(x)

            return prepare

        variants = [variant(mk, m) for _, _, _, mk in progs for m in modes]
        comp = cold_compiles(
            variants, s.compile_reps_small, warmup=s.compile_warmup, sync=s.sync, budget_s=s.compile_budget_s
        )
        compile_s = {(p[0], m): comp[i * len(modes) + j] for i, p in enumerate(progs) for j, m in enumerate(modes)}
    finally:
        restore()
    return {
        "programs": progs,
        "per_call": per_call,
        "compile_s": compile_s,
        "aot_only": aot_only,
        "problems": problems,
        "store_attr": bare_store_attr(s),
    }


def tables(s: Settings, data: dict) -> tuple[list[Table], list[tuple], list[str]]:
    pc, cs = data["per_call"], data["compile_s"]
    base = pc[("baseline",)]
    t = Table(
        "replay",
        "Replay cost per write (Dynamo layer, the default path)",
        [
            "program",
            "eager µs/call",
            "stock µs/call (writes lost)",
            "dynamo_ext µs/call",
            "dynamo_ext: extra µs per write",
            "target",
            "user-code writes, stock: extra µs per write",
            "dynamo_ext / eager",
            "compile: dynamo_ext / stock",
        ],
    )
    per_write: dict[tuple[str, int], Summary] = {}
    for name, n, kind, _ in data["programs"]:
        e, st, ours, user = (pc[(name, k)] for k in ("eager", "stock", "dynamo_ext", "user"))
        extra = Summary.of(differences(ours, base, per=n))
        uextra = Summary.of(differences(user, base, per=n))
        per_write[(kind, n)] = extra
        target = CONSTANT_TARGET_US if kind == "constant" else TENSOR_TARGET_US
        cr = Summary.of(ratios(cs[(name, "dynamo_ext")], cs[(name, "stock")]))
        ok = "meets" if extra.median < target else ("within noise" if extra.ci_lo < target else "misses")
        t.add(
            [
                name,
                Summary.of(e).fmt(1),
                Summary.of(st).fmt(1),
                Summary.of(ours).fmt(1),
                f"{extra.fmt(2)} [{extra.ci_lo:.2f}, {extra.ci_hi:.2f}]",
                f"< {target:g}: {ok}",
                uextra.fmt(2),
                f"{Summary.of(ratios(ours, e)).median:.3f}",
                f"{cr.median:.2f} ({cr.q1:.2f}-{cr.q3:.2f})",
            ],
            {
                "program": name,
                "kind": kind,
                "writes": n,
                **Summary.of(base).csv("baseline_stock_us"),
                **Summary.of(e).csv("eager_us"),
                **Summary.of(st).csv("stock_us"),
                **Summary.of(ours).csv("dynamo_ext_us"),
                **Summary.of(user).csv("user_writes_stock_us"),
                **extra.csv("extra_us_per_write"),
                **uextra.csv("user_writes_extra_us_per_write"),
                **cr.csv("compile_ratio"),
            },
        )
    t.notes.append(
        f"Baseline (the same graph without writes, stock): {Summary.of(base).fmt(1)} µs/call. "
        "extra µs per write = (variant - baseline) / writes, per round, median (IQR) [95% CI]. "
        "For tensor writes this includes computing each tensor and returning it from the graph; "
        "the user-code column is stock torch.compile doing the same writes with the same residual bytecode."
    )
    t.notes.append(
        f"{s.rounds} interleaved rounds (calls per round sized to ~{s.round_s * 1e3:.0f} ms per variant); "
        f"compile ratio over {s.compile_reps_small} interleaved cold compiles per variant."
    )

    sa = data["store_attr"]
    nmax = max(n for _, n, _, _ in data["programs"])
    scale = Table(
        "replay_scale",
        "For scale: one write",
        ["what", "µs", "how"],
    )
    rows = [
        (
            "plain Python STORE_ATTR on a tensor (x.a = 1)",
            sa["tensor"].median / 1000,
            f"measured here: 16 stores minus none, {sa['tensor'].fmt(1)} ns",
        ),
        (
            "plain Python STORE_ATTR on an object",
            sa["object"].median / 1000,
            f"measured here, {sa['object'].fmt(1)} ns",
        ),
        (
            f"dynamo_ext, constant write ({nmax} per call)",
            per_write[("constant", nmax)].median,
            "measured here: extra µs per write, table above",
        ),
        (
            f"dynamo_ext, tensor write ({nmax} per call)",
            per_write[("tensor", nmax)].median,
            "measured here, incl. computing the tensor",
        ),
        (
            "Flax NNX, state propagation per layer",
            FLAX_NNX_US_PER_LAYER,
            "cited: google/flax #4399 (nnx_graph_overhead.py, depth 100, their machine)",
        ),
        ("raw JAX, same benchmark, per layer", RAW_JAX_US_PER_LAYER, "cited: google/flax #4399"),
    ]
    for what, us, how in rows:
        scale.add([what, f"{us:.3f}", how], {"what": what, "us": us, "how": how})
    scale.notes.append(
        "The Flax figures are per layer of a whole training step on another machine (NNX splits and merges "
        "each layer's state on every call), shown only for the order of magnitude of per-call state "
        "bookkeeping in a framework that does it in Python."
    )
    out = [t, scale]
    if data["aot_only"]:
        from .bench_aot import aot_table

        out.append(aot_table(s, data))
    return out, rows, data["problems"]


def run(s: Settings) -> SectionResult:
    sec = SectionResult(
        "replay",
        f"2. Replay cost: {', '.join(map(str, s.write_counts))} writes per call",
        f"`x * 3 + 1` on a 64-element wrapper subclass whose `mul` writes {'/'.join(map(str, s.write_counts))} "
        f"string constants or {'/'.join(map(str, s.write_counts))} new tensors (`elem + i`) on its input; every "
        "variant timed in the same interleaved rounds.",
    )
    data = measure(s)
    sec.tables, rows, sec.problems = tables(s, data)
    if not s.smoke:
        for rec in sec.tables[0].records:
            target = CONSTANT_TARGET_US if rec["kind"] == "constant" else TENSOR_TARGET_US
            if rec["extra_us_per_write_ci95_lo"] >= target:
                sec.findings.append(
                    f"replay, {rec['program']}: {rec['extra_us_per_write_median']:.2f} µs per write misses < {target:g} µs"
                )
    sec.plots.append(
        ("replay", "extra µs per write, with a bare STORE_ATTR and Flax NNX for scale", _draw(sec.tables[0], rows))
    )
    return sec


def _draw(table: Table, scale_rows):
    def draw(plt):
        labels, vals, colors = [], [], []
        for rec in table.records:
            labels.append(f"dynamo_ext, {rec['writes']} {rec['kind']}")
            vals.append(rec["extra_us_per_write_median"])
            colors.append("#3a6" if rec["kind"] == "constant" else "#396")
        nmax = max(rec["writes"] for rec in table.records)
        for rec in table.records:
            if rec["writes"] == nmax:
                labels.append(f"user-code writes (stock), {nmax} {rec['kind']}")
                vals.append(rec["user_writes_extra_us_per_write_median"])
                colors.append("#69c")
        for what, us, _ in scale_rows:
            if "dynamo_ext" not in what:
                labels.append(what)
                vals.append(us)
                colors.append("#888")
        fig, ax = plt.subplots(figsize=(9, 0.35 * len(labels) + 1.5))
        shown = [max(v, 1e-3) for v in vals]  # log axis: noise below 1 ns shows at 1 ns
        ax.barh(range(len(labels)), shown, color=colors)
        ax.set_xscale("log")
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.axvline(CONSTANT_TARGET_US, color="#c33", ls="--", lw=1, label="target: 1 µs/constant")
        ax.axvline(TENSOR_TARGET_US, color="#c93", ls=":", lw=1, label="target: 2 µs/tensor")
        ax.set_xlabel("µs per write (log; values <= 1 ns drawn at 1 ns)")
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()

    return draw


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=31, help="interleaved rounds")
    p.add_argument("--backend", default="aot_eager")
    args = p.parse_args(argv)
    from .runner import setup

    s = presets.full(args.backend)
    s.rounds = args.reps
    setup(s)
    sec = run(s)
    for t in sec.tables[:2]:
        print(t.markdown() + "\n")
    for x in sec.problems:
        print("check failed:", x)


if __name__ == "__main__":
    main()
