"""enable / disable / enabled, the patch table, and the version check."""

from __future__ import annotations

import pytest

import dynamo_ext
from dynamo_ext import _compat
from dynamo_ext._patches import Patch, PatchSet, PatchTargetError


def _current():
    return [p.owner().__dict__[p.attr] for p in dynamo_ext._PATCHES.rows()]


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
    assert len(readme) <= 16_000
