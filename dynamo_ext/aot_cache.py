"""AOTAutogradCache for graphs with subclass inputs: the write plan travels with the entry.

A compile with a planner (``aot_layer``) uses the cache as stock does, with three
additions (See Note [A cache entry holds its plan]):

- the key is stock's (the Dynamo graph, the fake inputs with each subclass's flatten
  ctx, the configs) mixed with what else the traced program depends on: which writes
  Dynamo's residual bytecode replays (by input position), the module globals and closure
  variables dispatch read (Dynamo guards them, but the graph does not show them), the
  layers' switches and the plan format;
- the saved entry carries the frozen plan.  AOTAutograd saves in stage 2, or at the
  first backward where it compiles the backward lazily; either way the plan is attached
  once it is frozen;
- a found entry is used only where the real inputs hold every piece of state the
  passes read (the plan's entry reads), as Dynamo's guards on those reads would hold;
  otherwise it is a miss and the compile runs.  On a hit the reads are guarded as a
  traced compile guards them, and the compiled function gets the plan's replay.

A compile whose plan another process could not reuse (a write on an object outside the
inputs, state not comparable by value, a plan that does not pickle) is not saved; one
whose hand-off names objects outside the inputs is not looked up.  Both count as
``autograd_cache_bypass`` in ``torch._dynamo.utils.counters["aot_autograd"]`` with the
reason in the ``dynamo_ext`` log, as torch counts its own bypasses.

Note [A cache entry holds its plan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
What a compile replays is decided by its tracing passes, which a hit skips.  The passes
see three things: the graph and fake inputs (stock's key), the real inputs' state
their dispatch reads (answered from the real objects: See Note [Reads are answered
from the real object] in capture.py), and the Dynamo layer's hand-off.  The key covers
the first and third; the second is only known once traced, so the entry records it
(the plan's ``entry_reads``) and a lookup compares it with the real inputs, the way
FX graph cache entries carry their shape guards.  An entry found under the same key
with other state is a miss, and the compile that follows overwrites it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import logging
import weakref
from typing import Any, Callable

from . import aot_layer, capture, config, partial_backward
from .plan import Replay, WritePlan, plain, state_mismatch
from .values import GRAPH_VALUE

log = logging.getLogger(__name__)

#: Bumped when the plan's pickled form changes: older entries are then misses.
PLAN_FORMAT = 2


@dataclasses.dataclass(frozen=True)
class CachedPlan:
    """What an AOTAutogradCache entry carries (attribute ``_dynamo_ext_plan``)."""

    format: int
    plan: WritePlan


# The planner whose cache key and lookup are being computed (inside ``try_load``).
_LOOKING_UP: contextvars.ContextVar[aot_layer.Planner | None] = contextvars.ContextVar(
    "dynamo_ext_cache_lookup", default=None
)


class _Save:
    """An entry of a compile with a planner, waiting for the frozen plan."""

    def __init__(self) -> None:
        self.plan: WritePlan | None = None
        self.why_not: str | None = None
        self.deferred: tuple[Any, Any, bool] | None = None  # (key, entry, remote) saved before the freeze

    def frozen(self, plan: WritePlan) -> "_Save | None":
        """Called by stage 2 with the frozen plan; returns self while a save is still to
        come (AOTAutograd saves at the first backward), for the compiled function to keep."""
        self.plan, self.why_not = plan, plan.why_not_cacheable()
        if self.deferred is not None:
            key, entry, remote = self.deferred
            self.deferred = None
            _save(key, entry, remote)
            return None
        return self


# Saves waiting for their plan, by cache key: held weakly (the compiled function, or the
# compile in flight, owns each), so a freed compile leaves nothing here.
_SAVES: "weakref.WeakValueDictionary[str, _Save]" = weakref.WeakValueDictionary()


def _bypass(why: str) -> None:
    from torch._dynamo.utils import counters

    counters["aot_autograd"]["autograd_cache_bypass"] += 1
    log.info("AOTAutogradCache bypassed: %s", why)


def _positions(planner: aot_layer.Planner) -> dict[int, tuple]:
    """``{id(object): (input position, path)}`` for the real inputs and their inner subclasses."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    where: dict[int, tuple] = {}

    def walk(obj: Any, index: int, path: capture.Path) -> None:
        where.setdefault(id(obj), (index, path))
        if is_traceable_wrapper_subclass(obj):
            for name in obj.__tensor_flatten__()[0]:
                walk(getattr(obj, name), index, path + (("attr", name),))

    for i, obj in enumerate(planner.real_inputs):
        walk(obj, i, ())
    return where


def _handoff(planner: aot_layer.Planner) -> tuple[str, str | None]:
    """What the plan depends on beyond stock's key, as text; or why it cannot be keyed."""
    head = [PLAN_FORMAT, config.dynamo_layer, config.aot_layer, planner.epilogue]
    record = planner.record
    if record is None:
        return repr([*head, "called directly"]), None
    if record.shared_objects:
        return "", "dispatch reaches objects outside the graph's inputs (globals, closures)"
    where = _positions(planner)
    parts: list[tuple] = []
    for label, table in (("recorded", record.recorded), ("observed", record.observed)):
        for oid, attrs in table.items():
            if oid not in where:
                return "", f"Dynamo {label} writes on an object that is not among the graph's inputs"
            for name, value in attrs.items():
                if value is not GRAPH_VALUE and not plain(value):
                    return "", f"Dynamo {label} {name}={type(value).__name__}, not comparable by value"
                parts.append((label, where[oid], name, "<graph>" if value is GRAPH_VALUE else repr(value)))
    for owner, name, value in record.free_reads:
        if not plain(value):
            return "", f"dispatch read {owner}.{name}, a {type(value).__name__} not comparable by value"
        parts.append(("free", owner, name, repr(value)))
    return repr([*head, *sorted(set(parts), key=repr)]), None


# --------------------------------------------------------------------------- #
# Hooks (patch_table.py)
# --------------------------------------------------------------------------- #


def make_try_load_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``AOTAutogradCache.try_load`` (a staticmethod)."""

    @functools.wraps(original)
    def try_load(mod: Any, args: Any, aot_config: Any, *rest: Any, **kwargs: Any) -> Any:
        planner = aot_layer.pending()
        if planner is None and partial_backward.planned_backward_seen():
            # an entry could not say which gradients the compiled backward leaves undefined
            # (See Note [A backward run for part of the graph] in partial_backward.py)
            _bypass("a graph without a plan, compiled once a graph with subclasses and a backward was")
            return None, aot_config
        if planner is None:
            return original(mod, args, aot_config, *rest, **kwargs)
        _, why = _handoff(planner)
        if why is not None:
            _bypass(why)
            return None, aot_config  # no cache info: nothing is saved either
        token = _LOOKING_UP.set(planner)
        try:
            compiled, aot_config = original(mod, args, aot_config, *rest, **kwargs)
        finally:
            _LOOKING_UP.reset(token)
        if compiled is None:
            info = getattr(aot_config, "cache_info", None)
            if info is not None:  # a miss: stage 2 saves the entry under this key
                save = _Save()
                _SAVES[info.cache_key] = save
                planner.on_frozen = save.frozen
                planner.cache_save = save  # alive while the compile runs
            return None, aot_config
        plan = planner.cached_plan
        assert plan is not None, "an AOTAutogradCache hit without the plan its lookup checked"
        planner.adopt(plan)
        aot_layer.set_pending(None)
        planner.real_inputs = []
        log.debug("AOTAutogradCache hit: replaying %d writes", len(plan.writes) + len(plan.backward_writes))
        return (compiled if plan.empty else Replay(plan).wrap_boxed(compiled)), aot_config

    return try_load


def make_cache_key_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``autograd_cache_key`` as ``try_load`` calls it."""

    @functools.wraps(original)
    def autograd_cache_key(*args: Any, **kwargs: Any) -> Any:
        key, lines = original(*args, **kwargs)
        planner = _LOOKING_UP.get()
        if planner is None:
            return key, lines
        text, _ = _handoff(planner)
        digest = hashlib.blake2b((key + text).encode(), digest_size=26).hexdigest()
        return key[:1] + digest, [*lines, f"[dynamo_ext] stock key {key}; hand-off {text}"]

    return autograd_cache_key


def make_lookup_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``AOTAutogradCache._lookup`` (a staticmethod): an entry is found
    only if it holds a plan whose entry state the real inputs hold."""

    @functools.wraps(original)
    def _lookup(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        planner = _LOOKING_UP.get()
        if result is None or planner is None:
            return result
        stored = getattr(result[0], "_dynamo_ext_plan", None)
        if not isinstance(stored, CachedPlan) or stored.format != PLAN_FORMAT:
            log.info("AOTAutogradCache entry without a plan of format %d: a miss", PLAN_FORMAT)
            return None
        why = state_mismatch(stored.plan, planner.real_inputs)
        if why is not None:
            log.info("AOTAutogradCache entry traced from other state (%s): a miss", why)
            return None
        planner.cached_plan = stored.plan
        return result

    return _lookup


def _save(key: str, entry: Any, remote: bool) -> None:
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

    AOTAutogradCache.save(key, entry, remote)


def make_save_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``AOTAutogradCache.save`` (a staticmethod): the entry of a
    compile with a planner is saved with its frozen plan, or not at all."""

    @functools.wraps(original)
    def save(key: str, entry: Any, remote: bool, *rest: Any, **kwargs: Any) -> Any:
        waiting = _SAVES.get(key)
        if waiting is None:
            return original(key, entry, remote, *rest, **kwargs)
        if waiting.plan is None:  # saved inside stage 2, before the plan is frozen
            waiting.deferred = (key, entry, remote)
            return None
        _SAVES.pop(key, None)
        if waiting.why_not is not None:
            _bypass(waiting.why_not)
            return None
        entry._dynamo_ext_plan = CachedPlan(PLAN_FORMAT, waiting.plan)
        return original(key, entry, remote, *rest, **kwargs)

    return save
