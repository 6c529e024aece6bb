"""Which of the traced backward's writes eager makes when ``backward()`` runs part of it.

Note [A backward run for part of the graph]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Eager's backward runs an op's backward only where a gradient reaches it (an output no loss
uses sends none: ``ya.backward()`` leaves ``yb``'s ops alone) and only for inputs whose
gradient is wanted (``autograd.grad(y, [x])``, ``backward(inputs=[w])``). The compiled
backward runs whole; replaying the writes of the whole traced backward would bump a count
where eager's ops never ran (an outside tester's find, stock too).

Each dispatch call that wrote in the traced backward is known by the joint-graph nodes it
traced (``Scope.call_nodes``). The joint's backward nodes carry the ``seq_nr`` of the autograd
node they differentiate, so a call's node group is every backward node with its ``seq_nr``;
the joint's placeholders and outputs carry AOTAutograd's descriptors, which give each tangent
its output of the compiled node (``grad_outputs``) and each gradient its input
(``next_functions``). When the compiled backward runs, its pre-hook sees which incoming
gradients are defined and which inputs' gradients the engine will use, and sorts every
writing call:

- **runs** where a defined gradient reaches its node group and its own nodes reach a wanted
  input's gradient. Eager's engine runs that node (it receives a defined gradient and leads
  to a wanted input) and computes the gradient the call's op feeds. With every input's
  gradient wanted, reaching a defined gradient is enough: the node computes what it computed
  when traced.
- **does not run** where (a) no defined gradient reaches its node group nor any backward node
  upstream of it, counted group by group (a builtin op's backward with only undefined
  gradients dispatches nothing), (b) the forward op of its group depends on no input whose
  gradient is wanted (the engine prunes the node), or (c) the call's nodes feed only the
  gradients of unwanted inputs, through nothing but nodes of its own group (the node's
  formula for those edges is not computed: ``task_should_compute_output``). Each needs the
  group to have a forward op of its own: an ``autograd.Function``'s backward has none, and
  runs whole, with zeros where eager gives it an undefined gradient.
- a dispatch call that computes more from its op's result (``out * self.scale``: its nodes
  use the op's node) is refused where an undefined incoming gradient reaches it and what it
  gives reaches a gradient that is kept: eager's engine never runs it on that gradient (it
  does not sum an undefined one in), the compiled backward runs it on zeros, and a transformed
  zero need not be zero (a fuzz find: a subclass scaling ``add``'s result, summing the
  gradients of ``x + x``).
- otherwise it is not known (a call whose op feeds no gradient, a Function's backward under
  input pruning): refused, as is a skipped attribute that a running call's count, a decision
  of the traced backward or text it wrote may have read, or whose written value any call
  read back (``if not self.seen: self.seen = True``: the call eager runs finds it unset).

The written attributes of calls that do not run are left as they are; the others are set as
for the whole backward.

A compiled backward also sends a gradient to every input it traced one for: zeros where no
defined gradient reaches it (AOTAutograd materializes a missing tangent as zeros), where eager
sends none. Upstream, eager code or another compiled graph then runs its backward where eager's
never ran: behind a graph break, ``yb.backward()`` ran the first graph's backward and replayed
its count (an outside tester's find). So an input's gradient that no defined gradient reaches
(the same reasoning as (a), on the gradient's own node) is returned as None, as eager leaves
it (an optimizer skips a parameter without a gradient, and steps on zeros): by every graph with
a plan (subclass inputs or outputs), and, once such a graph with a backward has been compiled in
the process (``note_planned_backward``), by graphs without a plan too, for which AOTAutogradCache
is then bypassed (their cache entries could not say which gradients to drop). The hooks cost
about 40 µs a training step per graph; programs without subclasses are left alone. Not covered: an ``autograd.Function`` (or
activation checkpointing) run eagerly behind a graph break, which the engine reaches through
the later graph's edge and runs with zeros where eager's backward never reaches it (stock
alike). Where the descriptors cannot be mapped (synthetic or deduplicated
inputs, an intermediate base with a tangent, a graph without descriptors) the old rule
stays: refused unless every call depends on every tangent and reaches every input's
gradient. An attribute written by calls of both kinds gets the count of the calls that run,
where each call counts on from what the one before it left (See Note [One share of a count]);
otherwise it is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, NamedTuple, Sequence

import torch

from . import counters
from .errors import RefusalKind, SubclassWriteError

_SUBCLASS_PARTS = frozenset(
    {
        "SubclassGetAttrAOTInput", "SubclassSizeAOTInput", "SubclassStrideAOTInput",
        "SubclassGetAttrAOTOutput", "SubclassSizeAOTOutput", "SubclassStrideAOTOutput",
    }
)


@dataclasses.dataclass(frozen=True)
class BackwardCall:
    """One write of a dispatch call the traced backward ran (positions: of the compiled
    node's ``grad_outputs`` and ``next_functions``; masks: bit p for ``grad_outputs[p]``)."""

    key: tuple  # (input index, path, name) written
    #: gradients reaching the call's node group; None: the call has no node of its own
    tangents: int | None
    #: gradients reaching the group or any backward node upstream of it, group by group;
    #: None where one of those groups has no forward op (an autograd.Function's backward)
    upstream: int | None
    gradients: frozenset[int]  # the inputs whose gradients the call's own nodes reach
    #: the inputs requiring grad the group's forward op depends on; None: not known
    depends_on: frozenset[int] | None
    #: the inputs whose gradients the call's nodes reach through nothing but nodes of its
    #: own group (its node's edges to them); None where other nodes follow
    direct: frozenset[int] | None = None
    #: the expression of the count this write set (counters.Expr), None for another value;
    #: and the traced pass the call ran in (See Note [One share of a count])
    expr: tuple | None = None
    trace: int = 0


@dataclasses.dataclass(frozen=True)
class BackwardParts:
    """What a run of the compiled backward for part of its graph needs (See Note [A
    backward run for part of the graph])."""

    #: the old rule, applied where ``mapped`` is False: (writes need every incoming gradient,
    #: writes need every input's gradient, the number of incoming gradients)
    coarse: tuple[bool, bool, int]
    mapped: bool = False
    n_outputs: int = 0
    n_inputs: int = 0
    tangents: int = 0  # the incoming gradients the backward was traced with
    gradients: frozenset[int] = frozenset()
    calls: tuple[BackwardCall, ...] = ()
    #: keys a written count reads: key -> the keys its expression reads
    count_reads: tuple[tuple[tuple, frozenset], ...] = ()
    #: keys the traced backward's decisions read, or None where everything it read was
    #: baked in (text, containers)
    decision_reads: frozenset | None = frozenset()
    #: keys whose value a call of the traced backward wrote and user code read back after
    #: (any value: a flag set once and tested by the next call)
    written_reads: frozenset = frozenset()
    #: (the incoming gradients reaching it, the inputs whose gradients it reaches; None where
    #: not known) for each dispatch call that computed more from its op's result
    changing: tuple[tuple[int, frozenset[int]] | None, ...] = ()
    #: (input, the gradients reaching its gradient upstream, group by group): an input whose
    #: gradient no defined incoming gradient reaches gets None, not zeros
    fed_by: tuple[tuple[int, int], ...] = ()

    @property
    def may_refuse(self) -> bool:
        return bool(self.changing) or bool(self.calls) and (self.mapped or self.coarse[0] or self.coarse[1])

    @property
    def drops(self) -> bool:
        """Whether this graph's compiled backward drops gradients eager leaves undefined:
        where some may get none while others do, and where every incoming gradient is
        undefined (a graph behind a graph break, which the engine reaches through a later
        graph's edges: its zeros would run an earlier graph's writing backward where eager's
        never runs, or an optimizer step on a parameter eager leaves without a gradient)."""
        return bool(self.fed_by)


_PLANNED_BACKWARD_SEEN = False


def note_planned_backward() -> None:
    """A plan of a graph with a backward was made in this process: from now on graphs
    without a plan drop the gradients eager leaves undefined too."""
    global _PLANNED_BACKWARD_SEEN
    _PLANNED_BACKWARD_SEEN = True


def planned_backward_seen() -> bool:
    return _PLANNED_BACKWARD_SEEN


# --------------------------------------------------------------------------- #
# Compile time
# --------------------------------------------------------------------------- #


class _Unmapped(Exception):
    pass


def base_desc(desc: Any) -> Any:
    """The descriptor of the input or output a subclass's part (inner tensor, size) belongs to."""
    while type(desc).__name__ in _SUBCLASS_PARTS:
        desc = desc.base
    return desc


def _metadata(desc: Any) -> bool:
    """A subclass gradient's size or stride (under dynamic shapes a SymInt the graph returns,
    often an input's own): not the gradient's data, and reached by no tangent."""
    while type(desc).__name__ in _SUBCLASS_PARTS:
        if type(desc).__name__ in ("SubclassSizeAOTOutput", "SubclassStrideAOTOutput"):
            return True
        desc = desc.base
    return False


def _below(start: Iterable[Any]) -> set[Any]:
    seen, stack = set(start), list(start)
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _flat(value: Any) -> Iterable[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)
    else:
        yield value


def _bits(positions: Iterable[int]) -> int:
    mask = 0
    for p in positions:
        mask |= 1 << p
    return mask


def coarse_needs(graph: Any, calls: Sequence[tuple[str, ...] | None]) -> tuple[bool, bool, int]:
    """Whether every writing call depends on every tangent and reaches every input's
    gradient (the rule where positions are not known). Returns (needs every incoming
    gradient, needs every input's gradient, the number of incoming gradients)."""
    if graph is None:
        return True, True, 0
    nodes = {n.name: n for n in graph.nodes}
    tangents = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    output = next((n for n in graph.nodes if n.op == "output"), None)
    from_tangent = [_below([t]) for t in tangents]
    reached_by_any = set().union(*from_tangent) if from_tangent else set()
    outs = [o for o in _flat(output.args if output is not None else ()) if isinstance(o, torch.fx.Node)]
    gradients = {o for o in outs if o in reached_by_any}
    every_tangent = every_gradient = True
    for names in calls:
        mine = [nodes[n] for n in names or () if n in nodes]
        if not mine:
            return True, True, len(tangents)
        if not all(any(n in reach for n in mine) for reach in from_tangent):
            every_tangent = False
        if not gradients <= _below(mine):
            every_gradient = False
    return not every_tangent, not every_gradient, len(tangents)


class _Joint:
    """The joint graph's tangents, gradients and autograd-node groups as positions of the
    compiled node; raises _Unmapped where the descriptors do not give them."""

    def __init__(self, graph: Any, meta: Any) -> None:
        self.nodes = nodes = list(graph.nodes)
        self.by_name = {n.name: n for n in nodes}
        placeholders = [n for n in nodes if n.op == "placeholder"]
        if any(n.meta.get("desc") is None for n in placeholders):
            raise _Unmapped
        tangent_nodes = [n for n in placeholders if type(base_desc(n.meta["desc"])).__name__ == "TangentAOTInput"]
        primals = [n for n in placeholders if n not in tangent_nodes]

        # inputs: the compiled node's arguments in order; next_functions has one per tensor
        bases: list[Any] = []
        tensors: set[Any] = set()
        for n in primals:
            b = base_desc(n.meta["desc"])
            if type(b).__name__ != "PlainAOTInput":
                raise _Unmapped  # parameters lifted by AOTAutograd, synthetic bases, tokens
            if not bases or bases[-1] != b:
                if b in bases:
                    raise _Unmapped
                bases.append(b)
            if isinstance(n.meta.get("val"), torch.Tensor):
                tensors.add(b)
        if [b.idx for b in bases] != list(range(len(bases))) or len(meta.input_info) != len(bases):
            raise _Unmapped  # deduplicated inputs
        input_of = {b: k for k, b in enumerate(b for b in bases if b in tensors)}
        self.n_inputs = len(input_of)
        requires_grad = {input_of[b] for b in bases if b in tensors and meta.input_info[b.idx].requires_grad}
        primal_bit = {n: 1 << input_of[base_desc(n.meta["desc"])] for n in primals if base_desc(n.meta["desc"]) in input_of}
        primal_bit = {n: bit for n, bit in primal_bit.items() if bit.bit_length() - 1 in requires_grad}

        # outputs: mutated inputs, the user's outputs, intermediate bases
        n_mutated = meta.num_mutated_inp_runtime_indices
        mutated = list(meta.mutated_inp_runtime_indices)
        self.n_outputs = n_mutated + meta.num_outputs + meta.num_intermediate_bases
        self.tangent_of: dict[Any, int] = {}
        for t in tangent_nodes:
            d = base_desc(base_desc(t.meta["desc"]).output)
            kind = type(d).__name__
            if kind == "PlainAOTOutput":
                self.tangent_of[t] = n_mutated + d.idx
            elif kind == "InputMutationAOTOutput" and type(base_desc(d.mutated_input)).__name__ == "PlainAOTInput":
                self.tangent_of[t] = mutated.index(base_desc(d.mutated_input).idx)
            else:
                raise _Unmapped  # an intermediate base
        self.unknown = 1 << self.n_outputs  # a group whose runs are not known

        output = next(n for n in nodes if n.op == "output")
        leaves = list(_flat(output.args))
        descs = output.meta.get("desc")
        if descs is None or len(descs) != len(leaves):
            raise _Unmapped
        self.gradient_of: dict[Any, set[int]] = {}
        for leaf, desc in zip(leaves, descs):
            d = base_desc(desc) if desc is not None else None
            if type(d).__name__ != "GradAOTOutput" or not isinstance(leaf, torch.fx.Node) or _metadata(desc):
                continue
            pos = input_of.get(base_desc(d.grad_of))
            if pos is None:
                raise _Unmapped
            self.gradient_of.setdefault(leaf, set()).add(pos)

        # autograd-node groups: backward nodes by the seq_nr of the forward op they differentiate
        self.groups: dict[Any, list[Any]] = {}
        self.forward_ops: dict[Any, list[Any]] = {}
        for n in nodes:
            if n.op == "call_function" and n.meta.get("seq_nr") is not None:
                (self.forward_ops if self._forward(n) else self.groups).setdefault(n.meta["seq_nr"], []).append(n)

        # masks, in topological order: ``reach`` the tangents a node depends on; ``up`` the
        # same with every group a node depends on taken whole; ``needs`` the inputs
        # requiring grad a forward node depends on
        self.reach: dict[Any, int] = {}
        self.needs: dict[Any, int] = {}
        for n in nodes:
            if n in self.tangent_of:
                self.reach[n] = 1 << self.tangent_of[n]
            elif n in primal_bit:
                self.needs[n] = primal_bit[n]
            else:
                args = n.all_input_nodes
                self.reach[n] = _or(self.reach.get(a, 0) for a in args)
                self.needs[n] = _or(self.needs.get(a, 0) for a in args)
        self.group_up: dict[Any, int] = {}
        while True:
            self.up: dict[Any, int] = {}
            for n in nodes:
                if n in self.tangent_of:
                    self.up[n] = 1 << self.tangent_of[n]
                    continue
                if n.op == "placeholder" or self._forward(n):
                    continue
                mask = _or(self.up.get(a, 0) for a in n.all_input_nodes)
                if n.op == "call_function" and not self._sums(n):
                    seq = n.meta.get("seq_nr")
                    mask |= self.unknown if seq is None or not self.forward_ops.get(seq) else self.group_up.get(seq, 0)
                self.up[n] = mask
            grown = {seq: _or(self.up.get(n, 0) for n in ops) for seq, ops in self.groups.items()}
            if grown == self.group_up:
                break
            self.group_up = grown

    @staticmethod
    def _forward(n: Any) -> bool:
        return n.meta.get("partitioner_tag") == "is_forward"

    def _sums(self, n: Any) -> bool:
        """An add the engine made summing the gradients several nodes send one tensor (no
        forward op of its own; an autograd.Function's backward ops carry no tag): defined
        where one of them is."""
        return (
            n.target is torch.ops.aten.add.Tensor
            and n.meta.get("partitioner_tag") == "is_backward"
            and not self.forward_ops.get(n.meta.get("seq_nr"))
        )

    def _accumulates(self, n: Any) -> bool:
        """Such an add summing an input's gradient (its result is the gradient)."""
        return self._sums(n) and all(u.op == "output" or self._accumulates(u) for u in n.users)

    def positions(self, mask: int) -> frozenset[int]:
        return frozenset(i for i in range(mask.bit_length()) if mask >> i & 1)

    def call(self, key: tuple, names: tuple[str, ...] | None, expr: tuple | None = None, trace: int = 0) -> BackwardCall:
        mine = [self.by_name[n] for n in names or () if n in self.by_name]
        seqs = {n.meta.get("seq_nr") for n in mine}
        if not mine or None in seqs:
            return BackwardCall(key, None, None, frozenset(), None, expr=expr, trace=trace)
        group = set(mine).union(*(self.groups.get(s, []) for s in seqs))
        reach = _below(mine)
        gradients = self._gradients_in(reach)
        builtin = all(self.forward_ops.get(s) for s in seqs)
        upstream = _or(self.group_up.get(s, 0) for s in seqs) | _or(self.up.get(n, 0) for n in mine)
        needs = [_or(self.needs.get(n, 0) for n in self.forward_ops.get(s, ())) for s in seqs]
        own = all(n in group or n.op == "output" or self._accumulates(n) for n in reach)
        return BackwardCall(
            key,
            tangents=_or(self.reach.get(n, 0) for n in group),
            upstream=None if not builtin or upstream & self.unknown else upstream,
            gradients=gradients,
            depends_on=self.positions(_or(needs)) if builtin and all(needs) else None,
            direct=gradients if own and builtin and len(seqs) == 1 else None,
            expr=expr,
            trace=trace,
        )

    def changing(self, names: tuple[str, ...]) -> tuple[int, frozenset[int]] | None:
        mine = [self.by_name[n] for n in names if n in self.by_name]
        if not mine:
            return None
        return _or(self.reach.get(n, 0) for n in mine), self._gradients_in(_below(mine))

    def _gradients_in(self, nodes: set[Any]) -> frozenset[int]:
        """The inputs whose gradients are among ``nodes``."""
        return frozenset(p for leaf, ps in self.gradient_of.items() if leaf in nodes for p in ps)

    def fed_by(self) -> tuple[tuple[int, int], ...]:
        """Each input's gradient with the incoming gradients that reach it upstream (inputs
        where that is not known, or whose gradient depends on none, are left out)."""
        masks: dict[int, int] = {}
        for leaf, ps in self.gradient_of.items():
            mask = self.up.get(leaf, self.reach.get(leaf, 0))
            for p in ps:
                masks[p] = masks.get(p, 0) | (mask if mask else self.unknown)
        return tuple((p, m) for p, m in sorted(masks.items()) if not m & self.unknown)


def _or(masks: Iterable[int]) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def analyse(
    graph: Any,
    events: Sequence[tuple[tuple, tuple[str, ...] | None]],
    fw_metadata: Any,
    count_reads: dict[tuple, frozenset] | None = None,
    decision_reads: frozenset | None = frozenset(),
    written_reads: frozenset = frozenset(),
    changing: Sequence[tuple[str, ...]] = (),
) -> BackwardParts:
    """The parts of the joint graph each write of the traced backward needs, and which
    inputs' gradients may get no defined incoming gradient. ``events``, in the order they
    were made: (key written, the names of the graph nodes its dispatch call traced[, the
    expression of the count written or None, the traced pass])."""
    coarse = coarse_needs(graph, [e[1] for e in events])
    unknown = (None,) * len(changing)
    if graph is None or fw_metadata is None:
        return BackwardParts(coarse, changing=unknown)
    try:
        joint = _Joint(graph, fw_metadata)
    except (_Unmapped, AttributeError, TypeError, ValueError, IndexError):  # descriptors of another shape
        return BackwardParts(coarse, changing=unknown)
    return BackwardParts(
        coarse,
        mapped=True,
        n_outputs=joint.n_outputs,
        n_inputs=joint.n_inputs,
        tangents=_or(1 << p for p in joint.tangent_of.values()),
        gradients=frozenset(p for ps in joint.gradient_of.values() for p in ps),
        calls=tuple(joint.call(*e) for e in events),
        count_reads=tuple((count_reads or {}).items()),
        decision_reads=decision_reads,
        written_reads=written_reads,
        changing=tuple(joint.changing(names) for names in changing),
        fed_by=joint.fed_by(),
    )


# --------------------------------------------------------------------------- #
# Run time
# --------------------------------------------------------------------------- #


def will_run(fn: Any) -> bool:
    """Whether the engine runs ``fn`` (an edge of the node running) in this backward."""
    if fn is None:
        return False
    try:
        return torch._C._will_engine_execute_node(fn)
    except RuntimeError:  # a leaf autograd.grad captures: wanted
        return True


def _refuse(why: str) -> SubclassWriteError:
    return SubclassWriteError(
        RefusalKind.WRITE_IN_BACKWARD, "compiled backward", "<writes of the backward>", "partial backward",
        context=why + "; the compiled backward runs whole and replays the traced backward's writes",
    )


# Note [A count on a tensor the backward made]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dispatch may change a tensor it is handed that the backward made (``first.n += 1`` on the
# incoming gradient two op backwards share), and a later call read the change (a tag
# ``r.seen = first.n`` on a gradient, a result scaled from the second use on, a write on the
# weight). Where eager's backward does not run the call that changed it, the calls it runs
# read another value, and what they made of it was the whole backward's: a tag, a write on
# an input, a gradient's data (an outside tester's find). Such a change (a write a call made
# on a tensor among its operands or held by one, not on one it made; the traced backward's
# scope notes them: capture.Scope) is a writing call of its own here, keyed by MADE, and
# each later call handed the changed object one keyed by MADE_READ. A run where a change's call
# does not run and a later call handed it does (or a gradient the backward returns carries it)
# is refused. Whether dispatch read it is not seen (the backward's own tensors are not
# tracked): being handed it is enough. A change no later call is handed is left out: nothing
# eager keeps can hold it.

#: The first item of the key of such a change (MADE, pass, index, carried, name), and of a
#: later call handed it (MADE_READ, pass, index, name)
MADE = "<made by the backward>"
MADE_READ = "<read in the backward>"


class Run(NamedTuple):
    """What one run of the compiled backward does of the traced backward's writes."""

    skipped: frozenset  # keys of writes eager's backward would not make
    nulled: frozenset  # inputs whose gradients eager leaves undefined
    #: key -> the count eager's backward leaves (counters.Expr), for an attribute written by
    #: calls eager runs and calls it does not (See Note [One share of a count])
    shares: tuple = ()


WHOLE = Run(frozenset(), frozenset())

_CHANGING = (
    "a dispatch call of the backward computes more from its op's result (out * self.scale) where an output "
    "gets no gradient: eager's backward does not run it there, and the compiled backward runs it on zeros "
    "and keeps what it gives in a gradient"
)


def decide(node: Any, parts: BackwardParts, grad_outputs: Sequence[Any]) -> Run:
    """For this run of the compiled backward: the keys of the backward's writes eager's
    backward would not make, the inputs whose gradients eager leaves undefined, the counts
    of attributes only some of whose calls run; usually all empty. Raises where the writes
    are not known."""
    defined = _bits(i for i, g in enumerate(grad_outputs) if g is not None)
    nexts = node.next_functions
    if not parts.mapped or len(grad_outputs) != parts.n_outputs or len(nexts) != parts.n_inputs:
        if parts.changing and any(g is None for g in grad_outputs):
            raise _refuse(_CHANGING)
        return Run(_coarse(node, parts.coarse, grad_outputs), frozenset())
    every_tangent = parts.tangents & defined == parts.tangents
    if every_tangent and not parts.calls:
        return WHOLE
    nulled = frozenset() if every_tangent else frozenset(j for j, mask in parts.fed_by if not mask & defined)
    if not every_tangent:
        undefined = parts.tangents & ~defined
        for changing in parts.changing:
            if changing is None or (changing[0] & undefined and not changing[1] <= nulled):
                raise _refuse(_CHANGING)
    if not parts.calls:
        return Run(frozenset(), nulled)
    wanted = {j for j, (fn, _) in enumerate(nexts) if will_run(fn)}
    every_input = parts.gradients <= wanted
    if every_tangent and every_input:
        return WHOLE
    runs: set[tuple] = set()
    skipped: set[tuple] = set()
    ran: list[bool] = []
    for c in parts.calls:
        if c.tangents is not None and c.tangents & defined and (every_input or c.gradients & wanted):
            runs.add(c.key)
            ran.append(True)
        elif c.depends_on is not None and (
            (c.tangents and c.upstream is not None and not c.upstream & defined)
            or not c.depends_on & wanted
            or (c.direct and not c.direct & wanted)
        ):
            skipped.add(c.key)
            ran.append(False)
        else:
            raise _refuse(
                f"whether eager's backward runs the dispatch call that writes {c.key[-1]!r} is not known "
                "when part of the graph runs (an output gets no gradient, or an input's gradient is not wanted)"
            )
    # See Note [A count on a tensor the backward made]
    read = {k[1:3] for k in runs if k[0] == MADE_READ}
    made = sorted({k[-1] for k in skipped if k[0] == MADE and (k[3] or k[1:3] in read)})
    if made:
        raise _refuse(
            f"a dispatch call eager's backward would not run changed {made} on a tensor the backward made, "
            "which a call it runs was handed after (or a gradient it returns carries): what eager's calls "
            "make of it is not known"
        )
    runs = {k for k in runs if k[0] not in (MADE, MADE_READ)}
    skipped = {k for k in skipped if k[0] not in (MADE, MADE_READ)}
    both = runs & skipped
    shares = {key: _share(key, parts.calls, ran) for key in both}
    unshared = sorted(k[2] for k, share in shares.items() if share is None)
    if unshared:
        raise _refuse(
            f"eager's backward would run some of the dispatch calls that write {unshared} and not others "
            "(an output gets no gradient, or an input's gradient is not wanted), and what the calls it runs "
            "leave is not known: each call's own count is known only where it counts on from the value "
            "the call before it left"
        )
    if skipped:
        # what the kept writes are computed from must be what eager's calls find: no count
        # (a share reads its own attribute's entry value) or decision of the traced backward
        # read an attribute a skipped call wrote, nor a call read back what one wrote (a
        # call that wrote nothing in the trace, its branch decided by what a skipped call
        # wrote, may write in eager's run)
        reads = set().union(*(r for k, r in parts.count_reads if k in runs and k not in both))
        for k, share in shares.items():
            reads |= set(counters.reads_in(share)) - {k}
        if parts.decision_reads is None or (reads | parts.decision_reads) & skipped or parts.written_reads & (skipped - both):
            raise _refuse(
                f"what the backward writes on {sorted(k[2] for k in runs)} may read what the calls eager's "
                f"backward would not run write on {sorted(k[2] for k in skipped)}"
            )
    return Run(frozenset(skipped - both), nulled, tuple(shares.items()))


def _share(key: tuple, calls: Sequence[BackwardCall], ran: Sequence[bool]) -> tuple | None:
    """Note [One share of a count]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    An attribute several dispatch calls of the backward count on (``w.bw = w.bw + 1`` in each
    op's backward), where eager's backward runs some of those calls and not others: eager
    leaves the count the calls it runs make, each from what the one before it left. Each
    write's expression is taken as traced (counters.py); where a call counts from the value
    the previous write of the attribute left (its expression holds that write's expression,
    and reads the attribute nowhere else), its step is that expression with the previous
    one replaced by what the calls run so far left. The composed count is what the compiled
    backward writes. Returns None where a write is not such a step: a value other than a
    count, a count reading the attribute's entry value after it was written, a count another
    attribute holds too (another attribute's count would then carry the same expression), a
    copy of another attribute's value as read (a later read of it is the same expression),
    writes from two traced passes."""
    steps = [(c.expr, r, c.trace) for c, r in zip(calls, ran) if c.key == key]
    if len({t for _, _, t in steps}) > 1 or any(
        # another attribute's value as read: a later read of that attribute is the same
        # expression, so a step could not be told from a read of it
        expr is None or (expr[0] == "read" and expr[1] != key) for expr, _, _ in steps
    ):
        return None
    mine = [expr for expr, _, _ in steps]
    ids = {id(e) for e in mine}
    for c in calls:  # held by another attribute: no step of this one may be told from it
        if c.key != key and c.expr is not None and _holds(c.expr, ids):
            return None
    entry: tuple = ("read", key)
    current, previous = entry, entry
    for expr, run, _ in steps:
        if run:
            current = _replace(expr, previous, current, key, previous is entry)
            if current is None:
                return None
        previous = expr
    return current


def _holds(expr: tuple, ids: set[int]) -> bool:
    if id(expr) in ids:
        return True
    return expr[0] not in ("read", "const") and (_holds(expr[1], ids) or _holds(expr[2], ids))


def _replace(expr: tuple, previous: tuple, current: tuple, key: tuple, first: bool) -> tuple | None:
    """``expr`` with ``previous`` (by identity; for the first write, the attribute's read by
    value) replaced by ``current``; None where it reads ``key`` elsewhere."""
    if expr is previous or (first and expr == previous):
        return current
    if expr[0] == "read":
        return None if expr[1] == key else expr
    if expr[0] == "const":
        return expr
    left = _replace(expr[1], previous, current, key, first)
    right = _replace(expr[2], previous, current, key, first)
    if left is None or right is None:
        return None
    return (expr[0], left, right)


def _coarse(node: Any, coarse: tuple[bool, bool, int], grad_outputs: Sequence[Any]) -> frozenset[tuple]:
    needs_every_gradient, needs_every_input, n_tangents = coarse
    if needs_every_gradient and sum(g is not None for g in grad_outputs) < n_tangents:
        raise _refuse("an output of the compiled graph gets no gradient (eager's backward would not run its ops)")
    if needs_every_input and not all(will_run(fn) for fn, _ in node.next_functions if fn is not None):
        raise _refuse(
            "the gradient of an input is not wanted (autograd.grad, backward(inputs=...)): "
            "eager's backward would not run the ops that compute it"
        )
    return frozenset()


def drop(grad_inputs: Sequence[Any], nulled: frozenset[int]) -> tuple[Any, ...]:
    return tuple(None if j in nulled else g for j, g in enumerate(grad_inputs))


def count_reads_of(writes: Sequence[Any]) -> dict[tuple, frozenset]:
    """For each count the backward writes (a PlannedWrite whose value is counted), the keys
    its expression reads."""
    from .plan import ValueFrom

    return {
        (w.input_index, w.path, w.name): frozenset(counters.reads_in(w.value))
        for w in writes
        if w.value_from is ValueFrom.COUNTED
    }
