"""Inspection of what the compiled code replays at run time.

Dynamo's residual bytecode (the code that runs after the compiled graph) is
where the recorded writes become ``STORE_ATTR`` / ``DELETE_ATTR``
instructions.  ``residual_writes()`` collects them for every frame compiled
inside the block, read with the ``bytecode`` package through Dynamo's official
bytecode hook (``torch._dynamo.convert_frame.register_bytecode_hook``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import CodeType
from typing import Iterator

import bytecode


@dataclasses.dataclass
class CompiledFrame:
    name: str  # the user function's name
    stores: list[str]  # STORE_ATTR names, in order
    deletes: list[str]  # DELETE_ATTR names, in order


def attr_writes_in(code: CodeType) -> tuple[list[str], list[str]]:
    """``(STORE_ATTR names, DELETE_ATTR names)`` in one code object."""
    stores, deletes = [], []
    for instr in bytecode.Bytecode.from_code(code):
        if not isinstance(instr, bytecode.Instr):
            continue
        if instr.name == "STORE_ATTR":
            stores.append(instr.arg)
        elif instr.name == "DELETE_ATTR":
            deletes.append(instr.arg)
    return stores, deletes


@contextlib.contextmanager
def residual_writes() -> Iterator[list[CompiledFrame]]:
    """Collect the attribute stores in the bytecode of each frame compiled in the block."""
    from torch._dynamo.convert_frame import register_bytecode_hook

    frames: list[CompiledFrame] = []

    def hook(old_code: CodeType, new_code: CodeType) -> None:
        stores, deletes = attr_writes_in(new_code)
        frames.append(CompiledFrame(old_code.co_name, stores, deletes))

    handle = register_bytecode_hook(hook)
    try:
        yield frames
    finally:
        handle.remove()
