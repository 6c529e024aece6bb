"""Dynamo guards on what a trace read from real objects (compile time, both layers).

The Dynamo layer guards what fake propagation read; the AOTAutograd layer adds guards
for what only its own passes read (the traced backward, a pass taking another branch),
while Dynamo's guards for the frame are still being collected (they are built after the
backend returns).  Constants are guarded by value, never through ``VariableBuilder``,
whose ints and floats may become symbolic inputs.
"""

from __future__ import annotations

import copy
import enum
import functools
from typing import Any, Callable

import torch


def guard(source: Any, kind: str, **kwargs: Any) -> None:
    from torch._dynamo.guards import GuardBuilder, install_guard

    fn = getattr(GuardBuilder, kind)
    install_guard(source.make_guard(functools.partial(fn, **kwargs) if kwargs else fn))


def lambda_(source: Any, check: Callable[[Any], bool], text: str) -> None:
    """A guard with no GuardBuilder method of its own."""
    from torch._dynamo.guards import install_guard

    install_guard(source.make_guard(lambda builder, guard: add_lambda(builder, guard, check, text)))


def add_lambda(builder: Any, guard: Any, check: Callable[[Any], bool], text: str) -> None:
    """Inside a GuardBuilder method: ``check`` on the guarded value, shown as ``<value> text``."""
    from torch._dynamo.guards import get_verbose_code_parts

    code = f"{builder.arg_ref(guard)} {text}"
    builder.get_guard_manager(guard).add_lambda_guard(check, get_verbose_code_parts(code, guard), guard.user_stack)


def version(source: Any, value: int) -> None:
    """Guard a tensor's version counter."""
    lambda_(source, lambda x: x._version == value, f"._version == {value}")


def absent(source: Any, name: str) -> None:
    """Guard that ``name`` is still not in the real object's ``__dict__``."""
    from torch._dynamo.source import AttrSource

    guard(AttrSource(source, "__dict__"), "DICT_NOT_CONTAINS", key=name)


def keys(source: Any) -> None:
    """Guard which attributes the real object's ``__dict__`` holds."""
    from torch._dynamo.source import AttrSource

    guard(AttrSource(source, "__dict__"), "DICT_KEYS_MATCH")


# Values Dynamo's EQUALS_MATCH guard accepts (guards.py, GuardBuilder.EQUALS_MATCH).
_EQUALS_GUARDABLE = (
    int, float, complex, bool, str, bytes, type(None), tuple, frozenset, list, set,
    torch.Size, torch.dtype, torch.device, torch.layout, torch.memory_format,
)


def constant(source: Any, value: Any) -> None:
    """Guard that the real attribute still equals the constant the trace used."""
    if type(value) in _EQUALS_GUARDABLE and not _holds_unguardable(value):
        guard(source, "EQUALS_MATCH")  # a float zero's sign too (See Note [The sign of a float zero])
    elif isinstance(value, enum.Enum):
        guard(source, "ID_MATCH")
    else:  # a frozen dataclass, a dict of constants, ...: compared by ==
        _by_value(source, value)


def _by_value(source: Any, value: Any) -> None:
    """The object ``source`` holds is ``value`` and still equals it.

    Dynamo may hold a dict or list guard manager for the same source (user code read the
    container too), which takes no lambda guard: the identity is guarded on the source
    (ID_MATCH, which every manager takes) and the value by a root guard on that object.
    """
    from torch._dynamo.guards import get_verbose_code_parts, install_guard
    from torch._dynamo.source import AttrSource

    try:
        expected = copy.deepcopy(value)
    except Exception:  # ``sys.version_info`` (a struct sequence of C code): immutable, kept as is
        from .values import is_immutable_constant

        if not is_immutable_constant(value):
            raise
        expected = value
    if isinstance(source, AttrSource):
        # An attribute: read again from its holder, by value (another object holding an
        # equal value passes: NestedTensor's metadata cache is a new dict per tensor).
        name = source.member

        def check(holder: Any) -> bool:
            now = getattr(holder, name, _ABSENT)
            return type(now) is type(expected) and now == expected

        lambda_(source.base, check, f".{name} == {expected!r}")
        return
    guard(source, "ID_MATCH")

    def create(builder: Any, g: Any) -> None:
        code = f"{builder.arg_ref(g)} == {expected!r}"
        builder.guard_manager.root.add_lambda_guard(
            lambda _: type(value) is type(expected) and value == expected, get_verbose_code_parts(code, g), g.user_stack
        )

    install_guard(source.make_guard(create))


_ABSENT = object()


def _holds_unguardable(value: Any) -> bool:
    """Containers holding values EQUALS_MATCH cannot compare (nested dicts, objects)."""
    if isinstance(value, (tuple, frozenset, list, set)):
        return any(type(v) not in _EQUALS_GUARDABLE or _holds_unguardable(v) for v in value)
    return False
