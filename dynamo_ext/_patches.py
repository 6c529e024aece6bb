"""Patch machinery: the table's rows and the set that applies them, trace-scoped class
hooks, and run-eagerly marks on code objects.

Each ``Patch`` row names a target (module path + attribute), the replacement, why it is
needed and the torch release lines it applies to.  ``PatchSet.apply()`` resolves every
applicable target first and fails naming the first one that is missing or not what the
table expects (a function the row says is defined there but is now only re-exported,
say); only then does it swap anything.  ``undo()`` puts back the exact original objects
(tests check them with ``is``).  Every replacement counts its calls (``hits``), so tests
can prove each row is live on every supported torch.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import re
import threading
import types
from typing import Any, Callable, Iterable

from . import _compat
from .values import MISSING as _MISSING

_PLAIN_CALLABLES = (types.FunctionType, type(object.__getattribute__), types.BuiltinFunctionType)
_ALL_VERSIONS = _compat.SUPPORTED


@dataclasses.dataclass(frozen=True)
class Patch:
    module: str  # dotted module path, or "module:Class" for a class attribute
    attr: str
    make_replacement: Callable[[Any], Any]  # original function -> replacement function
    why: str
    versions: tuple[tuple[int, int], tuple[int, int]] = _ALL_VERSIONS  # release lines [first, last]
    #: The target is defined in ``module`` (not re-exported there): checked at enable(), so a
    #: function moved elsewhere (still importable under the old name, no longer called
    #: through it) fails loudly instead of leaving the row inert.
    defined_here: bool = True
    #: Called while compiled code runs (not only while compiling): the replacement runs with
    #: Dynamo's frame evaluation off, so a frame Dynamo is watching (a ``backward()`` after a
    #: graph break) does not trace dynamo_ext's own code.
    runtime: bool = False

    @property
    def target(self) -> str:
        return f"{self.module.replace(':', '.')}.{self.attr}"

    @property
    def versions_text(self) -> str:
        (a, b), (c, d) = self.versions
        return f"{a}.{b}" if (a, b) == (c, d) else f"{a}.{b}-{c}.{d}"

    def stored(self, owner: Any = None) -> Any:
        """The attribute as the owner holds it (``_MISSING`` where it does not)."""
        owner = self.owner() if owner is None else owner
        if not hasattr(owner, "__dict__"):  # an entry object with slots: its own attribute
            return getattr(owner, self.attr, _MISSING)
        # the owner's own namespace: a class attribute inherited from a base would be
        # shadowed, not patched, by setattr
        return vars(owner).get(self.attr, _MISSING)

    def owner(self) -> Any:
        """The module, class, or (``Class.table[key]``) an entry of a class's table."""
        mod_name, _, path = self.module.partition(":")
        owner: Any = importlib.import_module(mod_name)
        for name, key in re.findall(r"(\w+)(?:\[(\w+)\])?", path):
            owner = getattr(owner, name)
            if key:
                owner = owner[key]
        return owner


class PatchTargetError(RuntimeError):
    """A patch target is missing or changed: this torch is not the one the table was written for."""


#: Calls of each replacement since enable(): ``{target: count}``.
HITS: collections.Counter[str] = collections.Counter()


def _counted(target: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        HITS[target] += 1
        return fn(*args, **kwargs)

    return counted


class PatchSet:
    """Applies a table of patches as one unit, and undoes it exactly."""

    def __init__(self, table: list[Patch]) -> None:
        self.table = table
        self._originals: list[tuple[Patch, Any, Any]] = []  # (patch, owner, original)

    @property
    def applied(self) -> bool:
        return bool(self._originals)

    def rows(self) -> list[Patch]:
        """The rows that apply to this torch."""
        return [p for p in self.table if _compat.applies(p.versions)]

    def resolve(self) -> list[tuple[Patch, Any, Any]]:
        resolved = []
        for patch in self.rows():
            def fail(detail: str, patch: Patch = patch) -> PatchTargetError:
                return PatchTargetError(
                    f"dynamo_ext cannot patch {patch.target} (written for torch {patch.versions_text}, "
                    f"found {_compat.TORCH_VERSION}): {detail}. Needed because: {patch.why}"
                )

            try:
                owner = patch.owner()
            except (ImportError, AttributeError) as e:
                raise fail(str(e)) from e
            value = patch.stored(owner)
            fn = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            if value is _MISSING or not callable(fn):
                raise fail("not found")
            defined_in = patch.module.partition(":")[0]
            if patch.defined_here and getattr(fn, "__module__", defined_in) != defined_in:
                raise fail(f"it is now defined in {fn.__module__} and only re-exported here")
            resolved.append((patch, owner, value))
        return resolved

    def apply(self) -> None:
        if self.applied:
            return
        resolved = self.resolve()
        for patch, owner, original in resolved:
            kind = type(original) if isinstance(original, (classmethod, staticmethod)) else None
            fn = original.__func__ if kind else original
            replacement = _counted(patch.target, patch.make_replacement(fn))
            if patch.runtime:
                import torch._dynamo

                replacement = torch._dynamo.disable(replacement)
            setattr(owner, patch.attr, kind(replacement) if kind else replacement)
            self._originals.append((patch, owner, original))

    def undo(self) -> None:
        while self._originals:
            patch, owner, original = self._originals.pop()
            setattr(owner, patch.attr, original)


# --------------------------------------------------------------------------- #
# Trace-scoped hooks on classes (tensor subclasses, registered state classes)
# --------------------------------------------------------------------------- #


class _HookHandle:
    def __init__(self, registry: "ClassHooks", classes: list[type]) -> None:
        self._registry = registry
        self._classes = classes

    def remove(self) -> None:
        classes, self._classes = self._classes, []
        self._registry._release(classes)


class ClassHooks:
    """Attribute hooks put on classes while a trace runs, and taken off after.

    Every hook goes through ``install`` (reference-counted per class, so nested and
    concurrent traces share one set) and comes off when its handle is removed, or
    all at once with ``remove_all()`` (``dynamo_ext.disable()``).  ``original`` gives
    what a class defines itself, ignoring the hooks, so code that walks the MRO never
    mistakes a hook for the user's method.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count: dict[type, int] = {}
        self._saved: dict[type, dict[str, Any]] = {}  # class -> name -> its own value (or MISSING)

    def original(self, klass: type, name: str) -> Any:
        return original_attribute(klass, name)

    def _base(self, cls: type) -> Callable[[str], Any]:
        """``base(name)``: a plain function ``(obj, *args)`` running what ``cls`` would run
        for the special method ``name`` without the hooks."""

        def base(name: str) -> Any:
            for klass in cls.__mro__:
                value = self.original(klass, name)
                if value is not _MISSING:
                    if type(value) in _PLAIN_CALLABLES:
                        return value
                    # Another descriptor (a partialmethod, say): bind it per call.
                    return lambda obj, *args, _d=value: _d.__get__(obj, type(obj))(*args)
            raise AttributeError(name)

        return base

    def install(self, classes: Iterable[type], make_hooks: Callable[[type, Callable[[str], Any]], dict[str, Any]]) -> _HookHandle:
        """Hook every class in ``classes`` (subclasses before their bases do not matter:
        each hook wraps the class's own original behaviour)."""
        from . import free_state

        taken: list[type] = []
        with self._lock:
            for cls in classes:
                if free_state.is_c_class(cls):
                    continue  # Python's own, or another class of C code (immutable: no hooks)
                if self._count.get(cls, 0) == 0:
                    hooks = make_hooks(cls, self._base(cls))
                    self._saved[cls] = {name: cls.__dict__.get(name, _MISSING) for name in hooks}
                    for name, hook in hooks.items():
                        setattr(cls, name, hook)
                self._count[cls] = self._count.get(cls, 0) + 1
                taken.append(cls)
        return _HookHandle(self, taken)

    def _release(self, classes: list[type]) -> None:
        with self._lock:
            for cls in classes:
                self._count[cls] -= 1
                if self._count[cls] == 0:
                    self._uninstall(cls)

    def _uninstall(self, cls: type) -> None:
        del self._count[cls]
        for name, value in self._saved.pop(cls).items():
            if value is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, value)

    def remove_all(self) -> None:
        with self._lock:
            for cls in list(self._count):
                self._uninstall(cls)

    def hooked(self) -> list[type]:
        with self._lock:
            return list(self._count)


#: The registries of class hooks (``dynamo_ext.disable()`` removes them all): attribute
#: access on traced objects, and ``_version`` on trace tensors (a second registry because
#: a class can carry both).
CLASS_HOOKS = ClassHooks()
VERSION_HOOKS = ClassHooks()


class CodeMarks:
    """Code objects marked to run eagerly (never compiled by Dynamo), undone by ``disable()``.

    A dispatch write or read that is refused becomes a graph break: the op then runs
    eagerly in the user's frame, and its ``__torch_dispatch__`` frame must not be
    compiled on its own (it would meet the same state problem under a stock error).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._codes: set[Any] = set()

    def run_eagerly(self, code: Any, recursive: bool = True) -> None:
        """Never compile ``code``; ``recursive``: nor the functions it calls."""
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        inner = FrameAction.SKIP if recursive else FrameAction.DEFAULT
        with self._lock:
            set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, inner))
            self._codes.add(code)

    def release_all(self) -> None:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        with self._lock:
            while self._codes:
                code = self._codes.pop()
                set_code_exec_strategy(code, FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT))

    def is_marked(self, code: Any) -> bool:
        with self._lock:
            return code in self._codes

    def marked(self) -> set[Any]:
        with self._lock:
            return set(self._codes)


#: The one registry of code marks.
CODE_MARKS = CodeMarks()


def original_attribute(klass: type, name: str) -> Any:
    """What ``klass`` itself defines as ``name``, ignoring every dynamo_ext hook (MISSING if nothing)."""
    for registry in (CLASS_HOOKS, VERSION_HOOKS):
        saved = registry._saved.get(klass)
        if saved is not None and name in saved:
            return saved[name]
    return klass.__dict__.get(name, _MISSING)
