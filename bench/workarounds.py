"""Section 3, against the workarounds, on the same computation: eager; stock compile with the
writing op kept out of the graph (``torch._dynamo.disable``: a graph break at every write);
stock per-block compile (the writing op still kept out); dynamo_ext whole-graph compile.
Speedups vs eager, paired round by round.

Two models: ``bench/blocks.py`` (blocks whose quantized-linear-style weights record the
activation amax and the op on every matmul) and the DTensor tensor-parallel model of
``bench/bench_tp.py`` (fake process group), whose vocab-parallel embedding records its mask.

    python -m bench --sections workarounds
"""

from __future__ import annotations

import time

import torch

import dynamo_ext

from . import bench_tp, blocks
from .report import SectionResult, Table
from .settings import Settings
from .timing import Summary, calls_per_round, interleaved, ratios
from .unused import restore

VARIANTS = [
    "eager",
    "stock whole-model compile (writes lost)",
    "stock compile, writing op kept out (dynamo.disable)",
    "stock per-block compile, writing op kept out",
    "dynamo_ext whole-model compile",
]


def _counters() -> tuple[int, int]:
    c = torch._dynamo.utils.counters
    return sum(c["stats"].get(k, 0) for k in ("unique_graphs",)), sum(c["graph_break"].values())


def _build(name: str, s: Settings, tag: str):
    kept_out = "kept out" in name
    model = blocks.fresh_model_class(tag)(
        blocks=s.model_blocks, weight_cls=blocks.AmaxWeight, device=s.device, kept_out=kept_out
    )
    if name == "eager":
        return model, model
    if name == "dynamo_ext whole-model compile":
        dynamo_ext.enable()
        return model, torch.compile(model, backend=s.backend, fullgraph=True)
    dynamo_ext.disable()
    if name.startswith("stock per-block"):
        for b in model.blocks:
            b.compile(backend=s.backend)
        return model, model
    return model, torch.compile(model, backend=s.backend, fullgraph=not kept_out)


def block_model(s: Settings) -> tuple[Table, list[str]]:
    h = torch.randn(16, 128, generator=torch.Generator().manual_seed(2)).to(s.device)
    ref_model = blocks.BlockModel(blocks=s.model_blocks, device=s.device)
    ref_out = ref_model(h)
    ref_state = ref_model.recorded_state()
    problems: list[str] = []
    calls, info = [], {}
    try:
        for i, name in enumerate(VARIANTS):
            model, f = _build(name, s, f"w{i}")
            g0, b0 = _counters()
            s.sync()
            t0 = time.perf_counter()
            out = f(h)
            s.sync()
            first = time.perf_counter() - t0
            g1, b1 = _counters()
            restore()
            same_out = torch.allclose(out, ref_out, atol=1e-4, rtol=1e-4)
            same_state = blocks.same_state(model.recorded_state(), ref_state)
            if name != "stock whole-model compile (writes lost)" and not (same_out and same_state):
                problems.append(f"block model, {name}: output or recorded state differs from eager")
            info[name] = (first, same_out, same_state, g1 - g0, b1 - b0)
            f(h)
            calls.append(lambda f=f: f(h))
        counts = [calls_per_round(c, s.round_s, s.sync) for c in calls]
        samples = dict(zip(VARIANTS, interleaved(calls, s.model_rounds, counts, warmup=1, sync=s.sync)))
    finally:
        restore()

    t = Table(
        "workarounds_blocks",
        f"Block model ({s.model_blocks} blocks, each matmul's weight records amax + op), inference",
        [
            "variant",
            "µs per call",
            "speedup vs eager",
            "first call (compile) s",
            "graphs",
            "graph breaks",
            "output = eager",
            "recorded state = eager",
        ],
    )
    eager = samples["eager"]
    for name in VARIANTS:
        xs = samples[name]
        sp = Summary.of(ratios(eager, xs))
        first, same_out, same_state, graphs, breaks = info[name]
        t.add(
            [
                name,
                Summary.of(xs).fmt(0),
                f"{sp.median:.2f}x ({sp.q1:.2f}-{sp.q3:.2f})",
                f"{first:.2f}",
                graphs,
                breaks,
                "yes" if same_out else "no",
                "yes" if same_state else "**no** (lost)",
            ],
            {
                "variant": name,
                **Summary.of(xs).csv("us_per_call"),
                **sp.csv("speedup_vs_eager"),
                "first_call_s": first,
                "graphs": graphs,
                "graph_breaks": breaks,
                "output_equal": same_out,
                "state_equal": same_state,
            },
        )
    t.notes.append(
        f"Input 16x128, dim 128, hidden 256; {2 * s.model_blocks} matmuls per call, each writing a tensor "
        f"(amax) and a constant on its weight. {s.model_rounds} interleaved rounds (calls per round sized to "
        f"~{s.round_s * 1e3:.0f} ms). Graph breaks: Dynamo's graph_break counter during the first call. "
        "The writes-lost row is stock compile without a workaround: fast, but the recorded state is missing."
    )
    return t, problems


def run(s: Settings) -> SectionResult:
    sec = SectionResult(
        "workarounds",
        "3. Against the workarounds",
        "The same computation four ways (plus stock whole-graph compile, which loses the writes): "
        "eager; stock compile with the writing op kept out of the graph; stock per-block compile; "
        "dynamo_ext whole-graph compile. Speedup = eager time / variant time per round, median (IQR).",
    )
    t, problems = block_model(s)
    sec.tables.append(t)
    sec.problems += problems
    world = 2
    tp = bench_tp.measure(s, world, train=s.tp_train)
    tts, tproblems = bench_tp.tables(s, tp, world)
    sec.tables += tts
    sec.problems += tproblems
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sec.plots.append(("workarounds", "speedup vs eager, block model and TP model", _draw([t] + tts)))
    for tt in tts:
        for r in tt.records:
            if "failed" in r and not s.smoke:
                sec.findings.append(f"{tt.title}: {r['variant']} {r['failed']}")
    return sec


def _draw(tables_: list[Table]):
    def draw(plt):
        fig, axes = plt.subplots(1, len(tables_), figsize=(5.5 * len(tables_), 4.2))
        for ax, t in zip(axes, tables_):
            recs = [r for r in t.records if "speedup_vs_eager_median" in r]
            names = [
                r["variant"].replace(" compile", "\ncompile").replace(" (", "\n(").replace(", ", ",\n") for r in recs
            ]
            colors = []
            for r in recs:
                v = r["variant"]
                colors.append(
                    "#888"
                    if v == "eager"
                    else "#3a6"
                    if v.startswith("dynamo_ext")
                    else "#c96"
                    if "lost" in v
                    else "#69c"
                )
            med = [r["speedup_vs_eager_median"] for r in recs]
            err = [
                [m - r["speedup_vs_eager_q1"] for m, r in zip(med, recs)],
                [r["speedup_vs_eager_q3"] - m for m, r in zip(med, recs)],
            ]
            ax.bar(range(len(recs)), med, color=colors, yerr=err, capsize=3)
            ax.axhline(1.0, color="#444", lw=1)
            ax.set_xticks(range(len(recs)), names, fontsize=6)
            ax.set_ylabel("speedup vs eager (median, IQR)")
            failed = [r["variant"] for r in t.records if "failed" in r]
            title = t.title.split(" (")[0] if t.title.startswith("Block") else t.title
            if failed:
                title += "\nfails: " + "; ".join(failed)
            ax.set_title(title, fontsize=8)
        fig.tight_layout()

    return draw
