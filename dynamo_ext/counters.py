"""Counters written in the backward: recorded as arithmetic on what the backward read.

AOTAutograd traces the backward once, at compile time; eager runs dispatch again at
every ``backward()``.  A backward that counts (``self.bwd = self.bwd + 1``) would be
replayed as the constant it wrote while traced.  Instead, while the backward is traced,
an int attribute of a tracked instance reads as a ``CountedInt``: an int (the traced
value) that also records how it was computed from the attributes read.  A written
``CountedInt`` is planned as that expression and evaluated on the real objects each
time the compiled backward runs (``evaluate``).

What the traced code decided from such a value (a comparison, a branch) is recorded too
(``Decision``); at run time a decision that would go the other way is refused rather
than replayed (the backward graph was traced for the other branch).  A value that flows
into a tensor op (where torch reads it with ``__index__``) is pinned the same way.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

#: An expression: ("read", key) | ("const", value) | (op name, expr, expr)
Expr = tuple

_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "pow": operator.pow,
    "and": operator.and_,
    "or": operator.or_,
    "xor": operator.xor,
    "lshift": operator.lshift,
    "rshift": operator.rshift,
    "max": max,
    "min": min,
}
_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
}


@dataclasses.dataclass(frozen=True)
class Decision:
    """``expr`` evaluated to ``value`` while traced (a comparison's outcome, a pinned int)."""

    expr: Expr
    value: Any


class Tape:
    """The decisions the traced backward made from counted values."""

    def __init__(self) -> None:
        self.decisions: list[Decision] = []
        self.values: set[int] = set()  # every counted value the backward held
        # a counted value was read where no PinsCountedArguments sees the ops it may reach
        self.unseen = False


def _expr(value: Any) -> Expr:
    return value.expr if isinstance(value, CountedInt) else ("const", value)


class CountedInt(int):
    """An int read from a tracked instance while the backward is traced."""

    expr: Expr
    tape: Tape

    def __new__(cls, value: int, expr: Expr, tape: Tape) -> "CountedInt":
        obj = super().__new__(cls, value)
        obj.expr = expr
        obj.tape = tape
        tape.values.add(value)
        return obj

    def _combine(self, op: str, other: Any, reverse: bool = False) -> Any:
        if type(other) not in (int, CountedInt) or type(other) is bool:
            return self._pin()._plain_op(op, other, reverse)
        a, b = (other, int.__int__(self)) if reverse else (int.__int__(self), int.__int__(other))
        ea, eb = (_expr(other), self.expr) if reverse else (self.expr, _expr(other))
        return CountedInt(_BINARY[op](a, b), (op, ea, eb), self.tape)

    def _plain_op(self, op: str, other: Any, reverse: bool) -> Any:
        a, b = (other, int.__int__(self)) if reverse else (int.__int__(self), other)
        return _BINARY[op](a, b)

    def _pin(self) -> "CountedInt":
        """The value is used as a plain int from here on: the backward depends on it."""
        self.tape.decisions.append(Decision(self.expr, int.__int__(self)))
        return self

    def _compare(self, op: str, other: Any) -> bool:
        result = _COMPARE[op](int.__int__(self), int.__int__(other) if isinstance(other, CountedInt) else other)
        self.tape.decisions.append(Decision((op, self.expr, _expr(other)), result))
        return result

    def __add__(self, o: Any) -> Any: return self._combine("add", o)  # noqa: E704
    def __radd__(self, o: Any) -> Any: return self._combine("add", o, True)  # noqa: E704
    def __sub__(self, o: Any) -> Any: return self._combine("sub", o)  # noqa: E704
    def __rsub__(self, o: Any) -> Any: return self._combine("sub", o, True)  # noqa: E704
    def __mul__(self, o: Any) -> Any: return self._combine("mul", o)  # noqa: E704
    def __rmul__(self, o: Any) -> Any: return self._combine("mul", o, True)  # noqa: E704
    def __floordiv__(self, o: Any) -> Any: return self._combine("floordiv", o)  # noqa: E704
    def __rfloordiv__(self, o: Any) -> Any: return self._combine("floordiv", o, True)  # noqa: E704
    def __mod__(self, o: Any) -> Any: return self._combine("mod", o)  # noqa: E704
    def __rmod__(self, o: Any) -> Any: return self._combine("mod", o, True)  # noqa: E704
    def __pow__(self, o: Any, mod: Any = None) -> Any:  # noqa: E704
        return self._combine("pow", o) if mod is None else pow(int.__int__(self._pin()), o, mod)
    def __and__(self, o: Any) -> Any: return self._combine("and", o)  # noqa: E704
    def __or__(self, o: Any) -> Any: return self._combine("or", o)  # noqa: E704
    def __xor__(self, o: Any) -> Any: return self._combine("xor", o)  # noqa: E704
    def __lshift__(self, o: Any) -> Any: return self._combine("lshift", o)  # noqa: E704
    def __rshift__(self, o: Any) -> Any: return self._combine("rshift", o)  # noqa: E704
    # The rest of int's operations give plain values: the value is used as a plain int
    # (``divmod(n, 3)``, ``n / 2``, ``abs(n)``, ``round(n, -1)``: an outside tester's find,
    # baked silently before), so the backward depends on it.
    def __truediv__(self, o: Any) -> Any: return int.__int__(self._pin()) / o  # noqa: E704
    def __rtruediv__(self, o: Any) -> Any: return o / int.__int__(self._pin())  # noqa: E704
    def __divmod__(self, o: Any) -> Any: return divmod(int.__int__(self._pin()), o)  # noqa: E704
    def __rdivmod__(self, o: Any) -> Any: return divmod(o, int.__int__(self._pin()))  # noqa: E704
    def __rpow__(self, o: Any) -> Any: return pow(o, int.__int__(self._pin()))  # noqa: E704
    def __rand__(self, o: Any) -> Any: return self._combine("and", o, True)  # noqa: E704
    def __ror__(self, o: Any) -> Any: return self._combine("or", o, True)  # noqa: E704
    def __rxor__(self, o: Any) -> Any: return self._combine("xor", o, True)  # noqa: E704
    def __rlshift__(self, o: Any) -> Any: return self._combine("lshift", o, True)  # noqa: E704
    def __rrshift__(self, o: Any) -> Any: return self._combine("rshift", o, True)  # noqa: E704
    def __abs__(self) -> Any: return abs(int.__int__(self._pin()))  # noqa: E704
    def __invert__(self) -> Any: return ~int.__int__(self._pin())  # noqa: E704
    def __round__(self, n: Any = None) -> Any: return round(int.__int__(self._pin()), n)  # noqa: E704
    def __trunc__(self) -> Any: return int.__int__(self._pin())  # noqa: E704
    def __floor__(self) -> Any: return int.__int__(self._pin())  # noqa: E704
    def __ceil__(self) -> Any: return int.__int__(self._pin())  # noqa: E704
    def __complex__(self) -> complex: return complex(int.__int__(self._pin()))  # noqa: E704
    def bit_length(self) -> int: return int.__int__(self._pin()).bit_length()  # noqa: E704
    def bit_count(self) -> int: return int.__int__(self._pin()).bit_count()  # noqa: E704
    def to_bytes(self, *a: Any, **k: Any) -> bytes: return int.__int__(self._pin()).to_bytes(*a, **k)  # noqa: E704
    def as_integer_ratio(self) -> Any: return int.__int__(self._pin()).as_integer_ratio()  # noqa: E704
    def conjugate(self) -> Any: return int.__int__(self._pin())  # noqa: E704

    def __neg__(self) -> Any: return CountedInt(-int.__int__(self), ("sub", ("const", 0), self.expr), self.tape)  # noqa: E704
    def __pos__(self) -> Any: return self  # noqa: E704
    def __eq__(self, o: Any) -> bool: return self._compare("eq", o)  # type: ignore[override]  # noqa: E704
    def __ne__(self, o: Any) -> bool: return self._compare("ne", o)  # type: ignore[override]  # noqa: E704
    def __lt__(self, o: Any) -> bool: return self._compare("lt", o)  # noqa: E704
    def __le__(self, o: Any) -> bool: return self._compare("le", o)  # noqa: E704
    def __gt__(self, o: Any) -> bool: return self._compare("gt", o)  # noqa: E704
    def __ge__(self, o: Any) -> bool: return self._compare("ge", o)  # noqa: E704
    def __bool__(self) -> bool: return self._compare("ne", 0)  # noqa: E704
    def __hash__(self) -> int: return hash(int.__int__(self._pin()))  # noqa: E704
    def __index__(self) -> int: return int.__int__(self._pin())  # noqa: E704
    def __int__(self) -> int: return int.__int__(self._pin())  # noqa: E704
    def __float__(self) -> float: return float(int.__int__(self._pin()))  # noqa: E704
    def __str__(self) -> str: return str(int.__int__(self._pin()))  # noqa: E704
    def __repr__(self) -> str: return repr(int.__int__(self))  # noqa: E704
    def __format__(self, spec: str) -> str: return format(int.__int__(self._pin()), spec)  # noqa: E704

    def __reduce__(self) -> Any:  # never stored: the plan keeps the expression
        return (int, (int.__int__(self),))


def evaluate(expr: Expr, read: Callable[[Any], Any]) -> Any:
    kind = expr[0]
    if kind == "read":
        return read(expr[1])
    if kind == "const":
        return expr[1]
    if kind in _COMPARE:
        return _COMPARE[kind](evaluate(expr[1], read), evaluate(expr[2], read))
    return _BINARY[kind](evaluate(expr[1], read), evaluate(expr[2], read))


def reads_in(expr: Expr) -> list[Any]:
    if expr[0] == "read":
        return [expr[1]]
    if expr[0] == "const":
        return []
    return reads_in(expr[1]) + reads_in(expr[2])


def holds_counted(value: Any, depth: int = 0) -> bool:
    """A counted value inside a container written as a constant (``("step", n)``)."""
    if isinstance(value, CountedInt):
        return True
    if depth < 4 and isinstance(value, (tuple, list, frozenset, set)):
        return any(holds_counted(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return any(holds_counted(v, depth + 1) for v in value.values())
    return False


def plain(value: Any, depth: int = 0) -> Any:
    """``value`` with the counted ints in it (``("step", n)``) as plain ints: what the
    backward wrote, as eager holds it."""
    if isinstance(value, CountedInt):
        return int.__int__(value)
    if depth >= 4 or not holds_counted(value):
        return value
    if isinstance(value, (tuple, list, frozenset, set)) and type(value) in (tuple, list, frozenset, set):
        return type(value)(plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return {k: plain(v, depth + 1) for k, v in value.items()}
    return value


def holds_text(value: Any, depth: int = 0) -> bool:
    """Text in a constant written by the backward (``"%d" % n`` formats a counted int as a
    plain int, unseen)."""
    if isinstance(value, (str, bytes)):
        return True
    if depth < 4 and isinstance(value, (tuple, list, frozenset, set)):
        return any(holds_text(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return any(holds_text(k, depth + 1) or holds_text(v, depth + 1) for k, v in value.items())
    return False


def pin_in(value: Any, seen: set[int] | None = None) -> None:
    """Pin every counted int in an op's arguments (in tuples, lists, ``torch.Size``, dicts,
    slices): torch reads each as a plain int, and the traced graph holds its value."""
    if isinstance(value, CountedInt):
        value._pin()
        return
    if not isinstance(value, (tuple, list, dict, slice)):
        return
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, slice):
        items = (value.start, value.stop, value.step)
    else:
        items = value
    for v in items:
        pin_in(v, seen)


class PinsCountedArguments(TorchFunctionMode):
    """Note [A count reaching a tensor op]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A counted int handed to a tensor op (``grad * n``, ``x.new_full(size, n)``, a view's
    sizes, ``torch.tensor(n)``) is read by torch's argument parser as a plain int, with no
    hook of the int's own, and the traced graph holds its value: the backward depends on it,
    so it is pinned (a decision the forward is guarded on). Active while a writing class's
    dispatch runs in the traced backward, where torch's function modes reach every op call
    (Tensor methods, ``torch.*`` functions, OpOverloads). Before, a count equal to any int
    scalar of the traced graph (a dim ``0``, a ``1``) was taken as baked: every read was
    then checked by value when the backward ran, and a second backward of one step (a
    retained graph, two forwards summed) was refused with the first one's count written."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        pin_in(args)
        pin_in(kwargs)
        return func(*args, **kwargs)


def note_read(value: Any, whole_dict: bool = False) -> None:
    """A read in the traced backward: a counted value read where no ``PinsCountedArguments``
    is active (code outside a writing class's dispatch: an ``autograd.Function``'s backward,
    another subclass's dispatch or ``__torch_function__``) may reach a tensor op unseen; its
    tape falls back to comparing values with the graph's scalars (``graph_scalars``)."""
    if whole_dict and isinstance(value, dict):
        found = [v for v in value.values() if isinstance(v, CountedInt)]
    else:
        found = [value] if isinstance(value, CountedInt) else []
    if found and not pins_active():
        for v in found:
            v.tape.unseen = True


def pins_active() -> bool:
    return any(isinstance(m, PinsCountedArguments) for m in _get_current_function_mode_stack())


def graph_scalars(graph: Any) -> set[Any]:
    """The int scalars the ops of a traced graph take: a counted value torch read as a plain
    int (``grad * n``) where no ``PinsCountedArguments`` saw it is baked there."""
    found: set[Any] = set()

    def visit(a: Any) -> None:
        if type(a) is int:
            found.add(a)
        elif isinstance(a, (tuple, list)):
            for b in a:
                visit(b)

    for node in getattr(graph, "nodes", ()):
        if node.op == "call_function":
            visit(node.args)
            visit(tuple(node.kwargs.values()))
    return found
