"""The hand-off from the Dynamo layer to the AOTAutograd layer, and the graph nodes both use.

Dynamo calls the backend (and so AOTAutograd) from inside ``compile_subgraph``.  What
the Dynamo layer learned while tracing that graph reaches the AOTAutograd layer as one
explicit record, set in a ``ContextVar`` around the backend call and reset after it
(``handing_off`` / ``received``).  Module dependencies run one way: both layers import
this module; neither imports the other.

The FX targets the Dynamo layer puts in the graph run (a) in AOTAutograd's tracing
passes, on the pass's own instances, and (b) at run time with ``backend="eager"``, on
the real objects:

- ``read_attr`` reads a tensor or symbolic value dispatch wrote, making it a graph output;
- ``seed_attr`` hands a traced object the entry value Dynamo answered a read with (a
  tensor made a graph input, a symbolic int): outside a capture scope it does nothing,
  since the real object already holds that value.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator

from . import capture


@dataclasses.dataclass
class DynamoRecord:
    """What the Dynamo layer knows about the graph it hands to the backend.

    ``recorded``: ``{id(real object): {attribute: constant or GRAPH_VALUE}}`` that Dynamo's
    residual bytecode replays (the AOTAutograd layer must not apply them twice);
    ``observed``: the same, seen in fake propagation but not recorded (Dynamo layer off);
    ``fullgraph``: a refusal must raise (else the frame falls back to eager);
    ``shared_objects``: objects dispatch reached through globals or closures, which
    AOTAutograd's passes must also leave as they found them.
    """  # noqa: D205

    recorded: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    observed: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    fullgraph: bool = True
    shared_objects: list[Any] = dataclasses.field(default_factory=list)
    #: ``{id(real object): its Dynamo source}``: the AOTAutograd layer guards what only
    #: its passes read (the traced backward) while the frame's guards are being collected.
    sources: dict[int, Any] = dataclasses.field(default_factory=dict)
    #: ``(module or closure owner, name, value)``: constants dispatch read from module
    #: globals and closures, guarded by Dynamo; the AOTAutograd passes trace with them,
    #: so an AOTAutogradCache key covers them (aot_cache.py).
    free_reads: list[tuple[str, str, Any]] = dataclasses.field(default_factory=list)
    #: dispatch code reads torch's anomaly mode, which AOTAutograd turns on while it traces
    #: (See Note [Anomaly mode while AOTAutograd traces] in aot_layer.py)
    reads_anomaly_mode: bool = False


_RECORD: contextvars.ContextVar[DynamoRecord | None] = contextvars.ContextVar("dynamo_ext_record", default=None)


@contextlib.contextmanager
def handing_off(record: DynamoRecord) -> Iterator[None]:
    token = _RECORD.set(record)
    try:
        yield
    finally:
        _RECORD.reset(token)


def received() -> DynamoRecord | None:
    """The record of the Dynamo graph being compiled now, or None (AOTAutograd called directly)."""
    return _RECORD.get()


# --------------------------------------------------------------------------- #
# FX targets
# --------------------------------------------------------------------------- #


#: AOTAutogradCache keys a graph holding our nodes on this (``node.meta["user_cache_hash"]``):
#: what they do is fixed by their arguments, which the key covers with the graph's code.
NODE_CACHE_HASH = "dynamo_ext.handoff/1"


def cacheable(node: Any) -> Any:
    """Mark a ``read_attr``/``seed_attr`` node as safe to cache (AOTAutogradCache bypasses
    a graph with a call it does not know unless the node says how to key it)."""
    node.meta["is_wrapped"] = True
    node.meta["user_cache_hash"] = NODE_CACHE_HASH
    return node


def read_attr(obj: Any, path: capture.Path, name: str) -> Any:
    """Graph node for a tensor or symbolic value written into ``obj...name`` by dispatch."""
    return getattr(capture.follow(obj, path), name)


def entry_value(value: Any) -> Any:
    """Graph node for a graph input a write aliases: the value itself, as the graph got it."""
    return value


def view_of(base: Any, inner: str | None, size: tuple, stride: tuple, offset: int) -> Any:
    """Graph node for a tensor attribute that is a view of another graph input (of its inner
    tensor ``inner``): that view, taken in the graph (See Note [A tensor attribute that is a
    view of another input] in dynamo_layer.py)."""
    if inner is not None:
        base = getattr(base, inner)
    return base.as_strided(size, stride, offset)


def same_view(value: Any, size: tuple, stride: tuple, offset: int) -> bool:
    """``value`` is a plain tensor with these sizes, strides and storage offset."""
    import torch

    return (
        isinstance(value, torch.Tensor) and tuple(value.size()) == size and tuple(value.stride()) == stride
        and value.storage_offset() == offset
    )


def seed_attr(obj: Any, path: capture.Path, name: str, value: Any) -> None:
    """Give a traced object the entry value of ``name`` that Dynamo answered a read with.

    In an AOTAutograd pass the object is the pass's own instance, rebuilt by
    ``__tensor_unflatten__``: it gets the graph's value (a tensor graph input, a
    symbolic int).  Outside a capture scope (run time, ``backend="eager"``) the real
    object already holds it and nothing happens.
    """
    scope = capture.current()
    if scope is None:
        return
    target = capture.follow(obj, path)
    t = scope.lookup(target)
    if t is None:
        t = scope.track(target, None)
    if name not in t.written:
        t.set_answer(name, value)


def getitem_as_eager(x: Any, index: Any) -> Any:
    """``x[index]`` with each slice that covers its whole dim (``:``) given the dim's own
    size (See Note [A whole-dim slice under symbolic sizes] in dynamo_layer.py)."""
    return x[whole_slices_sized(x, index)]


def whole_slices_sized(x: Any, index: Any) -> Any:
    """``index`` with each slice that covers its whole dim (``:``, ``0:n`` with ``n`` at least
    the size: a guard on a symbolic size) replaced by ``0:size:1``; unchanged where an entry's
    dims cannot be told (a nested list of bools, more than one ``...``)."""
    import torch

    items = index if isinstance(index, tuple) else (index,)

    def dims(i: Any) -> int | None:  # the dims of ``x`` an entry takes
        if i is None or i is Ellipsis or isinstance(i, bool):
            return 0
        if isinstance(i, (int, slice)):
            return 1
        if isinstance(i, torch.Tensor):
            return i.dim() if i.dtype in (torch.bool, torch.uint8) else 1
        if isinstance(i, list) and not any(isinstance(v, (list, tuple)) for v in i):
            return 1
        return None

    taken = [dims(i) for i in items]
    if any(t is None for t in taken) or sum(i is Ellipsis for i in items) > 1:
        return index
    out, dim = [], 0
    for i, t in zip(items, taken):
        if i is Ellipsis:
            dim += x.dim() - sum(taken)
        elif _covers_its_dim(i, x, dim):
            i = slice(0, x.shape[dim], 1)
        dim += t
        out.append(i)
    return tuple(out) if isinstance(index, tuple) else out[0]


def setitem_as_eager(x: Any, index: Any, value: Any) -> None:
    """``x[index] = value``, each ``:`` given its dim's size (as ``getitem_as_eager``)."""
    x[whole_slices_sized(x, index)] = value


def whole_dim_candidate(i: Any) -> bool:
    """A slice that covers its dim for some sizes: no start, no step, any plain stop."""
    return (
        isinstance(i, slice)
        and i.start in (None, 0)
        and i.step in (None, 1)
        and (i.stop is None or type(i.stop) is int and i.stop > 0)
    )


def _covers_its_dim(i: Any, x: Any, dim: int) -> bool:
    if not whole_dim_candidate(i) or dim >= x.dim():
        return False
    return i.stop is None or bool(i.stop >= x.shape[dim])
