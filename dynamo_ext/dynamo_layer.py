"""Dynamo layer: Dynamo sees the reads and writes ``__torch_dispatch__`` makes.

Compile-time half of the primary path; the run-time half is Dynamo's own residual
bytecode (nothing of ours runs per call).  Upstream request: pytorch #130028.

1. Around Dynamo's fake propagation of each op (``_get_fake_value_impl``), the
   objects the op can reach are tracked in the frame's capture scope: subclass graph
   inputs (and parameters Dynamo installs as ``get_attr``), subclasses nested in their
   flatten lists, registered state objects reachable from them, and subclass
   intermediates of the graph.
2. Reads of state are answered from the real object and become assumptions of the
   compiled code (See Note [Reads are answered from the real object] in capture.py):
   ints, floats and bools go through Dynamo's own ``VariableBuilder`` on the
   attribute's source, so they are guarded, or become symbolic inputs when Dynamo's
   automatic dynamic shapes says so; other constants are guarded by value; tensors
   become graph inputs.  A ``seed_attr`` node hands graph values to AOTAutograd's passes.
3. Each write is recorded with Dynamo's ``SideEffects.store_attr`` right after the
   op, so later user code reads the new value and the residual bytecode replays it
   after the graph (``STORE_ATTR``), exactly like a user-level ``x.attr = v``.  A
   tensor or symbolic value is read off the traced object by a ``read_attr`` node,
   which makes it a graph output.
4. Before the graph is compiled (``OutputGraph.compile_subgraph``) every tracked
   object is restored to its entry state, so guards, shape-guard production and
   AOTAutograd never see trace-time state; what was recorded is handed to the
   AOTAutograd layer (``handoff.DynamoRecord``).
"""

from __future__ import annotations

import collections.abc
import contextlib
import contextvars
import copy
import dataclasses
import functools
import io
import logging
import math
import operator
import os
import re
import sys
import threading
import types
import weakref
from typing import Any, Callable, Iterator, NoReturn

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import PendingUnbackedSymbolNotFound

from . import capture, config, free_state, guards, handoff
from .capture import Scope, Tracked, Write
from .errors import RefusalKind, SubclassWriteError, refuse
from .values import (
    GRAPH_VALUE,
    MISSING,
    PLAIN_MUTABLE,
    SYMBOLIC_TYPES,
    ValueKind,
    classify,
    contains_symbolic,
    contains_tensor,
    is_torch_internal,
    is_code_object,
    is_immutable_constant,
    refusal_for,
    symbolic_constant,
    trace_copy,
)

log = logging.getLogger(__name__)

_STATE_KEY = "_dynamo_ext_frame_state"
# storages of plain tensors the compiled function changed in place (See Note [An inner tensor
# the compiled function changes in place])
_PROGRAM_CHANGED_KEY = "_dynamo_ext_program_changed"


@dataclasses.dataclass
class Ref:
    """Where the Dynamo layer finds a tracked object: its variable (for ``store_attr``),
    its source (for guards and replay), and the graph node plus path that reach it
    (for ``seed_attr`` / ``read_attr`` nodes)."""

    vt: Any
    source: Any
    node: torch.fx.Node
    path: capture.Path = ()


# --------------------------------------------------------------------------- #
# Per-frame state (one per OutputGraph)
# --------------------------------------------------------------------------- #


class FrameState:
    """The frame's capture scope and what the Dynamo layer did with it."""

    def __init__(self, tx: Any) -> None:
        self.tx = tx
        self.scope = Scope(answer=self._answer, label="dynamo")
        self.scope.untracked_version = self._untracked_version
        self.scope.changed_in_place = {}
        self.record = handoff.DynamoRecord()
        self.collector = free_state.Collector(_OP_BOUNDARY)  # user code that ran in dispatch
        # Ints read by dispatch that became symbolic inputs: their symbols, and those a
        # subclass input carries in its flatten ctx (See Note [Symbolic ints in a flatten ctx])
        self.symbols: set[Any] = set()
        self.symbolic_ctx: dict[int, dict[str, Any]] = {}
        self.watch = free_state.ModuleWatch()  # module globals dispatch must leave alone
        self.watch.stored_names = self.collector.stored  # the names dispatch code sets, as found
        self._inference_guarded = False  # See Note [Inference mode while traced]
        self._torch_flags_guarded: set[str] = set()  # See Note [torch's global flags dispatch reads]
        self.tensor_reads: dict[str, None] = {}  # real tensors dispatch code reaches outside the tensors
        # those tensors by identity (See Note [A tensor dispatch reaches that the graph takes in])
        self.reached_tensors: dict[int, tuple[str, torch.Tensor]] = {}
        self._through_subclass = 0  # guarding what a subclass instance dispatch reaches holds
        # (object, attribute) written by residual bytecode -> the value's variable stored
        self.stored: dict[tuple[int, str], Any] = {}
        # (id(variable), name) -> (variable, value's variable): the writes in Dynamo's side
        # effects that dispatch made, and those of the program's own code already seen (See
        # Note [A write the program makes between two ops])
        self._ours: dict[tuple[int, str], tuple[Any, Any]] = {}
        self._seen_writes: dict[tuple[int, str], tuple[Any, Any]] = {}
        # what dispatch read through globals and closure variables, to check before each op
        # (See Note [A write the program makes between two ops])
        self._free_globals: list[free_state.FreeRead] = []
        self._free_values: dict[int, tuple[str, str, Any]] = {}
        # code an attribute of a tracked object holds, to guard as reached (See Note [Code an
        # attribute holds])
        self._held_code: list[tuple[Any, Any, str, str]] = []
        self._followed_code: dict[int, Any] = {}  # id -> the code value followed (kept alive)
        # the sources of attributes dispatch wrote on objects the frame has sources for (See
        # Note [Values read before dispatch wrote them])
        self.written_sources: set[Any] = set()
        self.scope.on_access = self._on_access
        self.scope.on_pending = self._refuse_program_write
        #: whether traced code touched a tracked object since last cleared (See Note
        #: [Dispatch an op runs on tensors it is not given])
        self.touched = False
        self._node: torch.fx.Node | None = None  # the op being propagated
        self._by_fake: dict[int, Any] = {}
        self._inputs_seen: set[Any] = set()
        self._by_fake_new: dict[int, Any] = {}
        self._tracked_seen: set[Any] = set()
        # objects reached from a graph input through attributes that dispatch wrote on:
        # (their variable, the names) (See Note [Writes on an object its holder rebinds])
        self.nested_writes: dict[int, tuple[Any, set[str], list[bool]]] = {}
        # ints read from the ctx of a class with its own __metadata_guard__: (source, value)
        self.custom_ctx_reads: list[tuple[Any, int]] = []

    def _on_access(self, frame: Any, cls: type) -> None:
        self.touched = True
        self.collector.on_access(frame, cls)

    @staticmethod
    def _new_items(d: dict, seen: set) -> list:
        """The items of ``d`` added since the last call (dicts keep insertion order, so
        they are at the end): per op this costs the new entries, not the whole dict."""
        new = []
        for key, value in reversed(d.items()):
            if key in seen:
                break
            new.append((key, value))
        seen.update(k for k, _ in new)
        return new[::-1]

    def input_vt(self, fake: Any) -> Any:
        from torch._dynamo.variables import TensorVariable

        for _, vt in self._new_items(self.tx.output.input_source_to_var, self._inputs_seen):
            if isinstance(vt, TensorVariable):
                ev = vt.proxy.node.meta.get("example_value")
                if ev is not None:
                    self._by_fake.setdefault(id(ev), vt)
        return self._by_fake.get(id(fake))

    def intermediate_vt(self, fake: Any) -> Any:
        """The variable of a tensor the graph computed, if Dynamo tracks it for attribute
        writes (``handle_traced_output`` tracks new tensors as ``AttributeMutationNew``)."""
        from torch._dynamo.variables import TensorVariable

        side_effects = self.tx.output.side_effects
        for _, vt in self._new_items(side_effects.id_to_variable, self._tracked_seen):
            if isinstance(vt, TensorVariable) and side_effects.is_attribute_mutation(vt) and vt.source is None:
                ev = vt.proxy.node.meta.get("example_value")
                if ev is not None:
                    self._by_fake_new[id(ev)] = vt
        return self._by_fake_new.get(id(fake))

    def close(self) -> None:
        self.scope.restore()

    def write_nested_on_entry_objects(self) -> None:
        """Note [Writes on an object its holder rebinds]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        Dispatch may write on an object it reaches through an attribute (``x.a.hits``) and then
        rebind the attribute (``x.a = new``): in eager the write stays on the object ``x.a``
        was. The residual bytecode would load ``x.a`` again after the graph, when it may be
        the new object (under backend="eager" the graph runs dispatch, which rebinds it). The
        object is loaded before the graph runs, and those writes are replayed on it. That
        holds for an object reached through a path dispatch took from an input (a nested
        subclass) and for one whose own source runs through an attribute (``L['x'].a``, an
        attribute outside the flatten list; a fuzz find: the new ``a`` got the old one's
        count under backend="eager"); the latter only where the frame rebinds an attribute on
        that source's way (its other writes stay as they were)."""
        from torch._dynamo.codegen import PyCodegen
        from torch._dynamo.source import LocalSource
        from torch._dynamo.variables.base import AttributeMutationExisting

        output = self.tx.output
        mutations = output.side_effects.store_attr_mutations
        rebound = {
            f"{vt.source.name}.{name}" for vt, attrs in mutations.items() if getattr(vt, "source", None) is not None
            for name in attrs
        }
        for vt, names, always in self.nested_writes.values():
            if not always[0] and not rebound.intersection(_attributes_on_the_way(vt.source)):
                continue
            pending = mutations.get(vt, {})
            moved = [name for name in pending if name in names]
            if not moved:
                continue
            local = output.new_var("dynamo_ext_entry")
            cg = PyCodegen(output.root_tx)
            cg(vt.source)
            cg.store(local)
            output.pregraph_bytecode.extend(cg.get_instructions())
            entry = _FromSource(source=LocalSource(local), mutation_type=AttributeMutationExisting())
            # replayed are the variables in this table (keyed by their object's id; the
            # entry object has the variable of its holder's attribute there already)
            output.side_effects.id_to_variable[id(entry)] = entry
            output.side_effects.keepalive.append(entry)
            try:
                entry.value_type = vt.python_type()
            except NotImplementedError:
                pass
            for name in moved:
                output.side_effects.store_attr(entry, name, pending.pop(name))
            if not pending:
                del mutations[vt]
        self.nested_writes.clear()

    def entry_values(self, tx: Any) -> tuple[list[Any], dict[Any, Any]]:
        """Note [Values read before dispatch wrote them]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        User code that read ``s = x.step`` before an op whose dispatch bumps it, and returns
        or keeps ``s``, holds a variable whose source is ``x.step``: Dynamo's codegen loads it
        from there after the graph ran. Under a backend that runs the graph as it is
        (``backend="eager"``) dispatch ran for real by then and ``s`` would be the bumped value
        (stock too). Each such source is loaded into a local before the graph runs, and the
        codegen loads it from there (``overridden_sources``, as Dynamo does for stolen lists).
        Returns the instructions and the overrides."""
        from torch._dynamo.codegen import PyCodegen
        from torch._dynamo.source import AttrSource, LocalSource
        from torch._dynamo.variables.base import VariableTracker

        if not self.written_sources:
            return [], {}
        output = self.tx.output
        found: dict[Any, None] = {}
        written = set(self.written_sources)
        for obj_id, name in self.stored:
            # an object dispatch wrote on that the program reached another way (a registered
            # ctx-state object through a global or closure: ``c0 = STATS.count`` before the op)
            held = output.side_effects.id_to_variable.get(obj_id)
            if getattr(held, "source", None) is not None:
                written.add(AttrSource(held.source, name))

        def visit(vt: Any) -> None:
            source = getattr(vt, "source", None)
            if source is not None and source in written:
                found[source] = None

        stored = [v for names in output.side_effects.store_attr_mutations.values() for v in names.values()]
        frames, frame = [], tx
        while frame is not None:
            frames.append(frame)
            frame = getattr(frame, "parent", None)
        roots = [v for f in frames for v in (*f.stack, *f.symbolic_locals.values())]
        VariableTracker.visit(visit, [*roots, *stored])
        instructions: list[Any] = []
        overrides: dict[Any, Any] = {}
        for source in found:
            local = output.new_var("dynamo_ext_read")
            cg = PyCodegen(output.root_tx)
            cg(source)
            cg.store(local)
            instructions.extend(cg.get_instructions())
            overrides[source] = LocalSource(local)
        return instructions, overrides

    # -- tracking -----------------------------------------------------------

    def track_arg(self, node: torch.fx.Node) -> Tracked | None:
        """Track the subclass (or parameter) an argument node stands for."""
        fake = node.meta.get("example_value")
        t = self.scope.lookup(fake)
        if t is not None:
            return t
        output = self.tx.output
        if node.op == "get_attr":  # a parameter/buffer Dynamo installed as a graph attribute
            real = output.nn_modules.get(node.target)
            source = (output.param_name_to_source or {}).get(node.target)
            if real is None or source is None:
                return None
            vt = output.side_effects.id_to_variable.get(id(real))
            return self._track_real(fake, real, Ref(vt, source, node))
        vt = self.input_vt(fake)
        if vt is not None and vt.source is not None and "grapharg" in vt.proxy.node.meta:
            real = vt.proxy.node.meta["grapharg"].example
            return self._track_real(fake, real, Ref(vt, vt.source, vt.proxy.node))
        vt = self.intermediate_vt(fake)
        if vt is not None:
            t = self.scope.track(fake, None, Ref(vt, None, vt.proxy.node))
            t.on_read = self._read_on_made
            return t
        return None

    def _read_on_made(self, t: Tracked, name: Any) -> None:
        """Note [A read of what the program set on a tensor it made]: code of the compiled
        function set an attribute on a subclass it made (``w = F8(...); w.step = 0``, ``y =
        x @ w; y.tag = 1``) and dispatch reads it: Dynamo holds the write pending, the trace
        tensor lacks it, and the op would read it absent (an outside tester's find: the
        count eager makes on it was lost, stock alike). Refused, as for an input
        (``unsupported_state_read``)."""
        asked = None if name is capture.KEYS else name if isinstance(name, str) else MISSING
        if asked is MISSING:
            return
        self._refuse_pending(t, t.obj, t.data, asked, "on this tensor, which it made, ")

    # Note [A plain argument's version counter]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Dispatch reading ``scale._version`` of a plain tensor it is handed reads the real counter
    # (guarded) plus the in-place changes the frame made to it so far. Those are counted from
    # the frame's start, when Dynamo made the fake at 0, not from when dispatch was first handed
    # the tensor: ``s.add_(1); w * s`` read one less than eager (an outside tester's find). A
    # fake Dynamo makes later as a view of an input it changed shares that input's counter, as
    # the real view does. AOTAutograd's passes read their functional tensor's own counter, from
    # 0: an input Dynamo's pass handed to an op of a subclass is tracked there too, and its
    # counter answered from the real one alike (a cache keyed on it went stale on aot_eager).
    # A view of an input the function changed keeps its own functional counter there: the passes
    # disagree and the program is refused (``inconsistent_passes``).
    # AOTAutograd counts a change its graph makes to an input twice (torch's own write-back);
    # a read in the next call sees that count, as the user's own code does.

    def track_plain_arg(self, node: torch.fx.Node) -> None:
        """A plain tensor an op on a subclass is given (a graph input, or a tensor the graph
        computed): dispatch may write on it too (``x.seen_by = w.n``), a write to replay."""
        fake = node.meta.get("example_value")
        if not isinstance(fake, torch.Tensor) or self.scope.lookup(fake) is not None:
            return
        vt = self.input_vt(fake)
        if vt is not None and vt.source is not None and "grapharg" in vt.proxy.node.meta:
            real = vt.proxy.node.meta["grapharg"].example
            if isinstance(real, torch.Tensor):
                self._track_plain_input(fake, real, Ref(vt, vt.source, vt.proxy.node))
            return
        vt = self.intermediate_vt(fake)
        if vt is not None:  # a tensor the graph computed: the caller may receive it
            self.scope.track(fake, None, Ref(vt, None, vt.proxy.node), plain_inner=True)
        return None

    def _track_plain_input(self, fake: Any, real: torch.Tensor, ref: Ref) -> None:
        """Track a plain graph input with the real tensor it stands for: its ``_version``
        counted from the frame's start (See Note [A plain argument's version counter]), and
        tracked in AOTAutograd's passes too (``record.sources``)."""
        self.scope.track(fake, real, ref, plain_inner=True).entry_version = 0
        self.record.sources[id(real)] = ref.source

    # Note [A version counter no real tensor answers]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # ``_version`` of a tensor the compiled function made is its fake's count, which is eager's
    # for a tensor of its own. A view of an input (``s[0]``, ``tokens[:, :L]``, ``w.elem[0:4]``,
    # a ``detach()``) shares the input's counter in eager, moved on by the caller's in-place
    # updates between calls; its fake counted from 0 and a cache keyed on it was never rebuilt
    # on aot_eager, the outputs stale (an outside tester's find). Such a read, of a tensor on
    # the storage of a graph input or of a tensor a real one stands behind, is refused. A plain
    # tensor the real object holds outside its flatten list, lifted as a graph input of its own
    # (``w.side``, a registered state object's buffer), is tracked with that real tensor: its
    # read is answered from it and guarded, in AOTAutograd's passes too.

    def _untracked_version(self, obj: Any) -> None:
        key = capture.storage_key(obj)
        if key is None:
            return
        inputs: list[Any] = [t.obj for t in self.scope.tracked.values() if t.real is not None and t.obj is not obj]
        for node in self.tx.output.graph.find_nodes(op="placeholder"):
            example = node.meta.get("example_value")
            if isinstance(example, torch.Tensor):
                inputs.append(example)
                names = capture._flatten_names(example) if type(example) is not torch.Tensor else ()
                inputs.extend(getattr(example, n, None) for n in names)
        if any(isinstance(i, torch.Tensor) and i is not obj and capture.storage_key(i) == key for i in inputs):
            reader = capture.dispatching_class()
            blamed = next((t for t in self.scope.tracked.values() if type(t.obj) is reader), None)
            if blamed is None:
                blamed = _first_subclass(self, self._node) if self._node is not None else next(iter(self.scope.tracked.values()))
            _refuse(
                RefusalKind.UNSUPPORTED_STATE_READ, blamed, "_version", "int",
                "dispatch reads the version counter of a tensor on the storage of a graph input (a view "
                "of it the compiled function made): eager's counter is the input's, moved on by in-place "
                "updates between calls, which the traced one does not count",
                hint="Key the cache on the input itself (hand the whole tensor to the op), or let the op "
                "run eagerly (fullgraph=False graph-breaks there).",
            )

    def _track_real(self, fake: Any, real: Any, ref: Ref) -> Tracked:
        """Track a traced object standing for ``real``, with what it reaches: subclasses
        nested in its flatten list, registered state objects reachable from it."""
        from torch._dynamo.source import AttrSource, GetItemSource
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        t = self.scope.track(fake, real, ref)
        capture.restore_aliases(t)
        self.record.sources[id(real)] = ref.source
        if real is not fake:
            # Dispatch given the traced object can still reach the real one (``ALL[self.idx]``,
            # a registry of weights, a weakref): a write there lands on it at trace time, on
            # top of the compiled call's (an outside tester's find: a count bumped twice, or
            # four times on aot_eager). Such a write is refused and undone.
            self.watch.add_object(
                ref.source.name if ref.source is not None else type(real).__name__, real,
                "set on the real object while traced (dispatch reached it around the traced one)",
            )
        self.watch.add(type(real).__module__)
        for name in capture._flatten_names(real):  # in flatten order: elem before a cache aliasing it
            inner_fake, inner_real = getattr(fake, name, None), getattr(real, name, None)
            if not isinstance(inner_fake, torch.Tensor) or not isinstance(inner_real, torch.Tensor):
                continue
            source = AttrSource(ref.source, name)
            vt = self.tx.output.input_source_to_var.get(source)
            inner_ref = Ref(vt, source, ref.node, ref.path + (("attr", name),))
            if is_traceable_wrapper_subclass(inner_fake) and is_traceable_wrapper_subclass(inner_real):
                self._track_real(inner_fake, inner_real, inner_ref)
            elif self.scope.lookup(inner_fake) is None:
                self.scope.track(inner_fake, inner_real, inner_ref, plain_inner=True)
                self.record.sources[id(inner_real)] = source
        for path, obj in capture.find_state(real):
            if self.scope.lookup(obj) is None:
                source = ref.source
                for kind, key in path:
                    source = AttrSource(source, key) if kind == "attr" else GetItemSource(source, key)
                self.scope.track(obj, obj, Ref(None, source, ref.node, ref.path + path))
        return t

    def _refuse_pending(self, t: Tracked, value: Any, ref: Ref | None, asked: str | None, on: str) -> None:
        """Refuse a read (``asked``; None: the whole dict) of an attribute the compiled
        function set on ``value`` before this op, which Dynamo holds pending."""
        changed = self._written_by_program(value, ref, t)
        if asked is not None and asked not in changed and value is not None:
            # a container or object the attribute holds, changed by the program's code
            # (``x.hooks.append(h)``, ``x.cfg["scale"] = k``, then the op)
            held = capture.obj_dict(value).get(asked, MISSING)
            if held is not MISSING and self._changed_by_program(held):
                changed = changed | {asked}
        if changed and (asked is None or asked in changed):
            _refuse(
                RefusalKind.UNSUPPORTED_STATE_READ, t, asked or sorted(changed)[0], "pending write",
                f"the compiled function set it {on}before this op; while traced the op would read "
                "the value from before the call",
                hint="Set the attribute outside the compiled function, or let the op run "
                "eagerly (fullgraph=False graph-breaks there).",
            )

    # -- answering reads ----------------------------------------------------

    def _answer(self, scope: Scope, t: Tracked, name: str) -> Any:
        """See Note [Reads are answered from the real object] (capture.py)."""
        ref: Ref | None = t.data
        real = t.real
        if ref is not None:
            asked = None if name is capture.KEYS else name.name if isinstance(name, capture.Unshadowed) else name
            # ``w.scale = s; w @ x``: while traced the op would see the value from before the
            # call (Dynamo applies the user's write after the graph)
            self._refuse_pending(t, real, ref, asked, "")
        if name is capture.KEYS:
            if ref is not None and ref.source is not None:
                guards.keys(ref.source)
            return None
        if isinstance(name, capture.Unshadowed):
            if ref is not None and ref.source is not None:
                guards.absent(ref.source, name.name)
            return None
        if name == "_version":
            version = real._version
            if ref is not None and ref.source is not None:
                guards.version(ref.source, version)
            return version + capture.version_delta(t)
        if name in capture.TENSOR_STATE_READS:
            return self._answer_autograd_state(t, ref, real, name)
        held = t.traced_counterpart(name)
        if held is not MISSING:
            t.settled.add(name)
            return held
        value, origin = capture.eager_lookup(real, name)
        if origin == "absent":
            if ref is not None and ref.source is not None:
                # ``getattr(cfg, "margin", 1)``: an attribute the user may add later
                guards.absent(ref.source, name)
            t.set_answer(name, MISSING)
            raise AttributeError(f"{t.cls_name!r} object has no attribute {name!r}")
        if ref is None or ref.source is None:  # not reachable from a graph input
            from torch._subclasses.fake_tensor import is_fake

            if isinstance(value, torch.Tensor) and not is_fake(value) and not t.born:
                # A real tensor on a shared object no input reaches (a pending mask in a
                # MaskBuffer DTensor's sharding cache shares with eager): the trace cannot
                # use it and no guard covers it.
                _refuse_read(t, name, value, "a real tensor held by a shared state object no graph input reaches")
            t.settled.add(name)
            return value
        from torch._dynamo.source import AttrSource

        source = AttrSource(ref.source, name)
        if isinstance(value, torch.Tensor):
            if t.shared:
                raise _NeedsSeed(t, name)
            for inner in t.flatten_names:  # an alias of an inner tensor: the traced one
                if getattr(real, inner, None) is value:
                    # guarded as an alias (``w.cache is w.elem``): a cache the user clears or
                    # fills with another tensor is another program (an outside tester found
                    # the graph reused, with elem, silently)
                    guards.lambda_(
                        ref.source,
                        lambda obj, name=name, inner=inner: capture.eager_lookup(obj, name)[0] is getattr(obj, inner, None),
                        f".{name} is .{inner}",
                    )
                    answer = getattr(t.obj, inner)
                    t.set_answer(name, answer)
                    return answer
            raise _NeedsSeed(t, name)
        if capture.is_registered(value):
            guards.guard(source, "ID_MATCH")
            t.settled.add(name)
            if scope.lookup(value) is None:
                scope.track(value, value, Ref(None, source, ref.node, ref.path + (("attr", name),)))
            return value
        if type(value) is int and not self._in_hop():
            answer = self._build_scalar(t, ref, name, source, value)
        elif is_immutable_constant(value):
            guards.constant(source, value)
            answer = value
        elif is_code_object(value):
            guards.guard(source, "ID_MATCH")
            answer = value
            self._follow_held_code(source, value, t, name)
        elif isinstance(value, PLAIN_MUTABLE) and not contains_tensor(value):
            guards.constant(source, value)
            answer = trace_copy(value)
        else:
            _refuse_read(t, name, value)
        if t.shared:
            t.settled.add(name)
            return value if answer is value else answer
        t.set_answer(name, answer)
        return answer

    def _answer_autograd_state(self, t: Tracked, ref: Ref | None, real: Any, name: str) -> Any:
        """Note [Autograd state dispatch reads]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        (Where it lies in its storage, and the storage's size: _answer_storage_read.)
        A tensor's gradient, a view's base, its hooks and whether it retains its gradient are
        not the trace stand-in's to know, and no Dynamo guard covers them: dispatch recording
        ``self.had_grad = self.grad is not None`` (or ``self.elem._base is not None``,
        ``bool(self.elem._backward_hooks)``) was replayed as traced after the user set a
        gradient, made the inner tensor a view of a flat buffer or registered a hook, on the
        input or an inner tensor (outside testers' finds). Read by dispatch, each is answered
        from the real tensor: the absence of a gradient, base, hooks or a retained gradient is
        guarded; a gradient tensor, a base, a hook or a retained gradient is state the trace
        cannot hold (AOTAutograd's passes read the stand-in's), and is refused
        (``unsupported_state_read``; ``fullgraph=False`` runs the op eagerly)."""
        if ref is None or ref.source is None:
            _refuse_read(t, name, real, "dispatch reads the autograd state of a tensor no graph input reaches")
        if name in capture.STORAGE_READS:
            return self._answer_storage_read(t, ref, real, name)
        if name == "retains_grad":
            # the stand-in retains none, in AOTAutograd's passes too: False guarded, True refused
            if real.retains_grad:
                _refuse_read(t, name, True, "dispatch reads .retains_grad of a traced tensor that retains its gradient")
            guards.lambda_(ref.source, lambda obj: not obj.retains_grad, ".retains_grad is False")
            return False
        attr = "_base" if name == "_is_view" else name
        # a gradient read without torch's warning for a tensor that is no leaf (checked at
        # every call)
        read = free_state.grad_of if attr == "grad" else operator.attrgetter(attr)
        held = read(real)
        if held is not None:
            _refuse_read(
                t, name, held, f"dispatch reads .{attr} of a traced tensor, which holds state the trace cannot "
                "(its stand-in holds none)",
            )
        guards.lambda_(ref.source, lambda obj: read(obj) is None, f".{attr} is None")
        if name == "_is_view":
            return lambda: False
        return None

    def _answer_storage_read(self, t: Tracked, ref: Ref, real: Any, name: str) -> Any:
        """A tensor's ``storage_offset()`` and its storage's size (``untyped_storage().nbytes()``)
        read by dispatch: the stand-in mirrors the real tensor's at compile time, and no Dynamo
        guard covers them: a sharding wrapper handed another shard of one flat buffer, or an inner
        tensor whose storage the user resized (FSDP's free and reallocate), had the first call's
        answer replayed (an outside tester's find). Guarded on the real tensor's value (a
        compile per value); a symbolic offset Dynamo made is carried as it is."""
        method = capture.stand_in_attribute(t.obj, name)
        if name == "storage_offset":
            offset = real.storage_offset()
            if type(method()) is int:
                guards.lambda_(ref.source, lambda obj: obj.storage_offset() == offset, f".storage_offset() == {offset}")
        else:
            size = real.untyped_storage().nbytes()
            traced = capture.stand_in_attribute(t.obj, "untyped_storage")().nbytes()
            if traced != size:  # torch 2.13 fakes a resized storage at the tensor's extent
                _refuse_read(
                    t, name, size, f"the trace stand-in's storage holds {traced} bytes where the real tensor's "
                    f"holds {size}: the op would be traced with another storage size than eager's",
                )
            guards.lambda_(ref.source, lambda obj: obj.untyped_storage().nbytes() == size, f".untyped_storage().nbytes() == {size}")
        return method

    def _follow_held_code(self, source: Any, value: Any, t: Tracked, name: str) -> None:
        """Note [Code an attribute holds]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        Dispatch calls a function, method or class an attribute holds (``w.get_scale =
        lambda: box["v"]``, a config object's bound method, ``w.scheme = Scheme`` read for
        ``Scheme.SCALE``): what that code reads was found by no static walk from the class's
        code, which follows globals and closures only, and stayed baked into the compiled
        program, silently, under every backend (an outside tester's find; stock fails
        loudly). Guarded by identity alone before; now the code is followed as code a global
        names (its globals, closure cells and defaults, a method's owner, a class's state)
        and guarded. Found while the op runs, before the code does: the op runs again from
        the start, with what the code may change (a closure cell it bumps, a global list it
        appends to) under the watch, which puts it back and refuses the op."""
        if isinstance(value, (types.BuiltinFunctionType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return
        if id(value) in self._followed_code:
            return
        self._followed_code[id(value)] = value
        self.collector.follow_held(value)
        self._held_code.append((source, value, t.cls_name, name))
        raise _NeedsWatch()

    def _in_hop(self) -> bool:
        return self.tx.output.current_tracer.parent is not None

    def _build_scalar(self, t: Tracked, ref: Ref, name: str, source: Any, value: Any) -> Any:
        """An int through Dynamo's own VariableBuilder: guarded like a user attribute read,
        or a symbolic graph input (automatic dynamic, ``specialize_int=False``).
        Floats and bools stay guarded constants: an unspecialized float reaches dispatch as
        ``item()`` of a tensor input, a data-dependent value fake propagation cannot use."""
        from torch._dynamo.variables import ConstantVariable, SymNodeVariable
        from torch._dynamo.variables.builder import VariableBuilder
        from torch._dynamo.variables.lazy import LazyVariableTracker

        if not free_state.is_user_class(type(t.obj)) or ref.node is None:
            # torch's own subclasses (NestedTensor, DTensor) hash and compare their ints:
            # they stay guarded constants, as Dynamo keeps their ctx. So do the ints of
            # an object dispatch reached through a global (no graph input holds it), as
            # Dynamo specializes the ints of globals.
            guards.constant(source, value)
            return value
        reader = _reading_frame()
        if reader is not None and free_state.tells_int_from_symint(reader.f_code, reader.f_globals, name):
            # See Note [An int dispatch code could tell from a symbolic one] (free_state.py)
            guards.constant(source, value)
            return value
        # wrap_symint, not the builder's int path: that one assumes ints of nn.Modules and
        # of globals are configuration and always specializes them, while this int is
        # state on a tensor (a parameter's step counter) that changes every call.
        # specialize_int, automatic_dynamic_shapes and the dynamic-source lists still apply.
        in_ctx = not t.shared and _in_flatten_ctx(t.real, name)
        if in_ctx and "__metadata_guard__" in _class_dicts(type(t.real)):
            # The class guards its ctx itself (Dynamo calls its __metadata_guard__ with the
            # traced and the new ctx): the int is its business, as in stock torch.compile,
            # unless dispatch writes in this frame (a written value may come from it: then it
            # is guarded by value, at the end of the trace).
            self.custom_ctx_reads.append((source, value))
            return value
        if in_ctx:
            # An int in the flatten ctx is specialized on the first compile, as Dynamo keeps a
            # subclass's ctx, also under dynamic=True; it becomes symbolic once it changes
            # (automatic dynamic: a counter compiles twice). See Note [Symbolic ints in a
            # flatten ctx].
            with torch._dynamo.config.patch(assume_static_by_default=True):
                vt = LazyVariableTracker.realize_all(VariableBuilder(self.tx, source).wrap_symint(value))
        else:
            vt = LazyVariableTracker.realize_all(VariableBuilder(self.tx, source).wrap_symint(value))
        if isinstance(vt, ConstantVariable):
            return value
        if isinstance(vt, SymNodeVariable):
            self._insert_seed(ref, name, vt.as_proxy().node)
            symbol = vt.sym_num
            self.symbols |= symbol.node.expr.free_symbols
            if in_ctx:
                # See Note [Symbolic ints in a flatten ctx]
                self.symbolic_ctx.setdefault(id(t.real), {})[name] = symbol
            return symbol
        # Anything else (an unspecialized float Dynamo carries as a tensor): guard by value.
        guards.constant(source, value)
        return value

    def _insert_seed(self, ref: Ref, name: str, value: Any) -> None:
        assert self._node is not None
        if isinstance(value, torch.fx.Node):
            _move_before(self._node, value)
        with self._node.graph.inserting_before(self._node):
            seed = self._node.graph.call_function(handoff.seed_attr, (ref.node, ref.path, name, value))
        seed.meta["example_value"] = None
        handoff.cacheable(seed)

    def seed_tensor(self, t: Tracked, name: str) -> None:
        """Make the real object's tensor ``name`` a graph input and hand it to the traced object."""
        from torch._dynamo.source import AttrSource
        from torch._dynamo.variables.builder import VariableBuilder
        from torch._dynamo.variables.lazy import LazyVariableTracker
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        ref: Ref = t.data
        value, _ = capture.eager_lookup(t.real, name)
        if self._in_hop():
            _refuse_read(t, name, value, "tensor attribute read inside a higher-order op body")
        if ref.node is None:
            _refuse_read(t, name, value, "a tensor held by an object reached through a global or closure")
        if self._seed_as_view(t, ref, name, value):
            return
        vt = LazyVariableTracker.realize_all(VariableBuilder(self.tx, AttrSource(ref.source, name))(value))
        proxy = vt.as_proxy()
        self._insert_seed(ref, name, proxy.node)
        fake = proxy.node.meta["example_value"]
        if (
            type(value) in (torch.Tensor, torch.nn.Parameter) and isinstance(fake, torch.Tensor)
            and self.scope.lookup(fake) is None and "grapharg" in proxy.node.meta
        ):
            # See Note [A version counter no real tensor answers]: a plain tensor the real object
            # holds (``w.side``, a registered state object's buffer, a result kept from an earlier
            # call) stands for that tensor, its ``_version`` answered from it and guarded
            self._track_plain_input(fake, value, Ref(vt, vt.source, proxy.node))
        if (
            is_traceable_wrapper_subclass(fake) and is_traceable_wrapper_subclass(value)
            and self.scope.lookup(fake) is None and "grapharg" in proxy.node.meta
        ):
            # Note [State of a tensor Dynamo lifted but never tracked]: a subclass reached
            # through an attribute outside the flatten list (``w.root``) is a graph input of
            # its own, handed to no op of Dynamo's graph: tracked here, with its source, its
            # reads are answered from the real object and guarded and its writes replayed.
            self._track_real(fake, value, Ref(vt, vt.source, proxy.node))
        _hand_seeded(t, name, fake)

    def _seed_as_view(self, t: Tracked, ref: Ref, name: str, value: Any) -> bool:
        """Note [A tensor attribute that is a view of another input]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        An attribute outside the flatten list may hold a view of another tensor the graph takes
        in: of an inner tensor (``self.recent = self.hist[:1]``, ``self.row0 = self.elem[0]``)
        or of a plain input. Made a graph input of its own, it was one AOTAutograd did not know
        aliases the other: an in-place change on one side (dispatch's ``hist[0] = amax``, the
        compiled function's ``w.mul_(s)``) was not seen through the other, silently (the
        value from before it, a NaN), or AOTAutograd failed on aliased inputs that are
        mutated, under ``fullgraph=False`` too (an outside tester's finds). The graph takes it
        as a view of that tensor instead (``handoff.view_of``: the same sizes, strides and
        storage offset), so the passes see one storage; the real attribute is guarded to stay
        such a view. One of another dtype, or of a tensor with no storage, is refused. Returns
        whether it was seeded so."""
        if type(value) is not torch.Tensor and type(value) is not torch.nn.Parameter:
            return False
        key = capture.storage_key(value)
        if key is None:
            return False
        base = self._input_holding_storage(key, value)
        if base is None:
            return False
        node, inner, real_base = base
        if real_base.dtype != value.dtype or value.is_sparse:
            _refuse_read(t, name, value, "a tensor attribute aliasing another input of the graph, as another dtype")
        size, stride, offset = tuple(value.size()), tuple(value.stride()), value.storage_offset()
        with self._node.graph.inserting_before(self._node):
            view = self._node.graph.call_function(handoff.view_of, (node, inner, size, stride, offset))
        example = node.meta["example_value"]
        view.meta["example_value"] = handoff.view_of(example, inner, size, stride, offset)
        handoff.cacheable(view)
        self._insert_seed(ref, name, view)
        guards.lambda_(
            ref.source,
            lambda obj, name=name: handoff.same_view(capture.eager_lookup(obj, name)[0], size, stride, offset),
            f".{name} is a view with sizes {size}, strides {stride}, offset {offset}",
        )
        base_ref = weakref.ref(real_base)  # the guard does not keep the input alive

        def same_storage(obj: Any, name: str = name) -> bool:
            base_now = base_ref()
            return base_now is not None and capture.storage_key(capture.eager_lookup(obj, name)[0]) == capture.storage_key(base_now)

        guards.lambda_(ref.source, same_storage, f".{name} shares its storage with the graph input it was a view of")
        _hand_seeded(t, name, view.meta["example_value"])
        return True

    def _input_holding_storage(self, key: int, value: Any) -> tuple[Any, str | None, Any] | None:
        """A graph input (placeholder node, with the inner tensor's name for a subclass) other
        than ``value`` itself whose real tensor is on storage ``key``."""
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        for node in self.tx.output.graph.find_nodes(op="placeholder"):
            arg = node.meta.get("grapharg")
            try:
                real = arg.example if arg is not None else None
            except Exception:  # noqa: BLE001 - an example no longer alive: not this value's base
                continue
            if not isinstance(real, torch.Tensor) or real is value:
                continue
            if is_traceable_wrapper_subclass(real):
                for inner in real.__tensor_flatten__()[0]:
                    held = getattr(real, inner, None)
                    if (
                        isinstance(held, torch.Tensor) and not is_traceable_wrapper_subclass(held)
                        and held is not value and capture.storage_key(held) == key
                    ):
                        return node, inner, held
            elif capture.storage_key(real) == key:
                return node, None, real
        return None

    # -- globals and closure variables --------------------------------------

    def guard_free_reads(self) -> bool:
        """Guard the module globals and closure variables the user code that just ran can
        load, as Dynamo guards a user's own, and what they lead to (See Note [State dispatch
        reaches outside the tensors]). Returns True when an object among them must be
        tracked first (its attribute reads answered): the op is then run again."""
        from torch._dynamo.source import AttrSource, GlobalSource

        retry = False
        if self.collector.writes_attributes and config.dynamo_layer:
            # What dispatch writes may hang on an answer tracing changes (a class whose code
            # writes no attribute compiles as stock)
            if self.collector.type_checks:  # See Note [An exact type check on a traced tensor]
                _refuse(
                    RefusalKind.UNSUPPORTED_STATE_READ, next(iter(self.scope.tracked.values())), "type()", "type",
                    f"{', '.join(sorted(set(self.collector.type_checks)))} compares type(t) with torch.Tensor: "
                    "while traced a plain tensor is a FakeTensor or FunctionalTensor, so the check answers "
                    "otherwise than in eager (in every pass alike)",
                    hint="Test for a plain tensor with isinstance(t, torch.Tensor) and not "
                    "torch.utils._python_dispatch.is_traceable_wrapper_subclass(t).",
                )
        self._refuse_trace_state_reads()
        self._guard_inference_mode()
        held, self._held_code = self._held_code, []
        for source, value, owner, name in held:  # See Note [Code an attribute holds]
            retry |= self._guard_reached(source, value, owner, name)
        reads = list(self.collector.reads())
        stored_globals = self._stored_globals() if reads else set()
        for r in reads:
            if r.cell is None and sys.modules.get(r.module) is None:
                continue  # the namespace of generated code (a namedtuple's methods): not importable state
            if r.cell is None and (r.module, r.name) in stored_globals:
                self._refuse_changed(r.module or "", r.name, "assigned")
            if r.cell is None:
                self._free_globals.append(r)
                if not isinstance(r.value, types.ModuleType):
                    self.watch.add(r.module)
                source = AttrSource(self.tx.import_source(r.module), r.name)
            else:
                self.watch.add_cell(f"{r.code_name}.{r.name}", r.cell)
                holder = self.tx.output.install_global_by_id("__dynamo_ext_cell", r.cell)
                source = AttrSource(GlobalSource(holder), "cell_contents")
            retry |= self._guard_reached(source, r.value, r.module or f"<closure of {r.code_name}>", r.name, uses=r.uses)
        for cls in self.collector.new_classes():
            # ``cls.scale`` / ``type(w).scale`` in dispatch: the class of a tracked object
            if free_state.is_user_class(cls):
                holder = self.tx.output.install_global_by_id("__dynamo_ext_class", cls)
                retry |= self._guard_class_state(GlobalSource(holder), cls)
        self._refuse_a_reached_tensor_the_graph_takes_in()
        return retry

    def _refuse_trace_state_reads(self) -> None:
        """Note [Reads that answer otherwise while traced]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        Dispatch code of a class that writes attributes asks whether it is being traced
        (``torch.compiler.is_compiling()``, ``torch._dynamo.is_compiling()``,
        ``TracingContext.try_get()``, ``is_fake(t)``) or asks a tensor what its trace stand-in
        cannot know (``t.is_shared()``, ``t.is_inference()``, ``t.is_pinned()``): the answer
        while traced is not eager's, and a stored answer was replayed as traced, on every
        backend (an outside tester's find). Refused (``unsupported_state_read``) where the
        code names one; under ``fullgraph=False`` the op runs eagerly. A class that writes
        nothing keeps stock's behaviour (asking is what ``is_compiling`` is for)."""
        if not (self.collector.writes_attributes and config.dynamo_layer):
            return
        asked = sorted(_TRACE_STATE_NAMES & self.collector.names)
        if asked:
            _refuse(
                RefusalKind.UNSUPPORTED_STATE_READ, next(iter(self.scope.tracked.values())), f"{asked[0]}()", "bool",
                f"dispatch code asks {', '.join(asked)}, which answers otherwise while traced than in eager "
                "(the trace's stand-ins are fake, and the trace is compiling): a stored or used answer would "
                "be the trace's",
                hint="Decide outside dispatch and carry the answer in the ctx or an attribute, or let the op "
                "run eagerly (fullgraph=False graph-breaks there).",
            )

    def _refuse_a_reached_tensor_the_graph_takes_in(self) -> None:
        """Note [A tensor dispatch reaches that the graph takes in]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        Dispatch code reaches a real tensor through a global or closure (a shared weight it
        special-cases, ``args[1] is SHARED``) that the compiled function is also handed: the
        op is given the trace's stand-in for it, so an identity check, or anything else
        telling the two apart, answers otherwise than in eager, on every backend (an outside
        tester's find: the flag stored False where eager stores True). Refused
        (``unsupported_state_read``); under ``fullgraph=False`` the op runs eagerly."""
        if not self.reached_tensors:
            return
        for node in self.tx.output.graph.find_nodes(op="placeholder"):
            arg = node.meta.get("grapharg")
            example = getattr(arg, "example", None) if arg is not None else None
            if example is not None and id(example) in self.reached_tensors:
                where, value = self.reached_tensors[id(example)]
                if value is example:
                    _refuse(
                        RefusalKind.UNSUPPORTED_STATE_READ, next(iter(self.scope.tracked.values())), where, "Tensor",
                        f"dispatch code reaches {where}, a tensor the compiled function is handed too: the op "
                        "is given the trace's stand-in for it, so telling the two apart (`is`) answers otherwise "
                        "than in eager",
                        hint="Mark the tensor with an attribute (w.is_shared = True) and read that, or let the op "
                        "run eagerly (fullgraph=False graph-breaks there).",
                    )

    def _guard_inference_mode(self) -> None:
        """Note [Inference mode while traced]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        Dynamo turns ``torch.inference_mode`` off while it compiles (it is on again when the
        compiled code runs), and inside a traced ``with torch.inference_mode():`` it turns
        grad off instead. Eager under inference mode differs in two ways dispatch can see:
        ``torch.is_inference_mode_enabled()`` answers True, and, the autograd keys being
        off, composite ops reach dispatch whole (``aten.matmul``, ``aten.linear``) where
        the trace hands it their parts (``aten.mm``): a float8 weight counting its ``mm``
        calls counts where eager does not (an outside tester's find). So an op a writing
        class (or code reading the mode) takes part in is refused where eager would run it
        under inference mode: the caller's mode, or the innermost traced
        ``inference_mode`` block (an ``_enter_inference_mode`` node whose exit is not
        made yet) (``traced_ops_differ``, ``unsupported_state_read`` for the mode read;
        eager under ``fullgraph=False``); and any
        other compile is guarded on inference mode being off, so a later call under it
        (where grad mode, which Dynamo guards, may be off alike) compiles again and
        refuses (guarded on the caller's mode: an op in an ``inference_mode(False)`` block
        compiles under inference mode)."""
        reads_mode = "is_inference_mode_enabled" in self.collector.names
        if not (reads_mode or self.collector.writes_attributes):
            return
        if _eager_inference_mode(self.tx):
            hint = "Compile the function under torch.no_grad() instead, or let the op run eagerly (fullgraph=False graph-breaks there)."
            t = next(iter(self.scope.tracked.values()))
            if reads_mode:
                _refuse(
                    RefusalKind.UNSUPPORTED_STATE_READ, t, "is_inference_mode_enabled()", "bool",
                    "the call runs under torch.inference_mode, which Dynamo turns off while it traces: dispatch "
                    "would read False where eager reads True", hint=hint,
                )
            _refuse(
                RefusalKind.TRACED_OPS_DIFFER, t, "<dispatch>", "torch.inference_mode",
                "the op runs under torch.inference_mode, which Dynamo turns off while it traces: eager hands "
                "dispatch composite ops whole (aten.matmul), the trace their parts (aten.mm)", hint=hint,
            )
        if self._inference_guarded:
            return
        from torch._dynamo.source import GlobalSource

        self._inference_guarded = True
        holder = self.tx.output.install_global_by_id("__dynamo_ext_torch", torch)
        caller = CALLER_INFERENCE_MODE.get()  # True where the op is in an inference_mode(False) block
        guards.lambda_(
            GlobalSource(holder), lambda t: t.is_inference_mode_enabled() is caller, f".is_inference_mode_enabled() is {caller}"
        )

    def _guard_reached(
        self, source: Any, value: Any, owner: str, name: str, depth: int = 0, uses: free_state.Uses = free_state.Uses()
    ) -> bool:
        """Note [State dispatch reaches outside the tensors]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        Dispatch code runs while traced, where Dynamo does not see it: whatever it reads
        outside the tensors it is given would stay baked into the compiled program. What
        the code can reach through a global or closure variable (found statically,
        free_state.Collector) is guarded the way Dynamo guards a user's own: constants and
        plain containers of constants by value; functions and classes by identity, and a
        class's own data attributes the code reads (``Float8Linear.enabled``, ``cls.scale``)
        as values reached through it; a user object or a registered state object is
        tracked, so each attribute read is answered and guarded; the attributes the code
        reads off a module object, an ``nn.Module`` (``model.training``, read without
        hooking torch's module classes) or a ``SimpleNamespace``, the items of another
        container, a partial's function and arguments and a bound method's owner, each as
        a value reached through it; a mapping of another library (``os.environ``) by the
        value of all it holds. Which attributes: the chains the code reads right after
        loading the value (``free_state.Uses``: ``Config.enabled`` guards ``enabled``, not
        a ``Config.step`` the training loop bumps), every name the code reads where it
        uses the value itself. A draw from Python's or numpy's global generator is refused
        (free_state._restore_generators). Returns True when the op must run again (an
        object was tracked)."""
        from torch._dynamo.source import AttrSource
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if isinstance(value, torch.Tensor):
            # fake propagation cannot compute with it: named if the op fails so (See
            # _real_tensor_in_fake_propagation)
            self.tensor_reads.setdefault(f"{owner}.{name}", None)
            if not is_traceable_wrapper_subclass(value) and not self._through_subclass:
                # (a subclass instance, and what it holds, is tracked: below)
                self.reached_tensors[id(value)] = (f"{owner}.{name}", value)
            if depth > 3 or not free_state.is_user_class(type(value)):
                return False
            # a subclass instance (a getter closing over the input, ``lambda: w.knob``): the
            # attributes the code reads off it, as values reached through it
            held = {k: v for k, v in capture.obj_dict(value).items() if not is_torch_internal(k)}
            self._through_subclass += 1
            try:
                return self._guard_attributes(source, held, uses.names(self.collector.names), f"{owner}.{name}", depth, uses)
            finally:
                self._through_subclass -= 1
        if depth > 3:
            return False
        if _owned_by_torch(value):  # ``from torch import is_warn_always_enabled``, ``PRINT_OPTS``
            self._guard_torch_flags({getattr(value, "__name__", ""), type(value).__name__})
        clock = _answers_anew(value, uses.names(self.collector.names))
        if isinstance(value, types.ModuleType) and value.__name__.split(".")[0] == "torch":
            # ``torch.get_rng_state()``: torch's own modules are not walked (below)
            state_reads = uses.names(self.collector.names) & _GENERATOR_STATE_METHODS
            clock = f"torch.{sorted(state_reads)[0]}()" if state_reads else clock
        if clock:
            _refuse(
                RefusalKind.UNSUPPORTED_STATE_READ, next(iter(self.scope.tracked.values())), name, clock,
                f"dispatch code can call {clock} (through {owner}.{name}), which answers anew at every call: "
                "the compiled program would replay the value it answered while traced",
                hint="Read it outside the compiled function, or let the op run eagerly (fullgraph=False "
                "graph-breaks there).",
            )
        if not isinstance(value, (types.ModuleType, type)) and not is_immutable_constant(value):
            changed = self._written_by_program(value)
            if changed:  # ``CFG.margin = 3`` / ``TABLE[k] = v`` in the compiled function, then the op
                self._refuse_changed(owner, name, sorted(changed)[0])
            self._free_values.setdefault(id(value), (owner, name, value))
        names = uses.names(self.collector.names)
        if isinstance(value, types.ModuleType):
            self.watch.add_module_object(value)  # its attributes are globals too
            if value.__name__.split(".")[0] == "torch" or not isinstance(vars(value), dict):
                self._guard_torch_flags()
                return False  # torch's own modules are torch's state
            if value is os and names & {"getenv", "getenvb"}:
                names = names | {"environ"}  # ``os.getenv("X")`` reads os.environ
            return self._guard_attributes(source, vars(value), names, value.__name__, depth, uses)
        if isinstance(value, types.FunctionType):
            guards.guard(source, "ID_MATCH")  # a helper rebound: its code is another
            if free_state.reads_environment(value):  # ``from os import getenv``
                self._guard_reached(AttrSource(self.tx.import_source("os"), "environ"), os.environ, "os", "environ", depth + 1)
            return self._guard_defaults(source, value, owner, name, depth)
        if isinstance(value, (logging.Logger, logging.LoggerAdapter)):
            # ``logger.isEnabledFor(DEBUG)``: its effective level, as the user sets it between calls
            guards.guard(source, "ID_MATCH")
            seen = _logger_state(value)
            guards.lambda_(source, lambda lg: _logger_state(lg) == seen, f" logs at {seen!r}")
            self.record.free_reads.append((owner, name, seen))
            return False
        if not isinstance(value, type) and isinstance(free_state._wrapped(value), types.FunctionType):
            guards.guard(source, "ID_MATCH")  # an ``lru_cache`` getter: the code it runs is followed
            return False
        if isinstance(value, types.MethodType):
            guards.guard(source, "ID_MATCH")
            owner_of = value.__self__  # ``cfg.apply``: what the method reads on its owner
            return self._guard_reached(AttrSource(source, "__self__"), owner_of, owner, name, depth + 1)
        if isinstance(value, functools.partial):
            guards.guard(source, "ID_MATCH")
            retry = False
            for part in ("func", "args", "keywords"):
                retry |= self._guard_reached(AttrSource(source, part), getattr(value, part), owner, name, depth + 1)
            return retry
        if is_code_object(value) and not isinstance(value, type):
            return False  # builtins, torch's ops
        if is_immutable_constant(value) or (type(value) in PLAIN_MUTABLE and free_state.holds_constants(value)):
            guards.constant(source, value)
            self.record.free_reads.append((owner, name, value))
            return False
        if isinstance(value, dict) and type(value) is not dict and free_state.holds_constants(dict(value)):
            # an EasyDict, an AttrDict made of a dict: its class and items
            held, cls = copy.deepcopy(dict(value)), type(value)
            guards.guard(source, "ID_MATCH")
            guards.lambda_(source, lambda obj: type(obj) is cls and dict(obj) == held, f" holds {held!r}")
            self.record.free_reads.append((owner, name, (cls.__qualname__, held)))
            if not hasattr(value, "__dict__"):
                return False
            # and its instance attributes, which attribute syntax finds first
            guards.keys(source)
            attrs = vars(value)
            return self._guard_attributes(source, attrs, set(attrs), f"{owner}.{name}", depth, free_state.Uses())
        if type(value) in (dict, list, tuple) and len(value) <= _MAX_ITEMS_GUARDED:
            # a container of other things (a hook registry, ``G["args"]``): which one it is,
            # and its items as values reached through it (a dict's by the keys the code
            # reads where it does not use the dict itself)
            from torch._dynamo.source import DictGetItemSource, GetItemSource

            guards.guard(source, "ID_MATCH")
            guards.lambda_(source, lambda obj, n=len(value): len(obj) == n, f" has {len(value)} items")
            retry = False
            if isinstance(value, dict):
                for key, item in list(value.items()):
                    if is_immutable_constant(key) and (not isinstance(key, str) or uses.bare or key in self.collector.names):
                        retry |= self._guard_reached(DictGetItemSource(source, key), item, owner, f"{name}[{key!r}]", depth + 1)
            else:
                for i, item in enumerate(value):
                    retry |= self._guard_reached(GetItemSource(source, i), item, owner, f"{name}[{i}]", depth + 1)
            return retry
        if isinstance(value, PLAIN_MUTABLE):
            guards.guard(source, "ID_MATCH")  # too many items to guard one by one (``sys.modules``)
            if type(value) is not dict:
                return False
            from torch._dynamo.source import DictGetItemSource

            # the items the code names (``sys.modules["helpers"].CACHE``)
            retry = False
            named = self.collector.names | {m for m in self.collector.module_names if isinstance(m, str)}
            for key in sorted(k for k in named if k in value):
                retry |= self._guard_reached(DictGetItemSource(source, key), value[key], owner, f"{name}[{key!r}]", depth + 1)
            return retry
        if isinstance(value, type) or (isinstance(value, (tuple, frozenset)) and value and all(isinstance(v, type) for v in value)):
            guards.guard(source, "ID_MATCH")  # a class, or a tuple or frozenset of them (isinstance checks)
            retry = False
            for cls in [value] if isinstance(value, type) else value:
                # its class-level state is global state (``Cls.total += 1``): the op runs
                # again under the watch
                retry |= self.watch.add_class(cls)
                if isinstance(value, type) and free_state.is_user_class(cls):
                    retry |= self._guard_class_state(source, cls, depth + 1, uses)
            return retry
        if isinstance(value, torch.nn.Module) or free_state.is_namespace(value):
            guards.guard(source, "ID_MATCH")
            self.watch.add_object(f"{owner}.{name}", value)
            held = dict(vars(value))
            if isinstance(value, torch.nn.Module):
                # submodules, parameters and buffers read as attributes (``GM.amax``, a buffer
                # of a module a global holds: a real tensor, an outside tester's find)
                held = {**value._modules, **value._buffers, **value._parameters, **held}
            else:  # ``getattr(cfg, "margin", 1)``, ``hasattr(cfg, "floor")``: set later by the user
                for attr in sorted(names - held.keys()):
                    if attr[:2] != "__":
                        guards.absent(source, attr)
            return self._guard_attributes(source, held, names, f"{owner}.{name}", depth, uses)
        if type(value) is weakref.ref:
            # ``MREF().calls += 1``: the object the reference leads to, reached through it
            from torch._dynamo.source import WeakRefCallSource

            guards.guard(source, "ID_MATCH")
            target = value()
            if target is None:
                return False
            return self._guard_reached(WeakRefCallSource(source), target, owner, f"{name}()", depth + 1, uses)
        if isinstance(value, weakref.WeakValueDictionary):
            # what it holds, as a weak dictionary's table of references: its objects' attributes
            # are compared (not guarded: no guard source reaches them)
            for item in list(value.values())[:_MAX_ITEMS_GUARDED]:
                if isinstance(getattr(item, "__dict__", None), dict) and not isinstance(item, (type, types.ModuleType)):
                    self.watch.add_object(f"{owner}.{name}[...]", item)
                elif free_state.slot_values(item) is not None:
                    self.watch.add_slotted(f"{owner}.{name}[...]", item)
        if (
            isinstance(value, collections.abc.Iterator) and not isinstance(value, io.IOBase)
            and not free_state.is_user_class(type(value))  # its state is attributes, tracked below
            and not (depth == 0 and type(value) in free_state.STATEFUL)
        ):
            # a generator or iterator dispatch may advance (``next(GEN)``): where it stands
            # cannot be guarded, copied or put back once a trace advanced it (refused before
            # the op runs: an outside tester found it advanced by each trace)
            self._refuse_changed(owner, name, "", opaque=type(value).__qualname__)
        if capture.is_registered(value) or (
            hasattr(value, "__dict__") and free_state.is_user_class(type(value))
        ):
            # A user object: its attribute reads are answered and guarded like a
            # registered ctx-state object's, which needs the op run again. Its class's
            # attributes are state too (an ``lru_cache`` on a method).
            retry_class = self.watch.add_class(type(value))
            guards.guard(source, "ID_MATCH")
            if self.scope.lookup(value) is None:
                try:
                    capture.obj_dict(value)
                except AttributeError:  # an object of a C type whose state is not in a __dict__
                    self._refuse_changed(owner, name, "", opaque=type(value).__qualname__)
                self.scope.track(value, value, Ref(None, source, None))
                self.record.shared_objects.append(value)
                return True
            return retry_class
        slots = free_state.slot_values(value)
        if slots is not None:  # a ``__slots__`` config object: every slot (a property may serve one)
            guards.guard(source, "ID_MATCH")
            self.watch.add_slotted(f"{owner}.{name}", value)
            return self._guard_attributes(source, slots, set(slots), f"{owner}.{name}", depth, free_state.Uses())
        snapshot = free_state.state_snapshot(value)
        if snapshot is free_state.UNREADABLE:
            self._refuse_changed(owner, name, "", opaque=type(value).__qualname__)
        if value is not os.environ:
            self.watch.add_value(f"{owner}.{name}", value)  # a StringIO log, a numpy array: compared
        if snapshot is not None:  # os.environ, a ContextVar, a numpy array, an array.array
            guards.guard(source, "ID_MATCH")
            guards.lambda_(source, lambda obj: free_state.state_snapshot(obj) == snapshot, f" holds {snapshot!r:.200}")
            self.record.free_reads.append((owner, name, snapshot))
            return False
        # Other objects (loggers, locks, torch's own): not state the program depends on;
        # an attribute dispatch code sets on one by name is compared (``add_foreign``)
        self.watch.add_foreign(f"{owner}.{name}", value)
        return False

    def _guard_torch_flags(self, held: set[str] | frozenset[str] = frozenset()) -> None:
        """Note [torch's global flags dispatch reads]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        Dispatch code reaching torch may read its process-wide settings
        (``torch.get_float32_matmul_precision()``, ``torch.backends.mkldnn.enabled``,
        ``torch.is_anomaly_enabled()``, ``torch.is_warn_always_enabled()``, the print options),
        which Dynamo's own global-state guard does not all cover: a change between calls was
        replayed stale (outside testers' finds). Every torch setting the watch takes when
        dispatch sets one (free_state's table) that the code names (by its getter, its name or
        an alias: ``PRINT_OPTS``), or that a global or closure variable holds (``READ =
        torch.is_anomaly_enabled``: ``held``, its names), guards the frame on its value."""
        names = self.collector.names | held
        named = [(label, get) for label, get, keys in _torch_flag_table() if keys & names]
        if names & free_state.ANOMALY_GETTERS:  # See Note [Anomaly mode while AOTAutograd traces] (aot_layer.py)
            self.record.reads_anomaly_mode = True
        named = [(label, get) for label, get in named if label not in self._torch_flags_guarded]
        if not named:
            return
        from torch._dynamo.source import GlobalSource

        self._torch_flags_guarded.update(label for label, _ in named)
        gets = tuple(get for _, get in named)
        seen = tuple(map(free_state._read, gets))
        holder = self.tx.output.install_global_by_id("__dynamo_ext_torch", torch)
        shown = ", ".join(f"{label}={value!r}" for (label, _), value in zip(named, seen))
        guards.lambda_(GlobalSource(holder), lambda _: tuple(map(free_state._read, gets)) == seen, f" flags {shown}")

    def _guard_defaults(self, source: Any, fn: Any, owner: str, name: str, depth: int) -> bool:
        """A user function's default arguments that are not constants (``def scaled(t,
        cfg=CFG)``), each as a value reached through it."""
        from torch._dynamo.source import AttrSource, GetItemSource

        if not free_state.is_user_code(fn.__code__.co_filename):
            return False
        retry = False
        for i, default in enumerate(fn.__defaults__ or ()):
            if not is_immutable_constant(default) and not is_code_object(default):
                retry |= self._guard_reached(
                    GetItemSource(AttrSource(source, "__defaults__"), i), default, owner, f"{name}.__defaults__[{i}]", depth + 1
                )
        return retry

    def _refuse_changed(self, owner: str, name: str, what: str, opaque: str = "") -> NoReturn:
        t = next(iter(self.scope.tracked.values()))
        if opaque:  # See Note [State dispatch reaches outside the tensors]
            _refuse(
                RefusalKind.UNSUPPORTED_STATE_READ, t, name, opaque,
                f"dispatch reads {owner}.{name}, a {opaque} whose state dynamo_ext cannot read to guard it",
            )
        _refuse(
            RefusalKind.UNSUPPORTED_STATE_READ, t, name, "pending write",
            f"dispatch reads {owner}.{name}, which the compiled function changed ({what}) before this op; "
            "while traced the op would read the value from before the call",
            hint="Change it outside the compiled function, or let the op run eagerly "
            "(fullgraph=False graph-breaks there).",
        )

    def _stored_globals(self) -> set[tuple[str | None, str]]:
        """(module, name) of the globals the user's code assigned in this frame so far."""
        from torch._dynamo.source import GlobalSource

        se, out = self.tx.output.side_effects, set()
        module = self.tx.output.global_scope.get("__name__")
        for vt, attrs in se.store_attr_mutations.items():
            if attrs and isinstance(getattr(vt, "source", None), GlobalSource) and type(vt).__name__ == "NewGlobalVariable":
                out.update((module, n) for n in attrs)
        return out

    def _guard_attributes(
        self, source: Any, held: dict, names: set[str], owner: str, depth: int, uses: free_state.Uses
    ) -> bool:
        """The attributes among ``names`` of an object holding ``held``, each as a value
        reached through it."""
        from torch._dynamo.source import AttrSource

        retry = False
        for attr in sorted(names & held.keys()):
            if attr[:2] != "__":
                retry |= self._guard_reached(AttrSource(source, attr), held[attr], owner, attr, depth + 1, uses.of(attr))
        return retry

    def _guard_class_state(self, source: Any, cls: type, depth: int = 0, uses: free_state.Uses = free_state.Uses()) -> bool:
        """The data attributes of a user class (and its user bases) that the dispatch code
        reads off it, as ``getattr(cls, name)`` resolves them: values reached through the class."""
        from torch._dynamo.source import AttrSource

        retry, seen = False, set()
        names = uses.names(self.collector.names)
        for klass in cls.__mro__:
            if not free_state.is_user_class(klass):
                continue
            for name, value in list(vars(klass).items()):
                if name in seen or name not in names or name[:2] == "__" or name.startswith(("_dynamo", "_abc")):
                    continue
                seen.add(name)
                if isinstance(value, (types.FunctionType, staticmethod, property, type)):
                    # a hook the user swaps (``Q.quant = staticmethod(floor)``): what
                    # ``cls.name`` gives, by identity (a function, a property, a class)
                    guards.guard(AttrSource(source, name), "ID_MATCH")
                    fn = value.__func__ if isinstance(value, staticmethod) else value
                    if isinstance(fn, types.FunctionType):  # and its default arguments
                        retry |= self._guard_defaults(AttrSource(source, name), fn, cls.__qualname__, name, depth)
                    continue
                if isinstance(value, classmethod):  # ``cls.name`` is a new bound method each time
                    guards.guard(AttrSource(AttrSource(source, name), "__func__"), "ID_MATCH")
                    continue
                if hasattr(type(value), "__get__"):
                    continue  # other descriptors (slots, cached properties): state of instances
                retry |= self._guard_reached(AttrSource(source, name), value, cls.__qualname__, name, depth + 1, uses.of(name))
        return retry

    # -- recording writes ---------------------------------------------------

    def record_writes(self, writes: list[Write]) -> None:
        tx = self.tx
        for w in writes:  # refuse before recording anything
            t: Tracked = w.tracked
            if not config.dynamo_layer:
                break  # the AOTAutograd layer alone decides
            bad = refusal_for(w.value, w.old, w.in_place)
            if bad is not None:
                _refuse(bad[0], t, w.name, bad[1])
            if self.collector.identity_calls and free_state.holds_traced_identity(w.value):
                # See Note [An object's identity while traced]
                _refuse(
                    RefusalKind.UNSUPPORTED_STATE_READ, t, w.name, type(w.value).__name__,
                    f"the value holds id() of a traced tensor ({', '.join(sorted(set(self.collector.identity_calls)))} "
                    "calls id()): while traced every tensor is another object than in eager",
                    hint="Key a cache on state the object carries (a version counter or tag in the "
                    "__tensor_flatten__ ctx), not on id() of a tensor.",
                )
            if self._in_hop():
                _refuse(RefusalKind.WRITE_IN_HOP, t, w.name, type(w.value).__name__)
            if not torch._dynamo.config.replay_side_effects:
                # torch.export (strict) traces with replay off: the write would be dropped.
                _refuse(RefusalKind.UNREPLAYABLE_ENTRY, t, w.name, type(w.value).__name__)
        # A value holding a data-dependent symbol (``x.elem.sum().item()``): its graph node
        # first. Dynamo wants the op that made an unbacked symbol to return it, and checks at
        # the next node it builds (a count's ``s0 + 1``, made first, failed the compile).
        early: dict[int, Any] = {}
        if config.dynamo_layer:
            for w in writes:
                if w.tracked.data is not None and _holds_unbacked(w.value) and symbolic_constant(w.value) is MISSING:
                    try:
                        early[id(w)] = self._graph_value_vt(w.tracked, w.tracked.data, w)
                    except PendingUnbackedSymbolNotFound:
                        # an expression of a data-dependent value (``x.sum().item() > 4``): the
                        # graph can return the value the op made, not what dispatch built from it
                        _refuse(
                            RefusalKind.OPAQUE_VALUE, w.tracked, w.name, type(w.value).__name__,
                            f"{w.value} is computed from a value of tensor data (.item()) in dispatch: "
                            "the compiled program can return that value, not an expression of it",
                            hint="Write the tensor itself (self.big = out.abs().max() > 4.0).",
                        )
        for w in writes:
            t = w.tracked
            ref: Ref | None = t.data
            if ref is None:
                continue  # an object made by the trace, not reachable from the graph
            if t.real is None and _is_sibling_alias(t, w, self.stored):
                # ``y.cache = y.elem`` (or ``y.a = y.elem``, ``a`` not flattened) on a tensor the
                # graph computes: the graph's outputs are built with that aliasing (the
                # AOTAutograd layer restores it on rebuilt outputs); a residual write would put
                # a separately rebuilt copy there (a second object where the inner tensor is a
                # subclass). An earlier write of the name in this frame is dropped: this one
                # undoes it.
                if (id(t.obj), w.name) in self.stored:
                    vt = self._target_vt(t, ref)
                    pending = tx.output.side_effects.store_attr_mutations.get(vt, {}) if vt is not None else {}
                    pending.pop(w.name, None)
                    del self.stored[(id(t.obj), w.name)]
                continue
            kind = classify(w.value)
            marker = w.value if kind is ValueKind.CONSTANT else GRAPH_VALUE
            if not config.dynamo_layer:
                if t.real is not None:
                    self.record.observed.setdefault(id(t.real), {})[w.name] = marker
                continue
            if capture.sets_besides(t, w.name):
                _refuse(
                    RefusalKind.OPAQUE_VALUE, t, w.name, type(w.value).__name__,
                    f"{w.name!r} was set while {t.cls_name} handled another assignment (its own "
                    "__setattr__, or a property's setter writing the instance dict), and replaying it "
                    f"would run {t.cls_name}.__setattr__ a second time",
                    hint=f"The value is not the problem: {w.name!r} is set besides the attribute assigned, on a "
                    f"class with its own __setattr__, which replaying would run again. Assign {w.name!r} "
                    "directly in dispatch instead.",
                )
            if capture.under_a_descriptor(t, w.name):
                _refuse(
                    RefusalKind.OPAQUE_VALUE, t, w.name, type(w.value).__name__,
                    f"dispatch wrote {w.name!r} into the instance dict, where a data descriptor of "
                    f"{t.cls_name} owns the name: a replayed setattr would go to the descriptor",
                )
            vt = self._target_vt(t, ref)
            if vt is None:
                _refuse(
                    RefusalKind.OPAQUE_VALUE, t, w.name, type(w.value).__name__,
                    "the object written on has no variable Dynamo can replay a write on",
                )
            constant = w.value if kind is ValueKind.CONSTANT else symbolic_constant(w.value)  # ``nan * s0``: nan
            if constant is not MISSING:
                value_vt = _constant_vt(tx, constant)
            elif id(w) in early:
                value_vt = early[id(w)]
            else:  # a tensor or a symbolic value
                with _pending_symbols_aside(tx):
                    value_vt = self._graph_value_vt(t, ref, w)
            where = ref.source.name if ref.source is not None else f"<intermediate {t.cls_name}>"
            log.debug("write recorded: %s.%s <- %s", where, w.name, type(w.value).__name__)
            tx.output.side_effects.store_attr(vt, w.name, value_vt)
            self.note_stored(vt, w.name, value_vt)
            if ref.source is not None and (ref.path or _attributes_on_the_way(ref.source)):
                # always where the path is dispatch's own; through an attribute Dynamo's source
                # names only where the frame rebinds that attribute (Note [Writes on an
                # object its holder rebinds])
                entry = self.nested_writes.setdefault(id(vt), (vt, set(), [False]))
                entry[1].add(w.name)
                entry[2][0] = entry[2][0] or bool(ref.path)
            self.stored[(id(t.obj), w.name)] = value_vt
            if ref.source is not None:
                from torch._dynamo.source import AttrSource

                self.written_sources.add(AttrSource(ref.source, w.name))
            if t.plain_inner and t.real is not None and ref.source is not None and w.name not in capture.obj_dict(t.real):
                # A plain tensor with no state of its own is traced without attribute hooks
                # (they would slow every op's fake propagation): a read of the name before
                # this write went unanswered, so the code is guarded on the name staying
                # absent (``x.seen_by = getattr(x, "seen_by", 0) + 1`` recompiles once it is
                # set, and is then traced with its reads answered).
                guards.absent(ref.source, w.name)
            if t.real is not None:
                self.record.recorded.setdefault(id(t.real), {})[w.name] = marker

    def note_stored(self, vt: Any, name: str, value_vt: Any) -> None:
        """A write of dispatch's went into Dynamo's side effects."""
        self._ours[(id(vt), name)] = (vt, value_vt)

    def mark_program_writes(self) -> None:
        """Note [A write the program makes between two ops]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        Code of the compiled function may set an attribute of an object dispatch already
        read or wrote in this frame (``y = x * w; w.mult = 3; y + w``, or ``w.n = w.n * 5``
        between two ops bumping ``n``; a global config object's field alike). Dynamo holds the
        write pending until after the graph, while the traced object keeps the value the
        earlier op settled: the next op would read the old value (an outside tester's find:
        silently wrong outputs and counts, under every backend). Before each op the writes in
        Dynamo's side effects that are not dispatch's and not seen yet are found, and their
        names marked pending on the tracked objects they are on: dispatch reading one is
        refused (``unsupported_state_read``) as a read of such a write is on an object no op
        touched before (``_refuse_pending``); dispatch writing one first takes it back. A list,
        dict or object an attribute holds that the program changed (Dynamo's side effects hold
        it modified: ``x.hooks.append(h)``) counts as a write of the attribute."""
        se = self.tx.output.side_effects
        found: list[tuple[Any, str]] = []
        for vt, names in se.store_attr_mutations.items():
            for name, value_vt in names.items():
                key = (id(vt), name)
                if self._ours.get(key, (None, None))[1] is value_vt:
                    continue
                seen = self._seen_writes.get(key)
                if seen is not None and seen[1] is value_vt:
                    continue
                self._seen_writes[key] = (vt, value_vt)
                found.append((vt, name))
        for t in self.scope.tracked.values():
            for name, (held, _) in t.containers.items():
                if t.real is not None:  # the real object's (the traced one holds what it was answered)
                    held = capture.obj_dict(t.real).get(name, held)
                if name not in t.pending and self._changed_by_program(held):
                    t.pending.add(name)
        if not found:
            return
        for t in self.scope.tracked.values():
            ref = t.data
            if not isinstance(ref, Ref):
                continue
            for vt, name in found:
                if ref.vt is vt or (
                    ref.source is not None and getattr(vt, "source", None) is not None and ref.source == vt.source
                ) or (t.real is not None and se.id_to_variable.get(id(t.real)) is vt):
                    t.pending.add(name)

    def refuse_free_state_the_program_changed(self) -> None:
        """See Note [A write the program makes between two ops]: a global or closure value
        an earlier op's dispatch read (guarded once, when its code first ran), changed since
        by the compiled function's own code (``CFG.mult = 3``, ``TABLE[k] = v``, ``global
        MULT; MULT = 3``). Checked before each op a subclass takes part in, whether or not
        its dispatch reads it again (the reads of code already followed are not noted again)."""
        stored = self._stored_globals() if self._free_globals else set()
        for r in self._free_globals:
            if (r.module, r.name) in stored:
                self._refuse_changed(r.module or "", r.name, "assigned")
        for owner, name, value in self._free_values.values():
            changed = self._written_by_program(value)
            if changed:
                self._refuse_changed(owner, name, sorted(changed)[0])

    def _changed_by_program(self, held: Any) -> bool:
        """A container or object the program's code changed in this frame (Dynamo holds the
        change pending; not dispatch's own writes on a ctx-state object)."""
        if is_immutable_constant(held) or isinstance(held, torch.Tensor):
            return False
        return bool(self._written_by_program(held))

    def _refuse_program_write(self, t: Tracked, name: str) -> None:
        """See Note [A write the program makes between two ops]."""
        asked = None if name == "__dict__" else name
        made = t.real is None  # a tensor the frame made: its own state is the traced object's
        self._refuse_pending(t, t.obj if made else t.real, t.data, asked, "on this tensor, which it made, " if made else "")

    def _written_by_program(self, value: Any, ref: Ref | None = None, t: Tracked | None = None) -> set[str]:
        """The attributes (or ``{"[]"}`` for a container's items) of ``value`` the user's
        code set in this frame before now, as Dynamo's side effects hold them pending (not
        those dispatch wrote, which dynamo_ext replays)."""
        se = self.tx.output.side_effects
        vt = ref.vt if ref is not None and ref.vt is not None else None
        if vt is None and ref is not None and ref.source is not None:
            vt = self.tx.output.input_source_to_var.get(ref.source)
        if vt is None:
            vt = se.id_to_variable.get(id(value))
        if vt is None:
            return set()
        obj_id = id(t.obj) if t is not None else id(value)
        # a name dispatch wrote is the program's again where its code stored another value
        # since (``w.n = w.n * 5`` between two ops bumping ``n``)
        changed = {
            n for n, v in se.store_attr_mutations.get(vt, {}).items()
            if self.stored.get((obj_id, n)) is not v and self.stored.get((id(value), n)) is not v
        }
        if not changed and type(value) in (dict, list) and se.is_modified(vt):
            changed = {"[]"}
        return changed

    def _target_vt(self, t: Tracked, ref: Ref) -> Any:
        if ref.vt is None and ref.source is not None:
            ref.vt = self.tx.output.input_source_to_var.get(ref.source)
        if ref.vt is None and ref.source is not None:
            from torch._dynamo.variables.builder import VariableBuilder
            from torch._dynamo.variables.lazy import LazyVariableTracker

            ref.vt = LazyVariableTracker.realize_all(VariableBuilder(self.tx, ref.source)(t.real))
        vt = ref.vt
        if vt is None or not self.tx.output.side_effects.is_attribute_mutation(vt):
            return None
        return vt

    def _inner_source(self, value: Any) -> Any:
        """The source of ``value`` if it is a subclass nested in a graph input's flatten tree."""
        from torch._dynamo.source import AttrSource
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if not is_traceable_wrapper_subclass(value):
            return None

        def find(t: Tracked, source: Any, depth: int) -> Any:
            # Only inner objects the real object held when the frame started and still holds:
            # the residual bytecode loads them from it.
            for name in capture._flatten_names(t.obj):
                if name in t.written or name not in capture.obj_dict(t.real):
                    continue
                child = capture.obj_dict(t.obj).get(name)
                if child is value:
                    return AttrSource(source, name)
                inner = self.scope.lookup(child) if depth < 4 else None
                if inner is not None and inner.real is not None and is_traceable_wrapper_subclass(child):
                    found = find(inner, AttrSource(source, name), depth + 1)
                    if found is not None:
                        return found
            return None

        for t in list(self.scope.tracked.values()):
            ref = t.data
            if isinstance(ref, Ref) and ref.source is not None and ref.path == () and not t.shared and t.real is not None:
                found = find(t, ref.source, 0)
                if found is not None:
                    return found
        return None

    def _graph_value_vt(self, t: Tracked, ref: Ref, w: Write) -> Any:
        """A tensor or symbolic value written by dispatch, as a value the graph returns."""
        from torch._dynamo.variables.builder import wrap_fx_proxy
        from torch._subclasses.fake_tensor import is_fake

        from torch._dynamo.source import AttrSource

        value = w.value
        inner = self._inner_source(value)
        if inner is not None:
            # A subclass nested in a graph input (``self.a = self.elem``): AOTAutograd would
            # return a rebuilt copy; the residual bytecode loads the real object instead.
            return _FromSource(source=inner)
        same = self.input_vt(value)
        if same is not None and isinstance(same.source, AttrSource):
            # The graph input stands for an attribute's value when the graph started; the
            # attribute may hold another tensor by the time the residual bytecode would
            # load it (a later write in this frame, or dispatch itself running again at
            # run time under backend="eager"): the graph returns the entry value.
            proxy = self.tx.output.create_proxy("call_function", handoff.entry_value, (same.as_proxy(),), {})
            handoff.cacheable(proxy.node)
            return wrap_fx_proxy(self.tx, proxy)
        same = same or self.intermediate_vt(value)
        if same is not None:
            # An alias of a graph input or of a value the graph computed: the residual
            # bytecode loads it from where it lives, keeping identity.
            return same
        if isinstance(value, torch.Tensor) and not is_fake(value) and not _is_fake_subclass(value):
            _refuse(
                RefusalKind.OPAQUE_VALUE, t, w.name,
                f"{type(value).__name__} (a real tensor not computed in the traced program)",
            )
        if ref.node is None:
            # An object dispatch reached through a global or closure variable (a registry's
            # stats object): no graph value leads to it, so the graph has no output to carry
            # the value (an outside tester's find: the compile crashed inside Dynamo).
            _refuse(
                RefusalKind.OPAQUE_VALUE, t, w.name, type(value).__name__,
                "a tensor or symbolic value written on an object dispatch reaches through a global "
                "or closure variable: no graph value leads to that object",
            )
        holder, path = ref.node.meta.get("_dynamo_ext_proxy") or _proxy_of(self.tx, ref), ref.path
        if path and not _still_reached(ref.node.meta.get("example_value"), path, t.obj):
            # The op rebound an attribute on the path after writing on the object it led to
            # (``x.a.cache = ...; x.a = new``): the object is taken before the op runs (See
            # Note [Writes on an object its holder rebinds]).
            assert self._node is not None
            with self._node.graph.inserting_before(self._node):
                pinned = self._node.graph.call_function(capture.follow, (holder.node, path))
            pinned.meta["example_value"] = t.obj
            handoff.cacheable(pinned)
            holder, path = torch.fx.Proxy(pinned, self.tx.output.current_tracer), ()
        proxy = self.tx.output.create_proxy("call_function", handoff.read_attr, (holder, path, w.name), {})
        handoff.cacheable(proxy.node)
        if type(value) is tuple and not all(isinstance(v, SYMBOLIC_TYPES) for v in value):
            # ``("rows", n)``: the graph returns the symbolic items, the residual bytecode
            # builds the tuple (Dynamo takes no tuple holding a str as a graph value)
            from torch._dynamo.variables import ConstantVariable, TupleVariable

            proxy.node.meta["example_value"] = value
            items = []
            for i, v in enumerate(value):
                if isinstance(v, SYMBOLIC_TYPES):
                    item = self.tx.output.create_proxy("call_function", operator.getitem, (proxy, i), {})
                    items.append(wrap_fx_proxy(self.tx, item, example_value=v))
                else:
                    items.append(ConstantVariable.create(v))
            return TupleVariable(items)
        return wrap_fx_proxy(self.tx, proxy)


def _attributes_on_the_way(source: Any) -> list[str]:
    """The names of the attribute sources ``source`` runs through (``L['x'].a``), itself first."""
    from torch._dynamo.source import AttrSource, ChainedSource

    names = []
    while isinstance(source, ChainedSource):
        if isinstance(source, AttrSource):
            names.append(source.name)
        source = source.base
    return names


@contextlib.contextmanager
def _pending_symbols_aside(tx: Any) -> Iterator[None]:
    """Data-dependent symbols the op being propagated made (``x[x > 0]``'s length) wait for
    its own result to return them; a write's value built meanwhile (a count's ``s0 + 1``)
    does not hold them, and Dynamo would fail its node for not returning them."""
    shape_env = getattr(tx.output, "shape_env", None)
    pending = getattr(shape_env, "pending_fresh_unbacked_symbols", None)
    if not pending:
        yield
        return
    aside = list(pending)
    pending.clear()
    try:
        yield
    finally:
        pending[:0] = aside


def _is_sibling_alias(t: Tracked, w: Write, stored: dict) -> bool:
    """``w`` puts one of ``t``'s flattened inner tensors under a second name (flattened or
    not: ``self.a = self.elem``), or a tensor another attribute holds that this frame's
    residual bytecode does not write (one its constructor set: ``self.seen = self.a``)."""
    names = capture._flatten_names(t.obj)
    if not isinstance(w.value, torch.Tensor):
        return False
    d = capture.obj_dict(t.obj)
    if any(d.get(other) is w.value for other in names if other != w.name):
        return True
    return any(
        held is w.value and other != w.name and other not in names and (id(t.obj), other) not in stored
        for other, held in d.items()
    )


@functools.cache
def _from_source_class() -> type:
    from torch._dynamo.variables.base import VariableTracker

    class FromSource(VariableTracker):
        """A value the residual bytecode loads from its source (nothing else uses it)."""

        value_type: type | None = None  # for Dynamo's logs

        def python_type(self) -> type:
            if self.value_type is None:
                return super().python_type()
            return self.value_type

    return FromSource


def _FromSource(source: Any, **kwargs: Any) -> Any:  # noqa: N802 - builds a variable
    return _from_source_class()(source=source, **kwargs)


def _move_before(anchor: torch.fx.Node, value: torch.fx.Node) -> None:
    """Move ``value`` and what it depends on above ``anchor``: a value Dynamo built while
    ``anchor``'s op was being propagated (``item()`` of an unspecialized float, say) was
    appended after it, and the seed that uses it goes before it."""
    after: set[torch.fx.Node] = set()
    cur = anchor.next
    while cur.op != "root":
        after.add(cur)
        cur = cur.next
    if value not in after:
        return
    order: list[torch.fx.Node] = []

    def visit(n: torch.fx.Node) -> None:
        if n in after and n not in order:
            for dep in n.all_input_nodes:
                visit(dep)
            order.append(n)

    visit(value)
    for n in order:
        anchor.prepend(n)


def _still_reached(root: Any, path: capture.Path, obj: Any) -> bool:
    try:
        return capture.follow(root, path) is obj
    except (AttributeError, LookupError, TypeError):
        return False


def _proxy_of(tx: Any, ref: Ref) -> Any:
    if ref.vt is not None and ref.path == ():
        return ref.vt.as_proxy()
    return torch.fx.Proxy(ref.node, tx.output.current_tracer)


def _is_fake_subclass(value: Any) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(value):
        return False
    names, _ = value.__tensor_flatten__()
    return any(is_fake(getattr(value, n)) or _is_fake_subclass(getattr(value, n)) for n in names)


def frame_state(tx: Any) -> FrameState:
    output = tx.output
    state = output.__dict__.get(_STATE_KEY)
    if state is None:
        state = FrameState(tx)
        output.__dict__[_STATE_KEY] = state
        output.add_cleanup_hook(state.close)
    return state


class _Probe:
    pass


def _holds(value: Any, probe: Any, depth: int = 0) -> bool:
    if value is probe:
        return True
    if depth > 4:
        return False
    if isinstance(value, (tuple, list)):
        return any(_holds(v, probe, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_holds(v, probe, depth + 1) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_holds(getattr(value, f.name, None), probe, depth + 1) for f in dataclasses.fields(value))
    return False


def _class_dicts(cls: type) -> set[str]:
    """The names the classes of ``cls``'s MRO define, torch.Tensor and object excluded."""
    return {n for klass in cls.__mro__ if klass not in (torch.Tensor, object) for n in vars(klass)}


def _in_flatten_ctx(real: Any, name: str) -> bool:
    """Whether ``real.__tensor_flatten__()`` carries attribute ``name`` in its ctx: flatten
    once with the attribute set to a probe object and look for the probe."""
    d = capture.obj_dict(real)
    if not hasattr(type(real), "__tensor_flatten__") or name not in d:
        return False
    old, probe = d[name], _Probe()
    d[name] = probe
    try:
        _, ctx = real.__tensor_flatten__()
        return _holds(ctx, probe)
    except Exception:
        return True  # flatten needs the real value: treat it as part of the ctx
    finally:
        d[name] = old


# --------------------------------------------------------------------------- #
# Guards
# --------------------------------------------------------------------------- #


# --------------------------------------------------------------------------- #
# Refusals
# --------------------------------------------------------------------------- #


class _NeedsSeed(BaseException):
    """Dispatch read a tensor the traced object lacks: make it a graph input, re-run the op.

    A BaseException so that neither the subclass's own ``except Exception`` nor
    Dynamo's RuntimeError wrapping swallows it.
    """

    def __init__(self, tracked: Tracked, name: str) -> None:
        self.tracked = tracked
        self.name = name


def _hand_seeded(t: Tracked, name: str, fake: Any) -> None:
    """Give the traced object the graph value a read of ``name`` was seeded with."""
    if t.shared:
        # The object is shared with eager: the fake stands in for the trace and is put back
        # when the frame is compiled.
        capture.obj_dict(t.obj)[name] = fake
        t.settled.add(name)
    else:
        t.set_answer(name, fake)


class _NeedsWatch(BaseException):
    """Dispatch is about to run code found only now (See Note [Code an attribute holds]):
    guard and watch what it reaches, re-run the op. A BaseException as _NeedsSeed is."""


class _Refused(BaseException):
    """A refusal raised inside fake propagation; re-raised as a graph break outside it."""

    def __init__(self, kind: RefusalKind, t: Tracked, attr: str, value_type: str, context: str = "", hint: str = "") -> None:
        self.args_ = (kind, t, attr, value_type, context, hint)


def _torch_flag_table() -> tuple[tuple[str, Callable[[], Any], frozenset[str]], ...]:
    """(label, getter, names code reads it by) of each torch setting in free_state's table
    (See Note [torch's global flags dispatch reads])."""
    settings = free_state._torch_settings()
    cached = _FLAG_TABLES.get(id(settings))
    if cached is None:
        table = []
        for module, label, get, _ in settings:
            if module != "torch":
                continue
            keys = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", label)) - _FLAG_MODULE_WORDS
            keys.add(label.split("(")[0].split(".")[-1])  # its own name (``cudnn.deterministic``)
            keys.add(getattr(get, "__name__", "<lambda>"))
            for word, aliases in _FLAG_ALIASES.items():
                if word in label:
                    keys |= aliases
            table.append((label, get, frozenset(keys - {"<lambda>", "partial", "inner"})))  # a getter's generic names
        # the seed, which only a reseed moves (a generator's state: _GENERATOR_STATE_METHODS)
        table.append(("initial_seed", torch.initial_seed, frozenset({"initial_seed"})))
        _FLAG_TABLES.clear()
        cached = _FLAG_TABLES[id(settings)] = (settings, tuple(table))
    return cached[1]


_FLAG_TABLES: dict[int, tuple[Any, tuple]] = {}


def _owned_by_torch(value: Any) -> bool:
    """A function, class or object of torch's own (not a module: see _guard_reached)."""
    try:
        module = getattr(value, "__module__", None)
    except Exception:  # noqa: BLE001 - an object's own __getattr__ (an EasyDict raises KeyError)
        module = None
    if not isinstance(module, str):
        module = type(value).__module__
    return isinstance(module, str) and module.split(".")[0] == "torch" and not isinstance(value, types.ModuleType)


# the words of a setting's label that name a module, not the setting (its last word is kept)
_FLAG_MODULE_WORDS = frozenset({
    "backends", "cuda", "cudnn", "mkldnn", "mha", "nnpack", "quantized", "opt_einsum", "utils", "autograd",
    "deterministic", "matmul", "generic", "all", "conv", "rnn", "set_flags",
})

# names code reads a setting by besides its label's and its getter's
_FLAG_ALIASES = {
    "printoptions": frozenset({"PRINT_OPTS", "_PrintOptions", "get_printoptions", "_tensor_str", "printoptions"}),
    "detect_anomaly": frozenset({"is_anomaly_enabled", "is_anomaly_check_nan_enabled", "detect_anomaly", "anomaly_mode"}),
    "deterministic_algorithms": frozenset({
        "are_deterministic_algorithms_enabled", "is_deterministic_algorithms_warn_only_enabled", "get_deterministic_debug_mode",
    }),
    "multithreading": frozenset({"is_multithreading_enabled"}),
    "default_dtype": frozenset({"get_default_dtype"}),
    "nnpack": frozenset({"nnpack", "_get_nnpack_enabled"}),
    "fill_uninitialized_memory": frozenset({"fill_uninitialized_memory"}),
    "fp32_precision": frozenset({"fp32_precision"}),
}


def _logger_state(logger: Any) -> tuple:
    """What decides whether a logger logs at a level: its effective level, whether it is
    disabled, and the manager's global ``logging.disable``."""
    if isinstance(logger, logging.LoggerAdapter):
        logger = logger.logger
    return (logger.getEffectiveLevel(), logger.disabled, logger.manager.disable)


# Note [A clock dispatch reads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dispatch may stamp the time (``self.stamp = time.time()``, profiling-style) or draw an id
# (``uuid.uuid4()``, ``os.urandom``). Such a call answers anew at every call and changes no
# state a guard or the module watch could see: the compiled program replayed the traced value,
# silently, on backend="eager" (an outside tester's find; the AOT backends refused only because
# their passes ran at different times). Code found calling one is refused, as a draw from the
# global random generators is (free_state._restore_generators).
_ANEW_FUNCTIONS = frozenset(
    [("time", n) for n in (
        "time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time",
        "process_time_ns", "thread_time", "thread_time_ns", "localtime", "gmtime", "ctime", "asctime",
    )]
    + [("posix", "urandom"), ("nt", "urandom"), ("uuid", "uuid1"), ("uuid", "uuid4"), ("secrets", "token_bytes"),
       ("secrets", "token_hex"), ("secrets", "token_urlsafe"), ("secrets", "randbelow"), ("secrets", "randbits"),
       ("secrets", "choice")]
)
_ANEW_METHODS = frozenset({"now", "utcnow", "today"})  # of datetime's classes
# A random generator's state (``torch.get_rng_state()``, ``random.getstate()``, numpy's
# ``get_state()``) moves on with every draw anywhere in the process: read by dispatch (a
# dropout-replay fingerprint), it is refused as a clock is (an outside tester's find: replayed
# as traced after the caller reseeded); a guard on it would fail at nearly every call. The
# seed, which only a reseed moves, is guarded (``torch.initial_seed()``: _torch_flag_table).
_GENERATOR_STATE_METHODS = frozenset({"getstate", "get_state", "get_rng_state", "graphsafe_get_state"})
_ANEW_FUNCTIONS = _ANEW_FUNCTIONS | {
    ("torch.random", "get_rng_state"), ("torch", "get_rng_state"), ("torch.random", "seed"), ("torch", "seed"),
}


def _is_random_generator(value: Any) -> bool:
    """Python's, numpy's or torch's random generator object."""
    import random

    if isinstance(value, (random.Random, torch.Generator)):
        return True
    cls = type(value)
    return cls.__module__.split(".")[0] == "numpy" and cls.__name__ in ("RandomState", "Generator")


def _answers_anew(value: Any, names: set[str]) -> str:
    """The name of a function ``value`` is (or, for datetime's classes, has among ``names``)
    that answers anew at every call; "" if none."""
    import datetime

    # (``__self__`` of a method only: an object's own ``__getattr__`` may raise anything)
    if isinstance(value, (types.MethodType, types.BuiltinMethodType)) and _is_random_generator(value.__self__):
        owner, name = value.__self__, getattr(value, "__name__", "")
        if name in _GENERATOR_STATE_METHODS:  # ``random.getstate()``, ``np.random.get_state()``
            return f"{type(owner).__name__}.{name}()"
    if _is_random_generator(value) and names & _GENERATOR_STATE_METHODS:  # ``torch.default_generator.get_state()``
        return f"{type(value).__name__}.{sorted(names & _GENERATOR_STATE_METHODS)[0]}()"
    if isinstance(value, (types.BuiltinFunctionType, types.FunctionType)):
        module = getattr(value, "__module__", None) or ""
        if (module, getattr(value, "__name__", "")) in _ANEW_FUNCTIONS:
            return f"{'os' if module in ('posix', 'nt') else module}.{value.__name__}()"
    elif isinstance(value, type) and issubclass(value, datetime.date):
        methods = _ANEW_METHODS & names
        if methods:
            return f"{value.__name__}.{sorted(methods)[0]}()"
    return ""


def _refuse(kind: RefusalKind, t: Tracked, attr: str, value_type: str, context: str = "", hint: str = "") -> NoReturn:
    raise _Refused(kind, t, attr, value_type, context, hint)


def _refuse_read(t: Tracked, name: str, value: Any, context: str = "") -> NoReturn:
    _refuse(RefusalKind.UNSUPPORTED_STATE_READ, t, name, type(value).__name__, context)


# Note [A tensor property on a subclass]
# ``x.data``, ``x.T``, ``x.mT``, ``x.H``, ``x.mH``, ``x.real``, ``x.imag`` run dispatch
# (``detach``, ``permute``, ``transpose``, ...). Dynamo gives their result the source
# ``L['x'].data``, and evaluates that source on the real input to look up a method on it
# (``x.data.mul_``), in guards and in residual bytecode: dispatch then runs, and writes, on
# the real input while traced and on every call (an outside tester's find: an extra
# ``detach`` logged, ``Guard failed on the same frame it was created``). For a subclass
# whose code may write state the result is made as Dynamo makes any tensor the graph
# computes, with no source: the op is in the graph, its result tracked for writes.

_DISPATCHING_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})


# Note [Backward code Dynamo traces with the forward]
# Dynamo traces an ``autograd.Function``'s ``backward`` and a hook registered on an
# intermediate (``h.register_hook(fn)``) when it traces the forward: an attribute they read
# is read then, and its value is in the graph. Eager reads it when ``backward()`` runs,
# after what the forward's later ops and the backward's earlier ops wrote (dispatch bumping
# ``w.bw_calls`` in the backward, a Function's backward scaling by it: an outside tester's
# find, wrong gradients on every backend; stock has the same staleness for any Python
# state, and loses the writes too). A read there of the state of a class whose dispatch
# may write (outside its flatten list and class attributes) is refused
# (``unsupported_state_read``); under ``fullgraph=False`` the Function or hook runs eagerly.

_speculating = threading.local()


def make_backward_code_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``AutogradFunctionApplyVariable.trace_backward_graph`` and
    ``TensorVariable._method_register_hook``: marks the thread as tracing backward code
    with the forward (See Note [Backward code Dynamo traces with the forward])."""

    @functools.wraps(original)
    def traced_with_the_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_speculating, "depth", 0)
        _speculating.depth = depth + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _speculating.depth = depth

    return traced_with_the_forward


def make_load_attr_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``SideEffects.load_attr``: a name the traced code wrote earlier is read
    back from Dynamo's pending writes, not through ``var_getattr`` (See Note [Backward code
    Dynamo traces with the forward])."""

    @functools.wraps(original)
    def load_attr(self: Any, item: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        if isinstance(name, str):
            _refuse_backward_code_read(item, name)
        return original(self, item, name, *args, **kwargs)

    return load_attr


def _refuse_backward_code_read(vt: Any, name: str) -> None:
    """See Note [Backward code Dynamo traces with the forward]."""
    if not getattr(_speculating, "depth", 0) or name[:2] == "__" or not _may_write(vt):
        return
    example = vt.proxy.node.meta.get("example_value")
    cls = type(example)
    if name in capture._flatten_names(example) or capture.class_attribute(cls, name) is not MISSING:
        return
    value = capture.obj_dict(example).get(name, MISSING)
    _graph_break_class(
        RefusalKind.UNSUPPORTED_STATE_READ, cls, name, type(value).__name__ if value is not MISSING else "absent",
        f"{cls.__name__}.{name} is read by an autograd.Function's backward or a hook on an intermediate, "
        "which Dynamo traces with the forward: eager reads it when backward() runs, after what the "
        "forward's later ops and the backward's earlier ops wrote",
        hint="Read the value in the forward and keep it on the autograd ctx (ctx.n = w.n), or compute "
        "the scaling in the subclass's dispatch.",
        reader="an autograd.Function's backward or a hook on an intermediate",
    )


def make_var_getattr_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``TensorVariable.var_getattr`` (``tp_getattro_impl`` from torch 2.14;
    See Note [A tensor property on a subclass])."""

    @functools.wraps(original)
    def var_getattr(self: Any, tx: Any, name: str) -> Any:
        _refuse_backward_code_read(self, name)
        _refuse_result_tag_read(self, tx, name)
        symbolic = _symbolic_on_a_result(self, tx, name)
        if symbolic is not None:
            return symbolic
        if name == "_version":
            counted = _version_of_subclass_state(self, tx)
            if counted is not None:
                return counted
        try:
            result = original(self, tx, name)
        except torch._dynamo.exc.ObservedAttributeError:
            _guard_absent_attribute(self, name)
            raise
        if name in _DISPATCHING_PROPERTIES and self.source is not None and _may_write(self):
            from torch._dynamo.variables import TensorVariable

            if isinstance(result, TensorVariable) and result.source is not None:
                result.source = None  # a tensor the graph computed (the op is in the graph)
        return result

    return var_getattr


def _version_of_subclass_state(vt: Any, tx: Any) -> Any:
    """Note [A subclass's version counter in code Dynamo traces]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Code Dynamo traces itself (a subclass method such as ``dequantize`` run from
    ``__torch_function__``, a frame of its own once a refused op graph-breaks there) reads
    ``self.int_data._version``, a cache key. Dynamo makes it an op whose value AOTAutograd bakes
    from its functional tensor's counter: on aot_eager and inductor the key never moved and the
    cache stayed stale after the user requantized in place (wrong outputs, an outside tester's
    find; stock alike). The counter of a graph input that is a subclass or is reached through
    one's attributes is answered from the real tensor and guarded, plus the in-place changes
    the frame made to it so far (its fake counts them from 0), as dispatch's own reads are.
    A plain tensor's counter read in the user's own code stays torch's. None: not such a read."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    source = vt.source
    if source is None or not hasattr(vt, "proxy"):
        return None
    grapharg = vt.proxy.node.meta.get("grapharg")
    fake = vt.proxy.node.meta.get("example_value")
    real = getattr(grapharg, "example", None)
    if not isinstance(real, torch.Tensor) or not isinstance(fake, torch.Tensor):
        return None
    rooted = is_traceable_wrapper_subclass(real)
    base = getattr(source, "base", None)
    while not rooted and base is not None:
        held = tx.output.input_source_to_var.get(base)
        example = held.proxy.node.meta.get("example_value") if held is not None and hasattr(held, "proxy") else None
        rooted = isinstance(example, torch.Tensor) and is_traceable_wrapper_subclass(example)
        base = getattr(base, "base", None)
    if not rooted:
        return None
    from torch._dynamo.variables import ConstantVariable

    value = real._version
    guards.version(source, value)
    return ConstantVariable.create(value + capture._raw_version(fake))


def _symbolic_on_a_result(vt: Any, tx: Any, name: str) -> Any:
    """Note [A symbolic value dispatch set on an op's result]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Dispatch sets on the subclass an op returns a value computed from a count made symbolic
    (``out.depth = x.depth + 1``), and the compiled function reads it. Dynamo answers a read on
    a tensor the graph computed from the traced result's instance dict, and cannot take a
    symbolic int from there (its own ``SourcelessBuilder`` error under ``fullgraph=True``, an
    outside tester's find; stock reads the value the first trace saw). The graph reads it off
    its result instead (a ``read_attr`` node), which every backend computes: the AOT backends
    from the traced dispatch's write, ``backend="eager"`` from the real one. None: not such a
    read."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if vt.source is not None or not hasattr(vt, "proxy"):
        return None
    example = vt.proxy.node.meta.get("example_value")
    if not (isinstance(example, torch.Tensor) and is_traceable_wrapper_subclass(example)):
        return None
    value = capture.obj_dict(example).get(name)
    items = type(value) in (tuple, torch.Size) and any(isinstance(v, SYMBOLIC_TYPES) for v in value)
    if not (isinstance(value, SYMBOLIC_TYPES) or items) or name in example.__tensor_flatten__()[0]:
        return None
    if items and not all(isinstance(v, SYMBOLIC_TYPES) or is_immutable_constant(v) for v in value):
        return None
    from torch._dynamo.variables import ConstantVariable, TupleVariable
    from torch._dynamo.variables.builder import wrap_fx_proxy

    proxy = tx.output.create_proxy("call_function", handoff.read_attr, (vt.as_proxy(), (), name), {})
    handoff.cacheable(proxy.node)
    if not items:
        return wrap_fx_proxy(tx, proxy)
    # ``out.dims = tuple(out.shape)``: the symbolic items off the graph, the others as constants
    proxy.node.meta["example_value"] = value
    parts = []
    for i, v in enumerate(value):
        if isinstance(v, SYMBOLIC_TYPES):
            item = tx.output.create_proxy("call_function", operator.getitem, (proxy, i), {})
            parts.append(wrap_fx_proxy(tx, item, example_value=v))
        else:
            parts.append(ConstantVariable.create(v))
    return TupleVariable(parts)


def _guard_absent_attribute(vt: Any, name: str) -> None:
    """Note [An absent attribute the compiled function read]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The compiled function reads an attribute its input lacks, and catches the AttributeError
    (``try: pre = x.tag except AttributeError: pre = None``); then an op's dispatch creates it
    (``self.tag = 7``), replayed after the graph. Dynamo installs no guard for the absence, so
    the next call ran the same code on an input that has it: the absent branch again, where
    eager takes the attribute (an outside tester's find; stock alike where the caller sets the
    attribute). For a class that may write, the absence is guarded (Dynamo's ``HASATTR``
    guard): a later call with the attribute recompiles."""
    if vt.source is None or not vt.source.subguards_allowed() or not _may_write(vt):
        return
    from torch._dynamo.guards import GuardBuilder, install_guard

    install_guard(vt.source.make_guard(functools.partial(GuardBuilder.HASATTR, attr=name)))


def make_traced_output_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``builder.handle_traced_output`` (See Note [A tag dispatch puts on an
    op's plain result])."""

    @functools.wraps(original)
    def handle_traced_output(example_value: Any, tx: Any, proxy: Any, options: Any, subclass_type: Any, target_cls: Any) -> Any:
        vt = original(example_value, tx, proxy, options, subclass_type, target_cls)
        if tx.output.__dict__.get(_STATE_KEY) is not None and options.get("source") is None:
            _record_result_tags(tx, vt, example_value)
        return vt

    return handle_traced_output


def _result_tags(example: Any) -> dict[str, Any]:
    """What dispatch set on a plain tensor an op returned while traced (``out.scale = 0.5``):
    the entries of its FakeTensor's instance dict torch gives none."""
    from torch._subclasses.fake_tensor import FakeTensor

    if type(example) is not FakeTensor:
        return {}
    d, own = capture.obj_dict(example), _fake_tensor_keys()
    if len(d) <= len(own):
        return {}
    return {k: v for k, v in d.items() if k not in own and not is_torch_internal(k)}


@functools.lru_cache(maxsize=1)
def _fake_tensor_keys() -> frozenset[str]:
    from .aot_layer import _fresh_keys
    from torch._subclasses.fake_tensor import FakeTensor

    return _fresh_keys(FakeTensor)


def _record_result_tags(tx: Any, vt: Any, example: Any) -> None:
    """Note [A tag dispatch puts on an op's plain result]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Dispatch may tag the plain tensor an op returns (``out.scale = 0.5``). The run-time output
    gets its tags (the eager backend runs dispatch; AOT backends plan them, See Note
    [Attributes on a plain output] in aot_layer.py), but user code later in the same frame
    read the traced result, which Dynamo's variable lacked them on: ``getattr(y, "scale", 1)``
    answered the default, silently (an outside tester's find; stock alike). A constant tag is
    recorded as a pending write on the result's variable, which Dynamo's attribute reads
    consult first; a read of any other tag is refused (``unsupported_state_read``, See
    ``make_var_getattr_hook``)."""
    from torch._dynamo.variables import TensorVariable

    if not isinstance(vt, TensorVariable) or vt.source is not None:
        return
    tags = _result_tags(example)
    if not tags or not tx.output.side_effects.is_attribute_mutation(vt):
        return
    for name, value in tags.items():
        if classify(value) is ValueKind.CONSTANT and not tx.output.side_effects.has_pending_mutation_of_attr(vt, name):
            value_vt = _constant_vt(tx, value)
            tx.output.side_effects.store_attr(vt, name, value_vt)
            tx.output.__dict__[_STATE_KEY].note_stored(vt, name, value_vt)


def _refuse_result_tag_read(vt: Any, tx: Any, name: str) -> None:
    """See Note [A tag dispatch puts on an op's plain result]: a tag that is not a constant."""
    if name[:2] == "__" or vt.source is not None or not hasattr(vt, "proxy"):
        return
    if tx.output.__dict__.get(_STATE_KEY) is None or tx.output.side_effects.has_pending_mutation_of_attr(vt, name):
        return
    tags = _result_tags(vt.proxy.node.meta.get("example_value"))
    if name in tags:
        refuse(
            RefusalKind.UNSUPPORTED_STATE_READ, "Tensor", name, type(tags[name]).__name__,
            f"the code reads {name!r}, which dispatch set on the plain tensor an op returned, and which "
            "the traced result holds as a value of the trace (not a constant): the compiled code cannot read it",
            hint="Read the attribute outside the compiled function, or let the code run eagerly "
            "(fullgraph=False graph-breaks there).",
        )


def _may_write(vt: Any) -> bool:
    """The variable stands for a wrapper subclass whose code may write state."""
    example = vt.proxy.node.meta.get("example_value") if hasattr(vt, "proxy") else None
    return _may_write_example(example)


def _may_write_example(example: Any) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return (
        isinstance(example, torch.Tensor)
        and is_traceable_wrapper_subclass(example)
        and free_state.class_may_write(type(example))
    )


# Note [Torch functions Dynamo rewrites]
# Dynamo's handlers for some torch functions put other ops in the graph than the function:
# ``torch.addcdiv(..., value=v)`` as ``div``, ``mul``, ``add``; ``torch.full`` with a tensor
# fill value as ``empty`` and ``fill_``; ``torch._foreach_lerp_`` and ``torch._foreach_pow``
# through Python versions (``_foreach_sub``, ``_foreach_addcmul_``, ``copy_``, ...);
# ``torch.tensor_split`` with a 0-d tensor as a constant; ``torch.tensor`` of tensors through
# ``torch._refs.tensor``; the methods ``addcmul_``,
# ``addcdiv_`` (with ``value=``) and ``add_`` (with a tensor ``alpha``) as ``mul``/``div``,
# ``fma`` and ``copy_`` (Adam's updates). Eager hands dispatch the function's own op: where a wrapper subclass that may write state is among the arguments, the handler
# is passed by, and the function goes into the graph as called (a graph break where Dynamo
# cannot, eager from there).

_REWRITING_HANDLERS = ("addcdiv", "full", "tensor", "_foreach_lerp_", "_foreach_pow", "tensor_split")
# taken as called, ``torch.full`` with a traced tensor fill value and ``torch.tensor`` of
# traced tensors fail Dynamo's compile (their unbacked ``item()``): refused instead
_REFUSED_REWRITES = frozenset({"full", "tensor"})


def make_handlers_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``TorchInGraphFunctionVariable._get_handlers`` (See Note [Torch
    functions Dynamo rewrites])."""
    wrapped: dict[int, dict[Any, Any]] = {}

    @functools.wraps(original)
    def _get_handlers() -> dict[Any, Any]:
        handlers = original()
        found = wrapped.get(id(handlers))
        if found is None:
            found = dict(handlers)
            for name in _REWRITING_HANDLERS:
                fn = getattr(torch, name, None)
                if fn in found:
                    found[fn] = _passed_by_for_writers(found[fn], name)
            wrapped.clear()
            wrapped[id(handlers)] = found
        return found

    return _get_handlers


def make_method_rewrite_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``TensorVariable.method_addcmul_`` / ``method_add_`` /
    ``method_addcdiv_``, which put ``mul``/``div``, ``fma`` and ``copy_`` in the graph for the
    in-place op (``enable_dynamo_decompositions``, on by default): passed by where a subclass
    that may write is the tensor or an argument (See Note [Torch functions Dynamo rewrites])."""

    @functools.wraps(original)
    def method(self: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        if _may_write(self) or any(_may_write(v) for v in [*args, *kwargs.values()]):
            return None
        return original(self, tx, *args, **kwargs)

    return method


def _passed_by_for_writers(handler: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(handler)
    def handle(self: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.variables.lists import BaseListVariable

        for vt in [*args, *kwargs.values()]:
            writer = next((v for v in (vt.items if isinstance(vt, BaseListVariable) else [vt]) if _may_write(v)), None)
            if writer is None:
                continue
            if name in _REFUSED_REWRITES:
                cls = type(writer.proxy.node.meta["example_value"])
                _graph_break_class(
                    RefusalKind.TRACED_OPS_DIFFER, cls, "<dispatch>", f"torch.{name} rewritten by Dynamo",
                    f"Dynamo puts other ops in the graph for torch.{name} given a {cls.__name__} than "
                    "the op eager hands dispatch",
                )
            return None
        return handler(self, tx, *args, **kwargs)

    return handle


# Note [A subclass value Dynamo does not track]
# Writes on a tensor the graph computed are recorded through the variable Dynamo tracks for
# attribute writes on it (``intermediate_vt``). Some values have none: the items of an op's
# tuple result (``torch.split(x, 1)[0]``, made by ``_wrap_fx_preexisting_tensor``, which
# tracks nothing; tracked here for a class that may write), ``x.data`` before Note [A tensor
# property on a subclass]. An op on such a value runs as stock
# fake propagation does: what dispatch writes on it is lost, and a write on shared state it
# reaches (a registered ctx object) lands on the real object while traced and is then
# replayed over. An op a class whose code may write state is handed such a value is
# refused (``traced_ops_differ``) before it runs: a graph break, eager from there.


def make_preexisting_tensor_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``builder._wrap_fx_preexisting_tensor``, which makes the variables of
    the items of an op's tuple result (``torch.split``, ``unbind``) without tracking them for
    attribute writes, as ``handle_traced_output`` tracks any other tensor the graph computed:
    a subclass item whose class may write is tracked alike (See Note [A subclass value Dynamo
    does not track])."""

    @functools.wraps(original)
    def _wrap_fx_preexisting_tensor(target_cls: Any, tx: Any, proxy: Any, tensor: Any, subclass_type: Any = None, **options: Any) -> Any:
        from torch._dynamo.variables import TensorVariable
        from torch._dynamo.variables.base import AttributeMutationNew
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        vt = original(target_cls, tx, proxy, tensor, subclass_type, **options)
        if (
            proxy.node.op != "placeholder"
            and options.get("source") is None
            and isinstance(vt, TensorVariable)
            and vt.mutation_type is None
            and is_traceable_wrapper_subclass(tensor)
            and _a_new_item(proxy.node, tensor)
            and free_state.class_may_write(type(tensor))
        ):
            tx.output.side_effects._track_obj(proxy, vt, mutation_type_cls=AttributeMutationNew)
        return vt

    return _wrap_fx_preexisting_tensor


def _a_new_item(node: torch.fx.Node, tensor: Any) -> bool:
    """``node`` takes an item of an op's result that appears once in it and is none of the
    op's inputs (torch 2.15's own rule for tracking them): a new object in eager too."""
    if node.op != "call_function" or node.target is not operator.getitem or not node.args:
        return False
    made_by = node.args[0]
    if not isinstance(made_by, torch.fx.Node):
        return False
    items = made_by.meta.get("example_value")
    if not isinstance(items, (tuple, list)) or sum(v is tensor for v in items) != 1:
        return False
    return not any(
        v is tensor
        for arg in made_by.all_input_nodes
        for v in torch.utils._pytree.tree_leaves(arg.meta.get("example_value"))
    )


def _refuse_untracked(node: torch.fx.Node) -> NoReturn:
    """See Note [A subclass value Dynamo does not track]."""
    cls = type(node.meta["example_value"])
    made_by = node.target if node.op != "call_function" else getattr(node.target, "__name__", node.target)
    _graph_break_class(
        RefusalKind.TRACED_OPS_DIFFER, cls, "<dispatch>", f"a {cls.__name__} Dynamo does not track ({made_by})",
        f"an op is handed a {cls.__name__} made by {made_by}, which Dynamo does not track for attribute "
        "writes: what its dispatch writes could not be recorded",
    )


# Note [A dispatch frame Dynamo would compile]
# Code that runs eagerly while Dynamo's frame hook is set (a frame Dynamo skipped after a
# graph break in a loop, the part after a graph break it could not resume) calls a
# subclass's ``__torch_dispatch__`` as a Python frame, which Dynamo then compiles on its
# own, on real tensors: a ctx int left symbolic, or an analysis that restarts and diverges
# (``SpeculationLogDivergence``, an outside tester's find). Eager runs dispatch as Python:
# the dispatch code of a class whose code may write, once traced, is marked to run eagerly
# (with what it calls), as a refused op's is.


def _dispatch_runs_eagerly(cls: type) -> None:
    """See Note [A dispatch frame Dynamo would compile]."""
    from . import _patches

    code = _dispatch_code(cls)
    if code is not None and free_state.is_user_code(code.co_filename) and not _patches.CODE_MARKS.is_marked(code):
        _patches.CODE_MARKS.run_eagerly(code)


def _dispatch_code(cls: type) -> types.CodeType | None:
    """The code of the class's ``__torch_dispatch__`` (a classmethod or a staticmethod)."""
    fn = getattr(cls, "__torch_dispatch__", None)
    return getattr(getattr(fn, "__func__", fn), "__code__", None)


def _graph_break_class(
    kind: RefusalKind, cls: type, attr: str, value_type: str, context: str, hint: str = "", reader: str = ""
) -> NoReturn:
    """``_graph_break`` for a class (no tracked object)."""
    from . import _patches

    code = _dispatch_code(cls)
    if code is not None:
        _patches.CODE_MARKS.run_eagerly(code)
    refuse(kind, cls.__name__, attr, value_type, context, hint, reader)


def _graph_break(kind: RefusalKind, t: Tracked, attr: str, value_type: str, context: str, hint: str = "") -> NoReturn:
    """Refuse a write or read (a graph break, or an error under fullgraph=True).

    After the graph break the op runs eagerly from the user's frame, and Dynamo would
    try to compile the subclass's ``__torch_dispatch__`` frame itself (and the
    functions it calls), on the real input, where the same state problem comes back
    under a stock error.  Dispatch frames are run eagerly instead, recursively, which
    is what the graph break means (a code mark ``disable()`` undoes).
    """
    _graph_break_class(kind, type(t.obj), attr, value_type, context, hint)


# --------------------------------------------------------------------------- #
# Recording helpers
# --------------------------------------------------------------------------- #


def _constant_vt(tx: Any, value: Any) -> Any:
    from torch._dynamo.source import GlobalSource
    from torch._dynamo.variables import ConstantVariable
    from torch._dynamo.variables.builder import SourcelessBuilder, VariableBuilder

    if ConstantVariable.is_literal(value):
        return ConstantVariable.create(value)
    try:
        vt = SourcelessBuilder.create(tx, value)
        if vt.is_python_constant() and vt.as_python_constant() == value:
            return vt
    except Exception:  # SourcelessBuilder raises Unsupported for types it cannot build
        pass
    # Immutable objects Dynamo cannot build without a source (frozen dataclasses,
    # some enums): replay them from a global holding the exact object.
    name = tx.output.install_global_by_id("__dynamo_ext_value", value)
    return VariableBuilder(tx, GlobalSource(name))(value)


# --------------------------------------------------------------------------- #
# The two hooks
# --------------------------------------------------------------------------- #


def _tensor_arg_nodes(node: torch.fx.Node, subclass: bool) -> list[torch.fx.Node]:
    """The argument nodes of ``node`` whose example value is a wrapper subclass (``subclass``)
    or a plain tensor (not ``subclass``), each once, in argument order."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    found: list[torch.fx.Node] = []

    def visit(arg: torch.fx.Node) -> torch.fx.Node:
        value = arg.meta.get("example_value")
        if arg not in found and isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value) == subclass:
            found.append(arg)
        return arg

    torch.fx.node.map_arg((node.args, node.kwargs), visit)
    return found


def _subclass_arg_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    return _tensor_arg_nodes(node, subclass=True)


# Note [A whole-dim slice under symbolic sizes]
# C++ indexing skips a slice that covers its dim (``x[:, 0]`` hands dispatch one ``select``)
# when it can tell it does: always with eager's sizes, but not with a symbolic size (dynamic
# shapes, automatic dynamic from the second shape on), where it hands dispatch a ``slice``
# first. For a subclass that may write, such an indexing node becomes
# ``handoff.getitem_as_eager`` (``setitem_as_eager`` for ``x[:, 0] = v``), which gives each
# ``:`` its dim's own size (``0:s0:1``): C++ then skips it while traced too, and at run time
# as in eager. A slice from the start whose stop reaches the end (``0:100`` on 5 rows, which
# eager clamps) is given it too, guarded on the stop reaching the size.


def _index_as_eager(node: torch.fx.Node) -> None:
    """See Note [A whole-dim slice under symbolic sizes]."""
    x = node.args[0] if node.args else None
    example = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
    index = node.args[1] if len(node.args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    if (
        not isinstance(example, torch.Tensor)
        or not any(handoff.whole_dim_candidate(i) for i in items)
        or not any(isinstance(s, torch.SymInt) for s in example.shape)
        or not _may_write_example(example)
    ):
        return
    node.target = handoff.getitem_as_eager if node.target is operator.getitem else handoff.setitem_as_eager
    handoff.cacheable(node)


# Note [Dispatch an op runs on tensors it is not given]
# A node's fake propagation can run a subclass's dispatch on instances that are not among
# its arguments: ``torch.func.grad`` / ``vjp`` / ``jacrev`` put a backward in the graph (one
# ``_autograd_grad`` node over plain tensors), whose ops reach a weight through what autograd
# saved. Run outside the capture block, what dispatch wrote there went onto the fake (taken,
# at the next op, for torch's doing) and what it read was the fake's: the compiled call left
# only the forward's writes on backend="eager" (an outside tester's find) and was refused on
# aot_eager. Once the frame tracks a subclass, the propagation of every node but torch's
# ops on their own arguments (aten ops, torch functions and tensor methods, operators; not a
# backward, a higher-order op or a user function) runs in the block, so writes on whatever
# tracked object it reaches are recorded and its reads answered.


def make_fake_value_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``torch._dynamo.utils._get_fake_value_impl``."""

    @functools.wraps(original)
    def _get_fake_value_impl(node: torch.fx.Node, tx: Any, allow_non_graph_fake: bool = False) -> Any:
        if node.op == "placeholder" or "example_value" in node.meta:
            return original(node, tx, allow_non_graph_fake)  # nothing runs
        if _builds_a_user_subclass(node):
            return _build_watched(node, tx, original, allow_non_graph_fake)
        _refuse_a_tensor_dispatch_changed(tx, node)
        _refuse_a_subclass_the_program_changed_under(tx, node)
        args = _subclass_arg_nodes(node)
        if not args:
            state = tx.output.__dict__.get(_STATE_KEY)
            if state is None or not state.scope.tracked or _runs_only_on_its_arguments(node):
                return original(node, tx, allow_non_graph_fake)
            return _propagate(state, node, tx, original, allow_non_graph_fake, [])
        if node.target is operator.getitem or node.target is operator.setitem:
            _index_as_eager(node)
        state = frame_state(tx)
        pairs = [(a, state.track_arg(a)) for a in args]
        for a, t in pairs:
            if t is None and free_state.class_may_write(type(a.meta["example_value"])):
                _refuse_untracked(a)
        tracked = [t for _, t in pairs if t is not None]
        if not tracked:
            return original(node, tx, allow_non_graph_fake)
        for arg in _tensor_arg_nodes(node, subclass=False):
            state.track_plain_arg(arg)
        result = _propagate(state, node, tx, original, allow_non_graph_fake, tracked)
        _refuse_a_written_view_of_a_changed_tensor(tx, state)
        _refuse_a_rebuild_changing_held_state(result)
        return result

    return _get_fake_value_impl


def _refuse_a_rebuild_changing_held_state(result: Any) -> None:
    """Note [A result whose rebuild changes the state its ctx holds]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Dispatch returns a subclass whose ctx holds a registered state object or another object
    of the user's, and whose ``__tensor_unflatten__`` (or the constructor it runs) changes that
    object or a module global (a partial's ``__init__`` counting its holders on the mask
    buffer, a tracker counting rebuilds). The AOT backends hand back such an
    output rebuilt through ``__tensor_unflatten__`` each call, where eager builds it once: the
    compiled call raised ``stale_plan`` at run time, under ``fullgraph=False`` too (an outside
    tester's find). The result is rebuilt once while traced, under a watch; a change is put
    back and the op refused (``global_state_write``), so under ``fullgraph=False`` it runs
    eagerly. The same rebuild of an input is refused where Dynamo fakes it (See Note [A state
    object __tensor_unflatten__ changes])."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for leaf in torch.utils._pytree.tree_leaves(result):
        if not is_traceable_wrapper_subclass(leaf):
            continue
        objects = _ctx_objects(leaf)
        if not objects:
            continue
        held = [(o, dict(vars(o))) for o in objects]
        with capture.unobserved():
            names, ctx = leaf.__tensor_flatten__()
            inner = {n: getattr(leaf, n) for n in names}
        with _constructor_watch(type(leaf)).watching(process=False) as changed, capture.unobserved():
            try:
                type(leaf).__tensor_unflatten__(inner, ctx, leaf.size(), leaf.stride())
            except Exception:  # noqa: BLE001 - only what it changes matters here
                pass
        what = [f"{c.module}.{c.name}" for c in changed]
        for o, before in held:
            what.extend(
                f"{type(o).__name__}.{c.name}"
                for c in free_state.put_back_instance(o, before, "set by a rebuild of the result while traced")
            )
        if what:
            _graph_break_class(
                RefusalKind.GLOBAL_STATE_WRITE, type(leaf), what[0], "an object its ctx holds",
                f"{type(leaf).__name__}.__tensor_unflatten__ or its constructor changed {what[0]}; the AOT "
                "backends rebuild each subclass output through it every call, where eager builds it once",
                hint="Leave the state the ctx holds unchanged in __tensor_unflatten__ and __init__ "
                "(fullgraph=False runs the op eagerly).",
                reader=f"{type(leaf).__name__}.__tensor_unflatten__",
            )


def _constructor_watch(cls: type) -> free_state.ModuleWatch:
    """A watch of the state a subclass's constructor or ``__tensor_unflatten__`` may change
    beside the instance: its classes' modules (their globals and the containers they hold),
    the objects of user classes those globals hold (``REG.created += 1``,
    ``REG.live.append(self)``) and its classes' own attributes."""
    watch = free_state.ModuleWatch()
    for klass in cls.__mro__:
        if not free_state.is_user_class(klass):
            continue
        watch.add(klass.__module__)
        module = sys.modules.get(klass.__module__)
        for name, value in free_state.namespace_items(vars(module)) if module is not None else []:
            if (free_state.is_user_class(type(value)) or free_state.is_namespace(value)) and not isinstance(
                value, (type, torch.Tensor, torch.nn.Module)
            ):
                watch.add_object(f"{klass.__module__}.{name}", value)
    watch.add_class(cls)
    return watch


def _builds_a_user_subclass(node: torch.fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function" and isinstance(target, type) and issubclass(target, torch.Tensor)
        and free_state.is_user_class(target)
    )


def _build_watched(node: torch.fx.Node, tx: Any, original: Callable[..., Any], allow: bool) -> Any:
    """Note [A subclass the compiled function builds]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The compiled function builds a subclass itself (``q = Int8W(data, scale)``): Dynamo puts
    the class in the graph as a call, and its fake propagation runs ``__new__`` and
    ``__init__`` on fakes. A constructor that counts in a module global or on its class
    (``uid = _NEXT; _NEXT += 1``) counted that fake: on ``backend="eager"`` the count moved
    twice a call (the guard on the global it reads recompiled each call), and the AOT
    backends rebuild the output from the traced ctx without calling it (an outside tester's
    find; stock moves it once more at compile). The propagation runs under a watch of the
    class's modules and class attributes; what it changed is put back and the call graph-breaks
    (``global_state_write``; ``fullgraph=True``: refused), so the constructor runs in eager, its code left uncompiled."""
    cls = node.target
    watch = _constructor_watch(cls)
    with watch.watching(process=False) as changed:
        result = original(node, tx, allow)
    if changed:
        from . import _patches

        for klass in (k for k in cls.__mro__ if free_state.is_user_class(k)):
            for name in ("__new__", "__init__"):  # run whole in eager, not from a resumed half
                fn = klass.__dict__.get(name)
                fn = getattr(fn, "__func__", fn)  # ``__new__`` is a staticmethod
                if isinstance(fn, types.FunctionType):
                    _patches.CODE_MARKS.run_eagerly(fn.__code__)
        change = changed[0]
        _graph_break_class(
            RefusalKind.GLOBAL_STATE_WRITE, cls, f"{change.module}.{change.name}", change.what,
            f"{cls.__name__}'s constructor, called in the compiled function, changed {change.module}.{change.name}; "
            "the compiled call builds it from what the trace saw",
            hint="Build the subclass outside the compiled function, or keep the constructor from changing "
            "module or class state (fullgraph=False runs the call eagerly).",
            reader=f"{cls.__name__}.__init__",
        )
    return result


def _refuse_a_tensor_dispatch_changed(tx: Any, node: torch.fx.Node) -> None:
    """Refuse an op handed a tensor on a storage an earlier op's dispatch changed in place
    (See Note [An inner tensor dispatch changes in place] in capture.py)."""
    state = tx.output.__dict__.get(_STATE_KEY)
    changed = state.scope.changed_in_place if state is not None else None
    if not changed:
        return
    for arg in _tensor_arg_nodes(node, subclass=False):
        key = capture.storage_key(arg.meta["example_value"])
        obj, name = changed.get(key, (None, ""))
        if obj is not None and _taken_in_before_the_graph(arg, key, name):
            _refuse_the_frame(
                tx, RefusalKind.UNSUPPORTED_STATE_READ, type(obj), name, "Tensor",
                f"dispatch changed the tensor it holds in place at an earlier op, and the compiled "
                f"function computes with that tensor ({arg.name}) after it; the compiled graph would "
                "read it from before that op",
                hint="Read it outside the compiled function (fullgraph=False runs the frame eagerly).",
                reader="the compiled function",
            )


def _refuse_a_written_view_of_a_changed_tensor(tx: Any, state: FrameState) -> None:
    """Note [A written view of a tensor dispatch changes in place]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Dispatch writes a view of a tensor an attribute holds (``self.recent = self.hist[:2]``,
    ``self.row0 = self.elem[0]``, ``self.hist.detach()``), and in the same graph dispatch
    changes that tensor in place (rolls the history, ``w.mul_(0.5)``), before or after the
    write. In eager the attribute stays a view and follows every later change of the tensor.
    The AOT backends write an inner tensor's change back into the caller's tensor after the
    graph and return the written view as a graph output computed from the new value, on a
    storage of its own: it kept the values of the call, silently (an outside tester's find,
    a QLoRA loop's kept history stale after its optimizer steps). Without the change in place
    the output is regenerated as a view of the caller's tensor and stays one. Refused
    (``opaque_value``); under ``fullgraph=False`` the frame runs eagerly."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    changed = state.scope.changed_in_place
    if not changed:
        return
    _refuse_a_changed_tensor_two_inputs_hold(tx, state, changed)
    # the storages of tensors the caller's objects held when the trace took them (a tensor the
    # graph made, written and then changed in place, is a graph output of its own: no view)
    taken_in = {
        capture.storage_key(v)
        for t in list(state.scope.tracked.values())
        if t.real is not None and not t.born
        for v in t.entry.values()
        if isinstance(v, torch.Tensor) and not is_traceable_wrapper_subclass(v)
    }
    for t in list(state.scope.tracked.values()):
        for name in t.written:
            value = t.expected.get(name)
            if (
                not isinstance(value, torch.Tensor) or is_traceable_wrapper_subclass(value)
                or value is t.entry.get(name)
            ):
                continue
            key = capture.storage_key(value)
            if key in changed and key in taken_in:
                holder, held = changed[key]
                _refuse_the_frame(
                    tx, RefusalKind.OPAQUE_VALUE, type(t.obj), name, "Tensor",
                    f"dispatch wrote {name!r} as a view of the tensor {type(holder).__name__} holds as {held!r}, "
                    "which dispatch changes in place in the same graph; the compiled program would hand "
                    "back a copy that no longer follows that tensor",
                    hint="Write a copy (.clone()) or keep the index and take the view where it is used "
                    "(fullgraph=False runs the frame eagerly).",
                    reader=f"{t.cls_name}.__torch_dispatch__",
                )


def _refuse_a_changed_tensor_two_inputs_hold(tx: Any, state: FrameState, changed: dict[int, tuple[Any, str]]) -> None:
    """Note [A tensor two inputs hold, changed in place by dispatch]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Two subclass inputs hold one tensor (a scale shared by the weights of a float8 model), and
    dispatch changes it in place through one of them. AOTAutograd takes each input's inner
    tensors as inputs of their own, not knowing they alias: stock lost the change and computed
    the second weight's op from the old value, silently; with dynamo_ext's write-back
    AOTAutograd failed on its own graph check, under ``fullgraph=False`` too (an outside
    tester's find). Refused (``unsupported_state_read``); under ``fullgraph=False`` the frame
    runs eagerly. One object handed twice holds it once, and compiles."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    holders: dict[int, list[tuple[Any, str, Any]]] = {}
    for t in list(state.scope.tracked.values()):
        if t.real is None or t.born or not isinstance(t.obj, torch.Tensor):
            continue
        for name, value in capture.obj_dict(t.obj).items():
            if isinstance(value, torch.Tensor) and not is_traceable_wrapper_subclass(value):
                key = capture.storage_key(value)
                if key in changed:
                    holders.setdefault(key, []).append((t.obj, name, value))
    for held in holders.values():
        # the storage held by two inputs, or by two tensors in one input's flatten list
        # (``hist = elem[:]``: AOTAutograd takes each inner tensor as an input of its own; an
        # outside tester's find, the next op computing from the value before the change). One
        # tensor under two names, or one object handed twice, holds it once.
        pair = next(
            (
                (a, b) for i, a in enumerate(held) for b in held[i + 1:]
                if a[0] is not b[0] or (a[2] is not b[2] and {a[1], b[1]} <= _flatten_names_of(a[0]))
            ),
            None,
        )
        if pair is not None:
            (first, name, _), (second, other, _) = pair
            _refuse_the_frame(
                tx, RefusalKind.UNSUPPORTED_STATE_READ, type(first), name, "Tensor",
                f"two inputs, or two inner tensors of one, hold one storage ({type(first).__name__}.{name} and "
                f"{type(second).__name__}.{other}) and dispatch changes it in place; the AOT backends take each "
                "tensor apart and would not carry the change from one to the other",
                hint="Keep the shared tensor in one object (a registered ctx state) or change it "
                "outside the compiled function (fullgraph=False runs the frame eagerly).",
                reader=f"{type(first).__name__}.__torch_dispatch__",
            )


def _flatten_names_of(obj: Any) -> frozenset[str]:
    with capture.unobserved():  # a look of dynamo_ext's own, not a read of dispatch's
        return frozenset(capture._flatten_names(obj))


_IN_PLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul,
})


def _changes_its_first_argument(node: torch.fx.Node) -> bool:
    """An op of the compiled function that changes its first argument in place (``t.mul_(2)``,
    ``t[0] = v``, ``t += 1``)."""
    target = node.target
    if node.op == "call_method":
        return isinstance(target, str) and target.endswith("_") and not target.startswith("_")
    if node.op != "call_function":
        return False
    if target in _IN_PLACE_OPERATORS:
        return True
    if isinstance(target, torch._ops.OpOverload):
        first = target._schema.arguments[0].alias_info if target._schema.arguments else None
        return first is not None and first.is_write
    name = getattr(target, "__name__", "")
    return getattr(target, "__objclass__", None) is torch._C.TensorBase and name.endswith("_") and not name.startswith("_")


def _refuse_a_subclass_the_program_changed_under(tx: Any, node: torch.fx.Node) -> None:
    """Note [An inner tensor the compiled function changes in place]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The compiled function changes in place a tensor that is also an inner tensor of a subclass
    input whose class may write (``w.elem.mul_(2)``, then ``w * y``). Dynamo made ``w.elem`` a
    graph input of its own, which AOTAutograd does not know aliases ``w``'s inner tensor:
    the later op's dispatch computed from the value before the change, silently (stock
    alike; an outside tester's find, once a view attribute of ``elem`` made it loud). An op
    handed that subclass after such a change is refused (``unsupported_state_read``); under
    ``fullgraph=False`` the whole frame runs eagerly (``_refuse_the_frame``)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    program_changed = tx.output.__dict__.get(_PROGRAM_CHANGED_KEY)
    if _changes_its_first_argument(node) and isinstance(node.args[0] if node.args else None, torch.fx.Node):
        changed = node.args[0].meta.get("example_value")
        if isinstance(changed, torch.Tensor) and not is_traceable_wrapper_subclass(changed):
            key = capture.storage_key(changed)
            # a graph input of its own (``w.elem``), or a view the graph took of one; not a
            # tensor an op on the subclass handed out (``x.data``), whose change AOTAutograd traces
            if key is not None and _taken_in_before_the_graph(node.args[0], key, ""):
                tx.output.__dict__.setdefault(_PROGRAM_CHANGED_KEY, set()).add(key)
        return
    if not program_changed:
        return
    for arg in _subclass_arg_nodes(node):
        value = arg.meta["example_value"]
        if not any(free_state.class_may_write(type(v)) for v in _subclass_nest(value)):
            continue
        for inner in value.__tensor_flatten__()[0]:
            held = getattr(value, inner, None)
            if is_traceable_wrapper_subclass(held):
                # a subclass nested in it (``w.inner.data_``) counts by its own inner tensors
                keys = {capture.storage_key(t) for t in capture.inner_plain_tensors(held)}
            elif isinstance(held, torch.Tensor):
                keys = {capture.storage_key(held)}
            else:
                continue
            if keys & program_changed:
                _refuse_the_frame(
                    tx, RefusalKind.UNSUPPORTED_STATE_READ, type(value), inner, "Tensor",
                    f"the compiled function changed in place a tensor that is also {arg.name}'s inner tensor "
                    f"{inner!r} before this op; the AOT backends would hand dispatch the value from before "
                    "the change",
                    hint="Change it through the subclass's own op, or outside the compiled function "
                    "(fullgraph=False runs the frame eagerly).",
                    reader="the op after the compiled function changed it in place",
                )


def _subclass_nest(value: Any, depth: int = 0) -> list[Any]:
    """``value`` and the subclass instances nested in its flatten list, theirs too."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    found = [value]
    if depth > 4:
        return found
    with capture.unobserved():
        held = [getattr(value, name, None) for name in value.__tensor_flatten__()[0]]
    for h in held:
        if is_traceable_wrapper_subclass(h):
            found.extend(_subclass_nest(h, depth + 1))
    return found


def _refuse_the_frame(
    tx: Any, kind: RefusalKind, cls: type, attr: str, value_type: str, context: str, hint: str, reader: str
) -> NoReturn:
    """Refuse where the cause lies in an earlier op of the frame (an in-place change the graph
    made): a graph break here would keep that op compiled, whose write-back differs from eager
    (an inner tensor's ``_version`` bumped twice), so under ``fullgraph=False`` the whole frame
    runs eagerly; under ``fullgraph=True`` it is Dynamo's ``Unsupported``."""
    if not _under_fullgraph(tx):
        from .errors import SubclassWriteError

        raise _RunFrameEagerly(SubclassWriteError(kind, cls.__name__, attr, value_type, context))
    _graph_break_class(kind, cls, attr, value_type, context, hint=hint, reader=reader)


def _taken_in_before_the_graph(node: torch.fx.Node, key: int, name: str) -> bool:
    """Whether ``node``'s value on storage ``key`` is a graph input's, or a view the graph took of
    one, other than the one the traced object holds attribute ``name`` by: the value a
    ``seed_attr`` node hands it, or one it hands the graph after an op (a ``read_attr`` of a
    tensor dispatch wrote). The AOT backends trace dispatch's changes in place on those."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if len(seen) >= _MAX_ITEMS_GUARDED:
            return True  # too far to follow: taken as a graph input's
        seen.add(n)
        value = n.meta.get("example_value")
        if not isinstance(value, torch.Tensor) or is_traceable_wrapper_subclass(value):
            continue
        if capture.storage_key(value) != key:
            continue
        if n.op in ("placeholder", "get_attr"):
            if not any(u.target is handoff.seed_attr and u.args[2] == name and u.args[3] is n for u in n.users):
                return True
            continue  # the value the traced object holds it by (seeded): its changes are traced
        stack.extend(n.all_input_nodes)
    return False


#: Modules of torch whose functions may run the autograd engine (a backward reaching what
#: autograd saved) or other code on tensors a node is not given (higher-order ops' bodies).
_REACHING_MODULES = ("torch.autograd", "torch._functorch", "torch.ops.higher_order", "torch._higher_order_ops", "torch.utils.checkpoint")


def _runs_only_on_its_arguments(node: torch.fx.Node) -> bool:
    """An op of torch's own that runs nothing but itself on its arguments (aten ops, torch's
    functions and tensor methods, operators; not a backward or a higher-order op): its fake
    propagation cannot run dispatch on a tensor it is not given."""
    target = node.target
    if node.op == "call_method":
        return target != "backward"
    if node.op != "call_function" or target is torch.Tensor.backward:
        return False
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    if isinstance(target, torch._ops.HigherOrderOperator):
        return False
    if getattr(target, "__objclass__", None) is torch._C.TensorBase:
        return True
    module = getattr(target, "__module__", None) or ""
    if module in ("_operator", "builtins", "math"):
        return True
    return (module == "torch" or module.startswith("torch.")) and not module.startswith(_REACHING_MODULES)


_AUTOGRAD_METHODS = frozenset({"requires_grad_", "detach_", "retain_grad", "register_hook", "register_post_accumulate_grad_hook"})


def _sets_autograd_state(node: torch.fx.Node) -> bool:
    """An op of the compiled function's own that sets its argument's autograd state
    (``x.requires_grad_()``): the change is the op's, not dispatch's."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    return name in _AUTOGRAD_METHODS


# See Note [Reads that answer otherwise while traced]
_TRACE_STATE_NAMES = frozenset({
    "is_compiling", "is_dynamo_compiling", "is_exporting", "TracingContext", "is_fake", "detect_fake_mode",
    "maybe_get_fake_mode", "is_shared", "is_inference", "is_pinned",
})

_MAX_ITEMS_GUARDED = 64  # items of a container guarded one by one


def _propagate(
    state: FrameState, node: torch.fx.Node, tx: Any, original: Callable[..., Any], allow: bool, tracked: list[Tracked]
) -> Any:
    scope = state.scope

    def blame() -> Tracked:  # the object a refusal names
        return tracked[0] if tracked else _first_subclass(state, node)

    outer_node = state._node  # fake propagation can nest (a value Dynamo builds while answering a read)
    state._node = node
    state.tx = tx
    try:
        for t in tracked:
            state.collector.add_class(type(t.obj))
            state.watch.add_class(type(t.obj))
            if state.collector.writes_attributes:
                _dispatch_runs_eagerly(type(t.obj))
        state.mark_program_writes()
        if tracked:
            try:
                state.refuse_free_state_the_program_changed()
                state.guard_free_reads()  # objects the classes' code reaches are tracked before it runs
            except _Refused as bad:
                _graph_break(*bad.args_)
        while True:
            checkpoint = _Checkpoint(scope)
            try:
                del scope.raised[:]
                del scope.caught[:]
                del scope.decomposed[:]
                scope.watch_caught = watched = state.collector.catches
                state.touched = False
                before = scope.autograd_states() if not _sets_autograd_state(node) else {}
                with scope.active(), state.watch.watching() as changes:
                    result = original(node, tx, allow)
                # a node given no subclass that reached none (See Note [Dispatch an op runs
                # on tensors it is not given]): nothing of dispatch's ran
                reached = bool(tracked) or state.touched
                if state.collector.catches and not watched:
                    checkpoint.rollback()  # code found while it ran handles exceptions: again, watched
                    continue
                writes = scope.settle()
                scope.refuse_changed_class(before)
                if tracked:
                    made = capture.made_tensors(result) if _runs_only_on_its_arguments(node) else []
                    scope.refuse_autograd_set_by_hand(tracked[0], before, made, writes)
                users = _users_own(scope.raised)
                if users:
                    raise _Refused(*_swallowed_refusal(state, node, users))
                caught = capture.caught_here(scope, scope.raised)
                if caught is not None:
                    raise _Refused(*_caught_refusal(state, node, caught))
                if scope.decomposed and (state.collector.writes_attributes or writes):
                    raise _Refused(
                        RefusalKind.TRACED_OPS_DIFFER, _first_subclass(state, node), "<dispatch>",
                        scope.decomposed[0][1], capture.split_context(scope.decomposed[0]),
                    )
                if changes:
                    change = changes[0]
                    raise _Refused(
                        RefusalKind.GLOBAL_STATE_WRITE, _first_subclass(state, node), f"{change.module}.{change.name}",
                        change.what, f"{len(changes)} module global(s) changed while tracing: "
                        + ", ".join(f"{c.module}.{c.name} ({c.what})" for c in changes),
                    )
                if reached and state.guard_free_reads():
                    checkpoint.rollback()
                    continue
            except _NeedsWatch:
                checkpoint.rollback()
                try:
                    state.guard_free_reads()
                except _Refused as bad:
                    _graph_break(*bad.args_)
                continue
            except _NeedsSeed as need:
                checkpoint.rollback()
                try:
                    state.seed_tensor(need.tracked, need.name)
                except _Refused as bad:  # a tensor read it cannot seed (inside a higher-order op body)
                    _graph_break(*bad.args_)
                continue
            except _Refused as bad:
                checkpoint.rollback()
                _graph_break(*bad.args_)
            except capture.FlattenMismatch as bad:
                checkpoint.rollback()
                if isinstance(bad, capture.MarkedDynamic) and not _under_fullgraph(tx):
                    raise _RunFrameEagerly(bad.as_refusal())
                _graph_break(RefusalKind[bad.kind_name], bad.tracked or blame(), bad.name, bad.value_type, bad.context, bad.hint)
            except Exception as exc:
                checkpoint.rollback()
                user = _raised_by_user_code(exc)
                users = _users_own(scope.raised)
                if users and user is None:
                    # What left dispatch was turned into another error on the way (a binary
                    # operator's TypeError, raised again by its reflected call, comes out of
                    # the user's ``w * x`` line with torch's frames below it)
                    _graph_break(*_swallowed_refusal(state, node, users))
                if user is not None:
                    # named by what left dispatch, not torch's wrapper around it (an outside
                    # tester's find: "raised RuntimeError" for the user's own exception class)
                    user = capture.left_dispatch(exc, scope.raised) or user
                    _graph_break(RefusalKind.DISPATCH_RAISED, blame(), "<dispatch>", type(user).__name__, repr(user)[:300])
                if state.tensor_reads and _real_tensor_in_fake_propagation(exc):
                    _graph_break(
                        RefusalKind.UNSUPPORTED_STATE_READ, blame(), next(iter(state.tensor_reads)), "Tensor",
                        "dispatch computes with a real tensor it reaches through a global or closure variable "
                        f"({', '.join(state.tensor_reads)}): the compiled program cannot take it as an input",
                    )
                caught = capture.caught_here(scope, scope.raised)
                if caught is not None:  # what dispatch caught left the op in a state it failed on
                    _graph_break(*_caught_refusal(state, node, caught))
                left = capture.left_dispatch(exc, scope.raised)
                if left is not None:
                    _graph_break(
                        RefusalKind.DISPATCH_RAISED, blame(), "<dispatch>", type(left).__name__,
                        f"{type(left).__name__} left dispatch while traced ({str(left)[:200]!r}): dispatch "
                        "cannot be traced there (a branch on tensor data)",
                    )
                raise
            except BaseException:
                checkpoint.rollback()
                raise
            break
        try:
            if writes:
                state.record_writes(scope.net_writes(writes))
        except _Refused as bad:
            _graph_break(*bad.args_)
        return result
    finally:
        state._node = outer_node
        state.collector.forget_frame()  # a finished frame keeps its locals (fakes) alive


def _holds_unbacked(value: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    parts = value if isinstance(value, (tuple, torch.Size)) else (value,)
    return any(isinstance(p, SYMBOLIC_TYPES) and free_unbacked_symbols(p) for p in parts)


def _real_tensor_in_fake_propagation(exc: BaseException) -> bool:
    """Fake propagation failed on a real tensor among an op's arguments (FakeTensorMode's
    "Please convert all Tensors to FakeTensors first")."""
    return any("convert all Tensors to FakeTensors" in str(e) for e in capture.exception_chain(exc))


def _reading_frame() -> Any:
    """The user frame whose attribute read is being answered (the first frame up the stack
    that is neither dynamo_ext's nor torch's)."""
    own = os.path.dirname(__file__) + os.sep
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(own):
        frame = frame.f_back
    # a read torch made (not dispatch code) has torch's frame here
    return frame if frame is not None and free_state.is_user_code(frame.f_code.co_filename) else None


_TORCH_DIR = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep


def _users_own(raised: list[BaseException]) -> list[BaseException]:
    """The exceptions that left a user dispatch which are not torch's or dynamo_ext's own
    signals (a tensor to seed, a data-dependent guard)."""
    users = []
    for e in raised:
        if (type(e).__module__ or "").startswith(("torch", "dynamo_ext")):
            continue
        where = _raised_in(e)
        if where is not None and not os.path.realpath(where).startswith(_TORCH_DIR):  # not raised by torch
            users.append(e)
    return users


def _caught_refusal(state: FrameState, node: torch.fx.Node, caught: BaseException) -> tuple:
    """See Note [An exception dispatch caught while traced] in capture.py."""
    return (
        RefusalKind.DISPATCH_RAISED, _first_subclass(state, node), "<dispatch>", type(caught).__name__,
        capture.caught_context(caught),
    )


def _raised_in(exc: BaseException) -> str | None:
    """The file of the innermost frame ``exc`` passed through that is not dynamo_ext's own
    (an absent attribute is answered with AttributeError by the attribute hooks, on behalf
    of the user code that read it)."""
    own = os.path.dirname(__file__) + os.sep
    where = None
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not filename.startswith(own):
            where = filename
        tb = tb.tb_next
    return where


def _swallowed_refusal(state: FrameState, node: torch.fx.Node, raised: list[BaseException]) -> tuple:
    """Note [An exception dispatch raised that torch swallowed]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    An exception can leave a user dispatch while traced and the op still succeed: torch
    turns a TypeError from a binary operator's ``__torch_dispatch__`` into NotImplemented
    and runs the reflected operator, whose dispatch takes another branch (``args[0]`` is
    the plain tensor). Traced values raise where eager's do not: a count or size that
    became symbolic has no ``divmod``, no 3-argument ``pow``, no numpy ufuncs. The trace
    then recorded the other path (a write lost, silently: an outside tester's find), so
    the op is refused; eager under ``fullgraph=False``."""
    exc = raised[0]
    return (
        RefusalKind.DISPATCH_RAISED, _first_subclass(state, node), "<dispatch>", type(exc).__name__,
        f"dispatch raised {type(exc).__name__}({str(exc)[:200]!r}) while traced and torch went on "
        "another way (a binary operator's reflected call): with the traced values (symbolic ints "
        "or sizes) dispatch can raise where eager does not",
    )


def _raised_by_user_code(exc: BaseException) -> BaseException | None:
    """The exception user code raised itself (``raise ValueError(...)`` in dispatch), not one
    torch raised (a shape error, a data-dependent guard, Dynamo's own signals); None if not."""
    for _ in range(4):  # torch wraps what fake propagation raised (TorchRuntimeError)
        inner = exc.__cause__ or exc.__context__
        if type(exc).__module__.startswith("torch._dynamo") and inner is not None:
            exc = inner
    module = type(exc).__module__ or ""
    if module.startswith(("torch", "dynamo_ext")) or not isinstance(exc, Exception):
        return None
    where = _raised_in(exc)
    return exc if where is not None and free_state.is_user_code(where) else None


def _first_subclass(state: FrameState, node: torch.fx.Node) -> Tracked:
    for arg in _subclass_arg_nodes(node):
        t = state.scope.lookup(arg.meta.get("example_value"))
        if t is not None:
            return t
    return next(iter(state.scope.tracked.values()))


_OP_BOUNDARY = frozenset({_propagate.__code__})


class _Checkpoint:
    """The tracked objects' state before an attempt at an op, to go back to if it is
    abandoned (a tensor to seed first, a refusal, an error)."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.n_events = len(scope.events)
        self.n_tracked = len(scope.tracked)
        self.saved = [
            (
                t, dict(capture.obj_dict(t.obj)), dict(t.expected), set(t.settled), set(t.absent), set(t.written),
                dict(t.containers), t.dict_complete,
            )
            for t in scope.tracked.values()
        ]

    def rollback(self) -> None:
        scope = self.scope
        for t, d, expected, settled, absent, written, containers, dict_complete in self.saved:
            capture.obj_dict(t.obj).clear()
            capture.obj_dict(t.obj).update(d)
            t.expected, t.settled, t.absent, t.written, t.containers = expected, settled, absent, written, containers
            t.dict_complete = dict_complete  # the answers put in the dict are gone with it
        # Objects first tracked during the attempt go back to how they were found.
        for t in list(scope.tracked.values())[self.n_tracked :]:
            if t.real is t.obj or t.real is None:
                capture.obj_dict(t.obj).clear()
                capture.obj_dict(t.obj).update(t.entry)
        del scope.events[self.n_events :]
        scope._settled_upto = min(scope._settled_upto, self.n_events)


#: Whether the frame Dynamo is compiling was called under ``torch.inference_mode`` (Dynamo
#: turns it off while it compiles). See Note [Inference mode while traced].
CALLER_INFERENCE_MODE: contextvars.ContextVar[bool] = contextvars.ContextVar("dynamo_ext_inference_mode", default=False)
#: The class-level state of the subclasses a compile fakes (See Note [Constructors torch
#: runs while compiling] in free_state.py).
COMPILE_WATCH: contextvars.ContextVar[free_state.CompileWatch | None] = contextvars.ContextVar(
    "dynamo_ext_compile_watch", default=None
)


def _eager_inference_mode(tx: Any) -> bool:
    """Whether eager runs the op being traced under inference mode (See Note [Inference mode
    while traced]): the innermost ``inference_mode`` block the traced code is in, else the
    caller's mode."""
    graph = tx.output.graph
    entered = graph.find_nodes(op="call_function", target=torch.autograd.grad_mode._enter_inference_mode)
    open_blocks = [n for n in entered if not n.users]  # the exit takes the enter node
    if open_blocks:
        return bool(open_blocks[-1].args[0])
    return CALLER_INFERENCE_MODE.get()


def make_inference_mode_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``maybe_disable_inference_mode`` as convert_frame binds it, which
    spans one frame's compile: notes the caller's inference mode before Dynamo turns it
    off, and puts back the class-level state of the subclasses the compile faked."""

    @functools.wraps(original)
    @contextlib.contextmanager
    def maybe_disable_inference_mode() -> Iterator[None]:
        token = CALLER_INFERENCE_MODE.set(torch.is_inference_mode_enabled())
        watch = free_state.CompileWatch()
        watch_token = COMPILE_WATCH.set(watch)
        try:
            with original():
                yield
        finally:
            COMPILE_WATCH.reset(watch_token)
            CALLER_INFERENCE_MODE.reset(token)
            for change in watch.restore():
                log.debug("put back %s.%s (%s) after the compile", change.module, change.name, change.what)

    return maybe_disable_inference_mode


def make_wrap_tensor_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``VariableBuilder.wrap_tensor``: See Note [Torch functions torch runs on
    a real input while compiling] in free_state.py."""

    @functools.wraps(original)
    def wrap_tensor(self: Any, value: Any) -> Any:
        if type(value) is torch.Tensor or type(value) is torch.nn.Parameter or not free_state.has_own_torch_function(value):
            return original(self, value)
        watch = COMPILE_WATCH.get()
        if watch is not None:
            watch.add_instance(value)
        before = dict(vars(value))
        try:
            return original(self, value)
        finally:  # before the traced code reads the instance dict
            free_state.put_back_instance(value, before)

    return wrap_tensor


def make_fakify_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for builder's ``_wrap_to_fake_tensor_and_record_impl``: a user subclass's
    class-level state is noted before Dynamo first fakes an instance of it in this compile
    (See Note [Constructors torch runs while compiling] in free_state.py)."""

    @functools.wraps(original)
    def _wrap_to_fake_tensor_and_record_impl(e: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        watch = COMPILE_WATCH.get()
        if watch is None or not is_traceable_wrapper_subclass(e):
            return original(e, *args, **kwargs)
        watch.add(type(e))
        watch.add_instance(e)
        held = [(o, dict(vars(o))) for o in _ctx_objects(e)]
        # the module globals of the classes it rebuilds: a constructor or unflatten counting in
        # a global container (``CREATED["n"] += 1``) counted the fakes too (See Note [A state
        # object __tensor_unflatten__ changes])
        module_watch = _constructor_watch(type(e))
        with module_watch.watching(process=False) as changed:
            made = original(e, *args, **kwargs)
        _refuse_unflatten_writes(e, held, changed)
        return made

    return _wrap_to_fake_tensor_and_record_impl


def _ctx_objects(e: Any) -> list[Any]:
    """The objects with state a subclass instance's rebuild may change: the registered state
    objects it reaches, and the user objects its flatten ctx holds, a nested subclass's too
    (a plain tracker an unflatten counts on, ``ctx[0].unflattens += 1``)."""
    found = {id(o): o for _, o in capture.find_state(e)}

    def walk(value: Any, depth: int) -> None:
        if depth > 4 or id(value) in found or isinstance(value, (type, types.ModuleType, torch.Tensor)) or callable(value):
            return
        if isinstance(value, (tuple, list)):
            for v in value[:64]:
                walk(v, depth + 1)
        elif isinstance(value, dict):
            for v in list(value.values())[:64]:
                walk(v, depth + 1)
        elif (free_state.is_user_class(type(value)) or free_state.is_namespace(value)) and isinstance(
            getattr(value, "__dict__", None), dict
        ):
            found[id(value)] = value
            for v in list(vars(value).values())[:64]:
                walk(v, depth + 1)

    for t in _subclass_nest(e):
        with capture.unobserved():
            walk(t.__tensor_flatten__()[1], 0)
    return list(found.values())


def _refuse_unflatten_writes(e: Any, held: list[tuple[Any, dict[str, Any]]], globals_changed: list[Any]) -> None:
    """Note [A state object __tensor_unflatten__ changes]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Eager never unflattens a subclass; torch does while compiling (Dynamo's fake of each input,
    AOTAutograd's passes) and, on the AOT backends, for each output of each call. A
    ``__tensor_unflatten__`` (or the constructor it runs) that changes a registered state object
    its ctx holds (``reg.rebuilds += 1``) changed the caller's real object as often as torch
    rebuilt, with no refusal; one counting in a module global (``STATS["unflat"] += 1``) failed
    inside Dynamo on aot_eager, the count moved (outside testers' finds). Dynamo's fake of the
    input is the first such rebuild: a change there is put back (the module globals by
    ``globals_changed``'s watch) and the program refused (``global_state_write``)."""
    if globals_changed:
        change = globals_changed[0]
        _refuse_rebuild(
            e, f"{change.module}.{change.name}", change.what,
            f"{type(e).__name__}.__tensor_unflatten__ or its constructor changed {change.module}.{change.name}",
            "Leave module state unchanged in __tensor_unflatten__ and __init__: torch rebuilds subclasses "
            "while compiling and for the outputs of compiled calls, where eager builds none.",
        )
    changed = None
    for o, before in held:
        put_back = free_state.put_back_instance(o, before, "set by a rebuild while compiling")
        if put_back and changed is None:
            changed = (o, put_back[0].name)
    if changed is not None:
        obj, name = changed
        _refuse_rebuild(
            e, f"{type(obj).__name__}.{name}", "an object its ctx holds",
            f"{type(e).__name__}.__tensor_unflatten__ changed {type(obj).__name__}.{name}",
            "Leave the state the ctx holds unchanged in __tensor_unflatten__: torch rebuilds subclasses "
            "while compiling and for the outputs of compiled calls, where eager builds none.",
        )


def _refuse_rebuild(e: Any, attr: str, value_type: str, context: str, hint: str) -> NoReturn:
    """Refuse a rebuild's change (``global_state_write``): under ``fullgraph=False`` the whole
    frame runs eagerly, since torch rebuilds again in every later graph of it and for their
    outputs (a graph break there left the later graphs counting, silently)."""
    cls = type(e).__name__
    reader = f"{cls}.__tensor_unflatten__"
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except AttributeError:
        tx = None
    if tx is not None and not _under_fullgraph(tx):
        error = SubclassWriteError(RefusalKind.GLOBAL_STATE_WRITE, cls, attr, value_type, context)
        raise _RunFrameEagerly(error)
    refuse(RefusalKind.GLOBAL_STATE_WRITE, cls, attr, value_type, context=context, hint=hint, reader=reader)


def _fullgraph(tx: Any) -> bool:
    """Whether a graph break would raise in ``tx`` (``fullgraph=True``, or Dynamo's
    ``error_on_graph_break``)."""
    return bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))


def _under_fullgraph(tx: Any) -> bool:
    """Whether a graph break would raise in ``tx`` or in the frame it is inlined into."""
    return _fullgraph(getattr(tx.output, "root_tx", tx)) or _fullgraph(tx)


def make_compile_subgraph_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``OutputGraph.compile_subgraph``: restore the traced objects, then
    compile with what the Dynamo layer recorded handed to the AOTAutograd layer."""

    @functools.wraps(original)
    def compile_subgraph(self: Any, *args: Any, **kwargs: Any) -> Any:
        state: FrameState | None = self.__dict__.get(_STATE_KEY)
        if state is None:
            # no subclass state traced here (a frame of dispatch code itself Dynamo compiles):
            # the AOTAutograd layer may still refuse (See _run_frame_eagerly)
            try:
                return original(self, *args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as e:
                refusal = _refusal_in(e)
                if refusal is None or _fullgraph(self.root_tx):
                    raise
                _run_frame_eagerly(self.root_tx, refusal)
        state.close()
        state.write_nested_on_entry_objects()
        if state.record.recorded:
            for source, value in state.custom_ctx_reads:
                guards.constant(source, value)
        fullgraph = _fullgraph(self.root_tx)
        state.record.fullgraph = fullgraph
        try:
            with handoff.handing_off(state.record):
                return original(self, *args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            refusal = _refusal_in(e)
            if refusal is None or fullgraph:
                raise
            _run_frame_eagerly(self.root_tx, refusal)

    return compile_subgraph


# Note [Iterating a subclass tensor]
# Eager's ``Tensor.__iter__`` hands dispatch one ``unbind(0)`` (through ``__torch_function__``);
# Dynamo unrolls ``for r in x``, ``list(x)``, ``a, b = x`` into ``x[0]``, ``x[1]``, ... made
# straight in the graph: dispatch is handed a ``select`` per row. A wrapper subclass whose
# code may write state is iterated as eager iterates it: one ``unbind(0)``, through Dynamo's
# own method call (its ``__torch_function__`` first, where it has one), its rows unpacked. One whose class defines
# its own ``__iter__`` (which Dynamo's unrolling passes by) is refused
# (``traced_ops_differ``).


def make_unpack_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``TensorVariable.unpack_var_sequence`` (See Note [Iterating a
    subclass tensor])."""

    @functools.wraps(original)
    def unpack_var_sequence(self: Any, tx: Any, idxes: Any = None) -> Any:
        from torch._dynamo.variables import ConstantVariable

        if not _may_write(self):
            return original(self, tx, idxes)
        example = self.proxy.node.meta["example_value"]
        cls = type(example)
        if example.dim() == 0:
            return original(self, tx, idxes)
        if getattr(cls, "__iter__", None) is not torch.Tensor.__iter__:
            refuse(
                RefusalKind.TRACED_OPS_DIFFER, cls.__name__, "__iter__", "iteration",
                f"{cls.__name__} defines its own __iter__, which Dynamo's unrolling of the loop "
                "passes by: what dispatch writes could differ",
            )
        rows = self.call_method(tx, "unbind", [ConstantVariable.create(0)], {}).unpack_var_sequence(tx)
        if idxes is None:
            return rows
        if len(idxes) != len(rows):
            raise AssertionError(f"Can't unpack a tensor of {len(rows)} rows into a tuple of {len(idxes)} elements.")
        return [rows[i] for i in idxes]

    return unpack_var_sequence


def make_stolen_lists_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``OutputGraph.handle_aliases_for_stolen_lists``, which compile_subgraph
    calls for the instructions it runs before the graph and the sources its codegen loads
    from elsewhere: the values user code read before dispatch wrote them are added (See
    Note [Values read before dispatch wrote them])."""

    @functools.wraps(original)
    def handle_aliases_for_stolen_lists(self: Any, tx: Any) -> Any:
        instructions, overrides = original(self, tx)
        state: FrameState | None = self.__dict__.get(_STATE_KEY)
        if state is None:
            return instructions, overrides
        more, entry = state.entry_values(tx)
        return [*more, *instructions], {**entry, **overrides}

    return handle_aliases_for_stolen_lists


def _refusal_in(exc: BaseException) -> Any:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, SubclassWriteError):
            return exc
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


class _RunFrameEagerly(BaseException):
    """A Dynamo-layer refusal that runs the frame being compiled eagerly rather than graph
    break (See Note [A size marked dynamic given to dispatch as a number] in capture.py). A
    BaseException, so it leaves inlined frames and fake propagation unwrapped."""

    def __init__(self, refusal: SubclassWriteError) -> None:
        super().__init__(refusal.attr)
        self.refusal = refusal


def _run_frame_eagerly(tx: Any, refusal: Any) -> NoReturn:
    """An AOTAutograd-layer refusal under ``fullgraph=False``: nothing may raise that eager
    does not. The frame (or the part after a graph break) and everything it calls run
    eagerly, now and on later calls, as Dynamo runs a frame it cannot resume (a soft
    failure with a recursive skip strategy); the reason goes where graph breaks go (the
    graph_breaks log, Dynamo's graph-break counters)."""
    _run_code_eagerly(tx.f_code, refusal.kind.gb_type, str(refusal), refusal)


def _run_code_eagerly(code: Any, gb_type: str, why: str, cause: BaseException) -> NoReturn:
    """See _run_frame_eagerly."""
    from torch._dynamo.exc import Unsupported
    from torch._dynamo.types import FrameAction, FrameExecStrategy
    from torch._dynamo.utils import counters

    reason = f"{gb_type}: the frame runs eagerly. {why}"
    counters["graph_break"][gb_type] += 1
    log.warning("%s: %s runs eagerly", gb_type, code.co_name)
    from . import _patches

    _patches.CODE_MARKS.run_eagerly(code)  # so that disable() lifts it
    error = Unsupported(reason)
    error.frame_exec_strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    # Not "compile up to the previous resumable state" (Dynamo's way with a graph break it
    # cannot resume from): that graph's outputs would meet eager code's gradients it did not
    # trace (a subclass where it guessed a plain tensor, an outside tester's find)
    error.skip_frame = True
    raise error from cause


# Note [A refusal inside a higher-order op's body]
# Some higher-order ops allow no graph break in their body (``nested_compile_region``'s
# ``invoke_subgraph``, ``hints_wrapper``, ``strict_mode``): Dynamo turns one there into
# ``UncapturedHigherOrderOpError``, which it raises under ``fullgraph=False`` too. Eager runs
# the body as plain Python (``nested_compile_region`` is only a marker), so a dynamo_ext
# refusal there (a write in the body, ``write_in_hop``) broke the promise that nothing
# raises that eager does not (an outside tester's find). Under ``fullgraph=False`` the
# frame then runs eagerly, as after an AOTAutograd-layer refusal. (``cond``, ``map`` and
# ``while_loop`` bodies are compiled in eager too, where they raise as well.)


# Note [A recompile torch 2.13 fails on a subclass gradient]
# On torch 2.13 a recompile of a frame whose input holds a subclass ``.grad`` (a plain leaf
# whose gradient a wrapping dispatch made a subclass, accumulated over calls) fails in torch's
# fakification (``Expected SubclassSymbolicContext or None``), stock too; stock rarely
# recompiles such a frame, but a count dispatch bumps is a guarded input here, and the second
# compile raised under ``fullgraph=False`` (an outside tester's find). The frame runs eagerly
# instead, as after a refusal.
_SUBCLASS_GRAD_RECOMPILE = "Expected SubclassSymbolicContext"


def make_frame_compile_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``torch._dynamo.convert_frame._compile``: See Note [A refusal inside
    a higher-order op's body]."""
    from torch._dynamo.exc import UncapturedHigherOrderOpError

    @functools.wraps(original)
    def _compile(code: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            with free_state.walks_shared():  # See Note [The global-state watch's cost]
                return original(code, *args, **kwargs)
        except _RunFrameEagerly as e:
            _run_code_eagerly(code, e.refusal.kind.gb_type, str(e.refusal), e.refusal)
        except (UncapturedHigherOrderOpError, AssertionError) as e:
            box = kwargs.get("convert_frame_box")
            one_graph = args[5] if len(args) > 5 else kwargs.get("one_graph", True)
            if one_graph or box is None or box.error_on_graph_break is not False:
                raise
            if isinstance(e, AssertionError):
                if _SUBCLASS_GRAD_RECOMPILE not in str(e):
                    raise
                # See Note [A recompile torch 2.13 fails on a subclass gradient]
                _run_code_eagerly(code, "dynamo_ext: torch_recompile_failure", str(e), e)
            refusal = _dynamo_refusal_in(e)
            if refusal is None:
                raise
            _run_code_eagerly(code, refusal.gb_type, str(refusal), e)

    return _compile


def _dynamo_refusal_in(exc: BaseException) -> Any:
    """The Dynamo-layer refusal (an ``Unsupported`` of a dynamo_ext kind) ``exc`` wraps."""
    from torch._dynamo.exc import Unsupported

    kinds = {kind.gb_type for kind in RefusalKind}
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, Unsupported) and getattr(exc, "gb_type", None) in kinds:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


# Note [Symbolic ints in a flatten ctx]
#     A counter kept in a subclass's flatten ctx (``tag += 1`` in dispatch) would be
#     guarded by Dynamo's ctx guard (TENSOR_SUBCLASS_METADATA_MATCH) and recompile at
#     every call. Once Dynamo's automatic dynamic makes the int a symbolic input (after
#     its first change, as for an int attribute user code reads), three things keep it
#     symbolic: the ctx guard compares every ctx entry but those (the symbolic int is
#     guarded through its own source); AOTAutograd's passes read the symbol through the
#     seed node, not the traced ctx; and outputs whose ctx dispatch built from it (which
#     AOTAutograd rebuilds from the ctx it traced) get the int's run-time value set after
#     the call (``aot_layer.Planner.plan_outputs``).


def make_metadata_guard_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``GuardBuilder.TENSOR_SUBCLASS_METADATA_MATCH``: the ctx guard
    leaves out the entries that hold the frame's symbolic ints (See Note [Symbolic ints in
    a flatten ctx]); torch's own code treats a SymInt in a ctx as always equal."""

    @functools.wraps(original)
    def TENSOR_SUBCLASS_METADATA_MATCH(self: Any, guard: Any) -> Any:
        output = getattr(getattr(self, "check_fn_manager", None), "output_graph", None)
        state = getattr(output, "__dict__", {}).get(_STATE_KEY)
        value = self.get(guard)
        _guard_zero_signs(self, guard, value)
        symbolic = state.symbolic_ctx.get(id(value)) if state is not None else None
        if not symbolic:
            return original(self, guard)
        d = capture.obj_dict(value)
        saved = {name: d[name] for name in symbolic}
        d.update(symbolic)
        try:
            return original(self, guard)
        finally:
            d.update(saved)

    return TENSOR_SUBCLASS_METADATA_MATCH


def _zero_signs(ctx: Any, depth: int = 0) -> tuple:
    """The signs of the float zeros in a flatten ctx, in order."""
    if type(ctx) is float:
        return (math.copysign(1.0, ctx),) if ctx == 0.0 else ()
    if depth < 4 and isinstance(ctx, (tuple, list)):
        return tuple(sign for item in ctx for sign in _zero_signs(item, depth + 1))
    if depth < 4 and isinstance(ctx, dict):
        return tuple(sign for item in ctx.values() for sign in _zero_signs(item, depth + 1))
    return ()


def _guard_zero_signs(builder: Any, guard: Any, value: Any) -> None:
    """Dynamo's ctx guard compares with ``==``, which does not tell -0.0 from 0.0; eager's
    arithmetic does (a ctx float a dispatch flips between them): their signs are guarded too."""
    try:
        signs = _zero_signs(value.__tensor_flatten__()[1])
    except Exception:  # noqa: BLE001 - Dynamo's own guard reports a flatten that fails
        return
    if not signs:
        return

    def check(x: Any) -> bool:
        try:
            return _zero_signs(x.__tensor_flatten__()[1]) == signs
        except Exception:  # noqa: BLE001
            return False

    guards.add_lambda(builder, guard, check, f"has flatten-ctx zeros with signs {signs}")


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
        seeds = dict(memo or {})
        if capture.registered_classes():
            for path, _ in capture.find_state(x, from_value=True):
                cur = x
                if not path:  # the ctx is the state object itself
                    seeds[id(cur)] = cur
                for step in path:
                    cur = capture.follow(cur, (step,))
                    seeds[id(cur)] = cur
        copied = original(x, dict(seeds), *args)
        if not _equal(copied, x):
            # An object in the ctx equal only to itself (``__eq__`` by identity: shared state
            # of an unregistered class): its copy would fail the guard on the very frame
            # that built it. It is kept, so the guard asks for that same object.
            kept = {id(o): o for o in _equal_only_to_itself(x, lambda o: original(o, dict(seeds)))}
            if kept:
                copied = original(x, {**seeds, **kept}, *args)
        return copied

    return deepcopy


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def _equal_only_to_itself(x: Any, deepcopy: Callable[[Any], Any], depth: int = 0) -> Iterator[Any]:
    """The objects in a ctx (through tuples, lists and dicts) whose deep copy is not equal to
    them; ``deepcopy`` keeps registered state objects (they are not copied to compare)."""
    if depth > 4 or is_immutable_constant(x) or capture.is_registered(x):
        return
    if type(x) in (tuple, list):
        for v in x:
            yield from _equal_only_to_itself(v, deepcopy, depth + 1)
    elif type(x) is dict:
        for v in x.values():
            yield from _equal_only_to_itself(v, deepcopy, depth + 1)
    else:
        try:
            if not _equal(deepcopy(x), x):
                yield x
        except Exception:
            return
