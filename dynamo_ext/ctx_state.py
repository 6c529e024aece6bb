"""State held by objects reachable from a subclass's flatten ctx: journal and undo.

Some subclasses keep mutable state not on the tensor but on an object its ctx
points to, shared by reference with every instance unflattened from that ctx:
DTensor's ``_MaskPartial`` placement holds a ``MaskBuffer`` whose ``data`` and
``refcount`` dispatch sets and clears (``materialize_mask`` / ``release_mask``).
The same object is also shared across calls through DTensor's sharding
propagation caches, so a write made while tracing lands in eager's state
(pytorch #160697 and the "conflicting data" / "Please convert all Tensors to
FakeTensors" failures after a compile).

A ``__dict__`` diff of the tensor cannot see these writes, and the object is
often created inside dispatch (reachable only from an *output*), so it cannot be
discovered from the inputs before the op.  Instead its class is registered
(``register_ctx_state``; DTensor's ``MaskBuffer`` is registered by default) and,
while a ``Journal`` is open, every attribute assignment on an instance of a
registered class is journaled with the value it replaced.  Tracing passes open a
journal, read the net writes off it, and undo them.  This is the compile-time
half; the AOTAutograd layer replays the net writes at run time.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import torch

from .capture import MISSING, _same_value

#: A path from a tensor to an object: ("attr", name) and ("item", index) steps.
Path = tuple[tuple[str, Any], ...]

_REGISTERED: set[type] = set()
_OPEN: list["Journal"] = []
_INSTALLED: dict[type, Any] = {}  # class -> its own __setattr__ before ours (or MISSING)
_INSTALLED_INIT: dict[type, Any] = {}  # class -> its own __init__ before ours (or MISSING)


def register_ctx_state(cls: type) -> type:
    """Declare that instances of ``cls`` hold state that dispatch mutates and that is
    reachable from a flatten ctx. Usable as a class decorator."""
    _REGISTERED.add(cls)
    return cls


def register_defaults() -> None:
    from ._compat import HAS_DISTRIBUTED

    if HAS_DISTRIBUTED:
        from torch.distributed.tensor._ops._mask_buffer import MaskBuffer

        register_ctx_state(MaskBuffer)


def _make_setattr(cls: type, prev: Any) -> Callable[[Any, str, Any], None]:
    def __setattr__(obj: Any, name: str, value: Any) -> None:
        for journal in _OPEN:
            journal.note(obj, name)
        if prev is MISSING:
            super(cls, obj).__setattr__(name, value)
        else:
            prev(obj, name, value)

    return __setattr__


def _make_init(cls: type, prev: Any) -> Callable[..., None]:
    def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:
        if prev is MISSING:
            super(cls, obj).__init__(*args, **kwargs)
        else:
            prev(obj, *args, **kwargs)
        if type(obj) is cls:
            for journal in _OPEN:
                journal.constructed(obj)

    return __init__


def _install() -> None:
    for cls in _REGISTERED:
        if cls not in _INSTALLED:
            _INSTALLED[cls] = cls.__dict__.get("__setattr__", MISSING)
            cls.__setattr__ = _make_setattr(cls, _INSTALLED[cls])  # type: ignore[method-assign]
            _INSTALLED_INIT[cls] = cls.__dict__.get("__init__", MISSING)
            cls.__init__ = _make_init(cls, _INSTALLED_INIT[cls])  # type: ignore[misc]


def _uninstall() -> None:
    for table, name in ((_INSTALLED, "__setattr__"), (_INSTALLED_INIT, "__init__")):
        for cls, prev in table.items():
            if prev is MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, prev)
        table.clear()


class Journal:
    """While open: the value each attribute of each registered object had before its first write.

    An object constructed while the journal is open (its ``__init__`` ran) counts as having
    existed in its constructed state: what ``__init__`` left is its state "before". Undo
    then leaves it as constructed, not stripped, and the net writes are those dispatch made
    after construction.
    """

    def __init__(self) -> None:
        self._old: dict[tuple[int, str], tuple[Any, str, Any]] = {}
        self._open = False
        # Only the tracing thread's writes are the trace's: another thread's eager writes
        # to a shared state object while this one compiles are its own, never undone.
        self._thread = threading.get_ident()

    def open(self) -> "Journal":
        if not self._open:
            if not _OPEN:
                _install()
            _OPEN.append(self)
            self._open = True
        return self

    def close(self) -> None:
        if self._open:
            _OPEN.remove(self)
            self._open = False
            if not _OPEN:
                _uninstall()

    def __enter__(self) -> "Journal":
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def note(self, obj: Any, name: str) -> None:
        if threading.get_ident() != self._thread:
            return
        key = (id(obj), name)
        if key not in self._old:
            self._old[key] = (obj, name, obj.__dict__.get(name, MISSING))

    def constructed(self, obj: Any) -> None:
        """``obj``'s ``__init__`` just returned: its state now is its state before."""
        if threading.get_ident() != self._thread:
            return
        for name, value in vars(obj).items():
            self._old[(id(obj), name)] = (obj, name, value)

    def net_writes(self) -> list[tuple[Any, str, Any, Any]]:
        """``(object, attribute, value before, value now)`` for every attribute that changed."""
        out = []
        for obj, name, old in self._old.values():
            new = obj.__dict__.get(name, MISSING)
            if old is MISSING or new is MISSING or not _same_value(old, new):
                if not (old is MISSING and new is MISSING):
                    out.append((obj, name, old, new))
        return out

    def undo(self) -> None:
        """Put every journaled attribute back, newest first."""
        for obj, name, old in reversed(list(self._old.values())):
            if old is MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = old
        self._old.clear()


def find_state(root: Any, max_depth: int = 5, from_value: bool = False) -> Iterator[tuple[Path, Any]]:
    """Registered state objects reachable from ``root``'s attributes (through plain
    objects, dataclasses, tuples and lists), with the path that reaches each.
    ``from_value``: start at ``root`` itself (a ctx) rather than at its attributes."""
    if not _REGISTERED:
        return
    seen: set[int] = set()

    def walk(value: Any, path: Path, depth: int) -> Iterator[tuple[Path, Any]]:
        if id(value) in seen or isinstance(value, (torch.Tensor, type)) or callable(value):
            return
        seen.add(id(value))
        if type(value) in _REGISTERED:
            yield path, value
        elif depth < max_depth:
            if isinstance(value, (tuple, list)):
                for i, v in enumerate(value):
                    yield from walk(v, path + (("item", i),), depth + 1)
            elif hasattr(value, "__dict__") and not isinstance(value, type(torch)):
                for k, v in list(vars(value).items()):
                    yield from walk(v, path + (("attr", k),), depth + 1)

    if from_value:
        yield from walk(root, (), 0)
        return
    for k in _attribute_names(root):
        if hasattr(root, k):
            yield from walk(getattr(root, k), (("attr", k),), 1)


def make_guard_deepcopy(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``deepcopy`` as bound in ``torch._dynamo.guards``.

    Guards deep-copy a subclass's ctx (DTensor's spec) to compare later calls with
    it. A registered state object is shared state, not a value: a copy breaks
    identity-based equality (``_MaskPartial.__eq__`` compares its MaskBuffer with
    ``is``), and copying its holder may even drop it (a copied ``_MaskPartial`` has
    no ``mask_buffer``), so the guard would fail on the very frame that built it.
    The copy keeps registered objects, and the objects on the way to them, as they are.
    """

    def deepcopy(x: Any, memo: Any = None, *args: Any) -> Any:
        if _REGISTERED:
            memo = {} if memo is None else memo
            for path, _ in find_state(x, from_value=True):
                cur = x
                for step in path:
                    cur = follow(cur, (step,))
                    memo[id(cur)] = cur
        return original(x, memo, *args)

    return deepcopy


def _attribute_names(obj: Any) -> list[str]:
    """``__dict__`` keys and ``__slots__`` (DTensor keeps ``_spec`` in a slot)."""
    names = list(vars(obj)) if hasattr(obj, "__dict__") else []
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [n for n in slots if n not in ("__dict__", "__weakref__")]
    return list(dict.fromkeys(names))


def follow(root: Any, path: Path) -> Any:
    obj = root
    for kind, key in path:
        obj = getattr(obj, key) if kind == "attr" else obj[key]
    return obj
