"""State dispatch code reads or changes outside the objects it is given: module globals
and closure variables (compile time).

Dynamo guards the globals and closure variables of the code it traces; dispatch code
runs during fake propagation instead, where Dynamo does not see it, so a module-level
scale factor the user changes between calls would stay baked into the compiled graph.

- ``Collector`` records which user code objects ran during one op (a profile hook,
  installed only while dispatch of a tracked object runs, and only when no other
  profiler is installed); ``reads`` then lists the globals and closure variables that
  code can load, for the Dynamo layer to guard them as it guards a user's own.
- ``ModuleWatch`` notices dispatch rebinding a module global, mutating a module-level
  container (a global log list) or setting a class attribute (a class-level counter),
  which no compiled program can replay: the watch puts them back and the layer refuses
  the op (it then runs eagerly).
"""

from __future__ import annotations

import ast
import collections
import collections.abc
import contextlib
import dataclasses
import dis
import functools
import gc
import inspect
import itertools
import operator
import os
import sys
import sysconfig
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Iterator

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


_STDLIB_DIRS = tuple(os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib"))


def called_through_stdlib_from_user(frame: Any) -> bool:
    """The first frame from ``frame`` up that is not the standard library's (``copy``,
    ``copyreg``, ``pickle``) is user code."""
    while frame is not None and os.path.realpath(frame.f_code.co_filename).startswith(_STDLIB_DIRS):
        frame = frame.f_back
    return frame is not None and is_user_code(frame.f_code.co_filename)


@functools.lru_cache(maxsize=4096)
def is_user_code(filename: str) -> bool:
    """Code outside torch, dynamo_ext and the standard library (third-party packages such
    as torchao count as user code: their dispatch reads their own globals)."""
    if not filename or filename.startswith("<"):
        return not filename.startswith("<frozen")
    return not os.path.realpath(filename).startswith(_EXCLUDED_DIRS)


def is_c_class(cls: type) -> bool:
    """A class of C code (``object``, ``int``, ``_io.TextIOWrapper``): no class statement made
    it, and its attributes cannot be hooked. Not every class whose ``__module__`` says
    "builtins": one defined by ``exec(source, {})`` (generated or plugin code) says so too, and
    it is the user's (an outside tester's find: such a subclass was never hooked, its writes
    replayed as traced)."""
    return not cls.__flags__ & _HEAPTYPE or bool(cls.__flags__ & _IMMUTABLETYPE)


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement or type()
# Py_TPFLAGS_IMMUTABLETYPE: a heap type of C code whose attributes cannot be set (Cython's
# function type: hooking it failed the compile when dispatch called ``np.random.seed``, an
# outside tester's find)
_IMMUTABLETYPE = 1 << 8


def is_user_class(cls: type) -> bool:
    """Not Python's own, torch's or the standard library's (a class of generated code whose
    ``__module__`` says "builtins" is the user's)."""
    if is_c_class(cls):
        # a class of C code (``_io.TextIOWrapper`` behind ``sys.stderr``, ``sys.version_info``'s
        # type): not the program's state, and its attributes cannot be hooked (an outside
        # tester's find: dispatch naming ``sys.stderr`` crashed the compile)
        return False
    module = sys.modules.get(cls.__module__)
    return is_user_code(getattr(module, "__file__", "") or "")


# Names whose use can tell a symbolic int from an int: a type check (``type(n) is int``,
# ``isinstance(n, int)``, ``numbers.Integral``, ``n.__class__``), ``round`` (``round(s, -1)``
# ignores ndigits on a SymInt in torch 2.13), ``json`` (a SymInt is not serializable).
_TELLS_INT_NAMES = frozenset({"type", "int", "Integral", "numbers", "__class__", "round", "json", "dumps", "singledispatch"})
_LINE_LOADS = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD", "LOAD_DEREF", "LOAD_FAST", "LOAD_CLOSURE", "LOAD_CONST")


@functools.lru_cache(maxsize=4096)
def _lines(code: types.CodeType) -> tuple[tuple[frozenset, frozenset], ...]:
    """Per source line: the names and constants it loads, and the local names it stores."""
    loads: dict[int, set] = {}
    stores: dict[int, set] = {}
    line = code.co_firstlineno
    for ins in dis.get_instructions(code):
        if ins.starts_line is not None:
            line = ins.starts_line
        if ins.opname in _LINE_LOADS and isinstance(ins.argval, str):
            loads.setdefault(line, set()).add(ins.argval)
        elif ins.opname in ("STORE_FAST", "STORE_DEREF", "STORE_NAME"):
            stores.setdefault(line, set()).add(ins.argval)
    return tuple((frozenset(loads.get(n, ())), frozenset(stores.get(n, ()))) for n in sorted(set(loads) | set(stores)))


@functools.lru_cache(maxsize=4096)
def _held(code: types.CodeType, names: frozenset) -> frozenset:
    """``names`` and the locals of ``code`` assigned from them (and from those)."""
    held = set(names)
    for _ in range(3):
        for loaded, stored in _lines(code):
            if loaded & held:
                held |= stored
    return frozenset(held)


@functools.lru_cache(maxsize=4096)
def _code_tells_int(code: types.CodeType, names: frozenset) -> bool:
    """A line of ``code`` (or of a function nested in it) that uses one of ``names`` (the
    attribute, or a local holding it) also uses a name that can tell an int from a SymInt."""
    held = _held(code, names)
    if any(loaded & held and loaded & _TELLS_INT_NAMES for loaded, _ in _lines(code)):
        return True
    return any(_code_tells_int(c, held) for c in code.co_consts if isinstance(c, types.CodeType))


def tells_int_from_symint(code: types.CodeType, f_globals: dict, name: str) -> bool:
    """Note [An int dispatch code could tell from a symbolic one]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A counter read by dispatch becomes a symbolic int once it changes (one compile for every
    count), and dispatch then holds a ``torch.SymInt`` where eager holds an int. Code that
    checks the type (``type(n) is int``, ``isinstance(n, int)``, a ``singledispatch`` on
    int), rounds to ndigits or serializes it takes another path, silently (an outside
    tester's find). The code reading the int is scanned line by line: where a line using the
    attribute's name (or a local assigned from it, also in a function nested in the code)
    uses such a name too, or calls a helper through a global (a function, a table of them)
    whose code does, the int stays a guarded constant: one compile per value, up to
    Dynamo's recompile limit, after which the frame runs eagerly, as in eager. A check the
    value reaches another way (a method, an attribute of ``cls``) is not seen (README,
    Limits)."""
    return _tells_int(code, f_globals, frozenset({name}), 0, set())


def _tells_int(code: types.CodeType, f_globals: dict, names: frozenset, depth: int, seen: set[int]) -> bool:
    if id(code) in seen:
        return False
    seen.add(id(code))
    if _code_tells_int(code, names):
        return True
    if depth >= 2:
        return False
    held = _held(code, names)
    for loaded, _ in _lines(code):
        if not loaded & held:
            continue
        for global_name in loaded:
            value = f_globals.get(global_name)
            if callable(value) and hasattr(value, "registry") and hasattr(value, "dispatch"):
                return True  # a functools.singledispatch function given the value: picks by type
            # a helper given the value: a function, or a table of them (``CHECKS[kind](n)``)
            if isinstance(value, dict):
                items = list(value.values())[:_MAX_ITEMS]
            elif isinstance(value, (list, tuple)):
                items = list(value)[:_MAX_ITEMS]
            else:
                items = [value]
            for item in items:
                fn = getattr(item, "__func__", item)  # a staticmethod or bound method
                if isinstance(fn, types.FunctionType) and is_user_code(fn.__code__.co_filename):
                    every = frozenset(fn.__code__.co_varnames[: fn.__code__.co_argcount])
                    if _tells_int(fn.__code__, fn.__globals__, every, depth + 1, seen):
                        return True
    return False


@functools.lru_cache(maxsize=4096)
def loaded_globals(code: types.CodeType) -> tuple[str, ...]:
    return tuple(
        sorted({i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")})
    )


def globals_read(code: types.CodeType, f_globals: dict) -> tuple[str, ...]:
    """The globals ``code`` may load: by name, and by a string constant where it calls
    ``globals()`` (``globals()["SCALE"]``)."""
    names = loaded_globals(code)
    if "globals" in names and "globals" not in f_globals:
        names = tuple(sorted(set(names) | {c for c in read_names(code) if c in f_globals and c not in code.co_names}))
    return names


_COMPARE_OPS = frozenset({"IS_OP", "COMPARE_OP", "CONTAINS_OP"})


@functools.lru_cache(maxsize=4096)
def compares_type_with_tensor(code: types.CodeType) -> bool:
    """Note [An exact type check on a traced tensor]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    ``type(t) is torch.Tensor`` (or ``==``, ``in (torch.Tensor, ...)``, ``is not``): while
    traced, a plain tensor is a FakeTensor or FunctionalTensor, so the check answers what it
    never answers in eager, in every pass alike (no disagreement between passes shows it),
    and a write or result that depends on it is silently the traced one. Found in ``code``
    by its shape: a comparison whose operands load the builtin ``type`` and ``Tensor``
    (``isinstance(t, torch.Tensor)`` and ``is_traceable_wrapper_subclass`` answer as eager)."""
    instrs = list(dis.get_instructions(code))

    def loads(j: int, name: str) -> bool:
        return 0 <= j < len(instrs) and instrs[j].opname in ("LOAD_GLOBAL", "LOAD_NAME") and instrs[j].argval == name

    def tensor_at(j: int) -> int:
        """Where a load of ``torch.Tensor`` (or a global ``Tensor``) ending at ``j`` begins; -1."""
        if j < 0 or instrs[j].argval != "Tensor":
            return -1
        if instrs[j].opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            return j
        if instrs[j].opname in ("LOAD_ATTR", "LOAD_METHOD") and loads(j - 1, "torch"):
            return j - 1
        return -1

    def type_call_ending(j: int) -> bool:
        """A call of the builtin ``type`` whose result is the value ending at ``j``."""
        return 0 <= j and instrs[j].opname in ("CALL", "CALL_FUNCTION", "PRECALL") and any(
            loads(k, "type") for k in range(max(0, j - 8), j)
        )

    for i, ins in enumerate(instrs):
        if ins.opname not in _COMPARE_OPS:
            continue
        begin = tensor_at(i - 1)
        if begin >= 0 and type_call_ending(begin - 1):  # type(x) is torch.Tensor
            return True
        if type_call_ending(i - 1):  # torch.Tensor is type(x)
            k = next((k for k in range(i - 2, max(-1, i - 10), -1) if loads(k, "type")), -1)
            if k > 0 and (tensor_at(k - 1) >= 0 or (k > 1 and instrs[k - 1].opname == "PUSH_NULL" and tensor_at(k - 2) >= 0)):
                return True
    return False


_DISPLAY = frozenset({"__repr__", "__str__", "__format__"})


@functools.lru_cache(maxsize=4096)
def calls_id(code: types.CodeType) -> bool:
    """Note [An object's identity while traced]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    ``self.cache_key = id(self.elem)`` (a cache rebuilt when its tensor is another object):
    while traced, every tensor dispatch sees is another object than in eager (a fake, a
    functional tensor), so an identity taken then is not the run's. On ``backend="eager"``
    there is one trace only and nothing disagrees: the key replayed is the fake's, and the
    cache is rebuilt on every call. An identity used inside one dispatch call (a dict keyed
    on ``id(w)`` to find an operand again, as float8 code does) is consistent while traced.
    So code that loads the name ``id`` (the builtin unless its module defines its own; the
    caller checks), display code (``__repr__``, ``__str__``, ``__format__``) aside, turns on
    a check of what dispatch writes: a value holding the identity of a tensor alive while
    traced that is not real (an int, the int in a tuple or list, its decimal or hex text) is
    refused (``unsupported_state_read``). A value computed from an identity otherwise
    (``id(t) % n``) is not recognised (README limits)."""
    if code.co_name in _DISPLAY:
        return False
    return any(i.opname in ("LOAD_GLOBAL", "LOAD_NAME") and i.argval == "id" for i in dis.get_instructions(code))


_SMALLEST_ADDRESS = 1 << 16


def _identity_candidates(value: Any, depth: int = 0) -> tuple[set[int], list[str]]:
    """The ints (large enough to be an address) and the strings ``value`` holds."""
    ints: set[int] = set()
    texts: list[str] = []
    if isinstance(value, bool):
        return ints, texts
    if isinstance(value, int) and value >= _SMALLEST_ADDRESS:
        ints.add(value)
    elif isinstance(value, str):
        texts.append(value)
    elif depth < 4 and isinstance(value, (tuple, list, frozenset, set)):
        for item in value:
            i, t = _identity_candidates(item, depth + 1)
            ints |= i
            texts += t
    elif depth < 4 and isinstance(value, dict):
        for item in (*value.keys(), *value.values()):
            i, t = _identity_candidates(item, depth + 1)
            ints |= i
            texts += t
    return ints, texts


def holds_traced_identity(value: Any) -> bool:
    """``value`` holds ``id()`` of a tensor that is alive and not real (a fake or functional
    tensor, a subclass wrapping one). See Note [An object's identity while traced]."""
    ints, texts = _identity_candidates(value)
    if not ints and not any(any(c.isdigit() for c in t) for t in texts):
        return False
    from torch._subclasses.fake_tensor import is_fake

    def fake(o: Any) -> bool:
        try:  # a subclass's flatten runs user code, which may fail on a half-built object
            return is_fake(o)
        except Exception:
            return False

    # type(o), not isinstance: a module-level deprecation proxy warns on __class__
    traced = {id(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and fake(o)}
    if ints & traced:
        return True
    return any(str(i) in t or hex(i) in t or f"{i:x}" in t for t in texts for i in traced)


_CONSTRUCTORS = frozenset({"__new__", "__init__", "__tensor_unflatten__", "__post_init__"})


@functools.lru_cache(maxsize=4096)
def sets_attributes(code: types.CodeType) -> bool:
    """``code`` sets an attribute (``x.a = v``, ``setattr``, ``object.__setattr__``, or takes
    an instance dict, ``vars(x)[k] = v``, ``x.__dict__.update(...)``) and is not a
    constructor: the code of a subclass whose dispatch writes state."""
    if code.co_name in _CONSTRUCTORS:
        return False
    return any(
        i.opname == "STORE_ATTR"
        or (i.opname in ("LOAD_GLOBAL", "LOAD_NAME") and i.argval in ("setattr", "vars"))
        or (i.opname in ("LOAD_ATTR", "LOAD_METHOD") and i.argval in ("__setattr__", "__dict__"))
        for i in dis.get_instructions(code)
    )


@functools.lru_cache(maxsize=4096)
def stored_names(code: types.CodeType) -> frozenset[str]:
    """Attribute names ``code`` may set: ``x.a = v`` and ``del x.a``, and where it sets by name
    (``setattr``, ``vars(x).update(a=v)``) its string constants, keyword names included."""
    names = set()
    by_name = False
    for i in dis.get_instructions(code):
        if i.opname in ("STORE_ATTR", "DELETE_ATTR"):
            names.add(i.argval)
        elif (i.opname in ("LOAD_GLOBAL", "LOAD_NAME") and i.argval in ("setattr", "vars", "delattr")) or (
            i.opname in ("LOAD_ATTR", "LOAD_METHOD") and i.argval in ("__setattr__", "__dict__", "__delattr__")
        ):
            by_name = True
    if by_name:
        for c in code.co_consts:
            for v in c if type(c) is tuple else (c,):
                if type(v) is str and v.isidentifier():
                    names.add(v)
    return frozenset(names)


@dataclasses.dataclass(frozen=True)
class Uses:
    """How code uses a value it loads: the attribute chains it reads off it
    (``Config.enabled`` -> ``("enabled",)``, ``os.environ.get`` -> ``("environ", "get")``),
    and whether it also uses the value itself (passes it on, calls it, indexes it), where
    any attribute may be read. See Note [State dispatch reaches outside the tensors]."""

    paths: frozenset = frozenset()
    bare: bool = True

    def names(self, every: set[str]) -> set[str]:
        """The attribute names read off the value (``every`` where it is used bare, or its
        instance dict is: ``Holder.__dict__["factor"]``)."""
        return set(every) if self.bare or any(p[0] == "__dict__" for p in self.paths) else {p[0] for p in self.paths}

    def of(self, name: str) -> "Uses":
        """How the value's attribute ``name`` is used."""
        if self.bare:
            return Uses()
        tails = frozenset(p[1:] for p in self.paths if p[0] == name and len(p) > 1)
        return Uses(tails, any(p[0] == name and len(p) == 1 for p in self.paths))

    def __or__(self, other: "Uses") -> "Uses":
        return Uses(self.paths | other.paths, self.bare or other.bare)


_LOADS = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF")
_ATTRS = ("LOAD_ATTR", "LOAD_METHOD")


@functools.lru_cache(maxsize=4096)
def uses_in(code: types.CodeType) -> dict[str, Uses]:
    """For each global or free variable ``code`` loads: how it uses it (attribute chains read
    right after the load; bare otherwise). A store or delete of an attribute is not a read."""
    ins = list(dis.get_instructions(code))
    out: dict[str, Uses] = {}
    for i, ins_i in enumerate(ins):
        if ins_i.opname not in _LOADS:
            continue
        path: list[str] = []
        j = i + 1
        while j < len(ins) and ins[j].opname in _ATTRS:
            path.append(ins[j].argval)
            j += 1
        after = ins[j].opname if j < len(ins) else ""
        if path:
            use = Uses(frozenset([tuple(path)]), False)
        elif after in ("STORE_ATTR", "DELETE_ATTR"):
            use = Uses(frozenset(), False)  # a write: the watch's business
        else:
            use = Uses()
        name = ins_i.argval
        out[name] = out[name] | use if name in out else use
    return out


@dataclasses.dataclass(frozen=True)
class FreeRead:
    """A global (``cell`` None) or closure variable (``cell`` set) user code can load."""

    module: str | None  # the module whose globals hold it (globals); None for a closure
    name: str
    value: Any
    cell: Any = None
    code_name: str = ""
    uses: Uses = Uses()


class Collector:
    """The user code dispatch runs, and the globals and closure variables it can load.

    User frames are found on the stack whenever traced code touches a tracked object
    (``on_access``, called from the attribute hooks: dispatch always reads its inputs'
    inner tensors), then expanded statically through the functions, classes and nested
    code objects their globals name (a helper ``scaled(t)`` that reads ``SCALE``).
    Cheaper by far than a trace function (which slows every frame of fake propagation).
    """

    def __init__(self, stop_codes: frozenset[types.CodeType]) -> None:
        self._stop = stop_codes  # the op boundary: dynamo_ext's own frames
        self._last_frame: Any = None
        self._on_stack: set[types.CodeType] = set()
        self._expanded: set[types.CodeType] = set()
        self._new: list[tuple[types.CodeType, dict | None, dict]] = []
        self._cells: dict[str, Any] = {}  # closure cells found, by name#id (held: ids stay valid)
        self._classes: set[type] = set()
        self._new_classes: list[type] = []
        # attribute names (and string constants: ``getattr(cls, "scale")``) the expanded code
        # may read: what a class, module or namespace it reaches is guarded on
        self.names: set[str] = set()
        # code found comparing ``type(t)`` with ``torch.Tensor`` (See Note [An exact type
        # check on a traced tensor]), by qualified name
        self.type_checks: list[str] = []
        # code found calling the builtin ``id`` (See Note [An object's identity while traced])
        self.identity_calls: list[str] = []
        self.writes_attributes = False  # some code found sets attributes, outside constructors
        self.stored: set[str] = set()  # the attribute names the code found may set
        self.module_names: set[Any] = set()  # the modules whose code was found (``sys.modules[__name__]``)
        # some code found handles exceptions itself (See Note [An exception dispatch caught
        # while traced] in capture.py)
        self.catches = False

    def add_class(self, cls: type) -> None:
        """Dispatch may run the class's own methods without touching a tracked object
        while they are on the stack (a hook a shared base class's dispatch calls): their
        code is expanded as soon as an object of the class is tracked, before any op runs."""
        if cls in self._classes:
            return
        self._classes.add(cls)
        self._new_classes.append(cls)
        for klass in cls.__mro__:
            self.follow_held(klass)

    def on_access(self, frame: types.FrameType | None, cls: type | None = None) -> None:
        if cls is not None:
            self.add_class(cls)
        if frame is self._last_frame:
            return
        self._last_frame = frame
        found: list[tuple[types.CodeType, dict, dict]] = []  # (code, globals, frame locals or {})
        frames = []
        while frame is not None and frame.f_code not in self._stop:
            frames.append(frame)
            frame = frame.f_back
        # A function made by code running now (a lambda dispatch passes to tree_map) closes
        # over that call's locals, not over state: its cells are not read, whichever frame
        # the walk meets first
        running = self._on_stack | {f.f_code for f in frames}
        for frame in frames:
            code = frame.f_code
            if code not in self._on_stack and is_user_code(code.co_filename):
                self._on_stack.add(code)
                nested = any(code in c.co_consts for c in running if c is not code)
                found.append((code, frame.f_globals, {} if nested or not code.co_freevars else frame.f_locals))
        functions = _functions_with([code for code, _, frame_locals in found if frame_locals])
        for code, f_globals, frame_locals in found:
            self._expand(code, f_globals, _closure_cells(code, frame_locals, functions.get(code, [])))

    def follow_held(self, value: Any) -> None:
        """Code an attribute of a tracked object holds (a getter stored on the tensor, a
        bound method, a class), which dispatch may call: expanded as code a global names
        (See Note [Code an attribute holds] in dynamo_layer.py)."""
        for fn in _functions_of(value):
            if is_user_code(fn.__code__.co_filename):
                self._expand(fn.__code__, fn.__globals__, dict(zip(fn.__code__.co_freevars, fn.__closure__ or ())))

    def forget_frame(self) -> None:
        self._last_frame = None

    def new_classes(self) -> list[type]:
        """The classes of tracked objects added since the last call."""
        new, self._new_classes = self._new_classes, []
        return new

    def _expand(self, code: types.CodeType, f_globals: dict, cells: dict) -> None:
        queue = [(code, f_globals, cells)]

        def follow(value: Any, depth: int = 0) -> None:
            for fn in _functions_of(value):
                if is_user_code(fn.__code__.co_filename):
                    cells_of = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
                    queue.append((fn.__code__, fn.__globals__, cells_of))
            if depth < 2 and type(value) in (dict, list, tuple):  # a registry of hooks
                items = value.values() if isinstance(value, dict) else value
                if len(items) <= _MAX_FOLLOWED:
                    for item in list(items):
                        follow(item, depth + 1)

        def follow_chains(value: Any, uses: Uses, code: types.CodeType) -> None:
            # ``CONF.hook(t)``, ``cfg.scale_fn``: the functions reached through the attribute
            # chains the code reads off a value (any name the code holds where the value is
            # used bare), looked up statically (no property or __getattr__ runs)
            if isinstance(value, types.ModuleType) and not is_user_code(getattr(value, "__file__", "") or ""):
                return
            chains = {(a,) for a in read_names(code)} if uses.bare else uses.paths
            for chain in chains:
                v = value
                for attr in chain:
                    v = _static_attr(v, attr)
                    if v is _NOTHING:
                        break
                    follow(v)

        while queue:
            code, f_globals, cells = queue.pop()
            # Several functions can share one code object (classes or hooks made by one
            # factory), each with its own cells: the code is analysed once, the cells of
            # every function found are read and guarded
            keyed = {f"{k.split('#')[0]}#{id(c)}": c for k, c in cells.items()}
            new_cells = {k: c for k, c in keyed.items() if k not in self._cells}
            self._cells.update(new_cells)
            if code in self._expanded:
                if new_cells:
                    self._new.append((code, None, new_cells))
                    self._follow_cells(new_cells, code, follow, follow_chains)
                continue
            self._expanded.add(code)
            self._new.append((code, f_globals, new_cells))
            if compares_type_with_tensor(code):
                self.type_checks.append(getattr(code, "co_qualname", code.co_name))
            if calls_id(code) and "id" not in f_globals:
                self.identity_calls.append(getattr(code, "co_qualname", code.co_name))
            self.writes_attributes |= sets_attributes(code)
            if code.co_name not in _CONSTRUCTORS:
                self.stored.update(stored_names(code))
            self.catches = self.catches or catches_exceptions(code)
            self.names.update(read_names(code))
            uses = uses_in(code)
            self.module_names.add(f_globals.get("__name__"))
            for name in globals_read(code, f_globals):
                value = f_globals.get(name)
                follow(value)
                if isinstance(value, types.ModuleType) and is_user_code(getattr(value, "__file__", "") or ""):
                    # ``helpers.scaled(t)``: the functions a user module object holds
                    for attr in read_names(code):
                        follow(vars(value).get(attr))
                elif value is not None:
                    follow_chains(value, uses.get(name, Uses()), code)
            self._follow_cells(new_cells, code, follow, follow_chains)
            for const in code.co_consts:
                if isinstance(const, types.CodeType):  # a lambda or comprehension: made at run time
                    queue.append((const, f_globals, {}))

    @staticmethod
    def _follow_cells(cells: dict, code: types.CodeType, follow: Callable, follow_chains: Callable) -> None:
        """A helper held by a closure variable (``getter()``, ``hooks.scale_fn``)."""
        uses = uses_in(code)
        for key, cell in cells.items():
            value = _cell_value(cell)
            if value is not _NOTHING:
                follow(value)
                follow_chains(value, uses.get(key.split("#")[0], Uses()), code)

    def reads(self) -> Iterator[FreeRead]:
        """Globals and closure variables of the code objects found since the last call."""
        new, self._new = self._new, []
        for code, f_globals, cells in new:
            where = getattr(code, "co_qualname", code.co_name)
            uses = uses_in(code)
            if f_globals is not None:  # None: another function's cells for code already read
                module = f_globals.get("__name__")
                for name in globals_read(code, f_globals):
                    if name in f_globals:
                        yield FreeRead(module, name, f_globals[name], code_name=where, uses=uses.get(name, Uses()))
            for key, cell in cells.items():
                value = _cell_value(cell)
                if value is not _NOTHING:  # an empty cell: nothing to guard
                    name = key.split("#")[0]
                    yield FreeRead(None, name, value, cell=cell, code_name=where, uses=uses.get(name, Uses()))


_MAX_FOLLOWED = 256  # items of a container whose functions are followed


@functools.lru_cache(maxsize=4096)
def read_names(code: types.CodeType) -> frozenset[str]:
    """Names ``code`` may read attributes or items by: its attribute and global names, and
    its string constants (``getattr(obj, "scale")``, ``os.environ["MODE"]``)."""
    return frozenset(code.co_names) | frozenset(c for c in code.co_consts if type(c) is str and c.isidentifier())


@functools.lru_cache(maxsize=4096)
def catches_exceptions(code: types.CodeType) -> bool:
    """The code handles exceptions itself (``try``/``except``, or a ``with`` block's exit)."""
    handlers = ("PUSH_EXC_INFO",) if sys.version_info >= (3, 11) else ("SETUP_FINALLY", "SETUP_WITH", "SETUP_ASYNC_WITH")
    return any(i.opname in handlers for i in dis.get_instructions(code))


def _codes_in(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes_in(const)


def class_catches(cls: type) -> bool:
    """Some user function of the class (or a base) handles exceptions itself."""
    return _class_code_any(cls, catches_exceptions)


def class_writes(cls: type) -> bool:
    """Some user function of the class (or a base) sets attributes (``sets_attributes``)."""
    return _class_code_any(cls, sets_attributes)


def class_may_write(cls: type) -> bool:
    """The class's user functions, or code they reach through their globals and closures,
    set attributes outside constructors (a ``Collector``'s static expansion, made anew: a
    class's methods may be rebound)."""
    collector = Collector(frozenset())
    collector.add_class(cls)
    return collector.writes_attributes


def _class_code_any(cls: type, check: Callable[[types.CodeType], bool]) -> bool:
    """``check`` holds for some code (nested code too) of the user functions of the class or a base."""
    return any(
        check(c)
        for klass in cls.__mro__
        for fn in _functions_of(klass)
        if is_user_code(fn.__code__.co_filename)
        for c in _codes_in(fn.__code__)
    )


def _functions_of(value: Any) -> list[types.FunctionType]:
    """Functions ``value`` may run when called: itself, a bound method's or a partial's
    function, or a class's own methods."""
    if isinstance(value, types.MethodType):
        value = value.__func__
    elif isinstance(value, functools.partial):
        value = value.func
    elif not isinstance(value, (types.FunctionType, type)) and isinstance(_wrapped(value), types.FunctionType):
        value = _wrapped(value)  # an ``lru_cache`` getter: the function it calls on a miss
    if isinstance(value, types.FunctionType):
        return [value]
    if isinstance(value, type) and not is_c_class(value):
        out = []
        for attr in vars(value).values():
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            if isinstance(attr, types.FunctionType):
                out.append(attr)
        return out
    return []


def _wrapped(value: Any) -> Any:
    """The function a C-level wrapper (``functools.lru_cache``) calls, or None."""
    try:
        return inspect.getattr_static(value, "__wrapped__", None) if callable(value) else None
    except Exception:
        return None


def _functions_with(codes: list[types.CodeType]) -> dict[types.CodeType, list[types.FunctionType]]:
    """Every function object whose code is one of ``codes``, by code.

    Through the gc, in one pass for all of them, every time: a running frame does not point
    to its function, and a function made from the same code since an earlier look (a
    factory's next class or hook, with cells of its own) could be the one running. Not
    cached for that reason (a cached list answered with an older function whose cells held
    the same values, and the running function's own cells went unguarded)."""
    if not codes:
        return {}
    wanted = set(codes)
    out: dict[types.CodeType, list[types.FunctionType]] = {}
    for fn in gc.get_referrers(*codes):
        if isinstance(fn, types.FunctionType) and fn.__code__ in wanted:
            out.setdefault(fn.__code__, []).append(fn)
    return out


def _closure_cells(code: types.CodeType, frame_locals: dict, functions: list[types.FunctionType]) -> dict[str, Any]:
    """The cells the running ``code`` may read its free variables from: those of every
    function with this code whose cells hold what the frame sees. Which of them runs
    cannot be told from the frame, so all that fit are read and guarded."""
    if not code.co_freevars or not frame_locals:
        return {}
    cells: dict[str, Any] = {}
    for fn in functions:
        closure = dict(zip(code.co_freevars, fn.__closure__ or ()))
        if closure and all(_cell_value(c) is frame_locals.get(n, _NOTHING) for n, c in closure.items()):
            for n, c in closure.items():
                cells[f"{n}#{id(c)}"] = c
    return cells


_NOTHING = object()


def _static_attr(value: Any, name: str) -> Any:
    """``value.name`` as found without running user code (a property's getter, a
    staticmethod's or classmethod's function); ``_NOTHING`` when not found so."""
    try:
        v = inspect.getattr_static(value, name, _NOTHING)
    except Exception:  # an object whose __dict__ or class lookup itself fails
        return _NOTHING
    if isinstance(v, (staticmethod, classmethod)):
        return v.__func__
    if isinstance(v, property):
        return v.fget if v.fget is not None else _NOTHING
    if isinstance(v, types.MemberDescriptorType) and not isinstance(value, type):
        try:  # a slot's value (no user code runs)
            return v.__get__(value, type(value))
        except AttributeError:
            return _NOTHING
    return v


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _NOTHING


# --------------------------------------------------------------------------- #
# Globals changed by dispatch
# --------------------------------------------------------------------------- #

_CONTAINERS = (list, dict, set, bytearray, collections.deque)


def _contents(value: Any) -> Any:
    """A shallow copy to compare by identity and to refill from."""
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, set):
        return set(value)
    return list(value)


def _same_contents(value: Any, contents: Any) -> bool:
    if len(value) != len(contents):
        return False
    if not contents:
        return True
    if isinstance(value, dict):
        return value.keys() == contents.keys() and all(map(operator.is_, value.values(), map(contents.__getitem__, value)))
    if isinstance(value, set):
        return value == contents
    return all(map(operator.is_, value, contents))


def _held_containers(label: str, value: Any) -> list[tuple[str, Any]]:
    """The mutable containers a global (a class's or an object's attribute, a closure
    variable) holds, each with a name for messages: itself, the containers inside it (a dict
    in a tuple, the inner dicts of a ``defaultdict(dict)``), a weak dictionary's table, and a
    user function's default arguments and attributes (``def f(n, _cache={})``, ``f.cache =
    {}``), a weak set's references: where dispatch may keep what it computed while traced (an outside tester found a
    fake tensor left in each, and on the weight at the next call). Subclasses of the plain
    containers count (``defaultdict``, ``OrderedDict``, ``Counter``)."""

    out: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def walk(label: str, value: Any, depth: int) -> None:
        if type(value) in _LEAVES or id(value) in seen or depth > _MAX_DEPTH or len(out) >= _MAX_HELD or isinstance(value, torch.Tensor):
            return
        seen.add(id(value))
        if isinstance(value, (weakref.WeakKeyDictionary, weakref.WeakValueDictionary, weakref.WeakSet)):
            out.append((label, value.data))  # its values are not followed (a WeakSet's: weak references)
            return
        table = _mapping_table(value)
        if table is not None:
            # a mapping keeping its items in a dict (``UserDict``, torch's ``WeakIdKeyDictionary``)
            walk(f"{label}.data", table, depth)
            return
        if isinstance(value, collections.ChainMap):
            walk(f"{label}.maps", value.maps, depth)
            return
        if isinstance(value, functools.partial):
            walk(f"{label}.args", value.args, depth + 1)
            walk(f"{label}.keywords", value.keywords, depth + 1)
            return
        if isinstance(value, _CONTAINERS):
            out.append((label, value))
        if isinstance(value, dict):
            for k, v in itertools.islice(value.items(), _MAX_ITEMS):
                walk(f"{label}[{k!r}]", v, depth + 1)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(itertools.islice(value, _MAX_ITEMS)):
                walk(f"{label}[{i}]", v, depth + 1)
        elif depth == 0 and isinstance(value, (staticmethod, classmethod)):
            walk(label, value.__func__, depth)  # a method's default arguments (``def hook(key, _seen={})``)
        elif depth == 0 and isinstance(value, types.FunctionType) and is_user_code(value.__code__.co_filename):
            walk(f"{label}.__defaults__", value.__defaults__ or (), depth + 1)
            if value.__kwdefaults__:
                walk(f"{label}.__kwdefaults__", value.__kwdefaults__, depth + 1)
            walk(f"{label}.__dict__", vars(value), depth)
        elif depth == 0 and (memo := _memo(value)) is not None:
            walk(label, memo.__wrapped__, depth)

    walk(label, value, 0)
    return out


_MAX_HELD = 256  # containers followed from one global
# what holds no container (a class, a module, a constant): met most, left first
_LEAVES = frozenset({type, types.ModuleType, int, float, bool, str, bytes, type(None), types.BuiltinFunctionType})


def _mapping_table(value: Any) -> dict | None:
    """The dict a mapping that is not a dict keeps its items in (``self.data``), or None."""
    if isinstance(value, dict) or not isinstance(value, collections.abc.MutableMapping):
        return None
    try:
        table = inspect.getattr_static(value, "data", None)
    except Exception:
        return None
    return table if type(table) is dict else None


def _memo(value: Any) -> Any:
    """The ``functools.lru_cache`` / ``functools.cache`` wrapper ``value`` is (or a
    staticmethod or classmethod holds), else None."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    wrapper = getattr(functools, "_lru_cache_wrapper", None)
    if wrapper is not None and isinstance(value, wrapper) and hasattr(value, "cache_info"):
        return value
    return None


def _misses(memo: Any) -> int:
    return memo.cache_info().misses


def _snapshot_held(pairs: Any) -> list[tuple[str, Any, Any]]:
    """(name, container, its contents now) for what each ``(name, value)`` holds."""
    return [(label, c, _contents(c)) for name, value in pairs for label, c in _held_containers(name, value)]


def _restore_held(held: list[tuple[str, Any, Any]], owner: str, what: str) -> list[GlobalChange]:
    changes = []
    for label, container, contents in held:
        if not _same_contents(container, contents):
            changes.append(GlobalChange(owner, label, what))
            _refill(container, contents)
    return changes


def _snapshot_memos(pairs: Any) -> list[tuple[str, Any, int]]:
    return [(name, m, _misses(m)) for name, value in pairs if (m := _memo(value)) is not None]


def _restore_memos(memos: list[tuple[str, Any, int]], owner: str) -> list[GlobalChange]:
    """A memoised function that computed a value while traced holds a value of the trace (a
    fake tensor its next eager call returns): its cache is cleared (the one way to drop an
    entry of ``functools.lru_cache``), and the change reported."""
    changes = []
    for name, memo, misses in memos:
        if _misses(memo) != misses:
            changes.append(GlobalChange(owner, name, "filled while traced (a functools cache, now cleared)"))
            memo.cache_clear()
    return changes


@dataclasses.dataclass(frozen=True)
class GlobalChange:
    module: str
    name: str
    what: str  # "rebound" or "mutated in place"


class _Namespace:
    """What one watched namespace (a module's globals, a class's or an object's attributes,
    a closure variable) binds and holds: its bindings, the containers and caches they hold
    with their contents, and its stateful values. Walked once and reused while everything in
    it is as the walk found it (checked by identity before each op): the walk, not the
    check, is what costs (See Note [The global-state watch's cost])."""

    __slots__ = ("bindings", "held", "memos", "stateful", "tensors")

    def __init__(self, bindings: dict[str, Any]) -> None:
        self.bindings = bindings  # the names without dunders (Dynamo adds its own to a module's)
        pairs = list(bindings.items())
        self.held = _snapshot_held(pairs)
        self.memos = _snapshot_memos(pairs)
        self.stateful = [(k, v) for k, v in pairs if type(v) in STATEFUL]
        # plain tensors it binds or its containers hold (See Note [Autograd state of a global tensor])
        self.tensors = [
            (k, v) for k, v in pairs if type(v) is torch.Tensor or type(v) is torch.nn.Parameter
        ] + [
            (label, v) for label, _, contents in self.held
            for v in (contents.values() if isinstance(contents, dict) else contents)
            if type(v) is torch.Tensor or type(v) is torch.nn.Parameter
        ]

    def holds(self, bindings: dict[str, Any]) -> bool:
        """Still what it was walked as: the same bindings, containers holding the same items,
        caches that computed nothing since."""
        return (
            len(bindings) == len(self.bindings)
            and all(bindings.get(k, _ABSENT) is v for k, v in self.bindings.items())
            and all(_same_contents(c, contents) for _, c, contents in self.held)
            and all(_misses(m) == n for _, m, n in self.memos)
        )


def _own(ns: dict[str, Any]) -> dict[str, Any]:
    """A namespace's bindings without dunder names (``__builtins__``, what Dynamo installs in
    a module it compiles a frame of: ``__compiled_fn_1``, ``__import_torch``)."""
    return {k: v for k, v in namespace_items(ns) if k[:2] != "__"}


def namespace_items(ns: dict[str, Any]) -> list[tuple[str, Any]]:
    """A module namespace's items, taken whole. Walking it can set off the cycle collector,
    whose callbacks may drop a name from a namespace (Dynamo removes what it installed for a
    compiled frame that is gone): "dictionary changed size during iteration" inside a compile
    (a fuzz find on torch 2.13). ``dict.copy`` takes it without running Python; a change met
    anyway is taken again."""
    for _ in range(8):
        try:
            return list(ns.copy().items())
        except RuntimeError:
            continue
    return list(ns.copy().items())


def _namespace(cache: Any, key: Any, bindings: dict[str, Any]) -> _Namespace:
    known = cache.get(key)
    if known is None or not known.holds(bindings):
        known = cache[key] = _Namespace(bindings)
    return known


class _ByIdentity:
    """Walks of module namespaces for ``_namespace``, keyed by a namespace dict's identity and
    holding the dict, so the identity stays its own."""

    def __init__(self) -> None:
        self.table: dict[int, tuple[dict, _Namespace]] = {}

    def get(self, ns: dict) -> _Namespace | None:
        entry = self.table.get(id(ns))
        return entry[1] if entry is not None and entry[0] is ns else None

    def __setitem__(self, ns: dict, known: _Namespace) -> None:
        self.table[id(ns)] = (ns, known)


class _Walks(threading.local):
    """The walks of module namespaces and classes one compile shares: its Dynamo frame's ops
    and its AOTAutograd passes watch the same modules and classes (``walks_shared``)."""

    def __init__(self) -> None:
        self.depth = 0
        self.modules = _ByIdentity()
        self.classes: dict[type, _Namespace] = {}


_WALKS = _Walks()


@contextlib.contextmanager
def walks_shared() -> Iterator[None]:
    """Share the watch's walks of modules and classes for the block (a frame's compile);
    dropped when the outermost block ends, so nothing outlives a compile."""
    _WALKS.depth += 1
    try:
        yield
    finally:
        _WALKS.depth -= 1
        if _WALKS.depth == 0:
            _WALKS.modules = _ByIdentity()
            _WALKS.classes = {}


class ModuleWatch:
    """Note [The global-state watch's cost]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Module namespaces, classes, objects, closure variables and library objects whose state
    a traced op must leave as it found it. ``watching`` runs around every traced op of a
    subclass: walking every global of a test module for the containers it holds took about
    1.5 ms an op (3 to 4 points of the subclass compiles). Each namespace is walked once
    (``_Namespace``) and, before each op, only checked to hold what the walk found (the
    same bindings, each container the same items by identity); it is walked again where it
    does not."""

    def __init__(self) -> None:
        self.modules: dict[str, dict] = {}
        self.classes: dict[type, None] = {}  # user classes whose attributes dispatch must leave alone
        self.cells: dict[int, tuple[str, Any]] = {}  # closure cells dispatch code reads: (name, cell)
        # objects dispatch reaches through a global that nothing tracks (an nn.Module or a
        # namespace in a registry): their attributes are state the op must leave alone
        self.objects: dict[int, tuple[str, Any, str]] = {}
        # library objects whose state is not attributes (a numpy array, an array.array, a
        # StringIO, a ContextVar): compared and put back by value
        self.values: dict[int, tuple[str, Any]] = {}
        # objects of torch's or another library's (a module object, an op overload) on which
        # dispatch code sets attributes by name: those names are compared
        self.foreign: dict[int, tuple[str, Any]] = {}
        self.stored_names: set[str] = set()  # attribute names dispatch code sets (Collector.stored)
        self.slotted: dict[int, tuple[str, Any]] = {}  # user objects with ``__slots__`` a global holds
        self._walked: dict[Any, _Namespace] = {}
        self._module_walks = _ByIdentity()
        self._late: list[tuple[str, Any, dict[str, Any]]] | None = None  # foreign objects met inside an op

    def add_module_object(self, module: types.ModuleType) -> None:
        """A module object dispatch reaches through a global (``stats.calls += 1``)."""
        top = module.__name__.split(".")[0]
        if top in ("torch", "builtins") or top in sys.stdlib_module_names or not isinstance(vars(module), dict):
            self.add_foreign(module.__name__, module)  # torch's own namespaces, the standard library
            return
        if not is_user_code(getattr(module, "__file__", "") or ""):
            self.add_foreign(module.__name__, module)
            return
        key = f"{module.__name__}#{id(module)}"
        if key not in self.modules and sys.modules.get(module.__name__) is not module:
            self.modules[key] = vars(module)
        elif module.__name__ not in self.modules:
            self.add(module.__name__)

    def add_cell(self, name: str, cell: Any) -> None:
        """A closure variable dispatch code reads (a ``nonlocal`` counter is global state too)."""
        self.cells.setdefault(id(cell), (name, cell))

    def add_object(self, owner: str, value: Any, why: str = "") -> None:
        """An object dispatch reaches through a global (``REGISTRY["stats"]``, an nn.Module or a
        namespace), whose attribute reads are guarded: an attribute dispatch sets on it
        (``stats.calls += 1``) would be set by every trace and again at run time (counted twice
        per call on the eager backend, a functional tensor left on it by an AOT pass)."""
        if isinstance(getattr(value, "__dict__", None), dict):
            self.objects.setdefault(id(value), (owner, value, why or f"set on a {type(value).__qualname__} held by a global"))

    def add_slotted(self, owner: str, value: Any) -> None:
        """A user object keeping its state in ``__slots__`` that dispatch reaches through a
        global: its slots are compared and put back (``SLOTS.calls += 1`` was counted once per
        trace, never replayed: an outside tester's find)."""
        self.slotted.setdefault(id(value), (owner, value))

    def add_value(self, owner: str, value: Any) -> None:
        """A library object with state of its own dispatch reaches (``library_state``)."""
        if library_state(value) is not None:
            self.values.setdefault(id(value), (owner, value))

    def add_foreign(self, owner: str, value: Any) -> None:
        """An object of torch's or another library's dispatch reaches (``torch``, ``builtins``,
        an op overload): an attribute dispatch code sets on it by name (``torch._count = n``,
        ``func.calls += 1``) is set by every trace. Met inside an op (the op overload
        dispatch is handed), it is compared from there to the op's end."""
        if not isinstance(getattr(value, "__dict__", None), dict) or id(value) in self.foreign:
            return
        self.foreign[id(value)] = (owner, value)
        if self._late is not None:
            self._late.append((owner, value, self._foreign_state(value)))

    def _foreign_state(self, value: Any) -> dict[str, Any]:
        ns = vars(value)
        return {k: ns.get(k, _ABSENT) for k in self.stored_names}

    def add_class(self, cls: type) -> bool:
        """A class (and its user bases) whose own attributes are shared by every instance:
        a class-level counter dispatch bumps (``cls.total += 1``) is global state. True if
        it was not watched yet."""
        new = False
        for klass in cls.__mro__:
            if klass not in self.classes and is_user_class(klass):
                self.classes[klass] = None
                new = True
        return new

    def add(self, module_name: str | None) -> None:
        if not module_name or module_name in self.modules:
            return
        module = sys.modules.get(module_name)
        if module is None or not is_user_code(getattr(module, "__file__", "") or ""):
            return
        self.modules[module_name] = vars(module)

    @contextlib.contextmanager
    def watching(self, process: bool = True) -> Iterator[list[GlobalChange]]:
        """Yield a list that, after the block, holds what the block changed (and undid);
        ``process``: the process-wide state too (See Note [Process-wide state dispatch sets]),
        for a block that is one traced dispatch call, not a span torch's own tracing sets
        some of it in (AOTAutograd's joint runs in anomaly mode)."""
        walked = self._walked
        shared = _WALKS.depth > 0  # else this watch's own
        module_walks = _WALKS.modules if shared else self._module_walks
        class_walks = _WALKS.classes if shared else walked
        modules = [(name, ns, _namespace(module_walks, ns, _own(ns))) for name, ns in self.modules.items()]
        stateful = [(name, k, v, _inner_state(v)) for name, _, known in modules for k, v in known.stateful]
        classes = [(cls, _namespace(class_walks, cls, _class_state(cls))) for cls in self.classes]
        cells = [(name, cell, _namespace(walked, key, {name: _cell_value(cell)})) for key, (name, cell) in self.cells.items()]
        objects = [
            (owner, obj, why, dict(vars(obj)), _namespace(walked, key, _own(vars(obj))))
            for key, (owner, obj, why) in self.objects.items()
        ]
        values = [(owner, value, library_state(value)) for owner, value in self.values.values()]
        slotted = [(owner, value, slot_values(value) or {}) for owner, value in self.slotted.values()]
        foreign = [(owner, value, self._foreign_state(value)) for owner, value in self.foreign.values()] if self.stored_names else []
        generators = _generator_states()
        environ = _environ_now()
        process = _process_state() if process else None
        tensors = _tensor_states(
            [(name.split("#")[0], k, v) for name, _, known in modules for k, v in known.tensors]
            + [(cls.__qualname__, k, v) for cls, known in classes for k, v in known.tensors]
            + [("<closure>", k, v) for _, _, known in cells for k, v in known.tensors]
            + [(owner, k, v) for owner, _, _, _, known in objects for k, v in known.tensors]
        )
        changes: list[GlobalChange] = []
        outer, self._late = self._late, []
        _ACTIVE.watches.append(self)
        try:
            yield changes
        finally:
            _ACTIVE.watches.pop()
            late, self._late = self._late, outer
            changes.extend(_restore_generators(generators))
            changes.extend(_restore_environ(environ))
            if process is not None:
                changes.extend(_restore_process_state(process))
            changes.extend(_restore_tensor_states(tensors))
            for owner, value, state in values:
                now = library_state(value)
                if now is None or not _same_library_state(now, state):
                    changes.append(GlobalChange(owner, type(value).__qualname__, "changed in place (a library object's state)"))
                    if now is not None:
                        restore_library_state(value, state)
            for owner, value, before in slotted:
                now = slot_values(value) or {}
                for key in set(now) | set(before):
                    if now.get(key, _ABSENT) is not before.get(key, _ABSENT):
                        changes.append(GlobalChange(owner, key, f"set on a {type(value).__qualname__} (__slots__) held by a global"))
                        if key in before:
                            object.__setattr__(value, key, before[key])
                        else:
                            object.__delattr__(value, key)
            for owner, value, state in foreign + late:
                changes.extend(_restore_foreign(owner, value, state))
            for name, cell, known in cells:
                if _cell_value(cell) is not known.bindings[name]:
                    changes.append(GlobalChange("<closure>", name, "rebound (a closure variable)"))
                    cell.cell_contents = known.bindings[name]
                else:
                    changes.extend(_restore_held(known.held, "<closure>", "mutated in place (a closure variable)"))
                    changes.extend(_restore_memos(known.memos, "<closure>"))
            for cls, known in classes:
                changes.extend(_restore_class(cls, known))
            for owner, obj, why, attrs, known in objects:
                changes.extend(_restore_object(owner, obj, why, attrs, known))
            for module_name, ns, known in modules:
                bindings, now = known.bindings, _own(ns)
                if len(now) == len(bindings) and all(now.get(k, _ABSENT) is v for k, v in bindings.items()):
                    keys: Any = ()  # nothing rebound, added or removed
                else:
                    keys = set(now) | set(bindings)
                for key in keys:
                    if now.get(key, _ABSENT) is not bindings.get(key, _ABSENT):
                        changes.append(GlobalChange(module_name.split("#")[0], key, "rebound"))
                        if key in bindings:
                            ns[key] = bindings[key]
                        else:
                            del ns[key]
                changes.extend(_restore_held(known.held, module_name.split("#")[0], "mutated in place"))
                changes.extend(_restore_memos(known.memos, module_name.split("#")[0]))
            # last: undoing a counter's advance rebinds its global (after the bindings were put back)
            for module_name, key, value, state in stateful:
                if _inner_state(value) != state:
                    changes.append(GlobalChange(module_name.split("#")[0], key, "advanced through its methods"))
                    _set_inner_state(self.modules[module_name], key, value, state)


class _Active(threading.local):
    def __init__(self) -> None:
        self.watches: list[ModuleWatch] = []


_ACTIVE = _Active()


def note_op(func: Any) -> None:
    """Dispatch is handed ``func`` inside a watched op: attributes its code sets on the op
    overload or its packet (``func.calls += 1``) are global state (See ``add_foreign``)."""
    watches = _ACTIVE.watches
    if watches and watches[-1].stored_names:
        watches[-1].add_foreign(str(func), func)
        packet = getattr(func, "overloadpacket", None)
        if packet is not None:
            watches[-1].add_foreign(str(packet), packet)


def _restore_foreign(owner: str, value: Any, state: dict[str, Any]) -> list[GlobalChange]:
    ns, changes = vars(value), []
    for key, before in state.items():
        if ns.get(key, _ABSENT) is not before:
            changes.append(GlobalChange(owner, key, f"set on {type(value).__qualname__} {owner} while traced"))
            if before is _ABSENT:
                ns.pop(key, None)
            else:
                ns[key] = before
    return changes


_ABSENT = object()


def _stateful_types() -> tuple[type, ...]:
    import random

    return (itertools.count, random.Random)


# module globals whose state their own methods change and no container walk sees (a module-level
# ``deque`` is one of the containers, ``_CONTAINERS``)
STATEFUL = _stateful_types()


def _inner_state(value: Any) -> Any:
    """What a stateful global holds: a counter's position (``next(ids)``), a generator
    instance's state."""
    import random

    return value.getstate() if isinstance(value, random.Random) else repr(value)


def _set_inner_state(ns: dict, key: str, value: Any, state: Any) -> None:
    """Undo what the trace did to a stateful global: in place where its type allows, else
    (an ``itertools.count``, which has no setter) the global is bound to a counter at the
    position it had."""
    import itertools
    import random

    if isinstance(value, random.Random):
        value.setstate(state)
    else:
        args = ast.literal_eval(state[len("count") :])  # "count(5)" / "count(5, 2)"
        ns[key] = itertools.count(*args) if isinstance(args, tuple) else itertools.count(args)


def _environ_now() -> dict:
    """What ``os.environ`` holds, cheaply: its table of encoded items where it has one."""
    data = getattr(os.environ, "_data", None)
    return dict(data) if type(data) is dict else dict(os.environ)


def _restore_environ(before: dict) -> list[GlobalChange]:
    """``os.environ`` set or unset while traced: put back, and reported."""
    if _environ_now() == before:
        return []
    data = getattr(os.environ, "_data", None)
    decode = os.environ.decodekey if type(data) is dict else (lambda k: k)  # type: ignore[attr-defined]
    decode_value = os.environ.decodevalue if type(data) is dict else (lambda v: v)  # type: ignore[attr-defined]
    before_items = {decode(k): decode_value(v) for k, v in before.items()}
    now = dict(os.environ)
    for key in now.keys() - before_items.keys():
        del os.environ[key]
    for key, value in before_items.items():
        if now.get(key) != value:
            os.environ[key] = value
    return [GlobalChange("os", "environ", "set while traced")]


def _generator_states() -> list[tuple[str, Any, Any]]:
    """Python's and numpy's global random generators: (module, comparable state, state)."""
    import random

    states = [("random", None, random.getstate())]
    np = sys.modules.get("numpy")
    if np is not None:
        raw = np.random.get_state()
        states.append(("numpy.random", (raw[0], raw[1].tobytes(), *raw[2:]), raw))
    return states


# Note [Process-wide state dispatch sets]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dispatch may set state of the whole process: torch's global generator
# (``torch.manual_seed(step)``), its default dtype, its numerics flags
# (``torch.backends.cudnn.allow_tf32 = False``, ``set_float32_matmul_precision``), its print
# options, a logger's level, or register a ``weakref.finalize`` on the instance. Traced, that
# ran once on the trace's objects: the seed was set at compile time only (later draws differed
# from eager's, silently), the default dtype was not set at all on the AOT backends, a symbolic
# count landed in the print options, and a finalizer on a fake fired when the trace's objects
# died, running its callback and failing the next compile (outside testers' finds).
# The same holds for the interpreter's and numpy's settings (``sys.setrecursionlimit``, the
# switch interval, ``gc.set_threshold``/``gc.disable``, ``np.seterr``, numpy's print options,
# a signal handler, an excepthook, the working directory) and torch's anomaly mode: set once at
# compile time, they were not set again when the caller put them back between calls (outside
# testers' finds). The watch takes these before each traced dispatch call and puts back what it
# changed, which is reported as a change (``global_state_write``): a refusal, with nothing
# touched.


#: the getters of torch's anomaly mode, which AOTAutograd turns on while it traces (See Note
#: [Anomaly mode while AOTAutograd traces] in aot_layer.py)
ANOMALY_GETTERS = frozenset({"is_anomaly_enabled", "is_anomaly_check_nan_enabled"})


def _torch_settings() -> tuple[tuple[str, str, Callable[[], Any], Callable[[Any], None]], ...]:
    """(module, name, get, put) of each process-wide setting the watch takes (See Note
    [Process-wide state dispatch sets]); built once per set of loaded modules."""
    np = sys.modules.get("numpy")
    key = np is not None
    cached = _SETTINGS.get(key)
    if cached is None:
        cached = _SETTINGS[key] = _build_settings(np)
    return cached


_SETTINGS: dict[bool, tuple[tuple[str, str, Callable[[], Any], Callable[[Any], None]], ...]] = {}


def _build_settings(np: Any) -> tuple[tuple[str, str, Callable[[], Any], Callable[[Any], None]], ...]:
    import _signal
    import signal
    import threading

    def flag(owner: Any, name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
        # read through the flag's own getter, set through the property (torch's frozen-flags
        # check): the watch reads every setting twice per traced op
        prop = next((vars(k)[name] for k in type(owner).__mro__ if name in vars(k)), None)
        get = prop.getter if isinstance(prop, torch.backends.ContextProp) else functools.partial(getattr, owner, name)
        return get, (lambda v: setattr(owner, name, v))

    def put_gc(v: bool) -> None:
        (gc.enable if v else gc.disable)()

    # the standard signals Python can handle; realtime ones are left out (a read each costs)
    signals = [s for s in signal.valid_signals() if s < 32 and s not in (signal.SIGKILL, signal.SIGSTOP)]

    def put_signals(v: tuple) -> None:
        for s, handler in zip(signals, v):
            if handler is not None and _signal.getsignal(s) is not handler:
                signal.signal(s, handler)

    opts = torch._tensor_str.PRINT_OPTS
    settings: list[tuple[str, str, Callable[[], Any], Callable[[Any], None]]] = [
        *(("torch", f"set_printoptions({name})", *flag(opts, name)) for name in ("precision", "threshold", "edgeitems", "linewidth", "sci_mode")),
        ("torch", "get_float32_matmul_precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        (
            "torch", "use_deterministic_algorithms",
            lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
            lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        ),
        ("torch", "get_default_dtype", torch.get_default_dtype, torch.set_default_dtype),
        (
            "torch", "autograd.set_detect_anomaly",
            lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            lambda v: torch.set_anomaly_enabled(*v),
        ),
        *_backend_flags(flag),
        ("sys", "setrecursionlimit", sys.getrecursionlimit, sys.setrecursionlimit),
        ("sys", "setswitchinterval", sys.getswitchinterval, sys.setswitchinterval),
        ("sys", "excepthook", lambda: sys.excepthook, lambda v: setattr(sys, "excepthook", v)),
        ("threading", "excepthook", lambda: threading.excepthook, lambda v: setattr(threading, "excepthook", v)),
        ("gc", "set_threshold", gc.get_threshold, lambda v: gc.set_threshold(*v)),
        ("gc", "set_debug", gc.get_debug, gc.set_debug),
        ("gc", "callbacks", lambda: tuple(gc.callbacks), lambda v: gc.callbacks.__setitem__(slice(None), v)),
        ("sys", "path", lambda: tuple(sys.path), lambda v: sys.path.__setitem__(slice(None), v)),
        ("threading", "stack_size", threading.stack_size, threading.stack_size),
        ("signal", "pthread_sigmask", lambda: signal.pthread_sigmask(signal.SIG_BLOCK, ()), lambda v: signal.pthread_sigmask(signal.SIG_SETMASK, v)),
        ("gc", "disable", gc.isenabled, put_gc),
        ("os", "chdir", os.getcwd, os.chdir),
        # the handlers as the C module holds them (``signal.getsignal`` makes enums of them)
        ("signal", "signal", lambda: tuple(map(_signal.getsignal, signals)), put_signals),
    ]
    if hasattr(sys, "get_int_max_str_digits"):
        settings.append(("sys", "set_int_max_str_digits", sys.get_int_max_str_digits, sys.set_int_max_str_digits))
    if np is not None:
        settings.append(("numpy", "seterr", np.geterr, lambda v: np.seterr(**v)))
        settings.append(("numpy", "set_printoptions", np.get_printoptions, lambda v: np.set_printoptions(**v)))
        settings.append(("numpy", "seterrcall", np.geterrcall, np.seterrcall))
        settings.append(("numpy", "setbufsize", np.getbufsize, np.setbufsize))
    return tuple(settings)


class _Unreadable:
    """A setting whose read raises as the process stands (torch's matmul precision once the
    new ``fp32_precision`` flags and the legacy ones are both set): compared by the error."""

    __slots__ = ("error",)

    def __init__(self, error: type) -> None:
        self.error = error

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Unreadable) and other.error is self.error

    def __hash__(self) -> int:
        return hash(self.error)


def _read(get: Callable[[], Any]) -> Any:
    try:
        return get()
    except Exception as exc:  # noqa: BLE001 - a read that raises is no change of dispatch's
        return _Unreadable(type(exc))


def _read_all(settings: tuple[tuple[str, str, Callable[[], Any], Callable[[Any], None]], ...]) -> list[Any]:
    """Each setting's value, or its error where its read raises (See ``_Unreadable``)."""
    try:
        return [get() for _, _, get, _ in settings]
    except Exception:  # noqa: BLE001 - one read raised: each alone
        return [_read(get) for _, _, get, _ in settings]


def _backend_flags(flag: Callable[[Any, str], tuple]) -> list[tuple[str, str, Callable[[], Any], Callable[[Any], None]]]:
    """torch.backends' flags: each loaded backend module's properties (cudnn, mkldnn, ...),
    cuBLAS's matmul flags, the attention kernels' switches, the preferred libraries, the
    fast path of ``nn.MultiheadAttention``, nnpack, the quantized engine, opt_einsum,
    ``set_warn_always``. Those whose read fails on
    this build are left out."""
    import torch.backends.cuda
    import torch.backends.mha

    b = torch.backends
    found: list[tuple[str, str, Callable[[], Any], Callable[[Any], None]]] = []
    for module_name, module in sorted(sys.modules.items()):
        if (module_name == "torch.backends" or module_name.startswith("torch.backends.")) and module is not None:
            for prop, value in vars(type(module)).items():
                if isinstance(value, b.ContextProp):
                    found.append(("torch", f"{module_name[len('torch.'):]}.{prop}", *flag(module, prop)))
    matmul = b.cuda.matmul
    for prop in ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction", "fp32_precision"):
        found.append(("torch", f"backends.cuda.matmul.{prop}", *flag(matmul, prop)))
    cuda = b.cuda
    for get, put in (
        ("flash_sdp_enabled", "enable_flash_sdp"), ("mem_efficient_sdp_enabled", "enable_mem_efficient_sdp"),
        ("math_sdp_enabled", "enable_math_sdp"), ("cudnn_sdp_enabled", "enable_cudnn_sdp"),
        ("fp16_bf16_reduction_math_sdp_allowed", "allow_fp16_bf16_reduction_math_sdp"),
        ("preferred_linalg_library", "preferred_linalg_library"), ("preferred_blas_library", "preferred_blas_library"),
    ):
        if hasattr(cuda, get) and hasattr(cuda, put):
            found.append(("torch", f"backends.cuda.{put}", getattr(cuda, get), getattr(cuda, put)))
    found.append(("torch", "backends.mha.set_fastpath_enabled", b.mha.get_fastpath_enabled, b.mha.set_fastpath_enabled))
    found.append(("torch", "backends.nnpack.set_flags", torch._C._get_nnpack_enabled, torch._C._set_nnpack_enabled))
    for module_name, prop in (("torch.backends.quantized", "engine"), ("torch.backends.opt_einsum", "enabled"), ("torch.backends.opt_einsum", "strategy")):
        module = sys.modules.get(module_name)
        if module is not None:
            found.append(("torch", f"{module_name[len('torch.'):]}.{prop}", *flag(module, prop)))
    found.append(("torch", "set_warn_always", torch.is_warn_always_enabled, torch.set_warn_always))
    found.append((
        "torch", "utils.deterministic.fill_uninitialized_memory",
        torch._C._get_deterministic_fill_uninitialized_memory, torch._C._set_deterministic_fill_uninitialized_memory,
    ))
    found.append(("torch", "autograd.set_multithreading_enabled", torch._C._is_multithreading_enabled, torch._C._set_multithreading_enabled))
    get_precision = getattr(torch._C, "_get_fp32_precision_getter", None)
    set_precision = getattr(torch._C, "_set_fp32_precision_setter", None)
    if get_precision is not None and set_precision is not None:
        # every backend's and op's fp32_precision (``torch.backends.mkldnn.conv.fp32_precision``)
        for backend in ("generic", "mkldnn", "cuda", "cudnn"):
            for op in ("all", "conv", "matmul", "rnn"):
                found.append((
                    "torch", f"fp32_precision({backend}, {op})", functools.partial(get_precision, backend, op),
                    functools.partial(set_precision, backend, op),
                ))
    usable = []
    for entry in found:
        try:
            entry[2]()
        except Exception:  # noqa: BLE001 - a flag this build cannot read (a CUDA one on a CPU build)
            continue
        usable.append(entry)
    return usable


def _process_state() -> tuple[Any, tuple, list[Any], frozenset, Any]:
    """See Note [Process-wide state dispatch sets]: torch's generator state, the process's
    settings (with their values), the live ``weakref.finalize`` registrations and the
    loggers' levels."""
    settings = _torch_settings()
    values = _read_all(settings)
    return _generator_bytes(), settings, values, frozenset(weakref.finalize._registry), _logger_levels()  # type: ignore[attr-defined]


def _logger_levels() -> tuple[list, list, int]:
    """Each logger's level, ``disabled`` and ``propagate``, and ``logging.disable``'s level."""
    import logging

    manager = logging.Logger.manager
    known = _LOGGERS.get(len(manager.loggerDict))
    if known is None:  # a logger made since (the list is rebuilt only then: a scan per dispatch call)
        _LOGGERS.clear()
        known = _LOGGERS[len(manager.loggerDict)] = [
            logging.root, *(v for v in list(manager.loggerDict.values()) if isinstance(v, logging.Logger))
        ]
    return known, _logger_fields(known), manager.disable


def _logger_fields(loggers: list) -> tuple[list, ...]:
    """Each logger's level, ``disabled``, ``propagate``, handlers and filters lists, and their
    lengths, one list per field: read from the instance dicts in C and making no object per
    logger (a process holds hundreds of loggers, read twice per traced op; a tuple each
    triggered the garbage collector's passes over the trace's objects)."""
    try:
        dicts = list(map(_VARS, loggers))
        fields = [list(map(operator.itemgetter(name), dicts)) for name in _LOGGER_FIELDS]
    except KeyError:  # a Logger subclass keeping them elsewhere
        fields = [[getattr(lg, name) for lg in loggers] for name in _LOGGER_FIELDS]
    return (*fields, list(map(len, fields[3])), list(map(len, fields[4])))


_VARS = operator.attrgetter("__dict__")
_LOGGER_FIELDS = ("level", "disabled", "propagate", "handlers", "filters")
_LOGGERS: dict[int, list] = {}


@contextlib.contextmanager
def _outside_traces() -> Iterator[None]:
    """Outside the trace's dispatch modes and functorch's transforms, which would wrap the
    generator's state tensor."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C._DisableFuncTorch():
        yield


def _generator_bytes() -> bytes:
    """torch's global generator state as bytes."""
    with _outside_traces():
        return torch.random.default_generator.get_state().numpy().tobytes()


def _restore_process_state(before: tuple[Any, tuple, list[Any], frozenset, Any]) -> list[GlobalChange]:
    import logging

    generator, settings, values, finalizers, (loggers, levels, disabled) = before
    changes = []
    if _generator_bytes() != generator:
        changes.append(GlobalChange("torch", "<global generator>", "seeded or drawn from (torch.manual_seed)"))
        with _outside_traces():
            torch.random.default_generator.set_state(torch.frombuffer(bytearray(generator), dtype=torch.uint8))
    now = _read_all(settings)
    # types first: a symbolic value landed in a setting compares symbolically (a guard)
    if list(map(type, now)) != list(map(type, values)) or now != values:
        for (module, name, _, put), value, value_now in zip(settings, values, now):
            if type(value_now) is not type(value) or value_now != value:
                changes.append(GlobalChange(module, name, f"set (a process-wide {module} setting)"))
                if not isinstance(value, _Unreadable):
                    put(value)
    added = set(weakref.finalize._registry) - finalizers  # type: ignore[attr-defined]
    if added:
        changes.append(GlobalChange("weakref", "finalize", "registered on a traced object (its callback runs when the trace's objects die)"))
        for f in added:
            f.detach()
    now_levels = _logger_fields(loggers)
    if any(now is not then and now != then for now, then in zip(now_levels, levels)):
        for owner, then, now in zip(loggers, zip(*levels), zip(*now_levels)):
            if any(a is not b for a, b in zip(now, then)) and now != then:
                changes.append(GlobalChange(
                    "logging", owner.name, "set (a logger's level, disabled, propagate, handlers or filters)"
                ))
                level, owner.disabled, owner.propagate, owner.handlers, owner.filters, handlers, filters = then
                owner.setLevel(level)
                del owner.handlers[handlers:]  # added ones (``addHandler``, ``basicConfig``) go
                del owner.filters[filters:]
    if logging.Logger.manager.disable != disabled:
        changes.append(GlobalChange("logging", "disable", "set (logging.disable)"))
        logging.disable(disabled)
    return changes


# Note [Autograd state of a global tensor]
# Dispatch reaches a real tensor through a global, a class attribute, a closure variable or an
# object a global holds (a buffer, a registry of scales) and sets its autograd state:
# ``G.requires_grad_()``, ``G.grad = g``, a hook, ``G.data = t``. Traced, that ran once on the
# real tensor at compile time, never at run time; on the AOT backends a symbolic value landed
# in a real tensor's ``.grad`` (outside testers' finds). The watch takes each such tensor's
# autograd state before a traced dispatch call and puts back what changed, which is reported
# as a change (``global_state_write``).


def grad_reads_quietly(t: torch.Tensor) -> bool:
    """Whether reading ``t.grad`` gives torch no warning (a leaf, or a tensor retaining its
    gradient)."""
    base = torch._C.TensorBase
    return base.grad_fn.__get__(t) is None or base.retains_grad.__get__(t)  # type: ignore[attr-defined]


def grad_of(t: torch.Tensor) -> Any:
    """``t.grad`` without torch's warning for a tensor that is no leaf (eager never reads
    it there; the warning would show where eager shows none: an outside tester's find)."""
    base = torch._C.TensorBase
    if grad_reads_quietly(t):
        return base._grad.__get__(t)  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return base._grad.__get__(t)  # type: ignore[attr-defined]


def _tensor_states(tensors: list[tuple[str, str, torch.Tensor]]) -> list[tuple]:
    if not tensors:
        return []
    base = torch._C.TensorBase
    out = []
    with _outside_traces():  # ``.data`` is an op: the trace's modes would take it
        for owner, name, t in tensors:
            hooks = base._backward_hooks.__get__(t)  # type: ignore[attr-defined]
            out.append((
                owner, name, t, base.requires_grad.__get__(t), grad_of(t),  # type: ignore[attr-defined]
                hooks, tuple(hooks) if hooks else (), base.data.__get__(t),  # type: ignore[attr-defined]
            ))
    return out


def _same_data(t: torch.Tensor, data: torch.Tensor) -> bool:
    try:
        return (
            t.untyped_storage()._cdata == data.untyped_storage()._cdata and t.dtype == data.dtype
            and t.shape == data.shape and t.stride() == data.stride() and t.storage_offset() == data.storage_offset()
        )
    except Exception:  # noqa: BLE001 - no storage to compare (a sparse tensor): compared by its metadata
        return t.dtype == data.dtype and t.shape == data.shape


def _restore_tensor_states(states: list[tuple]) -> list[GlobalChange]:
    """See Note [Autograd state of a global tensor]."""
    base = torch._C.TensorBase
    changes = []
    for owner, name, t, requires_grad, grad, hooks, keys, data in states:
        hooks_now = base._backward_hooks.__get__(t)  # type: ignore[attr-defined]
        rg_now = base.requires_grad.__get__(t)  # type: ignore[attr-defined]
        grad_now = grad_of(t)
        if (
            rg_now is requires_grad and grad_now is grad and hooks_now is hooks
            and (tuple(hooks_now) if hooks_now else ()) == keys and _same_data(t, data)
        ):
            continue
        changes.append(GlobalChange(owner, name, "autograd state set (requires_grad, .grad, a hook or .data of a tensor a global holds)"))
        with _outside_traces():
            if not _same_data(t, data):
                base.data.__set__(t, data)  # type: ignore[attr-defined]
            if rg_now is not requires_grad and t.is_leaf:
                t.requires_grad_(requires_grad)
            if grad_now is not grad:
                base._grad.__set__(t, grad)  # type: ignore[attr-defined]
            if hooks_now is not hooks:
                base._backward_hooks.__set__(t, hooks)  # type: ignore[attr-defined]
            if hooks is not None:
                for key in [k for k in hooks if k not in keys]:
                    del hooks[key]
    return changes


def _restore_generators(before: list[tuple[str, Any, Any]]) -> list[GlobalChange]:
    """A draw from a global generator while traced is global state the compiled program
    cannot replay (it would repeat the trace's draw on every call, pytorch #130028's
    problem in another form): the draw is undone and reported as a change. torch's own
    generator is not among them: torch.rand in dispatch is an op of the graph."""
    import random

    changes = []
    for (module, key, state), (_, key_now, state_now) in zip(before, _generator_states()):
        if (key if key is not None else state) != (key_now if key_now is not None else state_now):
            changes.append(GlobalChange(module, "<global generator>", "drawn from (a random number the compiled program would repeat)"))
            if module == "random":
                random.setstate(state)
            else:
                sys.modules["numpy"].random.set_state(state)
    return changes


def _class_state(cls: type) -> dict[str, Any]:
    return {k: v for k, v in vars(cls).items() if not k.startswith("__") and not k.startswith("_dynamo")}


def _restore_class(cls: type, snapshot: _Namespace) -> list[GlobalChange]:
    """Put a class's attributes back as ``snapshot`` has them; what was changed."""
    attrs = snapshot.bindings
    changes = [
        dataclasses.replace(c, name=f"{cls.__qualname__}.{c.name}")
        for c in _restore_held(snapshot.held, cls.__module__, "mutated in place (a class attribute)")
        + _restore_memos(snapshot.memos, cls.__module__)
    ]
    now = _class_state(cls)
    for key in set(now) | set(attrs):
        if now.get(key, _ABSENT) is not attrs.get(key, _ABSENT):
            changes.append(GlobalChange(cls.__module__, f"{cls.__qualname__}.{key}", "rebound (a class attribute)"))
            if key in attrs:
                type.__setattr__(cls, key, attrs[key])
            else:
                type.__delattr__(cls, key)
    return changes


_TORCH_FUNCTIONS = (torch.Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl)


class CompileWatch:
    """Note [Constructors torch runs while compiling]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Compiling builds instances of a subclass eager never builds: Dynamo's and AOTAutograd's
    fake copies of the inputs, each pass's functional copies, dynamo_ext's own rebuilds,
    all through ``__tensor_unflatten__`` and so the class's constructor. A constructor that
    counts at class level (``type(self).created += 1``, an id registry) then counts them
    (an outside tester found one extra per input under ``fullgraph=False``, stock many
    more). The class-level state of each user subclass is taken when Dynamo first fakes an
    instance of it in a compile, and put back when the compile ends: eager semantics know
    no compile. (Dispatch changing it while traced is refused, ``ModuleWatch``.)"""

    def __init__(self) -> None:
        self.snapshots: dict[type, _Namespace] = {}
        self.instances: dict[int, tuple[Any, dict[str, Any]]] = {}

    def add(self, cls: type) -> None:
        for klass in cls.__mro__:
            if klass not in self.snapshots and is_user_class(klass):
                self.snapshots[klass] = _Namespace(_class_state(klass))

    def add_instance(self, obj: Any) -> None:
        """Note [Torch functions torch runs on a real input while compiling]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        Dynamo and AOTAutograd read the real input's properties (``shape``, ``dtype``,
        ``requires_grad``, ...) while they compile, each through the class's
        ``__torch_function__``: one that counts on the instance (``self.tf_calls += 1``)
        counted dozens of reads eager never makes, and again at each recompile (an outside
        tester's find; stock alike). A real input of a class with its own
        ``__torch_function__`` has its instance dict taken when Dynamo first fakes it, and put
        back when the compile ends: the writes the compiled code makes are Dynamo's, replayed
        when it runs. Dynamo's own marks (``_dynamo_*``) are left."""
        if id(obj) in self.instances or not has_own_torch_function(obj):
            return
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            self.instances[id(obj)] = (obj, dict(d))

    def restore(self) -> list[GlobalChange]:
        changes = []
        for cls, snapshot in self.snapshots.items():
            changes.extend(_restore_class(cls, snapshot))
        for obj, before in self.instances.values():
            changes.extend(put_back_instance(obj, before))
        return changes


def has_own_torch_function(obj: Any) -> bool:
    tf = getattr(type(obj), "__torch_function__", None)
    return getattr(tf, "__func__", tf) not in _TORCH_FUNCTIONS


def put_back_instance(obj: Any, before: dict[str, Any], what: str = "set on a real input while compiling") -> list[GlobalChange]:
    """Put back the instance dict taken as ``before``, but for Dynamo's own marks; what was
    changed, each name by identity."""
    d = vars(obj)
    changes = []
    for key in [k for k in set(d) | set(before) if not k.startswith("_dynamo")]:
        then, now = before.get(key, _ABSENT), d.get(key, _ABSENT)
        if then is now:
            continue
        changes.append(GlobalChange(type(obj).__qualname__, key, what))
        if then is _ABSENT:
            del d[key]
        else:
            d[key] = then
    return changes


def _restore_object(owner: str, obj: Any, why: str, attrs: dict[str, Any], snapshot: _Namespace) -> list[GlobalChange]:
    ns = vars(obj)
    changes = []
    if len(ns) != len(attrs) or any(ns.get(k, _ABSENT) is not v for k, v in attrs.items()):
        for key in set(ns) | set(attrs):
            if ns.get(key, _ABSENT) is not attrs.get(key, _ABSENT):
                changes.append(GlobalChange(owner, key, why))
        ns.clear()
        ns.update(attrs)
    changes.extend(_restore_held(snapshot.held, owner, f"mutated in place ({why})"))
    changes.extend(_restore_memos(snapshot.memos, owner))
    return changes


def _refill(value: Any, contents: Any) -> None:
    if isinstance(value, (dict, set)):
        value.clear()
        value.update(contents)
    elif isinstance(value, collections.deque):
        value.clear()
        value.extend(contents)
    else:
        value[:] = contents


# --------------------------------------------------------------------------- #
# State the traced backward reads
# --------------------------------------------------------------------------- #

_MAX_ITEMS = 64  # items of a container checked one by one
_MAX_DEPTH = 3  # values reached through a global: how far they are followed


def holds_constants(value: Any, depth: int = 0) -> bool:
    """A plain container of constants, functions, classes and torch ops (a registry keyed by
    op), which a guard can copy and compare: no tensors, modules or other objects."""
    from .values import is_code_object, is_immutable_constant

    if depth > 8:
        return False
    if isinstance(value, dict):
        return all(holds_constants(k, depth + 1) and holds_constants(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(holds_constants(v, depth + 1) for v in value)
    if isinstance(value, bytearray) or is_immutable_constant(value):
        return True
    # (a bound method holds its owner: not copied by a value guard)
    return is_code_object(value) and not isinstance(value, (types.ModuleType, types.MethodType))


def is_namespace(value: Any) -> bool:
    """A plain attribute holder of the standard library (``types.SimpleNamespace``,
    ``argparse.Namespace``, ``threading.local``: read in the calling thread)."""
    import threading

    cls = type(value)
    return (
        cls is types.SimpleNamespace
        or (cls.__name__ == "Namespace" and cls.__module__ == "argparse")
        or isinstance(value, threading.local)
    )


def mapping_items(value: Any) -> Any:
    """What a mapping of another library (``os.environ``) holds, as a dict, if it holds
    only constants; None for anything else."""
    import collections.abc

    from .values import is_immutable_constant

    if not isinstance(value, collections.abc.Mapping) or isinstance(value, dict):
        return None
    try:
        items = dict(value)
    except Exception:
        return None
    if all(is_immutable_constant(k) and is_immutable_constant(v) for k, v in items.items()):
        return items
    return None


_MAX_SNAPSHOT = 4096  # elements of an array a guard copies


def state_snapshot(value: Any) -> Any:
    """A comparable copy of what an object of a library class holds, where its state is not
    attributes a guard can read: a ``ContextVar``'s value, a numpy array's or
    ``array.array``'s contents, a ``deque`` of constants, a mapping of another library
    (``os.environ``). None: not such an object. ``UNREADABLE``: such an object whose state
    cannot be copied (a ContextVar holding an object, a large or object array)."""
    import array
    import collections
    import contextvars

    from .values import MISSING, is_immutable_constant

    if isinstance(value, contextvars.ContextVar):
        held = value.get(MISSING)
        return ("contextvar", held) if held is MISSING or is_immutable_constant(held) else UNREADABLE
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.size > _MAX_SNAPSHOT:
            return UNREADABLE
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, array.array):
        return ("array", value.typecode, value.tobytes()) if len(value) <= _MAX_SNAPSHOT else UNREADABLE
    if isinstance(value, collections.deque):
        held = tuple(value)
        return ("deque", held) if is_immutable_constant(held) else UNREADABLE
    items = mapping_items(value)
    if items is not None:
        return ("mapping", items)
    return None


UNREADABLE = ("<unreadable>",)


def library_state(value: Any) -> Any:
    """What a library object holds that a traced op could change in place and the watch can
    put back, as a comparable copy: a numpy array's or ``array.array``'s contents, a
    ``deque``'s items, a ``ContextVar``'s value, a ``StringIO`` or ``BytesIO`` log's text and
    position, a mapping of another library's items. None: not such an object."""
    import array
    import contextvars
    import io

    from .values import MISSING

    if isinstance(value, contextvars.ContextVar):
        return ("contextvar", value.get(MISSING))
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray):
        return ("ndarray", value.copy()) if not value.dtype.hasobject else None
    if isinstance(value, array.array):
        return ("array", value.tobytes())
    if isinstance(value, collections.deque):
        return ("deque", tuple(value))
    if isinstance(value, (io.StringIO, io.BytesIO)):
        return ("io", value.getvalue(), value.tell()) if not value.closed else None
    if isinstance(value, collections.abc.MutableMapping) and not isinstance(value, dict) and _mapping_table(value) is None:
        try:
            return ("mapping", dict(value))
        except Exception:
            return None
    return None


def _same_library_state(a: Any, b: Any) -> bool:
    if a[0] == "ndarray" and b[0] == "ndarray":
        np = sys.modules["numpy"]
        return a[1].shape == b[1].shape and a[1].dtype == b[1].dtype and bool(np.array_equal(a[1], b[1], equal_nan=True))
    if a[0] in ("deque", "mapping", "contextvar"):
        return _same_items(a[1], b[1])
    return a == b


def _same_items(a: Any, b: Any) -> bool:
    """Equal, holding the same objects where they are not plain constants (a fake tensor is
    never equal to what eager holds)."""
    from .values import is_immutable_constant

    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_items(a[k], b[k]) for k in a)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_items(x, y) for x, y in zip(a, b))
    if is_immutable_constant(a) and is_immutable_constant(b):
        return type(a) is type(b) and a == b
    return a is b


def restore_library_state(value: Any, state: Any) -> None:
    """Put back what ``library_state`` copied (a ContextVar a trace set, where it held no
    value before, keeps the value set: Python cannot unset it without the set's token)."""
    kind = state[0]
    if kind == "contextvar":
        from .values import MISSING

        if state[1] is not MISSING:
            value.set(state[1])
    elif kind == "ndarray":
        if value.shape == state[1].shape:
            value[...] = state[1]
    elif kind == "array":
        value[:] = type(value)(value.typecode, state[1])
    elif kind == "deque":
        value.clear()
        value.extend(state[1])
    elif kind == "io":
        value.seek(0)
        value.truncate()
        value.write(state[1])
        value.seek(state[2])
    elif kind == "mapping":
        for key in [k for k in value if k not in state[1]]:
            del value[key]
        for key, item in state[1].items():
            if key not in value or value[key] is not item:
                value[key] = item


def slot_values(value: Any) -> dict[str, Any] | None:
    """The slots a user class's instance holds (``__slots__``, no ``__dict__``), or None."""
    cls = type(value)
    if hasattr(value, "__dict__") or not is_user_class(cls):
        return None
    out: dict[str, Any] = {}
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            v = _static_attr(value, name)
            if v is not _NOTHING and name not in out:
                out[name] = v
    return out


def reads_environment(value: Any) -> bool:
    """``os.getenv`` (bound by name or reached through ``os``): reads ``os.environ``."""
    return value is os.getenv or value is getattr(os, "getenvb", None)


def _code_print(fn: Any) -> Any:
    """What a function is, comparable across processes: its name and bytecode."""
    code = getattr(fn, "__code__", None)
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn)), code.co_code if code else None)


@dataclasses.dataclass(frozen=True)
class BackwardRead:
    """Note [State the traced backward reads outside the tensors]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    AOTAutograd traces the backward when it compiles, so what the backward's dispatch code
    reads through a module global or a closure variable (a gain, a config object's flag, a
    hook) is baked into the compiled backward as it was then. The Dynamo layer guards the
    forward on such state, but eager's backward reads it when ``backward()`` runs: set
    between the forward and ``backward()``, the compiled backward used the old value,
    silently. The code the traced backward ran is found as the Dynamo layer finds dispatch
    code (a ``Collector`` on the backward's scope), and what it can reach is kept as
    ``BackwardRead``s (the global or cell, the chain of attributes or items followed, the
    value as traced); each is read again before the compiled backward runs, and a change is
    refused (``changed_before_backward``) before any gradient is accumulated. Reads are
    static (``inspect.getattr_static``): no user code runs. Functions compare by name and
    bytecode, so a plan holding them pickles for AOTAutogradCache; one holding a closure
    cell does not (another process has other cells) and bypasses the cache."""

    module: str | None  # the module whose globals hold it; None for a closure variable
    name: str
    chain: tuple[Any, ...]  # attribute names, or ("[]", key) for an item
    # "value", "len", "code" (a function's print), "state" (state_snapshot), "dict" (a
    # dict subclass's items)
    kind: str
    value: Any
    cell: Any = None
    code_name: str = ""  # the code reading a closure variable

    def where(self) -> str:
        parts = [self.name if self.cell is None else f"<closure of {self.code_name}>.{self.name}"]
        for step in self.chain:
            parts.append(f"[{step[1]!r}]" if isinstance(step, tuple) else f".{step}")
        return (f"{self.module}." if self.module else "") + "".join(parts)

    def now(self) -> Any:
        from .values import MISSING

        if self.cell is not None:
            v = _cell_value(self.cell)
        else:
            module = sys.modules.get(self.module or "")
            v = vars(module).get(self.name, _NOTHING) if module is not None else _NOTHING
        for step in self.chain:
            if v is _NOTHING:
                break
            v = _step(v, step)
        if v is _NOTHING:
            return MISSING
        if self.kind == "len":
            return len(v) if hasattr(v, "__len__") else MISSING
        if self.kind == "state":
            return state_snapshot(v)
        if self.kind == "dict":
            return dict(v) if isinstance(v, dict) else MISSING
        if self.kind == "code":
            return _code_print(v)
        return v

    def holds(self) -> bool:
        from .values import same_value

        now = self.now()
        return same_value(self.value, now) if self.kind == "value" else self.value == now


def _step(value: Any, step: Any) -> Any:
    if isinstance(step, tuple):
        try:
            return value[step[1]]
        except Exception:
            return _NOTHING
    if isinstance(value, types.ModuleType):
        return vars(value).get(step, _NOTHING)
    if isinstance(value, torch.nn.Module) and step in value._modules:
        return value._modules[step]
    if is_namespace(value):  # a threading.local's dict is this thread's: no static lookup
        held = vars(value)
        if step in held:
            return held[step]
    return _static_attr(value, step)


def backward_reads(reads: Iterator[FreeRead], names: set[str]) -> list[BackwardRead]:
    """What the traced backward's code can reach through the globals and closure variables
    ``reads`` lists, as it holds now (See Note [State the traced backward reads outside the
    tensors]); ``names``: every name that code reads attributes by."""
    out: dict[tuple, BackwardRead] = {}
    for r in reads:
        if r.cell is None and sys.modules.get(r.module or "") is None:
            continue  # the namespace of generated code: not importable state
        _reach(BackwardRead(r.module, r.name, (), "value", None, r.cell, r.code_name), r.value, r.uses, names, 0, out)
    return list(out.values())


def _reach(at: BackwardRead, value: Any, uses: Uses, names: set[str], depth: int, out: dict) -> None:
    """Keep what ``value`` (found at ``at``) holds that the code may read: the values the
    Dynamo layer guards a forward on (dynamo_layer's Note [State dispatch reaches outside
    the tensors]), as checks for the compiled backward."""
    from .values import MISSING, PLAIN_MUTABLE, is_immutable_constant

    def keep(kind: str, v: Any) -> None:
        key = (at.module, at.name, id(at.cell), at.chain, kind)
        out.setdefault(key, dataclasses.replace(at, kind=kind, value=v))

    def then(step: Any) -> BackwardRead:
        return dataclasses.replace(at, chain=at.chain + (step,))

    if depth > _MAX_DEPTH or isinstance(value, torch.Tensor):
        return
    wanted = uses.names(names)
    if isinstance(value, types.ModuleType):
        if value.__name__.split(".")[0] == "torch" or not isinstance(vars(value), dict):
            return
        held = vars(value)
        if value is os and wanted & {"getenv", "getenvb"}:
            wanted = wanted | {"environ"}
        for attr in sorted(wanted & held.keys()):
            if attr[:2] != "__":
                _reach(then(attr), held[attr], uses.of(attr), names, depth + 1, out)
        return
    if isinstance(value, types.FunctionType):
        if is_user_code(value.__code__.co_filename):  # a library's functions are not rebound
            keep("code", _code_print(value))
        elif reads_environment(value):
            _reach(dataclasses.replace(at, module="os", name="environ", chain=(), cell=None), os.environ, Uses(), names, depth + 1, out)
        return
    if not isinstance(value, type) and isinstance(_wrapped(value), types.FunctionType):  # lru_cache
        keep("code", _code_print(_wrapped(value)))
        return
    if isinstance(value, types.MethodType):
        if is_user_code(getattr(value.__func__, "__code__", None) and value.__func__.__code__.co_filename or ""):
            keep("code", _code_print(value))
        _reach(then("__self__"), value.__self__, Uses(), names, depth + 1, out)
        return
    if isinstance(value, functools.partial):
        for part in ("func", "args", "keywords"):
            _reach(then(part), getattr(value, part), Uses(), names, depth + 1, out)
        return
    if isinstance(value, type):
        if is_user_class(value):
            _reach_class(at, value, wanted, names, depth, out)
        return
    if is_immutable_constant(value) or (type(value) in PLAIN_MUTABLE and holds_constants(value)):
        keep("value", copy_constant(value))
        return
    if isinstance(value, dict) and type(value) is not dict and holds_constants(dict(value)):
        keep("dict", copy_constant(dict(value)))  # an EasyDict, an AttrDict made of a dict
        if not hasattr(value, "__dict__"):
            return
        # and its instance attributes, as a user object's (below)
    elif isinstance(value, (dict, list, tuple)) and len(value) <= _MAX_ITEMS:
        keep("len", len(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in list(items):
            if not isinstance(value, dict) or (
                is_immutable_constant(key) and (not isinstance(key, str) or uses.bare or key in names)
            ):
                _reach(then(("[]", key)), item, Uses(), names, depth + 1, out)
        return
    if isinstance(value, torch.nn.Module) or is_namespace(value) or (
        hasattr(value, "__dict__") and is_user_class(type(value))
    ):
        try:
            held = dict(vars(value))
        except TypeError:
            return
        module = isinstance(value, torch.nn.Module)
        if module:
            held.update(value._modules)
        # A config object's every setting, not only the names the code reads: a property or
        # its own __getattr__ serves those from others (``self._g``, ``self._d[name]``)
        for attr in sorted(wanted | (set() if module else held.keys())):
            if attr[:2] == "__":
                continue
            if attr in held:
                _reach(then(attr), held[attr], uses.of(attr) if attr in wanted else Uses(), names, depth + 1, out)
            elif not module and _static_attr(type(value), attr) is _NOTHING:
                # ``getattr(cfg, "margin", 1.0)``: a setting the user may add later
                out.setdefault((at.module, at.name, id(at.cell), at.chain + (attr,), "value"),
                               dataclasses.replace(then(attr), kind="value", value=MISSING))
        if is_user_class(type(value)):
            _reach_class(at, type(value), wanted - held.keys(), names, depth, out)
        return
    slots = slot_values(value)
    if slots is not None:  # a ``__slots__`` config object: every slot
        for attr, v in slots.items():
            _reach(then(attr), v, Uses(), names, depth + 1, out)
        _reach_class(at, type(value), wanted - slots.keys(), names, depth, out)
        return
    snapshot = state_snapshot(value)
    if snapshot is not None:  # os.environ, a ContextVar, a numpy array
        keep("state", snapshot)


def _reach_class(at: BackwardRead, cls: type, wanted: set[str], names: set[str], depth: int, out: dict) -> None:
    """A user class's own attributes the code reads (``cls.scale``, a hook ``Q.quant``),
    also through an instance (found by the same static lookup, unless the instance
    shadows them later: a change too)."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if not is_user_class(klass):
            continue
        for name, value in list(vars(klass).items()):
            if name in seen or name not in wanted or name[:2] == "__" or name.startswith(("_dynamo", "_abc")):
                continue
            seen.add(name)
            step = dataclasses.replace(at, chain=at.chain + (name,))
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                value = value.fget
            if isinstance(value, types.FunctionType):
                out.setdefault((at.module, at.name, id(at.cell), step.chain, "code"),
                               dataclasses.replace(step, kind="code", value=_code_print(value)))
            elif not hasattr(type(value), "__get__") or isinstance(value, type):
                _reach(step, value, Uses(), names, depth + 1, out)


def copy_constant(value: Any) -> Any:
    """A copy of a constant a check compares with later (a list of floats is mutated in place)."""
    import copy

    from .values import PLAIN_MUTABLE

    return copy.deepcopy(value) if isinstance(value, PLAIN_MUTABLE) else value
