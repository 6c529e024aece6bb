"""enable / disable / enabled, the patch table, and the version check."""

from __future__ import annotations

import pytest

import dynamo_ext
from dynamo_ext import _compat
from dynamo_ext._patches import Patch, PatchSet, PatchTargetError


def _current():
    return [p.stored() for p in dynamo_ext._PATCHES.rows()]


def test_disable_restores_exact_originals_and_is_idempotent():
    dynamo_ext.disable()
    originals = _current()
    dynamo_ext.enable()
    dynamo_ext.enable()  # idempotent: no double wrapping
    patched = _current()
    assert all(p is not o for p, o in zip(patched, originals))
    assert dynamo_ext.is_enabled()
    dynamo_ext.disable()
    dynamo_ext.disable()
    assert all(now is o for now, o in zip(_current(), originals))
    assert not dynamo_ext.is_enabled()


def test_enabled_context_restores_previous_state():
    dynamo_ext.disable()
    originals = _current()
    with dynamo_ext.enabled():
        assert dynamo_ext.is_enabled()
    assert all(now is o for now, o in zip(_current(), originals))
    dynamo_ext.enable()
    with dynamo_ext.enabled():
        pass
    assert dynamo_ext.is_enabled()  # was enabled before the block: stays enabled


def test_unsupported_torch_fails_at_enable_naming_found_and_needed(monkeypatch):
    dynamo_ext.disable()
    monkeypatch.setattr(_compat, "IS_SUPPORTED_TORCH", False)
    monkeypatch.setattr(_compat, "TORCH_VERSION", "2.99.0")  # dynamo_ext's own module, not torch
    with pytest.raises(RuntimeError, match=r"found torch 2\.99\.0") as info:
        dynamo_ext.enable()
    assert _compat.supported_text() in str(info.value)
    assert not dynamo_ext.is_enabled()


def test_missing_target_fails_naming_it_and_patches_nothing():
    import torch._dynamo.utils as utils

    original = utils._get_fake_value_impl
    table = [
        Patch("torch._dynamo.utils", "_get_fake_value_impl", lambda o: (lambda *a: None), why="test"),
        Patch("torch._dynamo.utils", "no_such_function", lambda o: o, why="test"),
    ]
    patches = PatchSet(table)
    with pytest.raises(PatchTargetError, match=r"torch\._dynamo\.utils\.no_such_function"):
        patches.apply()
    assert utils._get_fake_value_impl is original  # nothing half-applied
    assert not patches.applied


def test_missing_module_fails_naming_it():
    with pytest.raises(PatchTargetError, match=r"torch\._no_such_module\.f"):
        PatchSet([Patch("torch._no_such_module", "f", lambda o: o, why="test")]).apply()


def test_every_patch_says_why_and_which_torch():
    for patch in dynamo_ext.TABLE:
        assert patch.why
        assert _compat.SUPPORTED[0] <= patch.versions[0] <= patch.versions[1] <= _compat.SUPPORTED[1]


def test_readme_refusal_table_is_the_records():
    import pathlib

    from dynamo_ext.errors import REFUSALS, refusal_table

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    assert refusal_table() in readme
    assert set(REFUSALS) == set(dynamo_ext.RefusalKind)
    assert len(readme) <= 16_700  # a user's guide: what works, what is refused, the limits


# --------------------------------------------------------------------------- names bound before enable()


def _entry_points():
    """Every public way to reach AOTAutograd, each as ``compile(fn, example) -> callable``,
    with the names looked up now (the caller does it while dynamo_ext is disabled)."""
    import functorch.compile as fc
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import aot_autograd as aa

    nop = fc.nop

    def module_of(fn):
        class M(torch.nn.Module):
            def forward(self, x):
                return fn(x)

        return M()

    def simplified(simplify):
        def build(fn, example):
            gm = torch.fx.symbolic_trace(lambda x: (fn(x),))
            compiled = simplify(gm, [example], fw_compiler=nop)
            return lambda x: compiled(x)[0]

        return build

    backend = aot_autograd(fw_compiler=nop)
    compile_ = torch.compile
    return {
        "torch.compile": lambda fn, ex: compile_(fn, backend="aot_eager", fullgraph=True),
        "torch.compile(aot_autograd(...))": lambda fn, ex: compile_(fn, backend=backend, fullgraph=True),
        "functorch.compile.aot_function": lambda fn, ex: fc.aot_function(fn, fw_compiler=nop),
        "functorch.compile.aot_module": lambda fn, ex: fc.aot_module(module_of(fn), fw_compiler=nop),
        "aot_autograd.aot_function": lambda fn, ex, f=aa.aot_function: f(fn, fw_compiler=nop),
        "aot_autograd.aot_module": lambda fn, ex, f=aa.aot_module: f(module_of(fn), fw_compiler=nop),
        "aot_autograd.aot_module_simplified": simplified(aa.aot_module_simplified),
    }


def test_every_entry_point_bound_before_enable_sees_the_writes():
    import torch

    import subclasses as S
    from harness import assert_same_state, stock_torch

    def fn(x):
        return x * 3

    with stock_torch():
        entries = _entry_points()  # every name bound while dynamo_ext is off
    assert dynamo_ext.is_enabled()
    for name, build in entries.items():
        torch._dynamo.reset()
        compiled = build(fn, S.CachingTensor(torch.arange(4.0)))
        for _ in range(2):
            e, c = S.CachingTensor(torch.arange(4.0)), S.CachingTensor(torch.arange(4.0))
            torch.testing.assert_close(compiled(c).elem, fn(e).elem)
            assert "cache" in vars(c), f"{name}: the write was lost"
            assert_same_state(e, c, name)
