"""A tensor-parallel model (vocab-parallel embedding, column/row-parallel MLP blocks):
training-step time and compile time of eager, stock per-block compile (the usual DTensor
workaround, e.g. torchtitan #534), stock whole-model compile, and whole-model compile with
dynamo_ext; side by side in one run.

    python -m bench.bench_tp [--world-size 2] [--reps 15] [--steps 5] [--backend inductor] [--plot PATH]

Single process with the fake process group: the collectives do no communication, so this
times the compiled region itself (what compile changes); tests/test_dtensor_gloo.py runs
the model on real gloo groups. A step = forward + loss + backward + SGD step; the forward
and loss are what is compiled. Rounds interleave the variants; median and spread. Caches
are disabled so each variant's first step pays a cold compile.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

import dynamo_ext

from .timing import ratio, spread

VOCAB, DIM, HIDDEN, LAYERS, BATCH, SEQ = 4096, 128, 512, 4, 8, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(h)))


class TPModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, 16)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build(mesh):
    torch.manual_seed(0)
    m = TPModel()
    plan = {"emb": RowwiseParallel(input_layouts=Replicate())}
    for i in range(LAYERS):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    return parallelize_module(m, mesh, plan)


def loss_fn(m, ids, y):
    return nn.functional.cross_entropy(m(ids).flatten(0, 1), y.flatten())


def variant(name, mesh, backend):
    m = build(mesh)
    if name == "eager":
        f = loss_fn
    elif name == "stock per-block compile":
        dynamo_ext.disable()
        for b in m.blocks:  # the embedding (and its partial output) stays eager
            b.compile(backend=backend, fullgraph=True)
        f = loss_fn
    elif name == "stock whole-model compile":
        dynamo_ext.disable()
        f = torch.compile(loss_fn, backend=backend, fullgraph=True)
    else:
        dynamo_ext.enable()
        f = torch.compile(loss_fn, backend=backend, fullgraph=True)
    return m, torch.optim.SGD(m.parameters(), lr=0.01), f


VARIANTS = ["eager", "stock per-block compile", "stock whole-model compile", "dynamo_ext whole-model compile"]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--plot", default="bench/results/tp_step.png")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    # Every compile cold: otherwise the second whole-model variant reuses the first one's
    # inductor cache entries and its compile time means nothing.
    torch.compiler.config.force_disable_caches = True
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    mesh = init_device_mesh("cpu", (args.world_size,))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, 16, (BATCH, SEQ), generator=g)

    def step(m, opt, f):
        loss = f(m, ids, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    runs, compile_s, first_loss, failed = {}, {}, {}, {}
    for name in VARIANTS:
        torch._dynamo.reset()
        m, opt, f = variant(name, mesh, args.backend)
        t0 = time.perf_counter()
        try:
            first_loss[name] = step(m, opt, f)  # compiles
        except Exception as e:  # reported, not hidden: a workaround that crashes is a finding
            failed[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:90]}"
            continue
        compile_s[name] = time.perf_counter() - t0
        runs[name] = (m, opt, f)
    dynamo_ext.disable()

    samples = {name: [] for name in runs}
    for _ in range(args.reps):
        for name in runs:
            m, opt, f = runs[name]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(m, opt, f)
            samples[name].append((time.perf_counter() - t0) / args.steps * 1e3)

    print(f"torch {torch.__version__}, backend {args.backend}, fake process group world size {args.world_size}, "
          f"vocab {VOCAB} dim {DIM} hidden {HIDDEN} layers {LAYERS} batch {BATCH}x{SEQ}, "
          f"{args.reps} interleaved rounds x {args.steps} steps, 1 thread")
    print()
    print("| variant | step ms | speedup vs eager | first step (compile) s | first loss |")
    print("|---|---|---|---|---|")
    for name in VARIANTS:
        if name in failed:
            print(f"| {name} | fails in the first step: {failed[name]} | - | - | - |")
            continue
        xs = samples[name]
        print(f"| {name} | {statistics.median(xs):.2f} ({spread(xs)}) | {ratio(samples['eager'], xs):.2f}x "
              f"| {compile_s[name]:.1f} | {first_loss[name]:.6f} |")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
        shown = [n for n in VARIANTS if n in runs]
        names = [n.replace(" compile", "\ncompile") for n in shown]
        colors = {"eager": "#888", "stock per-block compile": "#c96", "stock whole-model compile": "#69c"}
        col = [colors.get(n, "#3a6") for n in shown]
        a1.bar(names, [statistics.median(samples[n]) for n in shown], color=col)
        a1.set_ylabel("training step, ms (median)")
        a1.set_title("TP model step time (lower is better)")
        a2.bar(names, [compile_s[n] for n in shown], color=col)
        a2.set_ylabel("first step incl. compile, s")
        a2.set_title("compile cost")
        for ax in (a1, a2):
            ax.tick_params(axis="x", labelsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"\nplot: {args.plot}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
