"""Section 5, counters: a float8-style model trained for ``counter_steps`` steps.

Its weights are parameters whose dispatch records the input's amax into a rolling history
tensor and bumps an int ``step`` on every matmul (the state delayed scaling keeps). The
loss is compiled (``fullgraph`` where the variant allows it); backward and SGD run eagerly.
Variants, one step of each per round (paired):

- eager;
- stock whole-model compile of the same model with weights that record nothing (stock
  loses the history and the step; with the recording weights it does not even compile on
  torch 2.13: an AOTAutograd partitioner error on the in-place history update);
- stock compile with the recording matmul under ``torch._dynamo.disable`` (today's
  workaround: a graph break around every matmul);
- dynamo_ext as before symbolic counters (``specialize_int=True``: one compile per step,
  until Dynamo's recompile_limit of 8, after which the frame runs eagerly);
- dynamo_ext now (the step counter is a symbolic input after its first change).

    python -m bench --sections counters [--backend inductor]
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import dynamo_ext

from . import float8
from .report import SectionResult, Table
from .settings import Settings
from .timing import Summary, ratios
from .unused import restore

VARIANTS = [
    "eager",
    "stock whole-model compile, weights recording nothing (state lost)",
    "stock compile, recording matmul kept out (dynamo.disable)",
    "dynamo_ext before symbolic counters (one compile per step)",
    "dynamo_ext now",
]


def _loss(model, x, y):
    return F.mse_loss(model(x), y)


def _own_loss(tag: str):
    """``_loss`` with a code object of its own: Dynamo keeps its cache (and counts the
    recompile limit) per code object, so variants must not share one."""
    import types

    return types.FunctionType(_loss.__code__.replace(co_name=f"loss_{tag}"), _loss.__globals__, f"loss_{tag}")


class _Variant:
    def __init__(self, name: str, s: Settings) -> None:
        self.name = name
        self.model = float8.MLP(kept_out="kept out" in name, device=s.device, record="recording nothing" not in name)
        self.counter = CompileCounterWithBackend(s.backend)
        self.config: contextlib.AbstractContextManager = contextlib.nullcontext()
        self.enabled = name.startswith("dynamo_ext")
        self.step_s: list[float] = []
        self.compiled_at: list[int] = []
        if name == "eager":
            self.fn = _loss
            return
        fullgraph = not ("kept out" in name or "before" in name)
        self.fn = torch.compile(_own_loss(str(VARIANTS.index(name))), backend=self.counter, fullgraph=fullgraph)
        if "before" in name:
            # What a user met before: the counter guarded per value, Dynamo's default limit.
            self.config = torch._dynamo.config.patch(specialize_int=True, recompile_limit=8)

    def step(self, x, y, s: Settings) -> float:
        (dynamo_ext.enable if self.enabled else dynamo_ext.disable)()
        before = self.counter.frame_count
        with self.config:
            s.sync()
            t0 = time.perf_counter()
            loss = self.fn(self.model, x, y)
            loss.backward()
            self.model.sgd(0.05)
            s.sync()
            dt = time.perf_counter() - t0
        if self.counter.frame_count > before:
            self.compiled_at.append(len(self.step_s))
        self.step_s.append(dt)
        return dt


def run(s: Settings) -> SectionResult:
    sec = SectionResult(
        "counters",
        "5. Counters: a float8-style model trained step by step",
        "Weights record the input's amax into a rolling history and bump a step counter on every "
        "matmul. Per-step time is the median over steps that did not compile; compile time is the "
        "extra time of the steps that did; ratios are per step, paired within each round.",
    )
    torch._dynamo.reset()
    variants = [_Variant(n, s) for n in VARIANTS]
    g = torch.Generator().manual_seed(0)
    steps = s.counter_steps
    try:
        for i in range(steps):
            x = torch.randn(64, float8.DIM, generator=g).to(s.device)
            y = torch.randn(64, float8.OUT, generator=g).to(s.device)
            order = variants if i % 2 == 0 else variants[::-1]
            for v in order:
                v.step(x, y, s)
    finally:
        restore()
    eager = variants[0]
    steady = [j for j in range(steps) if all(j not in v.compiled_at for v in variants) and j > 0]
    t = Table(
        f"counters_{steps}_steps",
        f"Float8-style MLP, {steps} training steps (loss compiled, backward + SGD eager)",
        ["variant", "ms per step", "speedup vs eager", "compiles", "compile time s", "state = eager"],
    )
    ref = eager.model.state()
    per_step = {}
    for v in variants:
        xs = [v.step_s[j] * 1e3 for j in steady] or [v.step_s[-1] * 1e3]
        per_step[v.name] = xs
        med = statistics.median(xs)
        compile_s = sum(v.step_s[j] - med / 1e3 for j in v.compiled_at) if v.compiled_at else 0.0
        same = float8.same_state(v.model.state(), ref) if "recording nothing" not in v.name else False
        if v.name.startswith("dynamo_ext") and not same:
            sec.problems.append(f"{v.name}: state differs from eager after {steps} steps")
        sp = Summary.of(ratios([eager.step_s[j] for j in steady] or [1.0], [v.step_s[j] for j in steady] or [1.0]))
        t.add(
            [v.name, f"{med:.2f}", f"{sp.median:.2f}x", len(v.compiled_at) if v.name != "eager" else "-",
             f"{compile_s:.2f}", "yes" if same else "**no**"],
            {"variant": v.name, "ms_per_step_median": med, "speedup_vs_eager": sp.median,
             "compiles": len(v.compiled_at), "compile_s": compile_s, "state_equal": same},
        )
    now, stock = per_step["dynamo_ext now"], per_step["stock whole-model compile, weights recording nothing (state lost)"]
    workaround = per_step["stock compile, recording matmul kept out (dynamo.disable)"]
    vs_stock = Summary.of(ratios(stock, now))
    vs_workaround = Summary.of(ratios(workaround, now))
    t.notes.append(
        f"dynamo_ext now vs stock whole-model compile: {1 / vs_stock.median:.3f}x the per-step time "
        f"(paired, {len(steady)} steady steps); vs the dynamo.disable workaround: {vs_workaround.median:.2f}x faster."
    )
    sec.tables.append(t)
    sec.findings.append(t.notes[-1])
    return sec
