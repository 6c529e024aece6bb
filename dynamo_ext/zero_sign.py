"""The sign of a float zero in what Dynamo reads itself (compile time).

Note [The sign of a float zero]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``0.0 == -0.0``, but eager's arithmetic tells them apart (``-x``, ``1 / x``,
``math.copysign``).  Dynamo loses the sign two ways when it reads a float from user
code, which includes dispatch's own code where Dynamo compiles ``__torch_dispatch__`` as
a frame (eager code after a graph break calls an op on a subclass):

- a float it specializes is guarded with ``==`` (``EQUALS_MATCH``), so a graph traced
  for ``0.0`` is reused for ``-0.0`` and replays the other sign (torch 2.13 and 2.14;
  2.15 compares the bits);
- a float it leaves unspecialized (``dynamic=True``) becomes a sympy symbol, and sympy's
  zero has no sign: once a guard like ``v == 0`` specializes the symbol, ``-(-v)`` folds
  to the constant ``0.0`` in the graph (all three releases).

Float zeros are therefore always specialized, and their sign is guarded beside ``==``.
A float that moves between zero and other values compiles once more than before.
The ctx floats of a subclass input are guarded in ``dynamo_layer`` (its ctx guard);
a zero computed by symbolic arithmetic (``-0.0 * n`` with ``n`` symbolic) is a
documented limit.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

from . import guards


def make_wrap_symfloat_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``VariableBuilder.wrap_symfloat``: a float zero is a constant."""

    @functools.wraps(original)
    def wrap_symfloat(self: Any, value: float, *args: Any, **kwargs: Any) -> Any:
        if value == 0.0 and self.name not in self.tx.output.unspec_variable_map:
            from torch._dynamo.guards import GuardBuilder
            from torch._dynamo.variables import ConstantVariable

            self.install_guards(GuardBuilder.CONSTANT_MATCH)  # EQUALS_MATCH: the sign too
            return ConstantVariable.create(value=value, source=self.source)
        return original(self, value, *args, **kwargs)

    return wrap_symfloat


def make_equals_guard_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``GuardBuilder.EQUALS_MATCH`` (torch 2.13 and 2.14): a float zero's
    sign is guarded beside ``==``."""

    @functools.wraps(original)
    def EQUALS_MATCH(self: Any, guard: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, guard, *args, **kwargs)
        value = self.get(guard)
        if type(value) is float and value == 0.0:
            guard_sign(self, guard, value)
        return result

    return EQUALS_MATCH


def guard_sign(builder: Any, guard: Any, value: float) -> None:
    sign = math.copysign(1.0, value)
    guards.add_lambda(
        builder, guard, lambda x: type(x) is float and math.copysign(1.0, x) == sign, f"has the sign of {value!r}"
    )
