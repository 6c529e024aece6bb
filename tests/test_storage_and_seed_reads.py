"""Reads dispatch makes that the caller changes without touching the subclass (outside round
48): where a tensor lies in its storage (``storage_offset()``, a shard of a flat buffer), how
large its storage is (``untyped_storage().nbytes()``, FSDP's free and reallocate), the random
seed and the random generators' state. The first call's answer was replayed, with no guard.
Each call now matches eager (a compile per value), or is refused with nothing touched
(eager under ``fullgraph=False``)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

BACKENDS = ["eager", "aot_eager"]


class Sharded(torch.Tensor):
    """A wrapper recording, at each op, what ``READ`` tells of the operand (``ON = "arg"``) or
    of its inner tensor (``ON = "inner"``), and scaling by it (the offset picks a shard's scale)."""

    READ = None
    ON = "arg"

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)
        r.elem = elem
        return r

    def __init__(self, *args):
        pass

    def __tensor_flatten__(self):
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w, x = args
        seen = cls.READ(x if cls.ON == "arg" else w.elem)
        w.seen = seen
        scale = float(seen % 3 + 1) if isinstance(seen, int) else 1.0
        return func(w.elem, x) * scale


def fn(w, x):
    return w * x


def _offset(t):
    return t.storage_offset()


def _nbytes(t):
    return t.untyped_storage().nbytes()


def _shards(w, i):
    flat = torch.arange(16.0)
    return flat[4 * i: 4 * i + 4]


def _alone_then_view(w, i):
    return torch.arange(4.0) if i == 0 else torch.arange(32.0)[8 * i: 8 * i + 4]


def _inner_rebound(w, i):
    if i:
        w.elem = torch.ones(16)[4 * i: 4 * i + 4]
    return torch.arange(4.0)


def _inner_resized(w, i):
    if i:
        w.elem.untyped_storage().resize_(16 * (i + 1))
    return torch.arange(4.0)


CASES = {
    "offset_of_a_shard": ("arg", _offset, _shards),
    "offset_of_the_inner_tensor": ("inner", _offset, _inner_rebound),
    "storage_of_a_view": ("arg", _nbytes, _alone_then_view),
    "storage_of_the_inner_tensor_resized": ("inner", _nbytes, _inner_resized),
}


def _run(f, case):
    on, read, arg = CASES[case]
    cls = type(f"Sharded_{case}", (Sharded,), {"READ": staticmethod(read), "ON": on})
    w = cls(torch.ones(4))
    seen = []
    for i in range(3):
        x = arg(w, i)
        before = w.__dict__.get("seen")
        try:
            out = f(w, x)
        except Exception as e:  # noqa: BLE001 - a refusal, checked by the caller
            seen.append(("refused", "dynamo_ext: " in str(e), before == w.__dict__.get("seen")))
            continue
        seen.append((out.tolist(), w.__dict__["seen"]))
    return seen


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_where_a_tensor_lies_in_its_storage(case, backend, fullgraph):
    torch._dynamo.reset()
    eager = _run(fn, case)
    compiled = _run(torch.compile(fn, backend=backend, fullgraph=fullgraph), case)
    assert len({e[1] for e in eager}) > 1  # the caller's change shows in eager
    if case == "offset_of_a_shard" or not fullgraph:
        assert compiled == eager
    else:
        # a stand-in with another storage than the real tensor's (a storage resized in place on
        # torch 2.13; AOTAutograd's functional stand-in of a view): a clean refusal, nothing touched
        for c, e in zip(compiled, eager):
            assert c == e or c == ("refused", True, True), (compiled, eager)
        if backend == "eager" and case != "storage_of_the_inner_tensor_resized":
            assert compiled == eager


class Seeded(Sharded):
    """A dropout-replay style wrapper recording the seed, or a fingerprint of a generator."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w, x = args
        w.seen = cls.READ()
        return func(w.elem, x)


SEED_READS = {
    "initial_seed": lambda: torch.initial_seed(),
    "torch_rng_state": lambda: hash(torch.get_rng_state().numpy().tobytes()) % 1000,
    "python_random_state": lambda: random.getstate()[1][1],
    "numpy_random_state": lambda: int(np.random.get_state()[1][0]),
}


def _seeded_run(f, read):
    cls = type(f"Seeded_{read}", (Seeded,), {"READ": staticmethod(SEED_READS[read])})
    w = cls(torch.ones(4))
    seen = []
    state = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    try:
        for i in range(3):
            torch.manual_seed(100 + i)
            random.seed(100 + i)
            np.random.seed(100 + i)
            before = w.__dict__.get("seen")
            try:
                out = f(w, torch.ones(4))
            except torch._dynamo.exc.Unsupported as e:
                seen.append(("refused", "dynamo_ext: unsupported_state_read" in str(e), before == w.__dict__.get("seen")))
                continue
            seen.append((out.tolist(), w.__dict__["seen"]))
    finally:
        torch.set_rng_state(state[0])
        random.setstate(state[1])
        np.random.set_state(state[2])
    return seen


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("read", list(SEED_READS))
def test_the_random_seed_or_state_dispatch_reads(read, backend, fullgraph):
    """The seed is guarded (one compile per seed); a generator's state, which every draw
    moves, is refused as a clock is."""
    torch._dynamo.reset()
    eager = _seeded_run(fn, read)
    compiled = _seeded_run(torch.compile(fn, backend=backend, fullgraph=fullgraph), read)
    assert len({e[1] for e in eager}) == 3
    if read == "initial_seed" or not fullgraph:
        assert compiled == eager
    else:
        assert compiled == [("refused", True, True)] * 3
