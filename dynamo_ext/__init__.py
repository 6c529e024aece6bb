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
    errors        refusals
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from . import _compat, aot_layer, config, dynamo_layer
from ._patches import Patch, PatchSet, PatchTargetError
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
        "torch._functorch.aot_autograd",
        "prepare_aot_module_simplified",
        aot_layer.make_prepare_hook,
        why="Wrap the function AOTAutograd traces so each tracing pass starts from the entry "
        "state and leaves none behind. aot_module_simplified calls it as a module global.",
    ),
]

_PATCHES = PatchSet(TABLE)


def enable() -> None:
    """Apply the patch table. Idempotent. Fails naming the target on an unsupported torch."""
    _compat.check_supported()
    _PATCHES.apply()


def disable() -> None:
    """Undo every patch, restoring the exact original torch objects. Idempotent."""
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
