"""dynamo_ext: attribute writes made inside ``__torch_dispatch__`` survive ``torch.compile``.

Public API.  ``enable()`` applies the patch table (``patch_table.TABLE``);
``disable()`` puts back the exact torch objects and takes off every trace-scoped hook.  With it enabled, a traceable
tensor subclass that writes attributes on its inputs inside
``__torch_dispatch__`` compiles with eager semantics: after a compiled call the
inputs hold the attributes eager would have left, or compilation refuses the
write with a clear error (upstream: pytorch #130028).

Modules, in the order of the flow:
    _compat       torch version facts
    _patches      patch machinery: the table's PatchSet, trace-scoped class hooks, code marks
    patch_table   every change to torch's modules
    config        switches (torch's config-module machinery)
    errors        refusal records
    values        what a written or read value is, and whether it can be replayed
    capture       records every read and write a trace makes (compile time, both layers)
    handoff       the Dynamo layer's record for the AOTAutograd layer; graph nodes both use
    dynamo_layer  answers reads, records writes with Dynamo's SideEffects (compile time);
                  Dynamo's residual bytecode replays them (run time)
    aot_layer     plans the writes of AOTAutograd's tracing passes (compile time)
    plan          the frozen write plan and its replay (run time)
    writeback     input data mutations written back per inner tensor where the subclass cannot copy_
    dtensor       DTensor's MaskBuffer: its replay, and its pending mask kept out of fake copies
    free_state    module globals and closure variables dispatch reads (guarded) or changes (refused)
    guards        Dynamo guards on what a trace read
    counters      counters written in the backward, replayed as arithmetic
    introspect    what the compiled code replays (residual bytecode)
    testing       a wrapper subclass base for tests
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from . import _compat, _patches, aot_layer, config, dtensor, free_state
from ._patches import Patch, PatchSet, PatchTargetError
from .capture import register_ctx_state
from .errors import RefusalKind, SubclassWriteError
from .patch_table import TABLE

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
        aot_layer.resolve_entry_codes()
        if _compat.HAS_DISTRIBUTED:
            dtensor.register_defaults()


def disable() -> None:
    """Undo every patch, restoring the exact original torch objects, and take off every
    trace-scoped hook. Idempotent. Waits for a compile running in another thread to finish."""
    with _compile_lock():
        _PATCHES.undo()
        _patches.CLASS_HOOKS.remove_all()
        _patches.VERSION_HOOKS.remove_all()
        _patches.CODE_MARKS.release_all()


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
