"""The differential harness: eager vs compiled on equal, separate inputs.

``differential`` runs a function eagerly and compiled, call after call, on two
separately built but equal sets of inputs, and after each call compares
outputs, gradients and the attribute state of every input, checks that no fake
or functional tensor leaked into any attribute, and returns the compile counter
(frames, ops) so tests can assert recompiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import dynamo_ext


@contextlib.contextmanager
def stock_torch():
    """Run a block with dynamo_ext disabled (stock torch behaviour)."""
    dynamo_ext.disable()
    try:
        torch._dynamo.reset()
        yield
    finally:
        dynamo_ext.enable()
        torch._dynamo.reset()


def plain(t: torch.Tensor) -> torch.Tensor:
    """The dense values of a tensor, unwrapping wrapper subclasses."""
    while is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        t = getattr(t, names[0])
    return t.detach()


def leaked_fakes(obj: Any, path: str = "x", depth: int = 0) -> list[str]:
    """Paths of FakeTensor / FunctionalTensor values reachable from ``obj``'s attributes."""
    if isinstance(obj, (FakeTensor, FunctionalTensor)):
        return [path]
    if depth > 4:
        return []
    found = []
    if isinstance(obj, torch.Tensor) and is_traceable_wrapper_subclass(obj) or (
        hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.Tensor)) and depth > 0
    ):
        for k, v in vars(obj).items():
            if v is obj:
                continue
            found += leaked_fakes(v, f"{path}.{k}", depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found += leaked_fakes(v, f"{path}[{i}]", depth + 1)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            found += leaked_fakes(v, f"{path}[{k!r}]", depth + 1)
    return found


def attr_state(obj: Any, depth: int = 0) -> dict[str, Any]:
    """A comparable picture of ``obj.__dict__``: values, and identities between attributes."""
    state: dict[str, Any] = {}
    # Dynamo itself tags outputs with bookkeeping (_dynamo_propagated_dynamic_indices
    # under dynamic shapes); that is stock behaviour, not user state.
    items = sorted((k, v) for k, v in vars(obj).items() if not k.startswith("_dynamo"))
    for name, value in items:
        if isinstance(value, torch.Tensor):
            if value is obj:
                state[name] = ("self",)
                continue
            twin = next((n for n, v in items if v is value and n < name), None)
            if twin is not None:
                state[name] = ("same_as", twin)
                continue
            inner = attr_state(value, depth + 1) if depth < 2 else None  # a plain tensor's tags too
            state[name] = ("tensor", type(value).__name__, plain(value), inner)
        else:
            state[name] = ("value", value)
    return state


def assert_same_state(eager: Any, compiled: Any, where: str = "input") -> None:
    leaks = leaked_fakes(compiled)
    assert not leaks, f"{where}: trace-time tensors leaked into {leaks}"
    es, cs = attr_state(eager), attr_state(compiled)
    assert es.keys() == cs.keys(), f"{where}: attributes differ: eager {sorted(es)} vs compiled {sorted(cs)}"
    _assert_same_picture(es, cs, where)


def _assert_same_picture(es: dict, cs: dict, where: str) -> None:
    for name in es:
        e, c = es[name], cs[name]
        assert e[0] == c[0], f"{where}.{name}: eager {e[:2]} vs compiled {c[:2]}"
        if e[0] == "tensor":
            assert e[1] == c[1], f"{where}.{name}: type {e[1]} vs {c[1]}"
            assert type(c[2]) is torch.Tensor, f"{where}.{name}: not a real tensor: {type(c[2])}"
            torch.testing.assert_close(c[2], e[2], msg=lambda m: f"{where}.{name}: {m}")
            if e[3] is not None:
                assert e[3].keys() == c[3].keys(), f"{where}.{name}: inner attributes differ"
                _assert_same_picture(e[3], c[3], f"{where}.{name}")
        else:
            assert e == c, f"{where}.{name}: eager {e} vs compiled {c}"


def identity_groups(roots: dict[str, Any], max_depth: int = 4) -> list[list[str]]:
    """Which places (``out1.elem.cache``) hold the same tensor object, across all the roots:
    the groups of two or more places, each sorted. An object seen again is not walked again."""
    places: dict[int, list[str]] = {}
    keep: list[Any] = []  # ids stay unique while the walk runs

    def walk(value: Any, where: str, depth: int) -> None:
        if not isinstance(value, torch.Tensor):
            return
        again = id(value) in places
        places.setdefault(id(value), []).append(where)
        keep.append(value)
        if again or depth >= max_depth:
            return
        for name, held in sorted(vars(value).items()):
            if not name.startswith("_dynamo") and held is not value:
                walk(held, f"{where}.{name}", depth + 1)

    for where, root in roots.items():
        for i, leaf in enumerate(torch.utils._pytree.tree_leaves(root)):
            walk(leaf, f"{where}[{i}]", 0)
    return sorted(sorted(group) for group in places.values() if len(group) > 1)


def assert_same_identities(eager: dict[str, Any], compiled: dict[str, Any], where: str) -> None:
    """The same places hold one object in both runs (inputs and outputs together)."""
    e, c = identity_groups(eager), identity_groups(compiled)
    assert e == c, f"{where}: objects held in several places: eager {e} vs compiled {c}"


def assert_same_outputs(eager: Any, compiled: Any) -> None:
    e_flat, e_spec = torch.utils._pytree.tree_flatten(eager)
    c_flat, c_spec = torch.utils._pytree.tree_flatten(compiled)
    assert e_spec == c_spec, f"output structure: {e_spec} vs {c_spec}"
    for i, (e, c) in enumerate(zip(e_flat, c_flat)):
        if isinstance(e, torch.Tensor):
            assert type(e) is type(c), f"output {i}: {type(e)} vs {type(c)}"
            torch.testing.assert_close(plain(c), plain(e))
            assert_same_state(e, c, f"output[{i}]")  # a plain output dispatch tagged too
        else:
            assert e == c, f"output {i}: {e} vs {c}"


def _backward(out: Any) -> None:
    tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    loss = sum(t.sum() for t in tensors)
    loss.backward()


@dataclasses.dataclass
class Outcome:
    counter: CompileCounterWithBackend
    eager_inputs: Sequence[Any]
    compiled_inputs: Sequence[Any]

    @property
    def frames(self) -> int:
        return self.counter.frame_count


def _assert_same_grad_ctx(e: torch.Tensor, c: torch.Tensor, where: str) -> None:
    """A subclass gradient's flatten ctx, by type and value (no SymInt of a trace)."""
    assert type(c) is type(e), f"{where}: {type(c).__name__} vs eager {type(e).__name__}"
    if is_traceable_wrapper_subclass(e):
        e_ctx, c_ctx = e.__tensor_flatten__()[1], c.__tensor_flatten__()[1]
        assert repr(c_ctx) == repr(e_ctx) and _types(c_ctx) == _types(e_ctx), f"{where}: ctx {c_ctx!r} vs eager {e_ctx!r}"


def _types(v: Any) -> Any:
    if isinstance(v, (tuple, list)):
        return tuple(_types(x) for x in v)
    if isinstance(v, dict):
        return tuple((k, _types(x)) for k, x in v.items())
    return type(v).__name__


def differential(
    fn: Callable[..., Any],
    make_inputs: Callable[[], Sequence[Any]],
    *,
    backend: str = "aot_eager",
    fullgraph: bool = True,
    calls: int = 1,
    backward: bool = False,
    fresh_inputs_each_call: bool = False,
    dynamic: bool | None = None,
) -> Outcome:
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=fullgraph, dynamic=dynamic)
    eager_inputs, compiled_inputs = list(make_inputs()), list(make_inputs())
    for call in range(calls):
        if fresh_inputs_each_call and call:
            eager_inputs, compiled_inputs = list(make_inputs()), list(make_inputs())
        e_out = fn(*eager_inputs)
        c_out = compiled(*compiled_inputs)
        assert_same_outputs(e_out, c_out)
        assert_same_identities(
            {"in": eager_inputs, "out": e_out}, {"in": compiled_inputs, "out": c_out}, f"call {call}"
        )
        if backward:
            _backward(e_out)
            _backward(c_out)
            for i, (e, c) in enumerate(zip(eager_inputs, compiled_inputs)):
                if isinstance(e, torch.Tensor) and e.requires_grad:
                    assert (c.grad is None) == (e.grad is None), f"input {i}: grad {c.grad} vs eager {e.grad}"
                    if e.grad is not None:
                        torch.testing.assert_close(plain(c.grad), plain(e.grad))
                        _assert_same_grad_ctx(e.grad, c.grad, f"input {i} grad")
                    e.grad = c.grad = None
        for i, (e, c) in enumerate(zip(eager_inputs, compiled_inputs)):
            if isinstance(e, torch.Tensor):
                assert_same_state(e, c, f"call {call} input {i}")
    return Outcome(counter, eager_inputs, compiled_inputs)


def assert_refused_untouched(fn: Callable[..., Any], make_inputs: Callable[[], Sequence[Any]], backend: str, kind: str) -> None:
    """``fn`` compiled with ``fullgraph=True`` is refused as ``kind`` at its first call, and its
    first input keeps only what it was built with (``elem``)."""
    torch._dynamo.reset()
    inputs = list(make_inputs())
    with pytest.raises(torch._dynamo.exc.Unsupported, match=f"dynamo_ext: {kind}"):
        torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    assert set(vars(inputs[0])) == {"elem"}
