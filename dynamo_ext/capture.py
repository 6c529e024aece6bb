"""Capture: every attribute read and write a trace makes on the objects it can reach.

Compile time, shared by both layers.  While a ``Scope`` is active (Dynamo's fake
propagation of one op, one AOTAutograd tracing pass), attribute access on the
objects it tracks goes through class-level hooks (``__getattribute__``,
``__setattr__``, ``__delattr__``; ``__init__`` on registered state classes),
installed for the duration and undone after (see ``_patches.ClassHooks``):

- every assignment or deletion is recorded, in order, whatever it compares equal
  to (the last one wins when replayed);
- every read of state (an instance ``__dict__`` entry, a class-level default, an
  attribute the instance lacks) on a traced instance that stands for a real object
  is answered by the layer's ``Answerer`` as eager would answer it on the real
  object; the Dynamo layer guards what it answered (See Note [Reads are answered
  from the real object]);
- writes that bypass attribute syntax (``obj.__dict__[k] = v``, a user
  ``__setattr__`` storing on the side) are caught when the scope settles, by
  identity against what the recorded events left, and so are in-place changes of
  containers handed to the trace.

``restore()`` puts every tracked object back as it was when tracking began, so
the next tracing pass starts from the entry state and no trace-time value reaches
a real object (pytorch #130028, problem 1).

Note [Reads are answered from the real object]
    A traced instance is rebuilt by ``__tensor_unflatten__`` from the flatten ctx:
    attributes outside the ctx are missing, or hold whatever ``__new__``/``__init__``
    /unflatten set as defaults; an attribute named like a ``torch.Tensor`` method
    resolves to the method.  Dispatch reading any of these would take another branch
    than in eager (a counter restarting from its default replays the same value
    forever).  So a read of state is answered from the real object, the way eager
    would resolve it there (instance dict, then class attribute; an attribute found
    nowhere falls through to the user's own ``__getattr__``, run on the traced
    instance, whose own reads are answered the same way), and what was answered
    becomes part of the compiled program's assumptions: the Dynamo layer guards it
    (or makes it a symbolic input), and a seed node hands it to AOTAutograd's passes.
    Inner tensors named by ``__tensor_flatten__`` are the traced instance's own.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import dis
import functools
import inspect
import itertools
import os
import sys
import threading
import types
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.utils._python_dispatch

from . import _patches, counters, free_state
from .values import (
    MISSING,
    PLAIN_MUTABLE,
    SYMBOLIC_TYPES,
    contains_symbolic,
    contains_tensor,
    is_immutable_constant,
    is_torch_internal,
    user_state,
)

_local = threading.local()

_get_dict = object.__getattribute__
# attribute names through which code takes an object's whole state (``copy``, ``pickle``)
_WHOLE_STATE = frozenset({"__getstate__", "__reduce_ex__", "__reduce__"})


def obj_dict(obj: Any) -> dict:
    """``obj.__dict__`` without going through dynamo_ext's attribute hooks."""
    return _get_dict(obj, "__dict__")


# with the separator: torchao's, torchvision's files are not torch's
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(__file__) + os.sep


def _called_from_torch(depth: int) -> bool:
    return sys._getframe(depth).f_code.co_filename.startswith(_TORCH_DIR)


def _called_from_user(depth: int) -> bool:
    name = sys._getframe(depth).f_code.co_filename
    return not (name.startswith(_TORCH_DIR) or name.startswith(_OWN_DIR))


def current() -> "Scope | None":
    """The scope active on this thread, if any."""
    return getattr(_local, "scope", None)


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """No scope on this thread for the block: dynamo_ext's own look at a tracked object
    (calling its ``__tensor_flatten__``) is neither a read nor a write."""
    previous = current()
    _local.scope = None
    try:
        yield
    finally:
        _local.scope = previous


# --------------------------------------------------------------------------- #
# Registered state classes (objects reachable from a flatten ctx)
# --------------------------------------------------------------------------- #

_REGISTERED: set[type] = set()
_REPLAYERS: dict[type, Callable[[Any, dict, dict], None]] = {}


def register_ctx_state(cls: type | None = None, *, replay: Callable[[Any, dict, dict], None] | None = None) -> Any:
    """Declare that instances of ``cls`` hold state that dispatch mutates and that is
    reachable from a flatten ctx (shared by reference with every unflattened instance).
    Usable as a class decorator, with or without arguments.

    ``replay(obj, entry, values)``: how to apply, after a compiled call, what a trace wrote
    on such an object that no input reaches (one made in dispatch, or found through a
    cache): ``entry`` maps each attribute to its value when the trace began, ``values``
    to the value it left. Without one, the writes are set when the object still holds
    its traced entry state, and refused (``stale_plan``) when it does not.
    """

    def register(klass: type) -> type:
        if not getattr(klass, "__dictoffset__", 0):
            # See Note [State in __slots__]: state is answered, guarded and replayed in the
            # instance dict (an instance without one failed inside Dynamo's compile)
            raise TypeError(
                f"register_ctx_state: instances of {klass.__qualname__} have no __dict__ (their state is in "
                "__slots__); dynamo_ext carries a registered object's state in its instance dict: drop "
                "__slots__ or add '__dict__' to it and keep the state dispatch mutates there"
            )
        _REGISTERED.add(klass)
        if replay is not None:
            _REPLAYERS[klass] = replay
        return klass

    return register(cls) if cls is not None else register


@dataclasses.dataclass(frozen=True)
class OnePerKey:
    """Instances of a class eager may hand out as one object where a compiled graph made
    several (DTensor's sharding cache, keyed on the op's shapes): ``key()`` is called when
    the trace makes one, ``may_share(a, b)`` says whether eager could give two such keys
    one object. See Note [Two partial embeddings in one graph] in dtensor.py."""

    why: str
    key: Callable[[], Any]
    may_share: Callable[[Any, Any], bool]


ONE_PER_KEY: dict[type, OnePerKey] = {}


_REBINDERS: list[Callable[[Any, dict[int, Any]], None]] = []


def register_rebinder(rebind: Callable[[Any, dict[int, Any]], None]) -> None:
    """``rebind(output, {id(old): new})``: make a compiled output hold ``new`` where its ctx
    holds ``old`` (See Note [Objects dispatch makes, per shape] in plan.py)."""
    if rebind not in _REBINDERS:
        _REBINDERS.append(rebind)


def rebind_held(output: Any, mapping: dict[int, Any]) -> None:
    for rebind in _REBINDERS:
        rebind(output, mapping)
    _rebind_attributes(output, mapping)


def _rebind_attributes(t: Any, mapping: dict[int, Any]) -> None:
    """A compiled output subclass (and the subclasses nested in its flatten list) holds the
    objects ``mapping`` gives where it held the traced ones, in its attributes and in the
    plain containers they hold (copied, so other outputs keep theirs)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return
    d = obj_dict(t)
    for name, value in list(d.items()):
        now = swap_held(value, mapping)
        if now is not value:
            d[name] = now
    for name in _flatten_names(t):
        _rebind_attributes(getattr(t, name, None), mapping)


def swap_held(value: Any, mapping: dict[int, Any], depth: int = 0) -> Any:
    """``value`` with the objects ``mapping`` gives in place of the ones it names: the same
    object where it holds none of them, else a shallow copy (of each container on the way)."""
    if id(value) in mapping:
        return mapping[id(value)]
    if depth >= 6 or isinstance(value, (torch.Tensor, type, types.ModuleType)) or callable(value):
        return value
    if type(value) in _REGISTERED or value is None or isinstance(value, (int, float, str, bytes, bool)):
        return value  # a shared state object: the same one in every call
    if isinstance(value, (tuple, list)):
        items = [swap_held(v, mapping, depth + 1) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)._make(items)
        return type(value)(items)
    if type(value) is dict:
        swapped = {k: swap_held(v, mapping, depth + 1) for k, v in value.items()}
        return value if all(swapped[k] is v for k, v in value.items()) else swapped
    d = getattr(value, "__dict__", None)
    if not isinstance(d, dict):
        return value
    changed = {k: v2 for k, v in list(d.items()) if (v2 := swap_held(v, mapping, depth + 1)) is not v}
    if not changed:
        return value
    fresh = copy.copy(value)
    for k, v in changed.items():
        object.__setattr__(fresh, k, v)
    return fresh


def replayer_for(obj: Any) -> Callable[[Any, dict, dict], None]:
    return _REPLAYERS.get(type(obj), replay_if_unchanged)


def replay_if_unchanged(obj: Any, entry: dict[str, Any], values: dict[str, Any]) -> None:
    """The default replay: the object must still hold what the trace started from."""
    from .errors import RefusalKind, SubclassWriteError
    from .values import HELD_TENSOR, same_value

    d = obj_dict(obj)
    for name, before in entry.items():
        now = d.get(name, MISSING)
        held = before is HELD_TENSOR and isinstance(now, torch.Tensor)
        if not held and not same_value(before, now):
            raise SubclassWriteError(
                RefusalKind.STALE_PLAN,
                type(obj).__name__,
                name,
                type(now).__name__,
                context=(
                    f"a shared state object no input reaches changed since it was traced "
                    f"({name}: traced from {before!r}, now {now!r}); register a replay function "
                    "with register_ctx_state(cls, replay=...)"
                ),
            )
    for name, value in values.items():
        setattr(obj, name, value)


def registered_classes() -> frozenset[type]:
    return frozenset(_REGISTERED)


def is_registered(obj: Any) -> bool:
    return type(obj) in _REGISTERED


#: A path from a tensor to an object: ("attr", name) and ("item", index) steps.
Path = tuple[tuple[str, Any], ...]


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


def _attribute_names(obj: Any) -> list[str]:
    """``__dict__`` keys and ``__slots__`` (DTensor keeps ``_spec`` in a slot)."""
    names = list(vars(obj)) if hasattr(obj, "__dict__") else []
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [n for n in slots if n not in ("__dict__", "__weakref__")]
    return list(dict.fromkeys(names))


def restore_aliases(t: Tracked) -> None:
    """Inner tensors the real object holds twice (``self.cache = self.elem``, both
    flattened) reach a trace as two separate objects (fakeification and AOTAutograd's
    passes rebuild each name): the traced instance holds them as one again, as eager
    does (``cache is elem``), so a write through either name is seen through both."""
    first: dict[int, str] = {}
    d = obj_dict(t.obj)
    for name in sorted(t.flatten_names):
        value = obj_dict(t.real).get(name)
        if not isinstance(value, torch.Tensor) or name not in d:
            continue
        if id(value) in first:
            d[name] = t.expected[name] = d[first[id(value)]]
        else:
            first[id(value)] = name


def follow(root: Any, path: Path) -> Any:
    obj = root
    for kind, key in path:
        obj = getattr(obj, key) if kind == "attr" else obj[key]
    return obj


# --------------------------------------------------------------------------- #
# What a scope tracks
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(eq=False)
class Write:
    """One attribute assignment (``value``) or deletion (``MISSING``) on a tracked object."""

    tracked: "Tracked"
    name: str
    value: Any
    old: Any  # what the attribute held before (MISSING: absent)
    in_place: bool = False  # an existing container was mutated, not rebound


_COMPUTING: Any = object()


def _put_back_torch_function_writes(t: "Tracked") -> None:
    """Note [Torch's reads of a traced object between two ops]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Between two ops Dynamo reads the traced object's properties (its sizes, ``requires_grad``,
    whether it is a view), each through the class's own ``__torch_function__``. One that
    writes on the instance (a call counter, ``self.tf_calls += 1``) counted those reads, and
    the next op's dispatch counted on from there: 15 where eager has 4 on
    ``backend="eager"`` (an outside tester's find; stock alike). Eager makes no such reads:
    what the object held when the last block ended is put back before the next one. Only
    constants (counts, names) written so: dynamo_ext's own hand-overs between blocks (a fake
    for a real tensor a copy holds) are tensors and objects."""
    d = obj_dict(t.obj)
    left = t.left or {}
    for name, value in list(user_state(d).items()):
        then = left.get(name, MISSING)
        if then is value or not is_immutable_constant(value) or not (then is MISSING or is_immutable_constant(then)):
            continue
        if then is MISSING:
            del d[name]
        else:
            d[name] = then


class Tracked:
    """One object a scope can reach.

    ``real`` is the object whose state eager would see: the user's tensor for a
    traced graph input, the object itself for a registered state object shared with
    eager by reference, None for an object made by the trace (an intermediate).
    ``data`` belongs to the layer (the Dynamo layer keeps the variable and source).
    """

    __slots__ = (
        "obj", "real", "data", "flatten_names", "entry", "entry_containers", "expected",
        "containers", "settled", "absent", "written", "assigned", "dict_complete", "_inner_ids", "plain_inner", "born", "on_read",
        "slot_names", "entry_version", "pending", "entry_type", "entry_inner_autograd", "left",
    )

    def __init__(self, obj: Any, real: Any, data: Any = None) -> None:
        self.obj = obj
        self.real = real
        self.data = data
        self.flatten_names: frozenset[str] = frozenset(_flatten_names(real if real is not None else obj))
        # See Note [State in __slots__]
        self.slot_names = _user_slot_names(type(obj)) - self.flatten_names
        self.entry = dict(user_state(obj_dict(obj)))
        # the traced tensor's own version counter when tracking began (See version_delta)
        self.entry_version = _raw_version(obj)
        self.entry_type = type(obj)  # See Note [State outside the instance dict]
        self.entry_inner_autograd = (
            {k: (v, _autograd_state(v)) for k, v in self.entry.items() if _plain_tensor(v)}
            if real is not None and isinstance(obj, torch.Tensor) else {}
        )
        self.entry_containers = {
            k: _snapshot(v) for k, v in self.entry.items() if isinstance(v, PLAIN_MUTABLE) and not contains_tensor(v)
        }
        self.expected = dict(self.entry)  # what __dict__ holds after the recorded events
        self.left: dict[str, Any] | None = None  # what it held when the last block ended
        self.containers: dict[str, tuple[Any, Any]] = {}  # name -> (container handed out, its contents then)
        self.settled: set[str] = set()  # names whose reads need no answer any more
        self.absent: set[str] = set()  # names answered "absent"
        self.written: set[str] = set()
        self.assigned: set[str] = set()  # names given to a class's own __setattr__ (See _sets_elsewhere)
        self.dict_complete = False
        self._inner_ids: frozenset[int] | None = None
        # A plain tensor inside a subclass's flatten list (a FakeTensor standing for the
        # real inner tensor): only what user code puts in its dict is state.
        self.plain_inner = False
        # Made by the traced code (a registered state object built in dispatch): its state
        # before is what its __init__ left, and it is the caller's only through an output.
        self.born = False
        # An object that stands for no real one yet (an incoming gradient of the traced
        # backward): called with (tracked, name) at the first read of a name, it may refuse.
        self.on_read: Callable[[Tracked, str], None] | None = None
        # Names the traced program's own code set since the trace last wrote them (Dynamo
        # holds those writes pending): a read by dispatch goes to ``Scope.on_pending``.
        self.pending: set[str] = set()

    def traced_counterpart(self, name: str) -> Any:
        """The traced object's own value of ``name`` if fakification made it from the real
        object's (it holds SymInts, or tensors that are all the traced object's inner
        tensors: NestedTensor's metadata cache and sizes), else MISSING."""
        held = obj_dict(self.obj).get(name, MISSING)
        if held is MISSING or not (contains_tensor(held) or contains_symbolic(held)):
            return MISSING
        if self._inner_ids is _COMPUTING:
            return held  # read by a flatten-name property while its value is looked up
        if self._inner_ids is None:
            # Flatten names may be properties (NestedTensor's metadata tensors) whose code
            # reads the very attributes being checked.
            self._inner_ids = _COMPUTING
            try:
                self._inner_ids = frozenset(id(getattr(self.obj, n, None)) for n in self.flatten_names)
            except BaseException:
                self._inner_ids = None
                raise
        if all(id(x) in self._inner_ids for x in _tensors_in(held)):
            return held
        return MISSING

    @property
    def shared(self) -> bool:
        return self.real is self.obj

    @property
    def cls_name(self) -> str:
        return type(self.obj).__name__

    def set_answer(self, name: str, value: Any) -> None:
        """The traced object now holds ``value`` as its entry state for ``name``."""
        d = obj_dict(self.obj)
        if value is MISSING:
            d.pop(name, None)
            self.expected.pop(name, None)
            self.absent.add(name)
        else:
            d[name] = value
            self.expected[name] = value
            if isinstance(value, PLAIN_MUTABLE) and not contains_tensor(value):
                self.containers[name] = (value, _snapshot(value))
            if self.real is not None and _plain_tensor(value) and isinstance(self.obj, torch.Tensor):
                # a tensor the real object holds outside the flatten list, seeded into the trace:
                # its autograd state is compared from here (an outside tester's find)
                self.entry_inner_autograd[name] = (value, _autograd_state(value))
        self.settled.add(name)


def _tensors_in(value: Any, depth: int = 0) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 4:
        return []
    if isinstance(value, (list, tuple, set, frozenset)):
        return [t for v in value for t in _tensors_in(v, depth + 1)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v, depth + 1)]
    return []


def _flatten_names(obj: Any) -> list[str]:
    flatten = getattr(type(obj), "__tensor_flatten__", None)
    if flatten is None or not isinstance(obj, torch.Tensor):
        return []
    try:
        names, _ = obj.__tensor_flatten__()
    except Exception:
        return []
    return list(names)


#: The name an answerer is asked for when code depends on which attributes the instance
#: dict holds (it read ``__dict__``, or the class's own ``__getattr__`` runs).
KEYS = "<keys>"


@dataclasses.dataclass(frozen=True)
class Unshadowed:
    """What an answerer is asked when traced code reads a method (``x.values``): the
    compiled code depends on no instance attribute of that name shadowing it."""

    name: str


class Answerer(Protocol):
    def __call__(self, scope: "Scope", tracked: Tracked, name: str) -> Any:
        """Answer a read of ``name`` on ``tracked.obj`` as eager would on ``tracked.real``:
        call ``tracked.set_answer`` and return the value, or raise AttributeError.
        ``KEYS``: guard which attributes the real object's dict holds (returns nothing)."""


# How a read of a name is served, decided from the class.
_PASS, _STATE, _METHOD = "pass", "state", "method"


def eager_lookup(real: Any, name: str) -> tuple[Any, str]:
    """``real.name`` as eager's standard lookup finds it: ``(value, "dict" | "class" | "absent")``.
    An attribute found in neither is left to the user's ``__getattr__``, run on the traced object."""
    d = obj_dict(real)
    if name in d:
        return d[name], "dict"
    cls_attr = class_attribute(type(real), name)
    if cls_attr is MISSING or callable(cls_attr):
        return MISSING, "absent"
    return cls_attr, "class"


def _is_data_descriptor(value: Any) -> bool:
    t = type(value)
    return hasattr(t, "__set__") or hasattr(t, "__delete__")


def class_attribute(cls: type, name: str) -> Any:
    """``name`` as found on ``cls``'s MRO (ignoring dynamo_ext's own hooks), or MISSING."""
    for klass in cls.__mro__:
        value = _patches.original_attribute(klass, name)
        if value is not MISSING:
            return value
    return MISSING


class FlattenMismatch(BaseException):
    """The traced instance does not hold an inner tensor the real object flattens to
    (its ``__tensor_unflatten__`` drops it): the trace would not see the input's state.
    A BaseException, so neither the subclass's ``except Exception`` nor Dynamo's error
    wrapping swallows it. ``SlotState`` is its other case."""

    #: the refusal each layer raises for it, and its value type, context and hint
    kind_name = "FLATTEN_ROUND_TRIP"
    value_type = "Tensor"
    context = ""
    hint = ""

    def __init__(self, tracked: Tracked | None, name: str) -> None:
        super().__init__(name)
        self.tracked = tracked
        self.name = name
        self.cls_name = tracked.cls_name if tracked is not None else "traced function"

    def as_refusal(self) -> Any:
        """The refusal raised where no graph break can be: a ``SubclassWriteError``."""
        from .errors import RefusalKind, SubclassWriteError

        return SubclassWriteError(RefusalKind[self.kind_name], self.cls_name, self.name, self.value_type, self.context)


# Note [State in __slots__]
# A subclass's own ``__slots__`` members live outside its instance dict: torch does not carry
# them to the traced instance (only what ``__tensor_unflatten__`` sets, from the ctx, or what
# ``__new__``/``__init__`` default to), and a read of one on the traced instance went unguarded
# (a scale set between calls silently ignored, stock alike; an outside tester's find); a
# write looked like a deletion. Dispatch reading or writing such a member of a traced
# object is refused (``unsupported_state_read``), but for inner tensors the flatten list
# names, in ``__tensor_flatten__``, and where the member holds a value of the ctx, which the
# traced instance is rebuilt from and Dynamo guards.


class SlotState(FlattenMismatch):
    """See Note [State in __slots__]."""

    kind_name = "UNSUPPORTED_STATE_READ"
    value_type = "__slots__ member"
    hint = "Keep the state in the instance dict (leave it out of __slots__) or in the __tensor_flatten__ ctx."

    def __init__(self, tracked: Tracked, name: str, verb: str) -> None:
        super().__init__(tracked, name)
        self.context = (
            f"dispatch {verb} {name!r}, a __slots__ member of {tracked.cls_name}: slot state is not carried "
            "into the traced program (the traced instance's slot is not the real object's)"
        )


# Note [State outside the instance dict]
# Besides its instance dict, dispatch can change what a tensor is: its class
# (``self.__class__ = Frozen``, a state machine's switch), or its autograd state
# (``self.requires_grad_(False)``, ``self.grad = g``, ``self.data = t``, ``self.register_hook(h)``).
# On an object that stands for a real one those changes land on the traced instance only: the
# AOT backends lost them silently (the class swap, the hook, the gradient) or failed to
# compile where eager runs (``requires_grad_`` on an instance that is no leaf when traced;
# outside testers' finds). Refused (``inner_metadata_mutation``) when dispatch makes them, with
# nothing touched; under ``fullgraph=False`` the op runs eagerly. Objects the trace made are
# the trace's own (a result whose class dispatch sets comes out of the graph with it). The same
# changes on a plain tensor an input holds (``self.elem.requires_grad_()``, ``.grad =``,
# ``.data =``, a hook) are found when the op settles, against what the tensor had when the
# trace took the input (``Tracked.entry_inner_autograd``).

#: names whose assignment goes to the tensor itself, not its instance dict
#: what a tensor holds for autograd that its trace stand-in does not (a gradient, a view's
#: base, hooks) and no Dynamo guard covers: a read from dispatch is answered from the real
#: tensor, guarded, or refused (See Note [Autograd state dispatch reads] in dynamo_layer.py)
AUTOGRAD_STATE_READS = frozenset({"grad", "_base", "_is_view", "_backward_hooks", "_post_accumulate_grad_hooks", "retains_grad"})
#: where a tensor lies in its storage and how large that storage is (a shard of a flat
#: buffer): no Dynamo guard covers them either (same Note)
STORAGE_READS = frozenset({"storage_offset", "untyped_storage", "_typed_storage", "storage"})
TENSOR_STATE_READS = AUTOGRAD_STATE_READS | STORAGE_READS

_TENSOR_STATE_NAMES = frozenset({"requires_grad", "grad", "data"})
#: methods that change a tensor's autograd state
_TENSOR_STATE_METHODS = frozenset(
    {"requires_grad_", "retain_grad", "register_hook", "register_post_accumulate_grad_hook"}
)


#: what ``_autograd_state`` holds, in order
_AUTOGRAD_FIELDS = ("requires_grad", "grad", "register_hook", "data")


def _plain_tensor(value: Any) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(value, torch.Tensor) and not is_traceable_wrapper_subclass(value)


# Note [Autograd state dispatch sets by hand]
# Dispatch runs below autograd: the tensors it makes never require grad (but as the op's
# result, which autograd records: it has a grad_fn), carry a gradient or a hook unless it sets
# them by hand (``out.requires_grad_()``, ``c.grad = g``, ``args[1].register_hook(h)``). On a
# tensor the op was handed (a plain graph input, a tensor the graph computed, the input itself
# through ``torch.Tensor.requires_grad_(self)``, past the attribute hook), on an inner tensor
# of the op's result, or on a tensor dispatch writes to an attribute, that state landed on the
# trace's tensor only: the AOT backends made those tensors as graph outputs without it,
# silently (stock alike; outside testers' finds). The tensors the op is handed are compared
# with their state before the op; a tensor dispatch made, in a result or written, must carry
# none. Refused (``inner_metadata_mutation``); under ``fullgraph=False`` the op runs eagerly.


def _first_change(before: tuple, now: tuple) -> str:
    return next(w for w, b, n in zip(_AUTOGRAD_FIELDS, before, now) if b != n)


def _autograd_set(t: torch.Tensor) -> str | None:
    """The autograd state a tensor carries (None: none; See Note [Autograd state dispatch sets
    by hand])."""
    with unobserved():
        base = torch._C.TensorBase
        # a result autograd recorded (dispatch returned it as the op's result) has a grad_fn,
        # or, a view of a tensor that requires grad made under no_grad, a base that requires it
        # (``w.t()`` of a parameter in inference: refused where stock compiles, an outside
        # tester's find)
        if base.requires_grad.__get__(t) and base.grad_fn.__get__(t) is None:  # type: ignore[attr-defined]
            viewed = base._base.__get__(t)  # type: ignore[attr-defined]
            if viewed is None or not base.requires_grad.__get__(viewed):  # type: ignore[attr-defined]
                return "requires_grad"
        if free_state.grad_of(t) is not None:
            return "grad"
        if base._backward_hooks.__get__(t):  # type: ignore[attr-defined]
            return "register_hook"
    return None


def made_tensors(result: Any) -> list[torch.Tensor]:
    """The tensors an op's result holds: its own and the plain ones inside its subclass
    instances (See Note [Autograd state dispatch sets by hand])."""
    return [leaf for leaf in torch.utils._pytree.tree_leaves(result) if isinstance(leaf, torch.Tensor)] + inner_plain_tensors(result)


def inner_plain_tensors(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """The plain tensors inside the subclass instances ``value`` holds (a result's), nested
    ones too."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    found: list[torch.Tensor] = []
    for leaf in torch.utils._pytree.tree_leaves(value):
        if not is_traceable_wrapper_subclass(leaf) or depth > 4:
            continue
        with unobserved():
            names = leaf.__tensor_flatten__()[0]
            inner = [getattr(leaf, n) for n in names]
        for v in inner:
            if is_traceable_wrapper_subclass(v):
                found.extend(inner_plain_tensors(v, depth + 1))
            elif isinstance(v, torch.Tensor):
                found.append(v)
    return found


def _autograd_state(t: torch.Tensor) -> tuple:
    """A plain tensor's autograd state dispatch may change without an op: ``requires_grad``,
    its gradient (by identity), its hooks, and the storage ``.data =`` rebinds."""
    with unobserved():
        return _autograd_state_unobserved(t)


def _autograd_state_unobserved(t: torch.Tensor) -> tuple:
    base = torch._C.TensorBase
    grad = free_state.grad_of(t)
    hooks = base._backward_hooks.__get__(t)  # type: ignore[attr-defined]
    return (base.requires_grad.__get__(t), id(grad) if grad is not None else None, len(hooks or ()), storage_key(t))


class UntracedState(FlattenMismatch):
    """See Note [State outside the instance dict] and Note [Autograd state dispatch sets by hand]."""

    kind_name = "INNER_METADATA_MUTATION"
    hint = "Keep such state in an attribute (self.frozen = True) and branch on it in dispatch."

    def __init__(self, tracked: Tracked, name: str, what: str, made_here: bool = False) -> None:
        super().__init__(tracked, name)
        self.value_type = what
        if made_here:
            self.context = (
                f"dispatch set {name.rpartition('.')[2]!r} by hand on a tensor it made and hands out "
                f"({name.rpartition('.')[0]}): the compiled program makes that tensor as a graph "
                "output, without autograd state"
            )
            self.hint = "Set autograd state outside dispatch, on the tensor the caller gets."
        elif name.startswith("<tensor argument>"):
            self.context = (
                f"dispatch changed {name.rpartition('.')[2]!r} of a plain tensor the op was handed: the "
                "trace's tensor stands for it, and the compiled program cannot replay such a change"
            )
        else:
            self.context = (
                f"dispatch changed {name!r} of a {tracked.cls_name} that "
                + ("stands for the caller's object" if tracked.real is not None else "the traced program made")
                + ": the traced instance's class and autograd state are not the real object's, and the "
                "compiled program cannot replay such a change"
            )


class OddName(FlattenMismatch):
    """Dispatch sets or reads an attribute whose name is no identifier (``setattr(self,
    "stats.n", v)``, legal Python): Dynamo's guards and residual bytecode name attributes by
    identifiers, and failed on it, under ``fullgraph=False`` too (an outside tester's find)."""

    value_type = "attribute name"
    hint = "Use attribute names that are identifiers, or keep such keys in a dict the ctx holds as a tuple."

    def __init__(self, tracked: Tracked, name: str, verb: str) -> None:
        super().__init__(tracked, name)
        self.kind_name = "OPAQUE_VALUE" if verb == "set" else "UNSUPPORTED_STATE_READ"
        self.context = f"dispatch {verb} attribute {name!r}, a name that is not an identifier"


def _changes_tensor_state(t: Tracked, depth: int) -> bool:
    """A tensor-state name set or called by user code on an object standing for the caller's changes
    what it is (See Note [State outside the instance dict])."""
    return t.real is not None and not t.born and _called_from_user(depth + 2)


def _user_slot_names(cls: type) -> frozenset[str]:
    """The ``__slots__`` members user classes on ``cls``'s MRO declare (not torch's own)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if (getattr(klass, "__module__", "") or "").startswith("torch"):
            continue
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and isinstance(vars(klass).get(name), types.MemberDescriptorType):
                names.add(name)
    return frozenset(names)


def _carried_by_ctx(t: Tracked, name: str, get: Callable[[Any, str], Any]) -> bool:
    """The real object's slot holds a value its flatten ctx holds, and the traced instance
    (rebuilt from that ctx, which Dynamo guards) holds it too."""
    try:
        real_value = get(t.real, name)
        traced_value = get(t.obj, name)
        with unobserved():
            ctx = t.real.__tensor_flatten__()[1]
    except Exception:  # noqa: BLE001 - absent, or a flatten that fails here: not carried
        return False
    leaves = torch.utils._pytree.tree_leaves(ctx)
    if not any(v is real_value for v in leaves):
        return False
    try:
        return traced_value is real_value or bool(traced_value == real_value)
    except Exception:  # noqa: BLE001 - a value that does not compare
        return False


def _in_flatten(depth: int = 3, most: int = 4) -> bool:
    frame = sys._getframe(depth)
    for _ in range(most):
        if frame is None:
            return False
        if frame.f_code.co_name == "__tensor_flatten__":
            return True
        frame = frame.f_back
    return False


def check_inner(t: Tracked, name: str, get: Callable[[Any, str], Any]) -> None:
    """Inner tensors are the traced instance's own, if it has them (See FlattenMismatch)."""
    if t.real is None or t.shared:
        return
    try:
        real_value = get(t.real, name)
    except AttributeError:
        return
    if not isinstance(real_value, torch.Tensor):
        return
    try:
        traced_value = get(t.obj, name)
    except AttributeError:
        traced_value = None
    if not isinstance(traced_value, torch.Tensor):
        raise FlattenMismatch(t, name)


def _where(t: Tracked, name: str) -> str:
    if is_torch_internal(name):
        return _PASS  # torch's caches: its own
    cls_attr = class_attribute(type(t.obj), name)
    if cls_attr is not MISSING and _is_data_descriptor(cls_attr):
        return _PASS  # properties and tensor metadata: their code reads through the hooks
    if name in obj_dict(t.obj) or (t.real is not None and name in obj_dict(t.real)):
        return _STATE
    if cls_attr is MISSING:
        return _STATE  # absent from the standard lookup
    if callable(cls_attr) or isinstance(cls_attr, (classmethod, staticmethod)):
        return _METHOD  # a method, unless an instance attribute of that name appears
    return _STATE  # a class-level default


# --------------------------------------------------------------------------- #
# The scope
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class OperandChange:
    """A change a dispatch call of the traced backward made on a tensor it was handed (See
    Note [A count on a tensor the backward made] in partial_backward.py)."""

    obj: Any  # the object (kept alive while ids stand for it)
    name: str
    nodes: tuple[str, ...]  # the graph nodes of the call that made it
    call: int  # the outermost dispatch call it was made in
    readers: list[tuple[str, ...]] = dataclasses.field(default_factory=list)  # later calls handed it
    carried: bool = False  # a gradient the backward returns carries it


class Scope:
    """Tracked objects and the writes made on them, for one trace."""

    def __init__(self, answer: Answerer | None = None, label: str = "trace") -> None:
        self.answer = answer
        self.label = label
        self.tracked: dict[int, Tracked] = {}
        self.events: list[Write] = []
        self.thread = threading.get_ident()
        self._settled_upto = 0
        self.constructing: set[int] = set()  # registered objects inside their __init__
        #: Inner tensors the traced instance lacks are refused (the backward's scope does
        #: not: its instances are a finished pass's)
        self.check_inner = True
        #: The writes taken when the scope's block ended early (the joint function returned)
        self.kept: list[Write] | None = None
        #: Called with the frame of traced code that touched a tracked object (the Dynamo
        #: layer finds the user code dispatch runs this way: free_state.Collector).
        self.on_access: Callable[[Any, type], None] | None = None
        #: Called with a tensor user code read ``_version`` of that no real tensor stands
        #: behind (an intermediate); may refuse (See Note [A version counter no real tensor
        #: answers] in dynamo_layer.py).
        self.untracked_version: Callable[[Any], None] | None = None
        #: Symbolic values user code turned into text here, answered by their hint and guarded
        #: once the trace is over (See Note [Symbolic text in the traced backward]); None:
        #: guarded at once.
        self.deferred_guards: list[Any] | None = None
        #: The graph nodes traced by the dispatch call each write was made in, by id(Write)
        #: (the traced backward's scope: See Note [A backward run for part of the graph] in
        #: aot_layer.py); None: not noted.
        self.call_nodes: dict[int, tuple[str, ...]] | None = None
        #: the graph nodes of each dispatch call that computed more from its op's result
        #: (noted where call_nodes is)
        self.changing_calls: list[tuple[str, ...]] = []
        #: id(object made during the scope) -> its key (See OnePerKey)
        self.birth_keys: dict[int, Any] = {}
        #: (tracked, name) of values the traced code wrote and user code read back; None: not noted
        self.written_reads: set[tuple[Tracked, str]] | None = None
        # exceptions that left a user dispatch while traced (See Note [An exception dispatch
        # raised that torch swallowed])
        self.raised: list[BaseException] = []
        # exceptions user dispatch code caught itself while traced, other than a lookup's
        # (See Note [An exception dispatch caught while traced])
        self.caught: list[BaseException] = []
        #: whether to note them: some user code dispatch can run handles exceptions (None:
        #: where the dispatching class's own functions do)
        self.watch_caught: bool | None = False
        self.classes_catching: dict[type, bool] = {}  # free_state.class_catches, by class
        #: (class, decomposed op) for each user dispatch call handed a part of an op torch's
        #: Python decomposition split while traced (See Note [An op split while traced])
        self.decomposed: list[tuple[type, str]] = []
        #: id(object) -> (object, where): untracked objects eager's caller can reach after the
        #: trace (the traced backward's: the forward's outputs), whose writes are noted in
        #: ``reachable_writes`` (See Note [A write in the backward on an output])
        self.reachable: dict[int, tuple[Any, str]] = {}
        #: Called with (tracked, name) where user code reads a name in ``Tracked.pending`` (or
        #: the whole ``__dict__``): the layer refuses the read.
        self.on_pending: Callable[[Tracked, str], None] | None = None
        self.reachable_writes: list[tuple[Any, str, str]] = []
        #: Noted where call_nodes is (See Note [A count on a tensor the backward made] in
        #: partial_backward.py): the outermost dispatch calls so far; each change a call made
        #: on a tensor it was handed (OperandChange); id(object) -> the indices of its changes.
        self.call_serial = 0
        self.operand_changes: list[OperandChange] = []
        self.changes_of: dict[int, list[int]] = {}
        #: storage key -> (object, name): the plain tensors a tracked object's attributes held
        #: that dispatch changed in place (See Note [An inner tensor dispatch changes in
        #: place]); None: not noted.
        self.changed_in_place: dict[int, tuple[Any, str]] | None = None

    def operands_handed(self, operands: dict[int, tuple[Any, dict]]) -> list[int]:
        """A dispatch call was handed these objects: the changes an earlier call made on them,
        which this one may read."""
        return [
            k for i in operands for k in self.changes_of.get(i, ()) if self.operand_changes[k].call != self.call_serial
        ]

    def note_operand_changes(self, operands: dict[int, tuple[Any, dict]], read: list[int], nodes: tuple[str, ...]) -> None:
        """What the call handed these objects (with their instance dicts then) changed on
        them (every name bound to another object, or removed), and which earlier changes it
        was handed."""
        for k in read:
            self.operand_changes[k].readers.append(nodes)
        for i, (obj, before) in operands.items():
            after = obj_dict(obj)
            changed = [n for n, v in after.items() if before.get(n, MISSING) is not v]
            changed += [n for n in before if n not in after]
            for name in changed:
                if is_torch_internal(name):
                    continue
                self.changes_of.setdefault(i, []).append(len(self.operand_changes))
                self.operand_changes.append(OperandChange(obj, name, nodes, self.call_serial))

    # -- tracking -----------------------------------------------------------

    def track(self, obj: Any, real: Any, data: Any = None, plain_inner: bool = False) -> Tracked:
        t = self.tracked.get(id(obj))
        if t is None or t.obj is not obj:
            t = Tracked(obj, real, data)
            t.plain_inner = plain_inner
            self.tracked[id(obj)] = t
        elif data is not None and t.data is None:
            t.data = data
        return t

    def _hook_classes(self) -> tuple[set[type], set[type]]:
        """Classes whose attribute access the block interposes on, and the trace-tensor
        classes whose ``_version`` it answers (plain inner tensors standing for real ones)."""
        full: set[type] = set(_REGISTERED)
        version: set[type] = set()
        for t in self.tracked.values():
            if not t.plain_inner:
                full.add(type(t.obj))
            elif t.real is not None:
                version.add(type(t.obj))
                if user_state(obj_dict(t.real)):  # the user keeps attributes on it: answer them
                    full.add(type(t.obj))
        return full, version

    def lookup(self, obj: Any) -> Tracked | None:
        t = self.tracked.get(id(obj))
        return t if t is not None and t.obj is obj else None

    @contextlib.contextmanager
    def active(self) -> Iterator["Scope"]:
        """Interpose on the tracked objects' attribute access for the block (this thread)."""
        previous = current()
        for t in self.tracked.values():
            if t.left is not None and free_state.has_own_torch_function(t.obj):
                _put_back_torch_function_writes(t)
            # Whatever changed since the last block was torch's doing (Dynamo between
            # two ops), not the traced code's: only changes inside a block are writes.
            t.expected = dict(user_state(obj_dict(t.obj)))
        full, version = self._hook_classes()
        handles = [
            _patches.CLASS_HOOKS.install(full, _make_hooks),
            _patches.VERSION_HOOKS.install(version, _make_version_hooks),
            _patches.CLASS_HOOKS.install(SYMBOLIC_TYPES, _make_symbolic_hooks),
        ]
        _local.scope = self
        try:
            yield self
        finally:
            _local.scope = previous
            for handle in reversed(handles):
                handle.remove()
            for t in self.tracked.values():
                if free_state.has_own_torch_function(t.obj):
                    t.left = dict(user_state(obj_dict(t.obj)))

    # -- what the hooks call ------------------------------------------------

    def read(self, t: Tracked, name: str, get: Callable[[Any, str], Any]) -> Any:
        if t.pending and (name in t.pending or name == "__dict__") and self.on_pending is not None and _called_from_user(3):
            self.on_pending(t, name)
        if (
            name in t.slot_names and t.real is not None and not t.plain_inner
            and _called_from_user(3) and not _in_flatten()
            and not _carried_by_ctx(t, name, get)
        ):
            raise SlotState(t, name, "read")  # See Note [State in __slots__]
        if self.written_reads is not None and (name in t.written or name == "__dict__") and _called_from_user(3):
            # a value the traced code wrote, read back (the traced backward's: See Note [A
            # backward run for part of the graph] in partial_backward.py)
            self.written_reads.update((t, n) for n in ((name,) if name != "__dict__" else t.written))
        if name == "__dict__" or (name in _WHOLE_STATE and free_state.called_through_stdlib_from_user(sys._getframe(2))):
            # User code reading __dict__ itself sees every entry eager would find there
            # (``copy.copy(cfg)`` takes it through ``__reduce_ex__``, in C).
            if t.on_read is not None and not t.dict_complete and not _called_from_torch(3):
                t.dict_complete = True
                t.on_read(t, KEYS)
            if (
                t.real is not None and not t.dict_complete and self.answer is not None
                and not _called_from_torch(3)
            ):
                self._answer_all(t)
            return get(t.obj, name)
        if name[:2] != "__" and not t.plain_inner and not is_torch_internal(name):
            d = obj_dict(t.obj)
            if name in d and t.expected.get(name, MISSING) is not d[name]:
                # written through the dict by the traced code (``__dict__.setdefault("n", 0)``,
                # a name read before as absent): its own value, a write of this trace
                self.catch_up()
                return get(t.obj, name)
        if t.real is None or self.answer is None or name in t.settled or name[:2] == "__":
            if t.on_read is not None and name not in t.settled and name[:2] != "__" and name not in t.written:
                if name in t.flatten_names and not _called_from_user(3):
                    return get(t.obj, name)  # torch unwrapping the instance, not dispatch's read
                t.settled.add(name)
                t.on_read(t, name)
            return get(t.obj, name)
        if (
            name in TENSOR_STATE_READS and self.label == "dynamo" and isinstance(t.obj, torch.Tensor)
            and isinstance(t.real, torch.Tensor) and _called_from_user(3)
        ):
            # See Note [Autograd state dispatch reads] (dynamo_layer.py)
            return self.answer(self, t, name)
        if name == "_version" and isinstance(t.obj, torch.Tensor):
            # what the version hooks answer when user code reads it (See _make_version_hooks);
            # a subclass's own counter alike (a cache keyed on ``self._version``, which an
            # optimizer's in-place step moves on: replayed stale, an outside tester's find)
            return self.answer(self, t, name) if _called_from_user(3) else get(t.obj, name)
        if t.plain_inner and name not in obj_dict(t.real) and (
            name in obj_dict(t.obj) or class_attribute(type(t.obj), name) is not MISSING or not _called_from_user(3)
        ):
            # the trace tensor's own (fake_mode, ...): only user state is answered, and a
            # user read of a name the real tensor lacks (``getattr(x, "seen_by", 0)``) is
            # answered "absent", guarded
            return get(t.obj, name)
        if name in t.absent:
            self._before_user_getattr(t)
            raise AttributeError(f"{t.cls_name!r} object has no attribute {name!r}")
        if name in t.flatten_names:
            if self.check_inner:
                check_inner(t, name, get)
            t.settled.add(name)
            return get(t.obj, name)
        where = _where(t, name)
        if where is not _STATE:
            if where is _METHOD and not t.shared and not t.plain_inner:
                self.answer(self, t, Unshadowed(name))
            t.settled.add(name)
            if name == "grad" and isinstance(t.real, torch.Tensor) and isinstance(t.obj, torch.Tensor):
                # the traced tensor is no leaf where the real one is: torch's warning for
                # reading a non-leaf's gradient only where eager's read warns
                return free_state.grad_of(t.obj) if free_state.grad_reads_quietly(t.real) else get(t.obj, name)
            return get(t.obj, name)
        try:
            return self.answer(self, t, name)
        except AttributeError:
            self._before_user_getattr(t)
            raise

    def _before_user_getattr(self, t: Tracked) -> None:
        """The read falls through to the class's own ``__getattr__``, which typically reads
        state with ``object.__getattribute__`` (no hook sees that): answer every entry eager
        would find in the instance dict first, so it reads the real object's state."""
        if not t.dict_complete and class_attribute(type(t.obj), "__getattr__") is not MISSING:
            self._answer_all(t)  # a shared config object's too (``self.__dict__["_d"]``)

    def _answer_all(self, t: Tracked) -> None:
        """Code reads the instance dict itself: answer every entry eager would find there,
        and which entries there are (``KEYS``)."""
        self.answer(self, t, KEYS)  # type: ignore[misc]
        names = set(user_state(obj_dict(t.real))) | set(user_state(obj_dict(t.obj)))
        for name in sorted(names - t.settled - t.absent - t.flatten_names):
            try:
                self.answer(self, t, name)  # type: ignore[misc]
            except AttributeError:
                pass
        # in eager's order: the real object's entries as it holds them, then those the trace
        # made (code iterating the dict applies them in that order)
        d, real = obj_dict(t.obj), obj_dict(t.real)
        order = [k for k in real if k in d] + [k for k in d if k not in real]
        if list(d) != order:
            items = [(k, d[k]) for k in order]
            d.clear()
            d.update(items)
        t.dict_complete = True

    def write(self, t: Tracked, name: str, value: Any) -> None:
        if name in t.slot_names and not t.plain_inner:
            raise SlotState(t, name, "wrote")
        self.catch_up()  # what went through an instance dict before this write, first
        old = obj_dict(t.obj).get(name, MISSING)
        self.events.append(Write(t, name, value, old))
        t.pending.discard(name)
        t.written.add(name)
        t.settled.add(name)
        t.absent.discard(name)
        t.expected[name] = value
        t.containers.pop(name, None)

    def delete(self, t: Tracked, name: str) -> None:
        self.catch_up()
        old = obj_dict(t.obj).get(name, MISSING)
        self.events.append(Write(t, name, MISSING, old))
        t.pending.discard(name)
        t.written.add(name)
        t.settled.add(name)
        t.absent.add(name)
        t.expected.pop(name, None)
        t.containers.pop(name, None)

    # -- after the traced code ran -----------------------------------------

    def autograd_states(self) -> dict[int, tuple[Tracked, tuple]]:
        """Each tracked tensor's own autograd state, taken before an op (See Note [Autograd
        state dispatch sets by hand])."""
        with unobserved():
            return {
                id(t.obj): (t, _autograd_state_unobserved(t.obj))
                for t in list(self.tracked.values()) if isinstance(t.obj, torch.Tensor)
            }

    def refuse_changed_class(self, before: dict[int, tuple[Tracked, tuple]] | None = None) -> None:
        """A class swap ``object.__setattr__`` made, past the hooks, or a change of the autograd
        state of a plain tensor an input holds (See Note [State outside the instance dict]), or
        of a tensor the op was handed (``before``: See Note [Autograd state dispatch sets by hand])."""
        for t in list(self.tracked.values()):
            if t.real is None or t.born:
                continue
            if type(t.obj) is not t.entry_type:
                raise UntracedState(t, "__class__", "type")
            for name, (value, state) in t.entry_inner_autograd.items():
                now = _autograd_state(value)
                if now != state:
                    raise UntracedState(t, f"{name}.{_first_change(state, now)}", "Tensor")
        with unobserved():
            changed = next(
                ((t, state, now) for t, state in (before or {}).values() if (now := _autograd_state_unobserved(t.obj)) != state),
                None,
            )
        if changed is not None:
            t, state, now = changed
            if not t.plain_inner:
                raise UntracedState(t, _first_change(state, now), "Tensor")
            # a plain tensor the op was handed: named as such, blamed on a subclass the op reached
            owner = next((o for o in self.tracked.values() if not o.plain_inner), t)
            raise UntracedState(owner, f"<tensor argument>.{_first_change(state, now)}", "Tensor")

    def refuse_autograd_set_by_hand(
        self, tracked: Tracked, before: dict[int, tuple[Tracked, tuple]], made: list[Any], writes: list["Write"]
    ) -> None:
        """A tensor dispatch made and hands back inside a result, or writes to an attribute,
        with autograd state set by hand (See Note [Autograd state dispatch sets by hand])."""
        found = [("<result>", v) for v in made] + [
            (w.name, v) for w in writes if isinstance(w.value, torch.Tensor)
            for v in (w.value, *inner_plain_tensors(w.value))
        ]
        odd = [(name, v, what) for name, v in found if (what := _autograd_set(v)) is not None]
        if not odd:
            return
        known = set(before) | {
            id(v) for t in list(self.tracked.values()) for v in (*t.entry.values(), *obj_dict(t.obj).values())
            if isinstance(v, torch.Tensor) and not any(v is w.value for w in writes)
        }
        for name, value, what in odd:
            if id(value) not in known:
                raise UntracedState(tracked, f"{name}.{what}", "Tensor", made_here=True)

    def settle(self) -> list[Write]:
        """Catch what attribute syntax did not show, and return the writes made since
        the last call, in order."""
        self.catch_up()
        new = self.events[self._settled_upto :]
        self._settled_upto = len(self.events)
        return new

    def written_so_far(self) -> list[Write]:
        """The writes ``settle`` would return now, left to it."""
        self.catch_up()
        return self.events[self._settled_upto :]

    def catch_up(self) -> None:
        """Record as events what attribute syntax did not show (writes through the instance
        dict, containers changed in place) up to now, leaving them to the next ``settle``: a
        read of a name the op wrote through the dict catches up mid-op, and that write is
        still one of the op's (taking it as settled there lost it: an outside tester's find)."""
        for t in list(self.tracked.values()):
            actual = user_state(obj_dict(t.obj))
            if t.plain_inner:  # torch keeps its own bookkeeping there: new names only
                actual = {k: v for k, v in actual.items() if k not in t.entry or k in t.written}
            for name, value in actual.items():
                if t.expected.get(name, MISSING) is not value:
                    self.events.append(Write(t, name, value, t.expected.get(name, MISSING)))
                    t.expected[name] = value
                    t.written.add(name)
                    t.settled.add(name)
            for name in [n for n in t.expected if n not in actual and not (t.plain_inner and n in t.entry)]:
                self.events.append(Write(t, name, MISSING, t.expected.pop(name)))
                t.written.add(name)
            for name, (container, contents) in list(t.containers.items()):
                if actual.get(name) is container and _changed(container, contents):
                    self.events.append(Write(t, name, container, contents, in_place=True))
                    t.containers[name] = (container, _snapshot(container))
            for name, contents in t.entry_containers.items():
                container = t.entry.get(name)
                if name not in t.containers and actual.get(name) is container and _changed(container, contents):
                    self.events.append(Write(t, name, container, contents, in_place=True))

    def restore(self) -> None:
        """Put every tracked object back as it was when tracking began."""
        for t in reversed(list(self.tracked.values())):
            d = obj_dict(t.obj)
            internal = {k: v for k, v in d.items() if is_torch_internal(k)}  # torch's, left as they are
            d.clear()
            d.update(t.entry)
            d.update(internal)
            for name, contents in t.entry_containers.items():
                container = t.entry[name]
                if contents is not _UNCOPYABLE and _changed(container, contents):
                    _refill(container, contents)

    def net_writes(self, events: list[Write] | None = None) -> list[Write]:
        """The last write of each (object, attribute), in the order of first writes."""
        last: dict[tuple[int, str], Write] = {}
        for w in self.events if events is None else events:
            key = (id(w.tracked.obj), w.name)
            first = last.pop(key, None)
            old = first.old if first is not None else w.old
            last[key] = dataclasses.replace(w, old=old, in_place=w.in_place or (first is not None and first.in_place))
        return list(last.values())


_UNCOPYABLE: Any = object()


def _snapshot(container: Any) -> Any:
    """A copy to compare with later; a container now holding what does not copy (a traced
    tensor, a symbolic int) compares as changed from then on."""
    try:
        return _copy_contents(container)
    except Exception:  # noqa: BLE001 - whatever deepcopy rejects
        return _UNCOPYABLE


def _copy_contents(container: Any) -> Any:
    """A deep copy that keeps the symbolic numbers inside as they are: a SymInt is immutable
    and does not copy (a dict ``{"step": s0}`` an object built while tracing holds, where
    the step is a dynamic int)."""
    memo: dict[int, Any] = {}
    _keep_symbolic(container, memo)
    return copy.deepcopy(container, memo)


def _keep_symbolic(value: Any, memo: dict[int, Any]) -> None:
    if isinstance(value, SYMBOLIC_TYPES):
        memo[id(value)] = value
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            _keep_symbolic(v, memo)
    elif isinstance(value, dict):
        for k, v in value.items():
            _keep_symbolic(k, memo)
            _keep_symbolic(v, memo)


def _changed(container: Any, contents: Any) -> bool:
    if contents is _UNCOPYABLE:
        return True
    try:
        return bool(container != contents)
    except Exception:
        return True


def _refill(container: Any, contents: Any) -> None:
    if isinstance(container, (dict, set)):
        container.clear()
        container.update(_copy_contents(contents))
    else:
        container[:] = _copy_contents(contents)


# --------------------------------------------------------------------------- #
# The class hooks
# --------------------------------------------------------------------------- #


def _tracked_here(obj: Any) -> tuple[Scope | None, Tracked | None]:
    scope = getattr(_local, "scope", None)
    if scope is None:
        return None, None
    t = scope.tracked.get(id(obj))
    if t is None or t.obj is not obj:
        if type(obj) in _REGISTERED:
            return scope, None
        return None, None
    return scope, t


def _note_reachable_write(obj: Any, name: str) -> None:
    scope = current()
    if scope is None or not scope.reachable or is_torch_internal(name):
        return
    held = scope.reachable.get(id(obj))
    if held is not None and held[0] is obj:
        scope.reachable_writes.append((obj, name, held[1]))


def sets_besides(t: "Tracked", name: str) -> bool:
    """``name`` was set on ``t``'s object by its class's own ``__setattr__`` while handling an
    assignment to another name (a count of sets, a renamed key): replaying the assigned names
    runs that ``__setattr__`` again, which would do it a second time (an outside tester's
    find: a count of sets counted twice)."""
    if name in t.assigned or not isinstance(t.obj, torch.Tensor):
        return False
    return _patches.CLASS_HOOKS._base(type(t.obj))("__setattr__") is not object.__setattr__  # as _make_hooks tells


def under_a_descriptor(t: "Tracked", name: str) -> bool:
    """``name`` landed in the instance dict though a data descriptor of the class owns it
    (``self.__dict__["shape"] = v``, or a property's name written through the dict): the
    replay's ``setattr`` would go to the descriptor (torch's ``shape`` is not writable; a
    property's setter runs where eager's never ran: an outside tester's find)."""
    return _sets_elsewhere(type(t.obj), name)


def _sets_elsewhere(cls: type, name: str) -> bool:
    """``obj.name = v`` does not put ``name`` in the instance dict itself: a data descriptor
    does (a property with a setter; not a ``__slots__`` member, which is the object's own)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            return hasattr(type(value), "__set__") and not isinstance(value, types.MemberDescriptorType)
    return False


def _make_hooks(cls: type, base: Callable[[str], Any]) -> dict[str, Any]:
    """The hooks for ``cls``; ``base(name)`` gives the implementation they wrap."""
    get_ = base("__getattribute__")
    set_ = base("__setattr__")
    del_ = base("__delattr__")
    own_setattr = set_ is not object.__setattr__  # the class's own decides what lands where

    def __getattribute__(obj: Any, name: str) -> Any:
        scope, t = _tracked_here(obj)
        if t is None:
            if scope is None or name[:2] == "__" or id(obj) in scope.constructing:
                return get_(obj, name)
            t = scope.track(obj, obj)  # a registered state object the trace reached through a ctx
        if name in _TENSOR_STATE_METHODS and _changes_tensor_state(t, 1):
            raise UntracedState(t, name, "method")
        if not name.isidentifier() and _called_from_user(2):
            raise OddName(t, name, "read")
        if scope.on_access is not None:  # type: ignore[union-attr]
            scope.on_access(sys._getframe(1), type(obj))  # type: ignore[union-attr]
        value = scope.read(t, name, get_)  # type: ignore[union-attr]
        if scope.label == "backward":  # type: ignore[union-attr]
            counters.note_read(value, name == "__dict__")
        return value

    def __setattr__(obj: Any, name: str, value: Any) -> None:
        scope, t = _tracked_here(obj)
        if scope is None:
            _note_reachable_write(obj, name)
        elif not is_torch_internal(name) and id(obj) not in scope.constructing:
            if t is None:  # a registered state object the trace reached through a ctx
                t = scope.track(obj, obj)
            # a tensor's state names, on a tensor: a registered state object's own field may be
            # called ``data`` (DTensor's MaskBuffer): refused as a tensor's (an outside tester's find)
            if (name == "__class__" or (name in _TENSOR_STATE_NAMES and isinstance(obj, torch.Tensor))) and _changes_tensor_state(t, 1):
                raise UntracedState(t, name, type(value).__name__)
            if not name.isidentifier():
                raise OddName(t, name, "set")
            if scope.on_access is not None:  # a hook that only writes: its closure is read too
                scope.on_access(sys._getframe(1), type(obj))
            if own_setattr:
                t.assigned.add(name)
            elif not _sets_elsewhere(type(obj), name):
                scope.write(t, name, value)
            # else: a property's setter or the class's own ``__setattr__`` decides what lands
            # in the instance dict (``self._scale = v``, a renamed key): its own writes are
            # recorded as they happen, and ``Scope.settle`` catches what it set directly.
            # Recorded as ``name``, the write looked like a deletion (an outside tester's find).
        set_(obj, name, value)

    def __delattr__(obj: Any, name: str) -> None:
        scope, t = _tracked_here(obj)
        if scope is None:
            _note_reachable_write(obj, name)
        elif not is_torch_internal(name):
            if t is None:
                t = scope.track(obj, obj)
            if not name.isidentifier():
                raise OddName(t, name, "deleted")
            scope.delete(t, name)
        del_(obj, name)

    hooks: dict[str, Any] = {
        "__getattribute__": __getattribute__,
        "__setattr__": __setattr__,
        "__delattr__": __delattr__,
    }
    if cls in _REGISTERED:
        init_ = base("__init__")

        def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:
            scope = getattr(_local, "scope", None)
            if scope is None or type(obj) is not cls:
                init_(obj, *args, **kwargs)
                return
            # Built during the trace: what __init__ leaves is its state "before" (not
            # writes); it stands for itself (the trace may hand it to eager, in an
            # output's ctx).
            scope.constructing.add(id(obj))
            try:
                init_(obj, *args, **kwargs)
            finally:
                scope.constructing.discard(id(obj))
            scope.track(obj, obj).born = True
            one = ONE_PER_KEY.get(cls)
            if one is not None:
                scope.birth_keys[id(obj)] = one.key()

        hooks["__init__"] = __init__
    dispatch = _user_dispatch(cls)
    if dispatch is not None:

        def __torch_dispatch__(klass: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            scope = getattr(_local, "scope", None)
            if scope is not None:
                args, kwargs = as_eager_passes(func, args, kwargs)
            graph = _tracing_graph(scope)
            stack = _local.__dict__.setdefault("dispatching", [])
            if graph is not None:
                first_node, first_event = len(graph.nodes), len(scope.events)
                if not stack:
                    scope.call_serial += 1
                operands = _operands((args, kwargs))  # See Note [A count on a tensor the backward made]
                handed = scope.operands_handed(operands)
            stack.append(klass)
            if scope is not None:
                free_state.note_op(func)
                split = _split_by(sys._getframe(1))
                if split is not None:
                    scope.decomposed.append((klass, split))
            watching = scope is not None and _watch_caught(scope, klass)
            # See Note [A count reaching a tensor op] in counters.py
            pins = counters.PinsCountedArguments() if scope is not None and scope.label == "backward" else _NO_PINS
            try:
                with pins, _watch_in_place(scope, args, kwargs):
                    return dispatch.__get__(None, klass)(func, types, args, kwargs)
            except Exception as exc:
                if scope is not None:
                    scope.raised.append(exc)
                    if scope.label == "backward" and _data_dependent(exc):
                        # a branch on tensor data in the traced backward (``float(grad.abs().max())``):
                        # named as in the forward, not torch's raw guard error (an outside tester's find)
                        from .errors import RefusalKind, SubclassWriteError

                        raise SubclassWriteError(
                            RefusalKind.DISPATCH_RAISED, klass.__name__, "<dispatch>", type(exc).__name__,
                            context=f"the traced backward's dispatch read tensor data: {str(exc)[:200]}",
                        ) from exc
                raise
            finally:
                if watching:
                    sys.settrace(None)
                    _local.caught_tracer = None
                stack.pop()
                if graph is not None:
                    nodes = list(itertools.islice(graph.nodes, first_node, None))
                    names = tuple(n.name for n in nodes)
                    for w in scope.events[first_event:]:  # an inner call's writes are its own
                        scope.call_nodes.setdefault(id(w), names)
                    scope.note_operand_changes(operands, handed, names)
                    if _changes_its_result(func, nodes):
                        scope.changing_calls.append(names)

        hooks["__torch_dispatch__"] = classmethod(__torch_dispatch__)
    return hooks


def _operands(args: Any) -> dict[int, tuple[Any, dict]]:
    """The tensors other than plain ones a dispatch call was handed, and the subclass tensors
    their instance dicts hold (a nested one), each with a copy of its instance dict, read
    without the attribute hooks."""
    import torch.utils._pytree as pytree

    found: dict[int, tuple[Any, dict]] = {}
    stack = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor) and type(a) is not torch.Tensor]
    while stack and len(found) < 64:
        obj = stack.pop()
        if id(obj) in found:
            continue
        d = obj_dict(obj)
        found[id(obj)] = (obj, dict(d))
        stack.extend(v for v in d.values() if isinstance(v, torch.Tensor) and type(v) is not torch.Tensor)
    return found


# Note [An exception dispatch caught while traced]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dispatch may try a fast path and catch what it raises (``try: self.np_max =
# float(out.numpy().max()) except RuntimeError: self.fallbacks += 1``). While traced, torch
# raises where eager does not: ``numpy()`` and ``data_ptr()`` on a fake tensor, a branch on
# tensor data (``.item()``, ``nonzero`` sizes). The trace took the ``except`` branch and the
# compiled program replayed it on every call, silently (an outside tester's find; stock
# loses every write). Nothing shows an exception caught inside the function that raised it
# but a trace function: while a user dispatch runs under a scope, one is set on the thread
# (``sys.settrace``), where some user code dispatch can run handles exceptions itself (found
# statically: free_state.Collector.catches, class_catches), since it slows every frame; and
# only where none is set (a debugger's or coverage's is left alone, and then this is not
# seen). It follows the user frames dispatch calls through user frames (no line events; not a
# library torch calls on the way: sympy catches its own), and a nested subclass's dispatch
# run from them, and notes each exception reaching one. What a lookup raises from user or
# dynamo_ext code (an absent attribute answered from the real object, a missing key, an index
# out of range) and what user code raises itself (a ``raise`` statement, on conditions the
# compiled code is guarded on) raise alike in eager and are left out; anything else caught in dispatch refuses the op (``dispatch_raised``; eager
# under ``fullgraph=False``), since the traced branch may not be eager's.

_NO_PINS = contextlib.nullcontext()


# Note [An inner tensor dispatch changes in place]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dispatch may change a tensor an attribute holds in place (``self.n.add_(1)``, a float8
# weight's ``hist[0] = amax``), with no write to record. Within the subclass that is right:
# AOTAutograd sees the change as one on the input's inner tensor. But when the compiled
# function reads that tensor itself after the op (``x.n + 0``, the module buffer that is also
# the weight's history), Dynamo made it a graph input of its own, which the compiled graph
# reads before the op's change: the AOT backends gave the value from before it, silently
# (an outside tester's find; the state after the call was right). Its version counter does
# not tell: changes below autograd do not move it, in eager too. So while Dynamo propagates
# an op, a dispatch mode inside each dispatch call sees the ops that change a tensor in
# place, and notes those on the storage of a plain tensor the call's operands held; the
# Dynamo layer refuses a later op of the compiled function handed a tensor on such a storage.


def _watch_in_place(scope: Scope | None, args: Any, kwargs: Any) -> Any:
    """A dispatch mode noting the in-place changes of the plain tensors the operands' attributes
    hold (See Note [An inner tensor dispatch changes in place]), or nothing to do."""
    if scope is None or scope.changed_in_place is None:
        return _NO_PINS
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    held: dict[int, tuple[Any, str]] = {}
    for obj, d in _operands((args, kwargs)).values():
        for name, value in d.items():
            if isinstance(value, torch.Tensor) and not is_traceable_wrapper_subclass(value):
                key = storage_key(value)
                if key is not None:
                    held.setdefault(key, (obj, name))
    return _InPlaceWatch(scope.changed_in_place, held) if held else _NO_PINS


def storage_key(t: torch.Tensor) -> int | None:
    """What tells tensors on one storage apart from others (None: a tensor with no storage)."""
    try:
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - no storage (a wrapper subclass, a sparse tensor)
        return None


class _InPlaceWatch(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, changed: dict[int, tuple[Any, str]], held: dict[int, tuple[Any, str]]) -> None:
        super().__init__()
        self.changed = changed
        self.held = held

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable:
            import torch.utils._pytree as pytree

            for i, arg in enumerate(schema.arguments):  # keyword-only ones come last
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = args[i] if not arg.kwarg_only and i < len(args) else kwargs.get(arg.name)
                for t in pytree.tree_leaves(value):
                    if isinstance(t, torch.Tensor):
                        key = storage_key(t)
                        if key in self.held:
                            self.changed.setdefault(key, self.held[key])
        return func(*args, **kwargs)


_LOOKUP_ERRORS = (AttributeError, KeyError, IndexError, StopIteration, StopAsyncIteration, GeneratorExit)
_RAISE = dis.opmap["RAISE_VARARGS"]


def _eager_raises_alike(kind: type, tb: Any) -> bool:
    """What a lookup raises from user or dynamo_ext code (an absent attribute answered from
    the real object, a missing key), and what user code raises itself (a ``raise`` statement,
    on conditions the compiled code is guarded on), raise alike in eager."""
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    if issubclass(kind, _LOOKUP_ERRORS):
        return not code.co_filename.startswith(_TORCH_DIR)
    return free_state.is_user_code(code.co_filename) and tb.tb_lasti < len(code.co_code) and code.co_code[tb.tb_lasti] == _RAISE


def _watch_caught(scope: Scope, klass: type) -> bool:
    """Set the trace function noting exceptions in user frames for this dispatch call; False
    where one is set already (an outer dispatch's, or a debugger's)."""
    watch = scope.watch_caught
    if watch is None:
        watch = scope.classes_catching.get(klass)
        if watch is None:
            watch = scope.classes_catching[klass] = free_state.class_catches(klass)
    current = sys.gettrace()
    if current is not None:
        if current is getattr(_local, "caught_tracer", None):
            # a nested subclass's dispatch, called from the watched one through torch's
            # frames: its frames are followed too
            _local.caught_reroot = True
        return False
    if not watch:
        return False
    caught = scope.caught

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "exception":
            kind, exc, tb = arg
            if exc is not None and tb is not None and not _eager_raises_alike(kind, tb):
                if not any(exc is e for e in caught):
                    caught.append(exc)
        return local

    entered: list[bool] = []

    def call(frame: Any, event: str, arg: Any) -> Any:
        # the first user frame (dispatch, under whatever decorator) and the user frames it
        # calls through user frames only (not a library torch calls on the way: sympy
        # catches its own errors)
        if event != "call" or not free_state.is_user_code(frame.f_code.co_filename):
            return None
        if entered and not _local.caught_reroot:
            caller = frame.f_back
            if caller is None or caller.f_trace is not local:
                return None
        else:
            entered.append(True)
            _local.caught_reroot = False
        frame.f_trace_lines = False
        return local

    _local.caught_tracer = call
    _local.caught_reroot = False
    sys.settrace(call)
    return True


# Note [An op split while traced]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Tracing runs with torch's Python dispatcher on, which splits some ops into their parts with
# Python decompositions. Those registered for the autograd keys (``hardshrink``,
# ``softshrink``, ``dropout``, ``native_batch_norm``, ``upsample_*``, ``rnn_*``) stand where
# eager has a kernel of its own and hands dispatch the op whole; those for
# CompositeImplicitAutograd stand for the C++ decomposition eager runs, not always alike
# (``one_hot``; ``matmul`` with a batched second operand hands dispatch ``expand`` where
# eager's hands it ``transpose``, ``expand``). A writing class counting or caching by op then
# wrote otherwise than eager, silently (an outside tester's find, through inference mode;
# stock loses its writes). Each user dispatch call while traced looks at the frames that
# called it (through dynamo_ext's hooks), up to the first that is not torch's own (generated
# or user code: an outer subclass's dispatch) or is Dynamo's: one that is such a
# decomposition, other than those found to split alike (``_ALIKE``; ``matmul`` with a matrix
# or vector second operand, where a batched first one is folded alike), marks the call, and a writing class's op is refused
# (``traced_ops_differ``; eager under ``fullgraph=False``).

_DYNAMO_DIR = os.path.join(_TORCH_DIR, "_dynamo") + os.sep


#: Python decompositions for CompositeImplicitAutograd found to hand dispatch what the C++ one
#: eager runs does (tests/test_adversarial.py::test_ops_torch_decomposes_alike_compile);
#: ``matmul``'s only where its second operand is a matrix or a vector (not a vector times a
#: matrix: eager's ends in ``squeeze_``, the Python one in ``squeeze``) and both fold a batched
#: first one (with a batched second it hands dispatch ``expand`` where eager's hands it
#: ``transpose`` and ``expand``; unfolded, ``view`` where eager's ``_unsafe_view``).
_ALIKE = frozenset({"aten.broadcast_tensors.default", "aten.tensor_split.tensor_indices_or_sections", "aten.unsafe_chunk.default"})
_MATMUL = frozenset({"aten.matmul.default", "aten.matmul.out"})


@functools.lru_cache(maxsize=1)
def _python_decompositions() -> dict[Any, frozenset[str]]:
    """The code of each Python kernel torch registers for an autograd key or for
    CompositeImplicitAutograd of an aten op, and the ops it is registered for, the autograd
    keys' marked ``!`` (read once, while traced: the decompositions are imported by then)."""
    found: dict[Any, set[str]] = {}
    # registering a Python kernel made its overload, kept on its packet: only those are looked at
    for packet in list(vars(torch.ops.aten).values()):
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for op in list(vars(packet).values()):
            if not isinstance(op, torch._ops.OpOverload):
                continue
            for key, kernel in op.py_kernels.items():
                code = getattr(inspect.unwrap(kernel), "__code__", None)
                if code is None:
                    continue
                if key.name.startswith("Autograd"):
                    found.setdefault(code, set()).add(f"!{op}")
                elif key.name == "CompositeImplicitAutograd":
                    found.setdefault(code, set()).add(str(op))
    return {code: frozenset(ops) for code, ops in found.items()}


def _split_by(frame: Any) -> str | None:
    """The Python decomposition among the frames calling this dispatch that may hand it other
    ops than eager's, if one is (See Note [An op split while traced])."""
    steps = 0
    while frame is not None and steps < 64:
        code = frame.f_code
        if code.co_filename.startswith(_OWN_DIR):  # this module's hooks (a property torch reads)
            frame = frame.f_back
            continue
        if not code.co_filename.startswith(_TORCH_DIR) or code.co_filename.startswith(_DYNAMO_DIR):
            return None
        if os.sep + "_decomp" + os.sep in code.co_filename or os.sep + "_refs" + os.sep in code.co_filename:
            ops = _python_decompositions().get(code)
            if ops is not None and not _splits_alike(ops, frame):
                return f"{frame.f_globals.get('__name__', '?')}.{code.co_name}"
        frame = frame.f_back
        steps += 1
    return None


def _splits_alike(ops: frozenset[str], frame: Any) -> bool:
    if ops <= _ALIKE:
        return True
    if ops <= _MATMUL:
        first, second = frame.f_locals.get("tensor1"), frame.f_locals.get("tensor2")
        if not (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)) or second.dim() > 2:
            return False
        if first.dim() == 1 and second.dim() == 2:
            return False  # eager's C++ ends in ``squeeze_``, the Python one in ``squeeze``
        if first.dim() <= 2:
            return True
        # a batched first operand: alike where both fold it into one ``mm``/``mv``; where
        # either does not, eager's ``bmm`` ends in ``_unsafe_view``, the Python one's in ``view``
        fold = frame.f_globals.get("should_fold")
        return callable(fold) and bool(fold(first, second, False)) and _eager_folds(first, second)
    return False


def _eager_folds(first: torch.Tensor, second: torch.Tensor) -> bool:
    """ATen's ``should_fold`` (LinearAlgebra.cpp) for a first operand of three or more dims and
    a second of one or two: eager's C++ ``matmul`` folds the batch into one ``mm``/``mv``."""
    if second.requires_grad or first.numel() == 0:
        return True
    shape, strides = first.shape, first.stride()
    return all(strides[i] == strides[i + 1] * shape[i + 1] for i in range(first.dim() - 2))


def split_context(split: tuple[type, str]) -> str:
    """What a refusal of an op split while traced says (both layers)."""
    klass, decomposition = split
    return (
        f"while traced, torch's Python decomposition {decomposition} hands {klass.__name__}'s dispatch "
        "an op's parts, where eager hands it the op whole: what dispatch writes could differ"
    )


def exception_chain(exc: BaseException, most: int = 6) -> Iterator[BaseException]:
    """``exc`` and what it wraps (its cause, or the exception it was raised handling)."""
    for _ in range(most):
        yield exc
        inner = exc.__cause__ or exc.__context__
        if inner is None:
            return
        exc = inner


def left_dispatch(exc: BaseException, raised: list[BaseException]) -> BaseException | None:
    """Note [An error torch raised inside dispatch]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Fake propagation can fail inside a user dispatch on what tracing cannot know: a branch
    on tensor data (``if self.elem.abs().max() > 2: self.overflows += 1``) raises torch's
    data-dependent error. Stock never met it where the traced instance lacked the state
    the branch is behind (the count lost, silently). The op is refused as
    ``dispatch_raised``, naming the subclass, and under ``fullgraph=False`` runs eagerly
    with its dispatch frame left uncompiled: Dynamo compiling that frame after the graph
    break crashed reading ``self.__dict__`` (an outside tester's find); an AOTAutograd pass alike (``aot_layer._refuse_what_left_dispatch``). Returns what left
    dispatch (``exc`` or what it wraps), or None where the failure was not inside one."""
    return next((e for e in exception_chain(exc) if any(e is r for r in raised)), None)


def caught_here(scope: Scope, raised: list[BaseException]) -> BaseException | None:
    """The first exception user dispatch caught while traced (not one that left it)."""
    for exc in scope.caught:
        if not any(exc is e for e in raised):
            return exc
    return None


def _data_dependent(exc: BaseException) -> bool:
    """torch's error for a Python value taken from tensor data while traced."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return isinstance(exc, (GuardOnDataDependentSymNode, DataDependentOutputException))


_PASSING = frozenset({"aten.detach.default", "aten.alias.default"})


def _changes_its_result(func: Any, nodes: list) -> bool:
    """Whether a dispatch call computed more from its op's result (``out * self.scale``):
    a call whose nodes use the op's node for anything but passing it on. Run on a zero
    gradient eager never computes, its result need not be zero (See Note [A backward run for
    part of the graph] in partial_backward.py)."""
    ops = [n for n in nodes if n.op == "call_function" and n.target is func]
    return any(
        n.op == "call_function" and str(n.target) not in _PASSING and any(a in ops for a in n.all_input_nodes)
        for n in nodes
    ) if ops else any(n.op == "call_function" for n in nodes)


def caught_context(caught: BaseException) -> str:
    """What a ``dispatch_raised`` refusal of a caught exception says (both layers)."""
    return (
        f"dispatch caught {type(caught).__name__}({str(caught)[:200]!r}) while traced: torch raises "
        "there on traced tensors where eager may not, so the traced branch may not be eager's"
    )


def _tracing_graph(scope: Scope | None) -> Any:
    """The FX graph being traced, where the scope notes which nodes its writes came with."""
    if scope is None or scope.call_nodes is None:
        return None
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return mode.tracer.graph if mode is not None else None


def dispatching_class() -> type | None:
    """The subclass whose ``__torch_dispatch__`` runs innermost on this thread (while hooked)."""
    stack = getattr(_local, "dispatching", None)
    return stack[-1] if stack else None


def _user_dispatch(cls: type) -> Any:
    """The user's own ``__torch_dispatch__`` classmethod ``cls`` runs, unhooked (None for
    torch's, or one that is not a classmethod)."""
    for klass in cls.__mro__:
        value = _patches.original_attribute(klass, "__torch_dispatch__")
        if value is not MISSING:
            if not isinstance(value, classmethod) or klass.__module__.startswith("torch"):
                return None
            return value
    return None


# Note [Numbers dispatch is given]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# In eager, dispatch gets a Python number where the caller passed one (``w * k``,
# ``torch.add(x, y, alpha=a)``), and no keyword argument at all where its value is the
# schema's default (``alpha=1``). While traced, a number Dynamo made dynamic
# (``dynamic=True``, or after it changed) arrives as a SymInt or SymFloat: code that
# branches on ``isinstance(other, (int, float))`` or on ``"alpha" in kwargs`` would take
# the other branch. Numbers in number and tensor positions of the schema are given to
# dispatch as their value, guarded (the graph is specialized on them, as for text made from
# a size, and recompiles when they change: a learning rate that changes every step is best
# passed as a tensor, as for compiled optimizers), and a keyword argument, or a trailing
# positional one, equal to its default is left out as torch leaves it out. Numbers made
# from sizes (``x / x.shape[-1]``) are numbers too: that op compiles per size. Sizes and
# indices (``SymInt`` positions: ``x[:n]``, ``narrow``) stay symbolic, so shapes stay
# dynamic: there dispatch sees a SymInt where eager sees an int. A number made from a
# tensor's data (unbacked, ``.item()``) has no value to give and stays symbolic.

_NUMBER_TYPES = frozenset({
    "number", "Optional[number]", "Tensor", "Optional[Tensor]", "float", "Optional[float]",
    "bool", "Optional[bool]", "complex", "Optional[complex]",
})
def _has_a_value(value: Any) -> bool:
    """A symbolic number with a value to give dispatch and guard (not an unbacked one made
    from a tensor's data, ``.item()``)."""
    node = getattr(value, "node", None) if isinstance(value, SYMBOLIC_TYPES) else None
    return node is not None and getattr(node, "expr", None) is not None and node.hint is not None


def as_eager_passes(func: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """``args`` and ``kwargs`` as eager passes them to dispatch (See Note [Numbers dispatch
    is given])."""
    if not any(isinstance(a, SYMBOLIC_TYPES) for a in args) and not (
        kwargs and any(isinstance(v, SYMBOLIC_TYPES) for v in kwargs.values())
    ):
        return args, kwargs
    schema = getattr(func, "_schema", None)
    if schema is None:
        return args, kwargs
    positional = [a for a in schema.arguments if not a.kwarg_only]
    by_name = {a.name: a for a in schema.arguments}
    new_args = list(args)
    given: set[int] = set()
    for i, value in enumerate(args):
        if i < len(positional) and str(positional[i].type) in _NUMBER_TYPES and _has_a_value(value):
            new_args[i] = _concrete(value)
            given.add(i)
    # torch leaves out trailing positional arguments equal to their defaults
    while new_args and len(new_args) - 1 in given and _is_default(positional[len(new_args) - 1], new_args[-1]):
        new_args.pop()
    new_kwargs = dict(kwargs or {})
    for name, value in list(new_kwargs.items()):
        arg = by_name.get(name)
        if arg is None or str(arg.type) not in _NUMBER_TYPES or not _has_a_value(value):
            continue
        value = _concrete(value)
        if arg.kwarg_only and _is_default(arg, value):
            del new_kwargs[name]  # torch leaves out a keyword argument equal to its default
        else:
            new_kwargs[name] = value
    return tuple(new_args), new_kwargs


def _is_default(arg: Any, value: Any) -> bool:
    """Equal to the schema's default as torch compares them (an int 1 is not a float 1.0)."""
    default = arg.default_value
    return arg.has_default_value() and type(default) is type(value) and default == value


# --------------------------------------------------------------------------- #
# Symbolic values turned into text by the traced code
# --------------------------------------------------------------------------- #

def _concrete(value: Any) -> Any:
    """The value a symbolic int/float/bool has in this trace, guarded: the compiled program
    is specialized on it (Dynamo recompiles when it changes), as for ``int(s)``."""
    deferred = getattr(getattr(_local, "scope", None), "deferred_guards", None)
    if deferred is not None:
        hint = value.node.hint
        if hint is not None:
            deferred.append(value)  # a size marked dynamic is refused there (guard_deferred)
            return hint
    marked = marked_dynamic(value)
    if marked is not None:  # See Note [A size marked dynamic given to dispatch as a number]
        klass = dispatching_class()
        raise MarkedDynamic(marked, klass.__name__ if klass is not None else "traced function")
    return guard_now(value)


# Note [Symbolic text in the traced backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Text dispatch makes from a size (``f"{rows}x{cols}"``) is the size's value, guarded. In the
# forward passes the guard specializes the size at once. In the backward, which AOTAutograd
# traces inside the joint function after its forward metadata was collected with the size
# symbolic, specializing it there changes the joint's forward outputs (a subclass output's
# symbolic sizes become constants) and the partitioner fails. There the text gets the
# size's hint, and the guard is added once AOTAutograd has compiled
# (``aot_layer.Planner.guard_deferred``): the graph keeps the symbol, the compiled frame
# runs only for that value, as for a guard made in the forward.


# Note [A size marked dynamic given to dispatch as a number]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``mark_dynamic`` promises the size stays symbolic, and Dynamo raises
# ``ConstraintViolationError`` at the end of the compile where something specialized it,
# also under ``fullgraph=False``. Dispatch given a number made from such a size (``y /
# x.shape[0]``, text made from it in the forward or the traced backward, ``mean``'s backward
# dividing by the numel) would specialize it (See Note [Numbers dispatch is given]), and
# giving dispatch the SymInt instead would let code that branches on ``isinstance(n, int)``
# take the other branch silently. The op is refused (``unsupported_state_read``), naming
# the size and ``maybe_mark_dynamic``, which lets it be specialized: under ``fullgraph=True``
# an ``Unsupported``; otherwise the frame runs eagerly, not a graph break, as stock Dynamo
# raises the same ``ConstraintViolationError`` when it resumes after a graph break with a
# tensor made from the size (an input of the resumed code, its size static). In the traced
# backward the value is answered by its hint as any other (See Note [Symbolic text in the
# traced backward]) and the refusal raised where it would be guarded. A symbol is marked
# where a tracked input's symbolic context holds a constraint that raises (not
# ``warn_only``) for its size or stride (Dynamo's ``tracked_fakes``, inner tensors' contexts
# too).


class MarkedDynamic(FlattenMismatch):
    """See Note [A size marked dynamic given to dispatch as a number]."""

    kind_name = "UNSUPPORTED_STATE_READ"
    value_type = "SymInt"

    def __init__(self, name: str, cls_name: str) -> None:
        super().__init__(None, name)
        self.cls_name = cls_name  # the tracked object is not known: the class dispatching
        self.context = (
            f"dispatch of {cls_name} was given a number made from {name}, which mark_dynamic keeps symbolic: "
            "eager gives dispatch an int, and giving it one here would specialize the size. Mark the size "
            "with torch._dynamo.maybe_mark_dynamic, which lets it be specialized, or pass the number as a tensor"
        )


def marked_dynamic(value: Any) -> str | None:
    """The name of a size or stride ``mark_dynamic`` constrained that symbolic ``value`` is
    made from, or None."""
    node = getattr(value, "node", None)
    expr = getattr(node, "expr", None)
    symbols = getattr(expr, "free_symbols", None)
    if not symbols:
        return None
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except AttributeError:  # no frame is being compiled (AOTAutograd called directly)
        return None
    if getattr(tx.output, "shape_env", None) is not getattr(node, "shape_env", None):
        return None  # a symbol of another compile's (symbols of the same name are equal)
    marked: dict[Any, str] = {}
    for tracked in tx.output.tracked_fakes:
        _marked_sizes(tracked.fake, tracked.symbolic_context, tracked.source.name, marked)
    return next((marked[s] for s in symbols if s in marked), None)


def _marked_sizes(fake: Any, context: Any, name: str, marked: dict[Any, str]) -> None:
    if not isinstance(fake, torch.Tensor) or context is None:
        return
    for what, values, constraints in (
        ("size", fake.size(), getattr(context, "constraint_sizes", None)),
        ("stride", fake.stride(), getattr(context, "constraint_strides", None)),
    ):
        for i, (v, constraint) in enumerate(zip(values, constraints or ())):
            # automatic dynamic's constraints only warn (``warn_only``); mark_dynamic's raise
            if constraint is not None and not getattr(constraint, "warn_only", True) and isinstance(v, torch.SymInt):
                for symbol in v.node.expr.free_symbols:
                    marked.setdefault(symbol, f"{name}.{what}()[{i}]")
    inner_contexts = getattr(context, "inner_contexts", None) or {}
    for attr, inner in inner_contexts.items():
        _marked_sizes(obj_dict(fake).get(attr), inner, f"{name}.{attr}", marked)  # not a read of dispatch's


def guard_now(value: Any) -> Any:
    from torch.fx.experimental import symbolic_shapes

    if isinstance(value, torch.SymInt):
        return symbolic_shapes.guard_int(value)
    if isinstance(value, torch.SymFloat):
        return symbolic_shapes.guard_float(value)
    return symbolic_shapes.guard_bool(value)


def _make_symbolic_hooks(cls: type, base: Callable[[str], Any]) -> dict[str, Any]:
    """Text made from a SymInt inside traced user code (``f"{rows}x{cols}"``) would
    otherwise hold the symbol's name ("s77"): user code gets the concrete value, guarded.
    torch's own code (logging, error messages) keeps the symbolic text."""
    str_, repr_, format_ = base("__str__"), base("__repr__"), base("__format__")

    def __str__(self: Any) -> str:
        if getattr(_local, "scope", None) is not None and _called_from_user(2):
            return str(_concrete(self))
        return str_(self)

    def __repr__(self: Any) -> str:
        if getattr(_local, "scope", None) is not None and _called_from_user(2):
            return repr(_concrete(self))
        return repr_(self)

    def __format__(self: Any, spec: str) -> str:
        if getattr(_local, "scope", None) is not None and _called_from_user(2):
            return format(_concrete(self), spec)
        return format_(self, spec)

    hash_ = base("__hash__")

    def __hash__(self: Any) -> int:
        # A dict key or set member in user code: the value it has here, guarded.
        if getattr(_local, "scope", None) is not None and _called_from_user(2):
            return hash(_concrete(self))
        return hash_(self)

    return {"__str__": __str__, "__repr__": __repr__, "__format__": __format__, "__hash__": __hash__}


# --------------------------------------------------------------------------- #
# A tensor's version counter, read by the traced code
# --------------------------------------------------------------------------- #


def _make_version_hooks(cls: type, base: Callable[[str], Any]) -> dict[str, Any]:
    """``inner._version`` in traced user code: a fake or functional tensor counts its own
    versions from 0, the real inner tensor's counter is what eager reads (a quantized
    weight's cache keyed on it). The layer answers it from the real tensor and guards it."""
    descriptor = class_attribute(cls, "_version")

    def get_version(obj: Any) -> Any:
        scope, t = _tracked_here(obj)
        if t is None or t.real is None:
            scope = current()
            if scope is not None and scope.untracked_version is not None and _called_from_user(2):
                scope.untracked_version(obj)
            return descriptor.__get__(obj, type(obj))
        if scope.answer is None or not _called_from_user(2):
            return descriptor.__get__(obj, type(obj))
        return scope.answer(scope, t, "_version")

    own_getattr = class_attribute(cls, "__getattr__")

    def __getattr__(obj: Any, name: str) -> Any:
        # Only a name the trace tensor lacks gets here: a user read of it on a tensor standing
        # for a real one (``getattr(x, "scale", 1.0)``) is answered from the real tensor, and
        # the code guarded on it (absent: on it staying absent).
        scope, t = _tracked_here(obj)
        if t is not None and t.real is not None and scope.answer is not None and name[:2] != "__":
            return scope.read(t, name, _missing if own_getattr is MISSING else own_getattr)
        if own_getattr is not MISSING:
            return own_getattr(obj, name)
        return _missing(obj, name)

    hooks = {"_version": property(get_version), "__getattr__": __getattr__}
    for name in TENSOR_STATE_READS:
        hooks[name] = _autograd_state_hook(cls, name)
    return hooks


def stand_in_attribute(obj: Any, name: str) -> Any:
    """``obj.name`` as the trace tensor's class defines it, past dynamo_ext's hooks."""
    for klass in type(obj).__mro__:
        value = _patches.original_attribute(klass, name)
        if value is not _patches._MISSING:
            return value.__get__(obj, type(obj)) if hasattr(value, "__get__") else value
    raise AttributeError(name)


def _autograd_state_hook(cls: type, name: str) -> property:
    """``inner.grad``, ``inner._base``, its hooks in traced user code: the trace tensor holds
    none of the real inner tensor's (See Note [Autograd state dispatch reads] in
    dynamo_layer.py). Read by user code on a tensor standing for a real one, the layer
    answers it; torch's own reads and writes go to the descriptor."""
    descriptor = class_attribute(cls, name)

    def get(obj: Any) -> Any:
        scope, t = _tracked_here(obj)
        if t is not None and t.real is not None and scope.answer is not None and scope.label == "dynamo" and _called_from_user(2):
            return scope.answer(scope, t, name)
        return descriptor.__get__(obj, type(obj))

    def set_(obj: Any, value: Any) -> None:
        descriptor.__set__(obj, value)

    def delete(obj: Any) -> None:
        descriptor.__delete__(obj)

    return property(get, set_ if hasattr(descriptor, "__set__") else None, delete if hasattr(descriptor, "__delete__") else None)


_VERSION = torch._C.TensorBase.__dict__["_version"]


def _raw_version(obj: Any) -> int | None:
    """A tensor's version counter, read past any hook; None for what is not a tensor."""
    return _VERSION.__get__(obj, type(obj)) if isinstance(obj, torch.Tensor) else None


def version_delta(t: Tracked) -> int:
    """How many in-place changes the traced code made to the tracked tensor so far: what eager's
    counter moved on from the real one's since the call began (``w.add_(1)`` then a read of
    ``w._version`` in the same function)."""
    now = _raw_version(t.obj)
    return now - t.entry_version if now is not None and t.entry_version is not None else 0


def _missing(obj: Any, name: str) -> Any:
    raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")


def make_backward_error_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``MetaConverter._backward_error``. Faking a subclass that requires
    grad and is no leaf (a graph-break resume's input, an AOTAutograd input) gives the fake
    an autograd history, which runs its dispatch (``detach``) outside any trace: a write
    there on a registered state object its ctx holds (the real one) is put back, and so are
    the fake's inner tensors (See Note [A fake copy's inner tensors])."""

    @functools.wraps(original)
    def _backward_error(cls: type, t: Any) -> Any:
        held = [(o, dict(vars(o))) for _, o in find_state(t)]
        _fake_held_tensors(t, held)
        try:
            made = original(cls, t)
        finally:
            for o, before in held:
                free_state.put_back_instance(o, before, "set while a fake copy's history was made")
        _keep_inner_tensors(t, made)
        return made

    return _backward_error


def _fake_held_tensors(t: Any, held: list[tuple[Any, dict[str, Any]]]) -> None:
    """Note [A real tensor a state object holds, in a fake copy's dispatch]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The fake copy's ctx holds the real registered state objects, and its dispatch (the
    ``detach`` that fakes its autograd history) may compute with a real tensor one holds: a
    DTensor-like partial applying its pending mask (``masked_fill(local, buf.data)``) failed
    with FakeTensor's "Please convert all Tensors to FakeTensors first" under
    ``fullgraph=False``, where eager runs (an outside tester's find). While it runs, such a
    tensor is replaced with a fake of it; the object's state is put back after."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not held:
        return
    mode = next((x.fake_mode for x in [t, *inner_plain_tensors(t)] if isinstance(x, FakeTensor)), None)
    if mode is None:
        return
    for o, before in held:
        d = vars(o)
        for name, value in before.items():
            if type(value) in (torch.Tensor, torch.nn.Parameter):
                d[name] = mode.from_tensor(value)


# Note [A fake copy's inner tensors]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The fake of a subclass input that requires grad and is no leaf (a graph-break resume's
# input: a result of the earlier graph) gets its autograd history from an op run through
# the class's own dispatch (``MetaConverter._backward_error``), which builds a new instance.
# A dispatch that wraps its result fresh (``cache = elem`` in ``__new__``) gives that
# instance other inner tensors than the input holds: the fake's ``cache`` is its ``elem``
# where the real input's is a distinct tensor, AOTAutograd traces the op on ``elem`` from
# the placeholder it flattened ``cache`` to, and at run time the compiled graph computes
# with the real ``cache`` (an outside tester's fuzz find; stock torch alike). The fake keeps
# the inner tensors the input's fake was built with, where their aliasing differs.


def _keep_inner_tensors(fake: Any, made: Any) -> None:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if type(made) is not type(fake) or not is_traceable_wrapper_subclass(fake):
        return
    # Note [A fake copy's state]: the class's ``detach`` may also change what the copy holds
    # besides tensors (a DTensor-like partial reduced to a replicated one, its mask buffer
    # dropped): the traced program then computed without the mask the real input holds, while
    # the writes of the real reduction were replayed (silent wrong values, an outside tester's
    # find). The copy holds the input's fake's own state.
    mine, theirs = obj_dict(made), obj_dict(fake)
    for name in [k for k, v in mine.items() if not isinstance(v, torch.Tensor) and k not in theirs]:
        del mine[name]
    for name, value in theirs.items():
        if not isinstance(value, torch.Tensor) and mine.get(name, MISSING) is not value:
            mine[name] = value
    try:
        names = list(fake.__tensor_flatten__()[0])
        got = list(made.__tensor_flatten__()[0])
    except Exception:  # noqa: BLE001 - a flatten that fails on the copy: left to torch
        return
    inner = [getattr(fake, n) for n in names]
    if got == names and _aliasing(inner) == _aliasing([getattr(made, n) for n in got]):
        return
    d = obj_dict(made)
    for n, value in zip(names, inner):
        d[n] = value


def _aliasing(tensors: list[Any]) -> list[int]:
    """For each tensor, the first position holding the same object."""
    ids = [id(t) for t in tensors]
    return [ids.index(i) for i in ids]
