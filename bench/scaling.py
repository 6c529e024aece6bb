"""Section 4, scaling: compile time and per-call time vs the number of subclass inputs (each
written once by its dispatch) and vs the attributes written per instance (constants;
tensors), dynamo_ext vs stock, side by side. A slope is fitted to each curve and growth
faster than linear is flagged; the worst point is then profiled (one cold compile under
cProfile, dynamo_ext's frames and their torch callees, and the functions whose time grew most
over stock's).

    python -m bench --sections scaling
"""

from __future__ import annotations

import cProfile
import io
import math
import pstats
import time

import torch

from .programs import fn, fresh, many, writer
from .report import SectionResult, Table
from .settings import Settings
from .timing import Summary, calls_per_round, cold_compiles, interleaved, ratios
from .unused import restore, set_mode

MODES = ("stock", "dynamo_ext")
SUPERLINEAR_EXPONENT = 1.2


class Series:
    def __init__(self, key: str, label: str, xs: tuple[int, ...], build):
        self.key, self.label, self.xs, self.build = key, label, xs, build


def _inputs(n: int, device: str, tag: str):
    cls = writer(constants=1)
    xs = [cls(torch.randn(64, device=device)) for _ in range(n)]
    return fresh(many, tag), (lambda: xs), xs


def _attrs(kind: str):
    def build(m: int, device: str, tag: str):
        cls = writer(constants=m) if kind == "constant" else writer(tensors=m)
        x = cls(torch.randn(64, device=device))
        return fresh(fn, tag), (lambda: x), x

    return build


def series(s: Settings) -> list[Series]:
    return [
        Series("inputs", "subclass inputs (each written once: 1 constant)", s.scale_inputs, _inputs),
        Series("attrs_constant", "constant attributes written per instance", s.scale_attrs, _attrs("constant")),
        Series("attrs_tensor", "tensor attributes written per instance", s.scale_attrs, _attrs("tensor")),
    ]


def growth(xs: list[int], ts: list[float]) -> dict[str, float]:
    """Fits of one curve: least-squares slope (time per unit), and the exponent k of the
    increment over the last doubling, t(x) - t(x_min) ~ (x - x_min)^k (1 = linear)."""
    n = len(xs)
    mx, mt = sum(xs) / n, sum(ts) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var if var else math.nan
    k = math.nan
    if n >= 3:
        x0, t0 = xs[0], ts[0]
        d1, d2 = ts[-2] - t0, ts[-1] - t0
        if d1 > 0 and d2 > 0:
            k = math.log(d2 / d1) / math.log((xs[-1] - x0) / (xs[-2] - x0))
    return {"slope": slope, "exponent": k}


def _compile(f, mode, backend):
    set_mode(mode)
    return torch.compile(f, backend=backend, fullgraph=True)


def measure_series(s: Settings, ser: Series, counter) -> dict:
    def variant(x, mode):
        def prepare():
            f, mk, _ = ser.build(x, s.device, f"s{next(counter)}")
            c = _compile(f, mode, s.backend)
            arg = mk()
            return lambda: c(arg)

        return prepare

    try:
        # Compile: every (point, mode) cold, interleaved, after one throwaway compile.
        variants = [variant(x, m) for x in ser.xs for m in MODES]
        comp = cold_compiles(variants, s.scale_compile_reps, warmup=1, sync=s.sync)
        compile_s = {(x, m): comp[i * len(MODES) + j] for i, x in enumerate(ser.xs) for j, m in enumerate(MODES)}
        # Per call.
        torch._dynamo.reset()
        calls, keys = [], []
        for x in ser.xs:
            for m in MODES:
                f, mk, _ = ser.build(x, s.device, f"s{next(counter)}")
                c = _compile(f, m, s.backend)
                arg = mk()
                c(arg)
                c(arg)
                calls.append(lambda c=c, arg=arg: c(arg))
                keys.append((x, m))
        restore()
        counts = [calls_per_round(c, s.round_s, s.sync) for c in calls]
        per_call = dict(zip(keys, interleaved(calls, s.scale_rounds, counts, warmup=1, sync=s.sync)))
    finally:
        restore()
    return {"compile_s": compile_s, "per_call": per_call}


def profile_point(s: Settings, ser: Series, x: int, counter) -> str:
    """cProfile of one cold compile at ``x``, dynamo_ext and stock; plus the compile time
    of both with Dynamo's side_effect_replay_policy = "silent" (no side-effect messages)."""
    def cold(mode):  # a fresh function at x, compiled for mode, and its argument
        torch._dynamo.reset()
        f, mk, _ = ser.build(x, s.device, f"p{next(counter)}")
        return _compile(f, mode, s.backend), mk()

    stats = {}
    for mode in MODES:
        c, arg = cold(mode)
        pr = cProfile.Profile()
        pr.enable()
        c(arg)
        pr.disable()
        restore()
        stats[mode] = pstats.Stats(pr)
    silent = {}
    policy = torch._dynamo.config.side_effect_replay_policy
    try:
        torch._dynamo.config.side_effect_replay_policy = "silent"
        for mode in MODES:
            c, arg = cold(mode)
            t0 = time.perf_counter()
            c(arg)
            silent[mode] = time.perf_counter() - t0
            restore()
    finally:
        torch._dynamo.config.side_effect_replay_policy = policy
        restore()
    return format_profile(ser, x, stats, silent)


def _short(key) -> str:
    filename, line, name = key
    for marker in ("site-packages/", "/work/", "/dynamo_ext/"):
        if marker in filename:
            filename = filename.split(marker, 1)[-1]
    if "dynamo_ext" in key[0]:
        filename = "dynamo_ext/" + key[0].rsplit("/dynamo_ext/", 1)[-1]
    return f"{filename}:{line}({name})"


def _is_ours(key) -> bool:
    return "/dynamo_ext/" in key[0]


def format_profile(ser: Series, x: int, stats: dict, silent: dict) -> str:
    ours, stock = stats["dynamo_ext"], stats["stock"]
    out = io.StringIO()
    w = out.write
    w(f"Profile of one cold compile, {ser.label} = {x}\n")
    w(f"total: stock {stock.total_tt:.2f} s, dynamo_ext {ours.total_tt:.2f} s (under cProfile)\n")
    w(
        f"compile with torch._dynamo.config.side_effect_replay_policy = 'silent' (no profiler): "
        f"stock {silent['stock']:.2f} s, dynamo_ext {silent['dynamo_ext']:.2f} s\n\n"
    )
    w("dynamo_ext frames, by cumulative time\n")
    w(f"{'ncalls':>8} {'tottime':>8} {'cumtime':>8}  function\n")
    mine = sorted(((k, v) for k, v in ours.stats.items() if _is_ours(k)), key=lambda kv: -kv[1][3])
    for k, (cc, nc, tt, ct, _callers) in mine[:25]:
        w(f"{nc:>8} {tt:>8.3f} {ct:>8.3f}  {_short(k)}\n")
    w("\ntheir torch callees (time spent in the callee when called from that frame), top 5 each\n")
    callees: dict = {}
    for k, v in ours.stats.items():
        for caller, (cc, nc, tt, ct) in v[4].items():
            if _is_ours(caller) and not _is_ours(k):
                callees.setdefault(caller, []).append((ct, nc, k))
    for k, _ in mine[:12]:
        rows = sorted(callees.get(k, []), key=lambda r: -r[0])[:5]
        if not rows:
            continue
        w(f"  {_short(k)}\n")
        for ct, nc, callee in rows:
            w(f"      {ct:8.3f} s {nc:>7} calls  {_short(callee)}\n")
    for column, limit, title in (
        (3, 30, "cumulative time grew most over stock's (stock, dynamo_ext, difference, s)"),
        (2, 25, "own time (tottime) grew most over stock's (stock, dynamo_ext, difference, s)"),
    ):
        w(f"\nfunctions whose {title}\n")
        a = {k: v[column] for k, v in stock.stats.items()}
        b = {k: v[column] for k, v in ours.stats.items()}
        grown = sorted(set(a) | set(b), key=lambda k: -(b.get(k, 0) - a.get(k, 0)))
        for k in grown[:limit]:
            w(f"{a.get(k, 0):8.3f} {b.get(k, 0):8.3f} {b.get(k, 0) - a.get(k, 0):+8.3f}  {_short(k)}\n")
    return out.getvalue()


def run(s: Settings) -> SectionResult:
    sec = SectionResult(
        "scaling",
        "4. Scaling: inputs and attributes written per instance",
        "Compile time (cold, stock and dynamo_ext interleaved) and per-call time (interleaved rounds) "
        "against the number of subclass inputs of one graph (`acc = acc + x * 3` over a list; every "
        "input's `mul` writes one constant) and against the attributes one instance writes per call "
        "(`x * 3 + 1`, 1-64 constants or tensors). Fit: least-squares slope, and the exponent k of the "
        "increment over the last doubling, t(x) - t(x_min) ~ (x - x_min)^k (1 = linear); "
        f"k > {SUPERLINEAR_EXPONENT} is flagged as superlinear.",
    )
    counter = iter(range(10**9))
    fits, curves = [], []
    worst = None
    for ser in series(s):
        if s.time_left() < 60:
            sec.findings.append(f"{ser.label}: skipped, time budget")
            continue
        d = measure_series(s, ser, counter)
        t = Table(
            f"scaling_{ser.key}",
            f"vs {ser.label}",
            [
                "x",
                "stock compile ms",
                "dynamo_ext compile ms",
                "compile ratio",
                "stock µs/call",
                "dynamo_ext µs/call",
                "per-call ratio",
            ],
        )
        med: dict = {}
        for x in ser.xs:
            cs, co = d["compile_s"][(x, "stock")], d["compile_s"][(x, "dynamo_ext")]
            ps, po = d["per_call"][(x, "stock")], d["per_call"][(x, "dynamo_ext")]
            cr, pr = Summary.of(ratios(co, cs)), Summary.of(ratios(po, ps))
            for key, xs_ in (("cs", cs), ("co", co), ("ps", ps), ("po", po)):
                med.setdefault(key, []).append(Summary.of(xs_).median)
            t.add(
                [
                    x,
                    f"{Summary.of(cs).median * 1e3:.0f}",
                    f"{Summary.of(co).median * 1e3:.0f}",
                    f"{cr.median:.2f}",
                    Summary.of(ps).fmt(1),
                    Summary.of(po).fmt(1),
                    f"{pr.median:.3f}",
                ],
                {
                    "series": ser.key,
                    "x": x,
                    **Summary.of(cs).csv("stock_compile_s"),
                    **Summary.of(co).csv("dynamo_ext_compile_s"),
                    **cr.csv("compile_ratio"),
                    **Summary.of(ps).csv("stock_us"),
                    **Summary.of(po).csv("dynamo_ext_us"),
                    **pr.csv("per_call_ratio"),
                },
            )
        xs = list(ser.xs)
        for what, key, unit, scale in (
            ("compile", "cs", "ms", 1e3),
            ("compile", "co", "ms", 1e3),
            ("per call", "ps", "µs", 1.0),
            ("per call", "po", "µs", 1.0),
        ):
            mode = "stock" if key[1] == "s" else "dynamo_ext"
            g = growth(xs, [v * scale for v in med[key]])
            fits.append((ser, what, mode, unit, g))
            if mode == "dynamo_ext" and g["exponent"] > SUPERLINEAR_EXPONENT and not s.smoke:
                g_stock = growth(xs, [v * scale for v in med[key[0] + "s"]])
                sec.findings.append(
                    f"superlinear: {what} time vs {ser.label}: exponent {g['exponent']:.2f} over the last doubling "
                    f"(stock {g_stock['exponent']:.2f})"
                )
                if what == "compile":
                    excess = med["co"][-1] / med["cs"][-1]
                    if worst is None or excess > worst[2]:
                        worst = (ser, xs[-1], excess)
        t.notes.append(
            f"{s.scale_compile_reps} cold compile(s) per point and mode, interleaved; {s.scale_rounds} interleaved "
            f"rounds per call. Ratios: dynamo_ext / stock, paired, median."
        )
        sec.tables.append(t)
        curves.append((ser, med))
    if fits:
        ft = Table(
            "scaling_fit",
            "Fits",
            ["curve", "mode", "slope", "exponent of the last doubling", "superlinear"],
        )
        for ser, what, mode, unit, g in fits:
            ft.add(
                [
                    f"{what} vs {ser.label}",
                    mode,
                    f"{g['slope']:.3g} {unit} per unit",
                    f"{g['exponent']:.2f}",
                    "**yes**" if g["exponent"] > SUPERLINEAR_EXPONENT else "no",
                ],
                {"series": ser.key, "what": what, "mode": mode, "unit": unit, **g},
            )
        sec.tables.append(ft)
    if s.profile_worst and curves:
        if worst is None:  # nothing flagged: profile the largest input count anyway, for the record
            ser0 = series(s)[0]
            worst = (ser0, ser0.xs[-1], 0.0)
        ser, x, _ = worst
        sec.texts.append((f"scaling_profile_{s.suffix}.txt", profile_point(s, ser, x, counter)))
    sec.plots.append(("scaling", "compile and per-call time vs inputs and attributes written", _draw(curves)))
    return sec


def _draw(curves):
    def draw(plt):
        fig, axes = plt.subplots(2, len(curves), figsize=(5 * len(curves), 7.5), squeeze=False)
        for col, (ser, med) in enumerate(curves):
            xs = list(ser.xs)
            for row, (title, ks, unit, scale) in enumerate(
                (("compile time", ("cs", "co"), "ms", 1e3), ("per call", ("ps", "po"), "µs", 1.0))
            ):
                ax = axes[row][col]
                for key, label, color in ((ks[0], "stock", "#69c"), (ks[1], "dynamo_ext", "#3a6")):
                    ax.plot(xs, [v * scale for v in med[key]], "o-", label=label, color=color)
                ys = [v * scale for v in med[ks[1]]]
                g = growth(xs, ys)
                if not math.isnan(g["slope"]):
                    a = sum(ys) / len(ys) - g["slope"] * sum(xs) / len(xs)
                    ax.plot(
                        xs,
                        [max(a + g["slope"] * x, 1e-9) for x in xs],
                        ":",
                        color="#999",
                        label="dynamo_ext, linear fit",
                    )
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel(ser.label, fontsize=8)
                ax.set_ylabel(f"{title}, {unit}")
                ax.legend(fontsize=7)
                ax.set_title(f"{title} vs {ser.key}", fontsize=9)
        fig.tight_layout()

    return draw
