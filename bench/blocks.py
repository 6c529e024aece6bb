"""A model of several blocks whose weights are wrapper subclasses that record state while
they dispatch: a quantized-linear-style weight that caches the amax of the activation it
was last multiplied with (a tensor) and the op that used it (a constant), as delayed
scaling does. Also the same model with weights that write nothing, and with plain weights.

Block: h + (gelu(layer_norm(h) @ w1) @ w2); every matmul with a subclass weight writes
two attributes on that weight (2 matmuls per block).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

aten = torch.ops.aten


class QuietWeight(torch.Tensor):
    """A wrapper weight whose dispatch unwraps, multiplies by its ctx ``scale``, writes nothing."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor, scale: float = 1.0):
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), dtype=elem.dtype, device=elem.device
        )
        r.elem = elem
        r.scale = scale
        return r

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.elem!r})"

    def __tensor_flatten__(self):
        return ["elem"], (self.scale,)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"], *ctx)

    @classmethod
    def record(cls, x: torch.Tensor, w: QuietWeight) -> None:
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mm.default:
            x, w = args
            cls.record(x, w)
            return func(x, w.elem) * w.scale
        if func in (aten.detach.default, aten.alias.default):
            (w,) = args
            return cls(func(w.elem), w.scale)
        raise NotImplementedError(f"{cls.__name__}: {func}")


class AmaxWeight(QuietWeight):
    """Records, on every matmul, the activation's amax (tensor) and the op (constant)."""

    @classmethod
    def record(cls, x: torch.Tensor, w: AmaxWeight) -> None:
        w.input_amax = x.abs().amax()
        w.last_op = "mm"


def qmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w)


@torch._dynamo.disable
def qmm_kept_out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The writing op kept out of the graph: the usual workaround (a graph break)."""
    return torch.mm(x, w)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, weight_cls: type | None, device: str, kept_out: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, device=device)
        w1 = torch.randn(dim, hidden, device=device) * dim**-0.5
        w2 = torch.randn(hidden, dim, device=device) * hidden**-0.5
        # Plain attributes, not parameters: an inference model whose quantized weights
        # are graph inputs with a source (L['self'].blocks[0].w1), so writes replay on them.
        self.w1 = weight_cls(w1) if weight_cls else w1
        self.w2 = weight_cls(w2) if weight_cls else w2
        self.mm = qmm_kept_out if kept_out else qmm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.mm(self.norm(h), self.w1))
        return h + self.mm(y, self.w2)


class BlockModel(nn.Module):
    block_cls: type = Block

    def __init__(
        self,
        blocks: int = 4,
        dim: int = 128,
        hidden: int = 256,
        weight_cls: type | None = AmaxWeight,
        device: str = "cpu",
        kept_out: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(self.block_cls(dim, hidden, weight_cls, device, kept_out) for _ in range(blocks))
        self.requires_grad_(False)  # inference: the subclass weights implement mm only

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            h = b(h)
        return h

    def recorded_state(self) -> list[tuple]:
        """What the weights recorded (None where nothing was written)."""
        out = []
        for b in self.blocks:
            for w in (b.w1, b.w2):
                d = getattr(w, "__dict__", {})
                amax = d.get("input_amax")
                out.append((None if amax is None else float(amax), d.get("last_op")))
        return out


def same_state(a: list[tuple], b: list[tuple], tol: float = 1e-4) -> bool:
    if len(a) != len(b):
        return False
    for (x1, o1), (x2, o2) in zip(a, b):
        if o1 != o2 or (x1 is None) != (x2 is None):
            return False
        if x1 is not None and abs(x1 - x2) > tol * max(1.0, abs(x1)):
            return False
    return True


def _fresh_method(f, tag):
    name = f"{f.__name__}_{tag}"
    return types.FunctionType(f.__code__.replace(co_name=name), f.__globals__, name, f.__defaults__)


def fresh_model_class(tag) -> type:
    """BlockModel with its own copies of the forward code objects: Dynamo keeps compiled
    code per code object, so variants of one run never share (and never guard-miss on)
    each other's cache entries."""
    block = type(f"Block_{tag}", (Block,), {"forward": _fresh_method(Block.forward, tag)})
    return type(
        f"BlockModel_{tag}", (BlockModel,), {"forward": _fresh_method(BlockModel.forward, tag), "block_cls": block}
    )
