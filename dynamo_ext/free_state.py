"""State dispatch code reads or changes outside the objects it is given: module globals
and closure variables (compile time).

Dynamo guards the globals and closure variables of the code it traces; dispatch code
runs during fake propagation instead, where Dynamo does not see it, so a module-level
scale factor the user changes between calls would stay baked into the compiled graph.

- ``Collector`` records which user code objects ran during one op (a profile hook,
  installed only while dispatch of a tracked object runs, and only when no other
  profiler is installed); ``reads`` then lists the globals and closure variables that
  code can load, for the Dynamo layer to guard them as it guards a user's own.
- ``ModuleWatch`` notices dispatch rebinding a module global or mutating a module-level
  container (a global log list), which no compiled program can replay: the watch puts
  the module back and the layer refuses the op (it then runs eagerly).
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import functools
import gc
import os
import sys
import sysconfig
import types
from typing import Any, Iterator

import torch

_EXCLUDED_DIRS = tuple(
    os.path.realpath(p) + os.sep
    for p in {
        os.path.dirname(torch.__file__),
        os.path.dirname(__file__),
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["platstdlib"],
    }
)


@functools.lru_cache(maxsize=4096)
def is_user_code(filename: str) -> bool:
    """Code outside torch, dynamo_ext and the standard library (third-party packages such
    as torchao count as user code: their dispatch reads their own globals)."""
    if not filename or filename.startswith("<"):
        return not filename.startswith("<frozen")
    return not os.path.realpath(filename).startswith(_EXCLUDED_DIRS)


@functools.lru_cache(maxsize=4096)
def loaded_globals(code: types.CodeType) -> tuple[str, ...]:
    return tuple(
        sorted({i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")})
    )


@dataclasses.dataclass(frozen=True)
class FreeRead:
    """A global (``cell`` None) or closure variable (``cell`` set) user code can load."""

    module: str | None  # the module whose globals hold it (globals); None for a closure
    name: str
    value: Any
    cell: Any = None
    code_name: str = ""


class Collector:
    """The user code objects that ran while the block ran, with their globals and closure cells."""

    def __init__(self) -> None:
        self.seen: set[types.CodeType] = set()
        self._user_codes: list[types.CodeType] = []
        self._new: list[tuple[types.CodeType, dict, dict]] = []

    @staticmethod
    def _closure_cells(code: types.CodeType, frame_locals: dict) -> dict[str, Any]:
        """The cells of the function running ``code`` (found through the gc: frames do not
        point to their function), matched by the values the frame sees."""
        if not code.co_freevars:
            return {}
        for fn in gc.get_referrers(code):
            if isinstance(fn, types.FunctionType) and fn.__code__ is code and fn.__closure__:
                cells = dict(zip(code.co_freevars, fn.__closure__))
                if all(_cell_value(c) is frame_locals.get(n, _cell_value(c)) for n, c in cells.items()):
                    return cells
        return {}

    def collect(self) -> "contextlib.AbstractContextManager[None]":
        return _profiling(self)

    def _on_call(self, frame: types.FrameType) -> None:
        code = frame.f_code
        if code in self.seen:
            return
        self.seen.add(code)
        if is_user_code(code.co_filename):
            # A closure made by code that ran here (a lambda or comprehension inside
            # dispatch) closes over that call's locals: not state outside the op.
            made_here = any(code in c.co_consts for c in self._user_codes)
            cells = {} if made_here else self._closure_cells(code, frame.f_locals)
            self._user_codes.append(code)
            self._new.append((code, frame.f_globals, cells))

    def reads(self) -> Iterator[FreeRead]:
        """Globals and closure variables of the code objects seen since the last call."""
        new, self._new = self._new, []
        for code, f_globals, cells in new:
            module = f_globals.get("__name__")
            for name in loaded_globals(code):
                if name in f_globals:
                    yield FreeRead(module, name, f_globals[name], code_name=getattr(code, 'co_qualname', code.co_name))
            for name, cell in cells.items():
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                yield FreeRead(None, name, value, cell=cell, code_name=getattr(code, 'co_qualname', code.co_name))


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return None


@contextlib.contextmanager
def _profiling(collector: Collector) -> Iterator[None]:
    if sys.getprofile() is not None:  # someone else profiles: leave them be (documented limit)
        yield
        return

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call":
            collector._on_call(frame)

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


# --------------------------------------------------------------------------- #
# Globals changed by dispatch
# --------------------------------------------------------------------------- #

_CONTAINERS = (list, dict, set, bytearray)


def _contents(value: Any) -> Any:
    """A shallow copy to compare by identity and to refill from."""
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, set):
        return set(value)
    return list(value)


def _same_contents(value: Any, contents: Any) -> bool:
    if isinstance(value, dict):
        return value.keys() == contents.keys() and all(value[k] is contents[k] for k in contents)
    if isinstance(value, set):
        return value == contents
    return len(value) == len(contents) and all(a is b for a, b in zip(value, contents))


@dataclasses.dataclass(frozen=True)
class GlobalChange:
    module: str
    name: str
    what: str  # "rebound" or "mutated in place"


class ModuleWatch:
    """Module namespaces whose globals a traced op must leave as it found them."""

    def __init__(self) -> None:
        self.modules: dict[str, dict] = {}

    def add(self, module_name: str | None) -> None:
        if not module_name or module_name in self.modules:
            return
        module = sys.modules.get(module_name)
        if module is None or not is_user_code(getattr(module, "__file__", "") or ""):
            return
        self.modules[module_name] = vars(module)

    @contextlib.contextmanager
    def watching(self) -> Iterator[list[GlobalChange]]:
        """Yield a list that, after the block, holds what the block changed (and undid)."""
        before = {
            name: (dict(ns), {k: _contents(v) for k, v in ns.items() if type(v) in _CONTAINERS})
            for name, ns in self.modules.items()
        }
        changes: list[GlobalChange] = []
        try:
            yield changes
        finally:
            for module_name, (bindings, containers) in before.items():
                ns = self.modules[module_name]
                for key in set(ns) | set(bindings):
                    if key.startswith("__"):
                        continue
                    if ns.get(key, _ABSENT) is not bindings.get(key, _ABSENT):
                        changes.append(GlobalChange(module_name, key, "rebound"))
                        if key in bindings:
                            ns[key] = bindings[key]
                        else:
                            del ns[key]
                for key, contents in containers.items():
                    value = ns.get(key)
                    if value is not None and not _same_contents(value, contents):
                        changes.append(GlobalChange(module_name, key, "mutated in place"))
                        _refill(value, contents)


_ABSENT = object()


def _refill(value: Any, contents: Any) -> None:
    if isinstance(value, (dict, set)):
        value.clear()
        value.update(contents)
    else:
        value[:] = contents
