"""The patch table: every change dynamo_ext makes to torch, in one place.

Each row names a target (module path + attribute), the replacement, why it is
needed and the torch line it was written for.  ``apply()`` resolves every
target first and fails naming the first one that is missing or not what the
table expects; only then does it swap anything.  ``undo()`` puts back the exact
original objects (tests check them with ``is``).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Patch:
    module: str  # dotted module path, or "module:Class" for a class attribute
    attr: str
    make_replacement: Callable[[Any], Any]  # original -> replacement
    why: str
    torch_versions: str = "2.13"

    @property
    def target(self) -> str:
        return f"{self.module.replace(':', '.')}.{self.attr}"

    def owner(self) -> Any:
        mod_name, _, cls_name = self.module.partition(":")
        owner: Any = importlib.import_module(mod_name)
        if cls_name:
            owner = getattr(owner, cls_name)
        return owner


class PatchTargetError(RuntimeError):
    """A patch target is missing or changed: this torch is not the one the table was written for."""


class PatchSet:
    """Applies a table of patches as one unit, and undoes it exactly."""

    def __init__(self, table: list[Patch]) -> None:
        self.table = table
        self._originals: list[tuple[Patch, Any, Any]] = []  # (patch, owner, original)

    @property
    def applied(self) -> bool:
        return bool(self._originals)

    def resolve(self) -> list[tuple[Patch, Any, Any]]:
        resolved = []
        for patch in self.table:
            try:
                owner = patch.owner()
            except (ImportError, AttributeError) as e:
                raise PatchTargetError(
                    f"dynamo_ext cannot find patch target {patch.target} "
                    f"(written for torch {patch.torch_versions}): {e}. Needed because: {patch.why}"
                ) from e
            # Look in the owner's own namespace: a class attribute inherited from
            # a base would be shadowed, not patched, by setattr.
            namespace = vars(owner)
            if patch.attr not in namespace or not callable(namespace[patch.attr]):
                raise PatchTargetError(
                    f"dynamo_ext cannot find patch target {patch.target} "
                    f"(written for torch {patch.torch_versions}). Needed because: {patch.why}"
                )
            resolved.append((patch, owner, namespace[patch.attr]))
        return resolved

    def apply(self) -> None:
        if self.applied:
            return
        resolved = self.resolve()
        for patch, owner, original in resolved:
            setattr(owner, patch.attr, patch.make_replacement(original))
            self._originals.append((patch, owner, original))

    def undo(self) -> None:
        while self._originals:
            patch, owner, original = self._originals.pop()
            setattr(owner, patch.attr, original)
