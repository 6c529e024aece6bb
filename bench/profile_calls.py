"""The per-call path of a compiled call whose dispatch makes 16 constant + 16 tensor writes:
cProfile over many calls, and every dynamo_ext frame found on it. On the default path
(both layers: Dynamo's residual bytecode replays the writes) there should be none; the
AOTAutograd-layer-only path (``config.dynamo_layer = False``) has its run-time epilogue.

    python -m bench --sections profile
"""

from __future__ import annotations

import cProfile
import io
import pstats

import torch

from .programs import fn, fresh, make, writer
from .report import SectionResult, Table
from .settings import Settings
from .unused import restore, set_mode

PATHS = (("default (both layers)", "dynamo_ext"), ("AOT layer only (config.dynamo_layer = False)", "aot_only"))


def _ours(key) -> bool:
    return "/dynamo_ext/" in key[0]


def _short(key) -> str:
    filename, line, name = key
    if _ours(key):
        filename = "dynamo_ext/" + filename.rsplit("/dynamo_ext/", 1)[-1]
    elif "site-packages/" in filename:
        filename = filename.split("site-packages/", 1)[-1]
    return f"{filename}:{line}({name})"


def profile_path(s: Settings, mode: str, calls: int, tag: str):
    cls = writer(constants=16, tensors=16)
    torch._dynamo.reset()
    set_mode(mode)
    f = torch.compile(fresh(fn, tag), backend=s.backend, fullgraph=True)
    x = make(cls, s.device)()
    f(x)
    f(x)
    restore()  # the per-call path must not depend on dynamo_ext being enabled
    ok = sorted(k for k in x.__dict__ if k != "elem") == sorted(
        [f"c{i}" for i in range(16)] + [f"t{i}" for i in range(16)]
    )
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        f(x)
    s.sync()
    pr.disable()
    return pstats.Stats(pr), ok


def run(s: Settings) -> SectionResult:
    sec = SectionResult(
        "profile",
        "Per-call profile: 16 constant + 16 tensor writes per call",
        f"cProfile over {s.profile_calls:,} calls of one compiled `x * 3 + 1` whose `mul` writes 16 constants "
        "and 16 tensors, after compiling and two warm-up calls; dynamo_ext disabled while profiling (the "
        "compiled code does not depend on it). Every frame whose file is in the dynamo_ext package is listed.",
    )
    t = Table(
        "profile",
        "dynamo_ext frames on the per-call path",
        [
            "path",
            "dynamo_ext functions seen",
            "their calls per compiled call",
            "µs per call in their code, wrapped torch calls excluded (profiled)",
            "µs per call, whole call (profiled)",
        ],
    )
    text = io.StringIO()
    paths = [p for p in PATHS if s.backend != "eager" or p[1] == "dynamo_ext"]
    for i, (label, mode) in enumerate(paths):
        st, ok = profile_path(s, mode, s.profile_calls, f"prof{i}")
        if not ok:
            sec.problems.append(f"{label}: the input does not hold the 32 written attributes")
        mine = {k: v for k, v in st.stats.items() if _ours(k)}
        # Time in dynamo_ext's code: the cumulative time of its frames entered from outside it,
        # less the torch functions those entry frames call directly (the compiled call they wrap).
        entry = {k for k, v in mine.items() if not any(_ours(c) for c in v[4])}
        wrapped = sum(
            ct
            for k, v in st.stats.items()
            if not _ours(k) and k[0] != "~"
            for c, (_, _, _, ct) in v[4].items()
            if c in entry
        )
        inside = sum(mine[k][3] for k in entry) - wrapped
        ncalls = sum(v[1] for v in mine.values())
        t.add(
            [
                label,
                len(mine) or "none",
                f"{ncalls / s.profile_calls:.1f}",
                f"{inside / s.profile_calls * 1e6:.2f}",
                f"{st.total_tt / s.profile_calls * 1e6:.1f}",
            ],
            {
                "path": label,
                "dynamo_ext_functions": len(mine),
                "calls_per_call": ncalls / s.profile_calls,
                "us_inside_per_call": inside / s.profile_calls * 1e6,
                "us_per_call_profiled": st.total_tt / s.profile_calls * 1e6,
            },
        )
        text.write(f"== {label}: {s.profile_calls} calls, backend {s.backend}\n\n")
        if mine:
            text.write("dynamo_ext frames (ncalls, tottime s, cumtime s, per compiled call µs cumulative)\n")
            for k, v in sorted(mine.items(), key=lambda kv: -kv[1][3]):
                text.write(f"  {v[1]:>8} {v[2]:8.4f} {v[3]:8.4f} {v[3] / s.profile_calls * 1e6:8.2f}  {_short(k)}\n")
        else:
            text.write("dynamo_ext frames: none\n")
        text.write("\ntop 25 functions by cumulative time (everything on the path)\n")
        buf = io.StringIO()
        st.stream = buf
        st.sort_stats("cumulative").print_stats(25)
        text.write(buf.getvalue().split("\n\n", 1)[-1])
        text.write("\n")
        if mode == "dynamo_ext" and mine and not s.smoke:
            sec.findings.append(
                f"per-call path, {label}: dynamo_ext frames found: " + ", ".join(_short(k) for k in list(mine)[:6])
            )
    t.notes.append(
        "Profiled times are inflated by cProfile's per-function overhead; they locate work, the unprofiled "
        "costs are in section 2."
    )
    sec.tables.append(t)
    sec.texts.append((f"profile_{s.suffix}.txt", text.getvalue()))
    return sec
