"""AOTAutograd layer: keep every tracing pass starting from the entry state.

Compile-time half of the fallback path.  AOTAutograd traces the Dynamo graph
several times (metadata analysis, subclass metadata, the final trace), each time
on fresh subclass instances rebuilt by ``__tensor_unflatten__``.  Dispatch runs
again in each pass and writes on those instances; right after the pass
AOTAutograd re-flattens them (``has_metadata_mutation``) and a flatten list that
grew (a cache listed once set) fails with ``expected FakeTensor for arg, got
NoneType``.  This layer wraps the function AOTAutograd traces (the
``functional_call`` built by ``prepare_aot_module_simplified``) so that each pass
ends with the instances restored exactly as they were before it.

State outside the flatten ctx that dispatch reads reaches each pass through the
Dynamo layer's ``seed_attr`` graph nodes; the writes themselves are replayed by
the Dynamo layer's residual bytecode, and new tensor attributes leave the graph
through ``read_attr`` outputs.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from . import config
from .capture import InstanceSnapshot, is_watched_type


def guard_tracing_pass(functional_call: Callable[..., Any], real_inputs: Sequence[Any]) -> Callable[..., Any]:
    """Wrap the traced function so each pass restores the instances it was given."""
    watched = [i for i, r in enumerate(real_inputs) if is_watched_type(r)]
    if not watched:
        return functional_call

    @functools.wraps(functional_call)
    def traced_call(*args: Any) -> Any:
        snaps = []
        for i in watched:
            if i < len(args) and is_watched_type(args[i]):
                snaps.append(InstanceSnapshot(args[i]))
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
