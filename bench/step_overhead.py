"""Per-step time of a compiled forward+backward of a weight subclass, for comparing two
checkouts side by side (alternating runs in one session).

    python -m bench.step_overhead /path/to/checkout_a /path/to/checkout_b [--counts]

``--counts``: the input requires grad, so the weight's dispatch counts the backward's ops (a
plan whose backward writes); otherwise nothing is written in the backward. Prints the median
microseconds per step of each checkout, three rounds alternating.
"""

from __future__ import annotations

import os
import subprocess
import sys

_CHILD = r"""
import statistics, sys, time, torch, dynamo_ext
from dynamo_ext.testing import WrapperTensor

class Counts(WrapperTensor):
    @classmethod
    def on_op(cls, func, first):
        if not torch.is_grad_enabled():
            first.bw = getattr(first, "bw", 0) + 1

dynamo_ext.enable()
torch.manual_seed(0)
w = Counts(torch.randn(64)); w.requires_grad_()

def f(x, w):
    h = (x * w).sin()
    return h.sum(), h

step = torch.compile(f, backend="aot_eager", fullgraph=True)
x = torch.randn(64, requires_grad=sys.argv[1] == "1")
for _ in range(50):
    loss, h = step(x, w); loss.backward()
times = []
for _ in range(7):
    t0 = time.perf_counter()
    for _ in range(300):
        loss, h = step(x, w); loss.backward()
    times.append((time.perf_counter() - t0) / 300 * 1e6)
print(round(statistics.median(times), 1))
"""


def main(argv: list[str]) -> None:
    counts = "--counts" in argv
    roots = [a for a in argv if not a.startswith("--")]
    for _ in range(3):
        for root in roots:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
            out = subprocess.run([sys.executable, "-c", _CHILD, "1" if counts else "0"], env=env, capture_output=True, text=True, check=True)
            print(f"{root}: {out.stdout.strip()} us/step")


if __name__ == "__main__":
    main(sys.argv[1:])
