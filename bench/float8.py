"""A float8-style model for the counters section: parameters that record the input's amax
into a rolling history and count their steps on every matmul (delayed scaling's state)."""

from __future__ import annotations

import torch

from dynamo_ext.testing import WrapperTensor

aten = torch.ops.aten
DIM, HIDDEN, OUT, HISTORY = 256, 1024, 64, 16


class Float8Weight(WrapperTensor):
    INNER = ("elem", "amax_history")
    WRAP_OUTPUTS = False  # matmul outputs (and the backward's w.t()) are plain tensors
    WRAP_OPS = ()
    ALIAS_KEEPS_STATE = True

    @classmethod
    def before_op(cls, func, args, kwargs):
        if func in (aten.mm.default, aten.addmm.default):
            w = next((a for a in args if isinstance(a, cls)), None)
            if w is None:
                return
            act = args[1] if func is aten.addmm.default else args[0]
            act = act.elem if isinstance(act, cls) else act
            w.amax_history = torch.roll(w.amax_history, 1)
            w.amax_history[0] = act.detach().abs().amax()
            w.step = getattr(w, "step", 0) + 1  # (getattr: stock compile, which drops the attribute, still runs)


class QuietWeight(Float8Weight):
    """The same weight recording nothing: what stock whole-model compile amounts to (it
    loses the state; with the recording weight it does not even compile on torch 2.13,
    an AOTAutograd partitioner error on the in-place history update)."""

    @classmethod
    def before_op(cls, func, args, kwargs):
        pass


def _weight(shape, device, seed, cls):
    g = torch.Generator().manual_seed(seed)
    data = (torch.randn(*shape, generator=g) * 0.1).to(device)
    return torch.nn.Parameter(cls(data, amax_history=torch.zeros(HISTORY, device=device), step=0))


@torch._dynamo.disable
def _matmul_kept_out(x, w):
    return x @ w


class MLP(torch.nn.Module):
    def __init__(self, kept_out: bool = False, device: str = "cpu", record: bool = True) -> None:
        super().__init__()
        cls = Float8Weight if record else QuietWeight
        self.w1 = _weight((DIM, HIDDEN), device, 1, cls)
        self.w2 = _weight((HIDDEN, OUT), device, 2, cls)
        self.mm = _matmul_kept_out if kept_out else torch.matmul

    def forward(self, x):
        return self.mm(torch.relu(self.mm(x, self.w1)), self.w2)

    @torch.no_grad()
    def sgd(self, lr: float) -> None:
        for p in self.parameters():
            grad = p.grad.elem if isinstance(p.grad, Float8Weight) else p.grad
            p.elem.sub_(lr * grad)
            p.grad = None

    def state(self) -> dict:
        return {n: (p.elem.clone(), p.amax_history.clone(), p.step) for n, p in self.named_parameters()}


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.allclose(a[k][0], b[k][0], atol=1e-5) and torch.allclose(a[k][1], b[k][1], atol=1e-5) and a[k][2] == b[k][2]
        for k in a
    )
