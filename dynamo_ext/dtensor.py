"""DTensor: what dynamo_ext needs to know about its state (compile time and run time).

DTensor's vocab-parallel embedding returns a partial result whose ``_MaskPartial``
placement holds a ``MaskBuffer`` (the mask of out-of-range ids, and a refcount) that the
later reduction applies and releases.  The buffer is shared by reference with every
instance unflattened from the spec and, through DTensor's sharding-propagation caches,
across calls.  dynamo_ext registers it as ctx state with a replay that updates it the way
eager does, and keeps a fake copy of a pending partial result from reducing it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import threading
from typing import Any, Callable, Iterator

import torch

from . import capture

_local = threading.local()


def replay_mask_buffer(buf: Any, entry: dict[str, Any], values: dict[str, Any]) -> None:
    """DTensor's MaskBuffer as eager updates it: a trace that materialized a mask (refcount
    up by one) materializes it (``materialize_mask``: a buffer still holding an equal
    pending mask counts one more, a different one raises "conflicting data", as in eager);
    one that released it releases it; anything else is set if the buffer still holds its
    traced state."""
    before, after = entry.get("refcount"), values.get("refcount", entry.get("refcount"))
    if isinstance(before, int) and isinstance(after, int):
        if after == before + 1 and isinstance(values.get("data"), torch.Tensor):
            buf.materialize_mask(values["data"])
            return
        if after == before - 1 and set(values) <= {"refcount", "data"}:
            buf.release_mask()
            return
    capture.replay_if_unchanged(buf, entry, values)


def register_defaults() -> None:
    from torch.distributed.tensor._ops._mask_buffer import MaskBuffer

    capture.register_ctx_state(MaskBuffer, replay=replay_mask_buffer)
    capture.register_rebinder(rebind_mask_buffers)
    # Note [Two partial embeddings in one graph]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # In eager, DTensor's sharding cache hands two embeddings of one shape the same
    # MaskBuffer: the second materialization counts one more (refcount 2, the mask kept until
    # both are reduced) or raises "conflicting data". A graph traced with static shapes
    # meets that as a data-dependent comparison (refused by Dynamo); under dynamic shapes the
    # trace misses the cache and makes one buffer each, so the compiled outputs held two
    # buffers of refcount 1 where eager's held one (an outside tester's find). A graph whose
    # passes make more than one is refused.
    # passes make more than one for ops eager could key alike (the same op, shapes that may
    # be equal: a symbolic size may be anything) is refused.
    capture.ONE_PER_KEY[MaskBuffer] = capture.OnePerKey(
        "two partial embeddings in one compiled region whose lookups may have one shape: in eager "
        "DTensor's sharding cache gives them one MaskBuffer (counted twice, or a conflict), which "
        "the compiled graph cannot decide",
        _schema_key,
        _may_share,
    )


def _schema_key() -> Any:
    """The DTensor op making a MaskBuffer, as its sharding cache keys it: (op, the shapes of
    its arguments, a symbolic size as None); None where no op schema is found on the stack."""
    from torch.distributed.tensor._op_schema import OpSchema

    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return None
        schema = next((v for v in frame.f_locals.values() if isinstance(v, OpSchema)), None)
        if schema is not None:
            return (str(schema.op), tuple(_arg_key(a) for a in schema.args_schema))
        frame = frame.f_back
    return None


def _arg_key(arg: Any) -> Any:
    shape = getattr(arg, "shape", None)
    if shape is not None:
        return ("shape", tuple(d if type(d) is int else None for d in shape))
    return ("value", arg if type(arg) in (int, float, bool, str, type(None)) else None)


def _may_share(a: Any, b: Any) -> bool:
    """Whether eager's sharding cache could key two ops alike (None: unknown, so yes)."""
    if a is None or b is None:
        return True
    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    for (kind_a, x), (kind_b, y) in zip(a[1], b[1]):
        if kind_a != kind_b:
            return False
        if kind_a == "value":
            if x is not None and y is not None and x != y:
                return False
            continue
        if len(x) != len(y) or any(p is not None and q is not None and p != q for p, q in zip(x, y)):
            return False
    return True


def rebind_mask_buffers(t: Any, mapping: dict[int, Any]) -> None:
    """A compiled output's ``_MaskPartial`` placements hold the buffers ``mapping`` gives for
    the ones they were traced with (See Note [Objects dispatch makes, per shape] in plan.py):
    a new spec, so outputs of other calls keep theirs."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _MaskPartial

    if not isinstance(t, DTensor):
        return
    spec = t._spec
    if not any(isinstance(p, _MaskPartial) and id(p.mask_buffer) in mapping for p in spec.placements):
        return
    placements = tuple(
        dataclasses.replace(p, mask_buffer=mapping[id(p.mask_buffer)])
        if isinstance(p, _MaskPartial) and id(p.mask_buffer) in mapping
        else p
        for p in spec.placements
    )
    spec = copy.copy(spec)
    spec.placements = placements
    t._spec = spec


# Note [A pending DTensor mask in a fake copy]
#     From torch 2.14, DTensor's detach/alias of a ``_MaskPartial`` DTensor redistribute
#     it to Replicate (apply the mask, reduce, release the mask). Fakifying a partial
#     result that requires grad (a compiled function's input, in Dynamo and again in
#     AOTAutograd) fakes its autograd history with detach (``MetaConverter._backward_error``)
#     and so would apply the real, shared mask to a fake tensor ("Please convert all Tensors
#     to FakeTensors first") and release the caller's pending mask. While a fake copy's
#     history is faked, detach and alias keep the placement, as they did in 2.13 - for this
#     thread only; everything else about DTensor is left alone.

_PASSTHROUGH: dict[Any, Callable[..., Any]] = {}


def _passthrough(op_call: Any, args: tuple, kwargs: dict) -> Any:
    from torch.distributed.tensor import DTensor

    t = args[0]
    if getattr(_local, "faking", False):
        return DTensor(op_call(t._local_tensor, *args[1:], **(kwargs or {})), t._spec, requires_grad=False)
    previous = _PASSTHROUGH.get(op_call)
    if previous is not None:
        return previous(op_call, args, kwargs)
    # Another thread's eager detach while a handler is installed: DTensor's own dispatch.
    handlers = DTensor._op_dispatcher._custom_op_handlers
    mine = handlers.pop(op_call)
    try:
        return op_call(*args, **(kwargs or {}))
    finally:
        handlers[op_call] = mine


@contextlib.contextmanager
def _detach_keeps_placements() -> Iterator[None]:
    from torch.distributed.tensor import DTensor

    aten = torch.ops.aten
    handlers = DTensor._op_dispatcher._custom_op_handlers
    ops = (aten.detach.default, aten.alias.default)
    saved = {op: handlers.get(op) for op in ops}
    _PASSTHROUGH.update({op: h for op, h in saved.items() if h is not None})
    handlers.update({op: _passthrough for op in ops})
    _local.faking = True
    try:
        yield
    finally:
        _local.faking = False
        for op, h in saved.items():
            if h is None:
                handlers.pop(op, None)
            else:
                handlers[op] = h
        _PASSTHROUGH.clear()


def make_backward_error_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``MetaConverter._backward_error`` (a classmethod): See Note [A
    pending DTensor mask in a fake copy]."""

    def _backward_error(cls: Any, t: Any) -> Any:
        if capture.registered_classes() and _holds_mask_partial(t):
            with _detach_keeps_placements():
                return original(cls, t)
        return original(cls, t)

    return _backward_error


def _holds_mask_partial(t: Any) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _MaskPartial

    return isinstance(t, DTensor) and any(isinstance(p, _MaskPartial) for p in t.placements)
