"""dynamo_ext: attribute writes made inside ``__torch_dispatch__`` survive ``torch.compile``.

Public API.  ``enable()`` applies the patch table (``_patches.TABLE``);
``disable()`` puts back the exact torch objects.  With it enabled, a traceable
tensor subclass that writes attributes on its inputs inside
``__torch_dispatch__`` compiles with eager semantics: after a compiled call the
inputs hold the attributes eager would have left, or compilation refuses the
write with a clear error (upstream: pytorch #130028).

Modules, in the order of the flow:
    _compat       torch version facts
    _patches      the patch table machinery
    capture       snapshot / diff / restore of instance state (compile time)
    dynamo_layer  records writes with Dynamo's SideEffects (compile time);
                  Dynamo's residual bytecode replays them (run time)
    aot_layer     keeps AOTAutograd's tracing passes starting from entry state
    ctx_state     journal / undo of state on objects reachable from a ctx (DTensor's MaskBuffer)
    writeback     input data mutations written back per inner tensor where the subclass cannot copy_
    errors        refusals
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from . import _compat, aot_layer, config, ctx_state, dynamo_layer, writeback
from ._patches import Patch, PatchSet, PatchTargetError
from .ctx_state import register_ctx_state
from .errors import RefusalKind, SubclassWriteError

__all__ = [
    "enable",
    "disable",
    "enabled",
    "is_enabled",
    "config",
    "RefusalKind",
    "SubclassWriteError",
    "PatchTargetError",
    "TABLE",
    "register_ctx_state",
]

__version__ = "0.1.0"

#: Every change dynamo_ext makes to torch.
TABLE: list[Patch] = [
    Patch(
        "torch._dynamo.utils",
        "_get_fake_value_impl",
        dynamo_layer.make_fake_value_hook,
        why="Dynamo runs __torch_dispatch__ on fake example values here; the writes it makes "
        "are read off and recorded with SideEffects. Callers import get_fake_value by name, "
        "so the module-global impl it calls is the one place that sees every op.",
    ),
    Patch(
        "torch._dynamo.output_graph:OutputGraph",
        "compile_subgraph",
        dynamo_layer.make_compile_subgraph_hook,
        why="Restore the fake example values before codegen, guards and the backend see them.",
    ),
    Patch(
        "torch._dynamo.guards",
        "deepcopy",
        ctx_state.make_guard_deepcopy,
        why="Guards deep-copy subclass ctx (DTensor specs) to compare later calls with it; "
        "objects registered with register_ctx_state are shared state compared by identity "
        "(_MaskPartial.__eq__), so the copy must keep them or the guard never holds.",
    ),
    Patch(
        "torch._functorch.aot_autograd",
        "prepare_aot_module_simplified",
        aot_layer.make_prepare_hook,
        why="Wrap the function AOTAutograd traces so each tracing pass starts from the entry "
        "state, leaves none behind, and returns new tensor attributes as extra outputs. "
        "aot_module_simplified calls it as a module global.",
    ),
    Patch(
        "torch._functorch.aot_autograd",
        "aot_module_simplified",
        aot_layer.make_aot_module_simplified_hook,
        why="Plan the writes of one compile and replay them after each call of the compiled "
        "graph (direct callers of torch._functorch.aot_autograd.aot_module_simplified).",
    ),
    Patch(
        "torch._dynamo.backends.common",
        "aot_module_simplified",
        aot_layer.make_aot_module_simplified_hook,
        why="The same, for every AOTAutograd-based Dynamo backend (aot_eager, inductor, "
        "aot_autograd(...)): backends/common.py imports aot_module_simplified by name.",
    ),
    Patch(
        "functorch.compile",
        "aot_module_simplified",
        aot_layer.make_aot_module_simplified_hook,
        why="The same, for users of the public functorch.compile name (bound by value).",
    ),
    Patch(
        "torch._functorch.aot_autograd",
        "aot_function",
        aot_layer.make_aot_function_hook,
        why="Plan and replay writes for direct aot_function users; aot_module calls it as a "
        "module global.",
    ),
    Patch(
        "functorch.compile",
        "aot_function",
        aot_layer.make_aot_function_hook,
        why="The same, for users of the public functorch.compile name (bound by value).",
    ),
    Patch(
        "torch.export._trace",
        "create_functional_call",
        aot_layer.make_export_functional_call_hook,
        why="Non-strict torch.export traces through it (imported by name) with no run-time "
        "epilogue: writes made there are refused instead of silently dropped.",
    ),
    Patch(
        "torch._functorch.compilers",
        "aot_function",
        aot_layer.make_aot_function_hook,
        why="The same, for functorch's ready-made compilers (memory_efficient_fusion, ...), "
        "which import aot_function by name.",
    ),
    Patch(
        "torch._functorch._aot_autograd.collect_metadata_analysis",
        "coerce_tangent_and_suggest_memory_format",
        aot_layer.make_coerce_tangent_hook,
        why="Tangent coercion runs on a pass's outputs after the pass undid its ctx-state "
        "writes; DTensor needs the mask to coerce a _MaskPartial output, so it sees the "
        "state the pass left, undone again after. Called as a module global.",
    ),
    Patch(
        "torch._functorch._aot_autograd.graph_capture_wrappers",
        "apply_in_graph_mutations",
        writeback.make_apply_in_graph_mutations,
        why="Data mutations of subclass inputs kept in the graph are written back with the "
        "subclass's own copy_, which DTensor cannot dispatch for a _MaskPartial input (the "
        "reduction masks the pending local shard in place); fall back to copying the inner "
        "tensors when old and new have the same flatten ctx. Called as a module global.",
    ),
    Patch(
        "torch._functorch._aot_autograd.subclass_codegen",
        "_compile_and_exec_source",
        writeback.make_compile_and_exec_source,
        why="The same for the run-time mutation epilogue AOTAutograd generates "
        "(_apply_mutations): its copy_ calls go through the same fallback. Imported by "
        "name inside the functions that call it, so the module global is the one to wrap.",
    ),
]

_PATCHES = PatchSet(TABLE)


def _compile_lock() -> contextlib.AbstractContextManager:
    # Dynamo holds this lock for a whole trace plus the backend compile: switching the
    # patches under it never lands in the middle of another thread's compile.
    from torch._dynamo.convert_frame import compile_lock

    return compile_lock


def enable() -> None:
    """Apply the patch table. Idempotent. Fails naming the target on an unsupported torch.
    Waits for a compile running in another thread to finish."""
    _compat.check_supported()
    with _compile_lock():
        _PATCHES.apply()
        ctx_state.register_defaults()


def disable() -> None:
    """Undo every patch, restoring the exact original torch objects. Idempotent.
    Waits for a compile running in another thread to finish."""
    with _compile_lock():
        _PATCHES.undo()
        dynamo_layer.release_dispatch_frames()


def is_enabled() -> bool:
    return _PATCHES.applied


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """``with dynamo_ext.enabled(): ...`` enables for the block, then restores the previous state."""
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()
