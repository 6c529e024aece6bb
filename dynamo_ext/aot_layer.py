"""AOTAutograd layer: keep every tracing pass starting from the entry state.

Compile-time half of the fallback path.  AOTAutograd traces the Dynamo graph
several times (metadata analysis, subclass metadata, the final trace), each time
on fresh subclass instances rebuilt by ``__tensor_unflatten__``.  Dispatch runs
again in each pass and writes on those instances; right after the pass
AOTAutograd re-flattens them (``has_metadata_mutation``) and a flatten list that
grew (a cache listed once set) fails with ``expected FakeTensor for arg, got
NoneType``.  This layer wraps the function AOTAutograd traces (the
``functional_call`` built by ``prepare_aot_module_simplified``) so that each pass:

- starts with the instance state of the real inputs (attributes outside the
  flatten ctx that ``__tensor_unflatten__`` cannot restore: constants, and copies
  of plain containers; tensors arrive through ``dynamo_layer.seed_attr`` graph nodes), and
- ends with the instances restored exactly as they were before the pass.

The writes themselves are replayed by the Dynamo layer's residual bytecode; the
values of new tensor attributes leave the graph through ``read_attr`` outputs.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from . import config
from .capture import MISSING, InstanceSnapshot, is_watched_type, seed_copy


def _seed_constants(traced: Any, real: Any) -> None:
    mine = traced.__dict__
    for name, value in real.__dict__.items():
        if name not in mine and not isinstance(value, torch.Tensor):
            copied = seed_copy(value)
            if copied is not MISSING:
                mine[name] = copied


def guard_tracing_pass(functional_call: Callable[..., Any], real_inputs: Sequence[Any]) -> Callable[..., Any]:
    """Wrap the traced function: seed each pass's instances, restore them after."""
    pairs = [(i, r) for i, r in enumerate(real_inputs) if is_watched_type(r)]
    if not pairs:
        return functional_call

    @functools.wraps(functional_call)
    def traced_call(*args: Any) -> Any:
        snaps = []
        for i, real in pairs:
            if i < len(args) and is_watched_type(args[i]):
                snaps.append(InstanceSnapshot(args[i]))
                _seed_constants(args[i], real)
        try:
            return functional_call(*args)
        finally:
            for snap in snaps:
                snap.restore()

    return traced_call


def make_prepare_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``torch._functorch.aot_autograd.prepare_aot_module_simplified``."""

    @functools.wraps(original)
    def prepare_aot_module_simplified(mod: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
        args = list(args)
        result = original(mod, args, *rest, **kwargs)
        if not config.aot_layer:
            return result
        functional_call, params_buffers_flat = result[0], result[1]
        real_inputs = list(params_buffers_flat) + args
        return (guard_tracing_pass(functional_call, real_inputs), *result[1:])

    return prepare_aot_module_simplified
