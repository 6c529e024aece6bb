"""A tensor-parallel model (vocab-parallel embedding, column/row-parallel MLP blocks): step
time and compile time of eager, the stock workarounds (per-block compile, e.g. torchtitan
#534; the embedding kept out of the graph with ``torch._dynamo.disable``), stock whole-model
compile, and whole-model compile with dynamo_ext; side by side in one run.

    python -m bench.bench_tp [--world-size 2] [--reps 15] [--steps 5] [--backend inductor] [--plot PATH]
    python -m bench --sections workarounds          (the suite: part of section 3)

Single process with the fake process group: the collectives do no communication, so this
times the compiled region itself (what compile changes); tests/test_dtensor_gloo.py runs
the model on real gloo groups. Two phases: a training step (forward + loss compiled, eager
backward, SGD step) and a forward-only step (``torch.no_grad``). Rounds interleave the
variants; median (interquartile range); speedups are paired round by round. Caches are
disabled so each variant's first step pays a cold compile.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import dynamo_ext

from . import settings as presets
from .programs import fresh
from .report import Table
from .settings import Settings
from .timing import Summary, interleaved, ratios

VOCAB, DIM, HIDDEN, LAYERS, BATCH, SEQ = 4096, 128, 512, 4, 8, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(h)))


class TPModel(nn.Module):
    def __init__(self, layers=LAYERS):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, 16)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class EagerEmbedding(nn.Module):
    """The workaround: the parallel embedding (its hooks included) runs outside the graph."""

    def __init__(self, emb):
        super().__init__()
        self.inner = emb

    @torch._dynamo.disable
    def forward(self, ids):
        return self.inner(ids)


def build(mesh, layers=LAYERS, device="cpu"):
    torch.manual_seed(0)
    m = TPModel(layers).to(device)
    plan = {"emb": RowwiseParallel(input_layouts=Replicate())}
    for i in range(layers):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    return parallelize_module(m, mesh, plan)


def loss_fn(m, ids, y):
    return nn.functional.cross_entropy(m(ids).flatten(0, 1), y.flatten())


VARIANTS = [
    "eager",
    "stock per-block compile",
    "stock compile, embedding kept out (dynamo.disable)",
    "stock whole-model compile",
    "dynamo_ext whole-model compile",
]


def variant(name, mesh, backend, tag, layers=LAYERS, device="cpu"):
    m = build(mesh, layers, device)
    f = fresh(loss_fn, tag)
    if name == "eager":
        f = loss_fn
    elif name == "stock per-block compile":
        dynamo_ext.disable()
        for b in m.blocks:  # the embedding (and its partial output) stays eager
            b.compile(backend=backend, fullgraph=True)
        f = loss_fn
    elif name.startswith("stock compile, embedding kept out"):
        dynamo_ext.disable()
        m.emb = EagerEmbedding(m.emb)
        f = torch.compile(f, backend=backend)
    elif name == "stock whole-model compile":
        dynamo_ext.disable()
        f = torch.compile(f, backend=backend, fullgraph=True)
    else:
        dynamo_ext.enable()
        f = torch.compile(f, backend=backend, fullgraph=True)
    return m, torch.optim.SGD(m.parameters(), lr=0.01), f


def _init(world_size: int, device: str):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return init_device_mesh(device, (world_size,))


def measure(s: Settings, world_size: int = 2, train: bool = True) -> dict:
    """Both phases (training step, forward only): first-step time, first loss, samples."""
    mesh = _init(world_size, s.device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(s.device)
    y = torch.randint(0, 16, (BATCH, SEQ), generator=g).to(s.device)

    def train_step(m, opt, f):
        loss = f(m, ids, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def forward_step(m, opt, f):
        with torch.no_grad():
            return f(m, ids, y)

    phases = [("forward", forward_step)] + ([("training step", train_step)] if train else [])
    result = {}
    counter = iter(range(10**9))
    try:
        for phase, step in phases:
            runs, compile_s, first_loss, failed = {}, {}, {}, {}
            for name in VARIANTS:
                if s.time_left() < 30:
                    failed[name] = "skipped: time budget"
                    continue
                m, opt, f = variant(name, mesh, s.backend, f"tp{next(counter)}", s.tp_layers, s.device)
                s.sync()
                t0 = time.perf_counter()
                try:
                    first_loss[name] = float(step(m, opt, f))  # compiles
                except Exception as e:  # reported, not hidden: a workaround that crashes is a finding
                    failed[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:90]}"
                    continue
                finally:
                    dynamo_ext.disable()
                s.sync()
                compile_s[name] = time.perf_counter() - t0
                runs[name] = (m, opt, f)
            names = list(runs)
            calls = [(lambda r=runs[n], step=step: step(*r)) for n in names]
            samples = interleaved(calls, s.tp_rounds, s.tp_steps, warmup=1, sync=s.sync)
            result[phase] = {
                "samples": {n: [x / 1e3 for x in xs] for n, xs in zip(names, samples)},  # ms
                "compile_s": compile_s,
                "first_loss": first_loss,
                "failed": failed,
            }
    finally:
        dynamo_ext.disable()
    return result


def tables(s: Settings, data: dict, world_size: int) -> tuple[list[Table], list[str]]:
    out, problems = [], []
    for phase, d in data.items():
        t = Table(
            "workarounds_tp_" + phase.replace(" ", "_"),
            f"Tensor-parallel model, {phase}",
            ["variant", "ms per step", "speedup vs eager", "first step (compile) s", "first loss", "loss = eager"],
        )
        eager = d["samples"].get("eager")
        for name in VARIANTS:
            if name in d["failed"]:
                t.add(
                    [name, f"fails: {d['failed'][name]}", "-", "-", "-", "-"],
                    {"variant": name, "failed": d["failed"][name]},
                )
                continue
            xs = d["samples"][name]
            sp = Summary.of(ratios(eager, xs)) if eager else None
            same = abs(d["first_loss"][name] - d["first_loss"].get("eager", float("nan"))) < 1e-4
            if name.startswith("dynamo_ext") and not same:
                problems.append(f"TP {phase}: dynamo_ext's first loss differs from eager's")
            t.add(
                [
                    name,
                    Summary.of(xs).fmt(2),
                    f"{sp.median:.2f}x ({sp.q1:.2f}-{sp.q3:.2f})" if sp else "-",
                    f"{d['compile_s'][name]:.1f}",
                    f"{d['first_loss'][name]:.6f}",
                    "yes" if same else "no",
                ],
                {
                    "variant": name,
                    **Summary.of(xs).csv("step_ms"),
                    **(sp.csv("speedup_vs_eager") if sp else {}),
                    "first_step_s": d["compile_s"][name],
                    "first_loss": d["first_loss"][name],
                },
            )
        t.notes.append(
            f"vocab {VOCAB}, dim {DIM}, hidden {HIDDEN}, {s.tp_layers} blocks, batch {BATCH}x{SEQ}, fake process "
            f"group world size {world_size}; {s.tp_rounds} interleaved rounds x {s.tp_steps} steps."
        )
        out.append(t)
    return out, problems


def draw_tp(tables_: list[Table]):
    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        for ax, t in zip(axes, tables_):
            recs = [r for r in t.records if "step_ms_median" in r]
            names = [r["variant"].replace(" compile", "\ncompile").replace(" (", "\n(") for r in recs]
            colors = [
                "#888" if r["variant"] == "eager" else "#3a6" if r["variant"].startswith("dynamo_ext") else "#69c"
                for r in recs
            ]
            ax.bar(
                range(len(recs)),
                [r["step_ms_median"] for r in recs],
                color=colors,
                yerr=[
                    [r["step_ms_median"] - r["step_ms_q1"] for r in recs],
                    [r["step_ms_q3"] - r["step_ms_median"] for r in recs],
                ],
                capsize=3,
            )
            ax.set_xticks(range(len(recs)), names, fontsize=7)
            failed = [r["variant"] for r in t.records if "failed" in r]
            title = t.title.replace("Tensor-parallel model, ", "TP model: ") + " (ms, lower is better)"
            if failed:
                title += f"\nfailed: {', '.join(failed)}"
            ax.set_title(title, fontsize=9)
        fig.tight_layout()

    return draw


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--plot", default="bench/results/tp_step.png")
    args = p.parse_args(argv)
    from .runner import setup

    s = presets.full(args.backend)
    s.tp_rounds, s.tp_steps = args.reps, args.steps
    setup(s)
    data = measure(s, args.world_size)
    ts, problems = tables(s, data, args.world_size)
    print(f"torch {torch.__version__}, backend {args.backend}, 1 thread\n")
    for t in ts:
        print(t.markdown() + "\n")
    for x in problems:
        print("check failed:", x)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        draw_tp(ts)(plt)
        plt.gcf().savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
