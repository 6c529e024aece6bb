"""Section 1, the unused path: programs that write nothing, compiled with dynamo_ext enabled
vs stock torch.compile. Per-call time (interleaved rounds) and compile time (interleaved cold
compiles: a fresh function or model class each time, ``torch._dynamo.reset()`` before each).

    python -m bench --sections unused

Targets: per call <= 1.02x stock, compile <= 1.05x stock (median of the paired ratios).
"""

from __future__ import annotations

import torch

import dynamo_ext

from . import blocks
from .programs import CatchesQuietly, Quiet, fn, fresh, make
from .report import SectionResult, Table
from .settings import Settings
from .timing import Summary, calls_per_round, cold_compiles, interleaved, ratios

PER_CALL_TARGET = 1.02
COMPILE_TARGET = 1.05
MODES = ("stock", "dynamo_ext")


def set_mode(mode: str) -> None:
    if mode == "stock":
        dynamo_ext.disable()
    else:
        dynamo_ext.enable()
        dynamo_ext.config.dynamo_layer = mode != "aot_only"


def restore() -> None:
    dynamo_ext.disable()
    dynamo_ext.config.dynamo_layer = True


class Program:
    """A program of the unused path: ``build(tag)`` returns ``(callable, input factory)``."""

    def __init__(self, name: str, build):
        self.name = name
        self.build = build


def _small(cls, device):
    def build(tag):
        return fresh(fn, tag), make(cls, device)

    return build


def _model(weight_cls, s: Settings):
    def build(tag):
        model = blocks.fresh_model_class(tag)(blocks=s.model_blocks, weight_cls=weight_cls, device=s.device)
        h = torch.randn(16, 128, generator=torch.Generator().manual_seed(2)).to(s.device)
        return model, lambda: h

    return build


def programs(s: Settings) -> list[Program]:
    return [
        Program("plain tensor, x*3+1", _small(None, s.device)),
        Program("subclass (writes nothing), x*3+1", _small(Quiet, s.device)),
        Program("subclass catching in dispatch (writes nothing), x*3+1", _small(CatchesQuietly, s.device)),
        Program(f"plain-weight block model ({s.model_blocks} blocks)", _model(None, s)),
        Program(
            f"block model, subclass weights that write nothing ({s.model_blocks} blocks)", _model(blocks.QuietWeight, s)
        ),
    ]


def compile_variant(prog: Program, mode: str, backend: str, tag):
    def prepare():
        set_mode(mode)
        f, mk = prog.build(tag())
        compiled = torch.compile(f, backend=backend, fullgraph=True)
        x = mk()
        return lambda: compiled(x)

    return prepare


def verdict(ratio: Summary, target: float) -> str:
    if ratio.median <= target:
        return "meets"
    if ratio.ci_lo <= target:
        return "within noise"
    return "misses"


def run(s: Settings) -> SectionResult:
    sec = SectionResult(
        "unused",
        "1. Unused path: programs that write nothing",
        "dynamo_ext enabled vs stock `torch.compile` on programs whose subclasses write nothing "
        "(and plain-tensor programs). Per call: interleaved rounds, ratio per round, median "
        "(interquartile range) [distribution-free 95% CI of the median]. Compile: the first call of a "
        "fresh function or model class after `torch._dynamo.reset()`, inductor/AOT caches disabled, "
        "stock and dynamo_ext compiles interleaved; the same statistics over the compiles.",
    )
    counter = iter(range(10**9))

    def tag():
        return f"u{next(counter)}"

    progs = programs(s)
    try:
        # Compile time first (it resets Dynamo): one interleaved schedule over every program and mode.
        variants = [compile_variant(p, m, s.backend, tag) for p in progs for m in MODES]
        comp = cold_compiles(
            variants, s.compile_reps, warmup=s.compile_warmup, sync=s.sync, budget_s=s.compile_budget_s
        )
        comp_by = {(p.name, m): comp[i * len(MODES) + j] for i, p in enumerate(progs) for j, m in enumerate(MODES)}

        # Per call: every (program, mode) compiled once, then timed side by side.
        torch._dynamo.reset()
        calls, keys, outs = [], [], {}
        for p in progs:
            for m in MODES:
                set_mode(m)
                f, mk = p.build(tag())
                compiled = torch.compile(f, backend=s.backend, fullgraph=True)
                x = mk()
                outs[(p.name, m)] = compiled(x)
                compiled(x)
                calls.append(lambda c=compiled, x=x: c(x))
                keys.append((p.name, m))
        restore()
        for p in progs:
            a, b = outs[(p.name, "stock")], outs[(p.name, "dynamo_ext")]
            a = getattr(a, "elem", a)
            b = getattr(b, "elem", b)
            if not torch.allclose(a, b):
                sec.problems.append(f"{p.name}: dynamo_ext output differs from stock")
        counts = [calls_per_round(c, s.round_s, s.sync) for c in calls]
        samples = interleaved(calls, s.rounds, counts, warmup=1, sync=s.sync)
        per_call = dict(zip(keys, samples))
    finally:
        restore()

    t = Table(
        "unused",
        "Per call and compile time, dynamo_ext enabled / stock",
        [
            "program",
            "stock µs/call",
            "dynamo_ext µs/call",
            "per call: dynamo_ext / stock",
            "95% CI",
            f"<= {PER_CALL_TARGET}",
            "stock compile ms",
            "dynamo_ext compile ms",
            "compile: dynamo_ext / stock",
            "95% CI",
            f"<= {COMPILE_TARGET}",
        ],
    )
    plot_rows = []
    for p in progs:
        st, ours = per_call[(p.name, "stock")], per_call[(p.name, "dynamo_ext")]
        r = Summary.of(ratios(ours, st))
        cst, cours = comp_by[(p.name, "stock")], comp_by[(p.name, "dynamo_ext")]
        cr = Summary.of(ratios(cours, cst))
        t.add(
            [
                p.name,
                Summary.of(st).fmt(1),
                Summary.of(ours).fmt(1),
                r.fmt(3),
                f"{r.ci_lo:.3f}-{r.ci_hi:.3f}",
                verdict(r, PER_CALL_TARGET),
                Summary.of(cst).fmt(0, 1e3),
                Summary.of(cours).fmt(0, 1e3),
                cr.fmt(3),
                f"{cr.ci_lo:.3f}-{cr.ci_hi:.3f}",
                verdict(cr, COMPILE_TARGET),
            ],
            {
                "program": p.name,
                **Summary.of(st).csv("stock_us"),
                **Summary.of(ours).csv("dynamo_ext_us"),
                **r.csv("per_call_ratio"),
                **Summary.of(cst).csv("stock_compile_s"),
                **Summary.of(cours).csv("dynamo_ext_compile_s"),
                **cr.csv("compile_ratio"),
            },
        )
        plot_rows.append((p.name, r, cr))
    t.notes.append(
        f"{s.rounds} interleaved rounds per call (calls per round sized to ~{s.round_s * 1e3:.0f} ms per variant); "
        f"{s.compile_reps} cold compiles per variant, interleaved. Verdict: meets = median within the target; "
        "within noise = median above it but the 95% CI reaches it; misses = the whole CI is above it."
    )
    sec.tables.append(t)
    for name, r, cr in plot_rows if not s.smoke else ():
        for what, x, target in (("per call", r, PER_CALL_TARGET), ("compile", cr, COMPILE_TARGET)):
            if x.median > target and x.ci_lo > target:
                sec.findings.append(
                    f"unused path, {name}: {what} ratio {x.median:.3f} (CI {x.ci_lo:.3f}-{x.ci_hi:.3f}) misses <= {target}"
                )
    sec.plots.append(("unused", "unused path: dynamo_ext / stock, per call and compile", _draw(plot_rows)))
    return sec


def _draw(rows):
    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(12, 0.6 * len(rows) + 1.8), sharey=True)
        names = [n for n, _, _ in rows]
        for ax, idx, target, title in (
            (axes[0], 1, PER_CALL_TARGET, "per call"),
            (axes[1], 2, COMPILE_TARGET, "compile"),
        ):
            med = [r[idx].median for r in rows]
            lo = [r[idx].median - r[idx].q1 for r in rows]
            hi = [r[idx].q3 - r[idx].median for r in rows]
            ax.barh(range(len(rows)), [m - 1 for m in med], left=1, xerr=[lo, hi], color="#3a6", capsize=3)
            ax.axvline(1.0, color="#444", lw=1)
            ax.axvline(target, color="#c33", ls="--", lw=1, label=f"target {target}")
            ax.set_title(f"{title}: dynamo_ext / stock (median, IQR)")
            ax.legend(loc="lower right", fontsize=8)
        axes[0].set_yticks(range(len(rows)), names, fontsize=8)
        fig.tight_layout()

    return draw
