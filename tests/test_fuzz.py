"""Differential fuzzing: random programs over random writing subclasses, eager vs compiled.

Each example draws a wrapper subclass and a program (``fuzz_parts``; its docstring lists
every dimension):

- the subclass: which ops write what (constants, counters, tensors, aliases, None, frozen
  dataclasses, lists; bumped values read with attribute syntax; values equal to the current
  one; sizes, SymInts under dynamic shapes), in the flatten ctx or not, in a flatten list
  that grows or not; defaults set by ``__new__`` and by ``__tensor_unflatten__`` outside the
  ctx; a user ``__getattr__`` (served from a ctx tuple, from another attribute, forwarded
  to the inner tensor) read with ``getattr(x, name, default)``; reads of module globals and
  closure variables; an inner tensor that is itself a writing subclass, written on by the
  outer dispatch too; an inner tensor named twice by ``__tensor_flatten__``
  (``self.cache = self.elem``);
- the program: 1-3 inputs, 1-4 ops, an optional graph break (inside the op loop of a nested
  frame, or in the compiled function itself), optional requires_grad and backward, 2-4
  calls, ``dynamic=True`` or not, a fixed or changing batch size, user changes between calls
  (input attributes, module globals, closure state: the same on both sides), and user code
  that reads the same globals.

Each example runs eager and compiled side by side, call after call, comparing outputs (and
their attributes, but for the one ``__tensor_unflatten__`` defaults: AOTAutograd builds
compiled outputs with it), grads, every input's attributes (strictly: 1 vs 1.0, 0.0 vs
-0.0, SymInt vs int, tensor identity, nested subclasses) and leaked fakes; or, where the
spec leaves a fresh list in an attribute under ``fullgraph=True``, expects the
``mutable_value`` refusal at the first compile with the input untouched. Under
``fullgraph=False`` nothing may raise.

Nothing is filtered for failing: the one ``assume`` drops programs that hit the documented
stock limit (a backward write growing a gradient's flatten list), and a failure stock
torch shows with the same message is attributed to torch (See Note [Divergences stock
torch shows]).

Profiles: ``ci`` (default: 60 examples per backend, fixed seed, reported unshrunk) and
``long`` (5,000 per backend, shrunk to a minimal example):
    DYNAMO_EXT_FUZZ=long python -m pytest -q tests/test_fuzz.py --hypothesis-show-statistics
To replay one case outside pytest: ``fuzz_parts.run_case(spec, program, backend)`` with the
``Spec`` / ``Program`` hypothesis printed (``from fuzz_parts import *``; after
``dynamo_ext.enable()``).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, event, given, settings

import dynamo_ext
from fuzz_parts import case_st, layout_of, make_subclass, refusal_kind, run_case, run_compiled_only

# ci: a fixed set of examples; a failing one is reported as generated (no shrink or explain
# phase: shrinking a compile-heavy example takes minutes). long: shrinks what it finds.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
)
settings.register_profile(
    "long",
    max_examples=5000,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
settings.load_profile(os.environ.get("DYNAMO_EXT_FUZZ", "ci"))
# A long run can be stopped before its end: with DYNAMO_EXT_FUZZ_PROGRESS=FILE each example
# appends one line (backend, outcome) to FILE, so a stopped run still says how far it got.
PROGRESS = os.environ.get("DYNAMO_EXT_FUZZ_PROGRESS")


def _progress(backend, outcome):
    if PROGRESS:
        with open(PROGRESS, "a") as f:
            f.write(f"{backend} {outcome}\n")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@given(case=case_st())
def test_fuzz_matches_eager_or_refuses(backend, case):
    spec, program = case
    # Known limitation, stock too: a write in the backward that grows a *gradient's*
    # flatten list (grad accumulation runs add on the gradients) fails AOTAutograd's
    # tangent checks. Writes on inputs and outputs are what dynamo_ext covers.
    assume(not (program.requires_grad and layout_of(spec).growing))
    # Every example starts clean: code marks a refusal left on shared code objects (the
    # factory's dispatch, this module's fn) are lifted by disable().
    dynamo_ext.disable()
    dynamo_ext.enable()
    torch._dynamo.reset()
    try:
        run_case(spec, program, backend)
    except Exception as ours:
        if _getattr_answer_lost_in_a_dispatch_frame(spec, ours):
            _progress(backend, f"stock (a __getattr__ answer lost) {type(ours).__name__}")
            event("stock torch: a user __getattr__ answer lost where Dynamo compiled dispatch as a frame")
            return
        if _stock_crashes_the_same(spec, program, backend, ours) or _known_torch_crash(ours):
            _progress(backend, f"stock (crashes the same) {type(ours).__name__}")
            event(f"stock torch crashes the same way: {type(ours).__name__}")
            STOCK_DIVERGENCES.append((spec, program, backend, _normalized(ours)))
            return
        if not _stock_shows_the_same(spec, program, backend, ours):
            _progress(backend, f"DIVERGES {type(ours).__name__}: {str(ours)[:300]!r}")
            raise
        _progress(backend, f"stock (diverges the same) {type(ours).__name__}")
        # torch's own divergence (Note [Divergences stock torch shows]): counted, not ours.
        event(f"stock torch diverges the same way: {type(ours).__name__}")
        STOCK_DIVERGENCES.append((spec, program, backend, _normalized(ours)))
    else:
        _progress(backend, "ok")


# Note [Divergences stock torch shows]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some programs diverge from eager in stock torch.compile itself, writes or not: Dynamo
# compiles a subclass's dispatch code as its own frame after a graph break inside a loop
# of a nested frame (user ``__getattr__`` answers lost there, a ctx int left a SymInt).
# (The sign of a float zero, which stock loses there too, dynamo_ext keeps: See Note [The
# sign of a float zero].) An example
# that fails is run again with dynamo_ext disabled, on its backend and on the other one:
# if stock torch fails with the same message (or both leave a trace's SymInt in an output's
# ctx, where stock's first symptom may be another ctx of that output) it is attributed to torch (listed in STOCK_DIVERGENCES, reported by hypothesis' statistics);
# any other failure is dynamo_ext's. Stock torch drops or crashes on most writes, so this
# only ever excuses divergences that have nothing to do with what dynamo_ext replays.
STOCK_DIVERGENCES: list = []


def _normalized(error: BaseException) -> str:
    return re.sub(r"0x[0-9a-f]+|\bs\d+\b|\bu\d+\b", "#", f"{type(error).__name__}: {error}")[:2000]


def _leaks_symint(error: BaseException) -> bool:
    """A trace's SymInt left in an output's ctx where eager has an int: when Dynamo compiles
    dispatch as a frame of its own, stock leaves one there too (its first symptom may be
    another ctx of the same output than ours)."""
    return isinstance(error, AssertionError) and "('SymInt', '#')" in _normalized(error) and "output[" in str(error)


def _getattr_answer_lost_in_a_dispatch_frame(spec, ours: BaseException) -> bool:
    """The documented stock divergence (README, Limits): Dynamo compiled the dispatch code
    as a frame of its own (it has cache entries) and a value the user's ``__getattr__``
    serves, recorded in ``got_<name>``, differs. Dynamo's ``getattr(x, name, default)`` on a
    tensor subclass does not call a user ``__getattr__`` (plain user code too). Stock may
    fail such a program earlier on another write, so it is recognised here, not by rerunning."""
    if spec.getattr_kind is None or ".got_" not in str(ours):
        return False
    cls, _, _ = make_subclass(spec)  # every class the factory makes shares this code object
    code = cls.__torch_dispatch__.__func__.__code__
    return bool(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code))


def _crash_site(error: BaseException) -> tuple[str, str]:
    """The file and function the exception was raised in (its innermost frame)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code if tb is not None else None
    return (code.co_filename, code.co_name) if code is not None else ("", "")


def _known_torch_crash(ours: BaseException) -> bool:
    """torch 2.13's AOTAutograd, a nested subclass output of a graph whose input strides
    became dynamic: the stride symbol is specialized while the graph is traced and the
    generated wrapper reads outputs the graph no longer returns (IndexError in
    ``subclass_wrapper``). Stock reaches it on plain ``x.t()``
    (test_fuzz_findings.py::test_torch_2_13_crash_on_a_nested_subclass_view), fixed in 2.14;
    here it is reached where stock loses the writes first."""
    return (
        torch.__version__.startswith("2.13.")
        and isinstance(ours, IndexError)
        and _crash_site(ours)[0].endswith("codegen(subclass_wrapper)")
    )


def _stock_crashes_the_same(spec, program, backend, ours: BaseException) -> bool:
    """torch itself raised inside the compiled call (no assertion of the harness, no
    refusal), and stock, run without comparing anything, raises the same there: a crash of
    torch's (torch 2.13's AOTAutograd on a nested subclass whose strides became dynamic,
    README Limits), which stock hits before any state could differ."""
    if isinstance(ours, AssertionError) or refusal_kind(ours) is not None:
        return False
    dynamo_ext.disable()
    try:
        torch._dynamo.reset()
        try:
            run_compiled_only(spec, program, backend)
        except Exception as stock:
            return _normalized(stock) == _normalized(ours) and _crash_site(stock) == _crash_site(ours)
        return False
    finally:
        dynamo_ext.enable()
        torch._dynamo.reset()


def _stock_shows_the_same(spec, program, backend, ours: BaseException) -> bool:
    """Stock fails with our message on this backend, or on the other one: a divergence of
    Dynamo's front end shows on both with dynamo_ext, while stock AOTAutograd may first
    lose a write and fail on that."""
    dynamo_ext.disable()
    try:
        for other in [backend] + [b for b in ("eager", "aot_eager") if b != backend]:
            torch._dynamo.reset()
            try:
                run_case(spec, program, other)
            except Exception as stock:
                if _normalized(stock) == _normalized(ours) or (_leaks_symint(stock) and _leaks_symint(ours)):
                    return True
        return False
    finally:
        dynamo_ext.enable()
        torch._dynamo.reset()
