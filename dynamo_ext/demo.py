"""Demo: a caching tensor subclass under eager, stock torch.compile and dynamo_ext.

    python -m dynamo_ext.demo

Two wrapper subclasses write on themselves inside ``__torch_dispatch__``:

- ``CountingTensor`` counts its multiplications in its flatten ctx (``calls``);
- ``AmaxTensor`` caches the absolute maximum of its data on the first
  multiplication and lists the cache in ``__tensor_flatten__`` once it is set.

Each is run once eagerly, once with stock ``torch.compile`` and once with
dynamo_ext enabled (backend ``aot_eager``, ``fullgraph=True``); the table shows
the output and the input's attributes after the call.
"""

from __future__ import annotations

import torch

import dynamo_ext
from dynamo_ext.testing import WrapperTensor


class CountingTensor(WrapperTensor):
    """ctx = (calls,): every multiplication increments ``calls``."""

    CTX = ("calls",)

    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.mul.Tensor:
            first.calls += 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.elem.tolist()})"


class AmaxTensor(WrapperTensor):
    """Caches ``amax`` on the first multiplication; the flatten list grows to include it."""

    INNER = ("elem", "amax")
    amax = None

    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.mul.Tensor and first.amax is None:
            first.amax = first.elem.abs().amax()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.elem.tolist()})"


def _state(x: torch.Tensor) -> str:
    shown = []
    for name in ("calls", "amax"):
        if name in x.__dict__:
            v = x.__dict__[name]
            shown.append(f"{name}={v.item() if isinstance(v, torch.Tensor) else v}")
    return ", ".join(shown) or "(nothing written)"


def _run(how: str, make: type, fn) -> tuple[str, str]:
    x = make(torch.tensor([1.0, -3.0, 2.0]))
    try:
        if how == "eager":
            out = fn(x)
        else:
            torch._dynamo.reset()
            out = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
        return repr(out), _state(x)
    except Exception as e:  # stock torch fails on one of the two
        first_line = str(e).strip().splitlines()
        reason = next((ln for ln in first_line if "Error" in ln), first_line[0] if first_line else "")
        reason = reason.strip().replace("<class 'NoneType'>", "NoneType")
        return f"{type(e).__name__}: {reason}", _state(x)


def main() -> None:
    def fn(x):
        return x * 2

    rows = []
    for cls in (CountingTensor, AmaxTensor):
        for how in ("eager", "stock torch.compile", "dynamo_ext"):
            if how == "dynamo_ext":
                dynamo_ext.enable()
            else:
                dynamo_ext.disable()
            out, state = _run(how, cls, fn)
            rows.append((cls.__name__, how, out, state))
    dynamo_ext.disable()

    widths = [max(len(r[i]) for r in rows + [("subclass", "run", "output", "input attributes after the call")]) for i in range(4)]
    header = ("subclass", "run", "output", "input attributes after the call")
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()
