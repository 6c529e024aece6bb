"""Programs shared by the benchmarks: a small function over wrapper subclasses whose
dispatch writes 0-64 attributes per call (constants or tensors), the same writes made in
user code (what stock torch.compile already replays), and a function over many inputs."""

from __future__ import annotations

import types

import torch

from dynamo_ext.testing import WrapperTensor


class _Wrapper(WrapperTensor):
    """The shared wrapper base; ``write(first)`` runs on every ``mul``."""

    @classmethod
    def write(cls, first):
        pass

    @classmethod
    def on_op(cls, func, first):
        if func is torch.ops.aten.mul.Tensor:
            cls.write(first)


class Quiet(_Wrapper):
    pass


class CatchesQuietly(_Wrapper):
    """Writes nothing; its dispatch handles an exception itself (a ``try`` around a lookup),
    so dispatch runs under dynamo_ext's watch for caught exceptions while traced."""

    @classmethod
    def write(cls, first):
        try:
            cls.limit
        except AttributeError:
            pass


def writer(constants: int = 0, tensors: int = 0) -> type:
    """A subclass whose ``mul`` writes ``constants`` string constants (``c0``...) and
    ``tensors`` new tensors (``t0 = elem + 0``...) on its first subclass argument."""

    class Writer(_Wrapper):
        @classmethod
        def write(cls, first):
            for i in range(constants):
                setattr(first, f"c{i}", "mul")
            for i in range(tensors):
                setattr(first, f"t{i}", first.elem + i)

    Writer.__name__ = f"Writes{constants}c{tensors}t"
    Writer.__qualname__ = Writer.__name__
    return Writer


def _constant_writer(n):
    return writer(constants=n)


def _tensor_writer(n):
    return writer(tensors=n)


def fn(x):
    return x * 3 + 1


SIZE = 64


def _data(device):
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(0)).to(device)


def make(cls, device="cpu"):
    """A factory of fresh inputs of ``cls`` (None: a plain tensor), all with the same values."""
    if cls is None:
        return lambda: _data(device)
    return lambda: cls(_data(device))


def programs(device="cpu", counts=(1, 4, 16)):
    """``(name, writes, kind, make_input)`` of every program over ``fn``."""
    out = [
        ("plain tensor, no writes", 0, None, make(None, device)),
        ("subclass, no writes", 0, None, make(Quiet, device)),
    ]
    for kind in ("constant", "tensor"):
        for n in counts:
            cls = writer(constants=n) if kind == "constant" else writer(tensors=n)
            out.append((f"subclass, {n} {kind} write(s)", n, kind, make(cls, device)))
    return out


PROGRAMS = [(name, mk) for name, _, _, mk in programs()]


def fresh(f, tag):
    # Dynamo caches compiled code per code object: each variant gets its own copy
    # of the code so variants never share a cache entry.
    name = f"{f.__name__}_{tag}"
    return types.FunctionType(f.__code__.replace(co_name=name), f.__globals__, name)


def fresh_fn(tag):
    return fresh(fn, tag)


def user_writes_fn(n: int, kind: str, tag) -> types.FunctionType:
    """``fn`` preceded by the same writes made in user code (stock replays those too):
    ``x.c0 = "mul"`` ... or ``x.t0 = x.elem + 0`` ..."""
    name = f"user_writes_{kind}{n}_{tag}"
    lines = [f"def {name}(x):"]
    for i in range(n):
        lines.append(f"    x.c{i} = 'mul'" if kind == "constant" else f"    x.t{i} = x.elem + {i}")
    lines.append("    return x * 3 + 1")
    scope: dict = {}
    exec(compile("\n".join(lines), f"<bench {name}>", "exec"), scope)
    return scope[name]


def many(xs):
    """One ``mul`` (which writes) per input, summed."""
    acc = xs[0] * 3
    for x in xs[1:]:
        acc = acc + x * 3
    return acc


def written_state(x) -> dict:
    """The attributes a program left on ``x`` besides its inner tensor (tensors as lists)."""
    out = {}
    for k, v in x.__dict__.items():
        if k == "elem":
            continue
        out[k] = v.tolist() if isinstance(v, torch.Tensor) else v
    return out
