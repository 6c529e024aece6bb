import gc
import os
import sys
from typing import Any

import pytest
import torch
import torch._dynamo
from torch.utils._config_module import ConfigModule

sys.path.insert(0, os.path.dirname(__file__))

import dynamo_ext  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo(request: pytest.FixtureRequest):
    """Every test starts from a clean Dynamo, with dynamo_ext enabled and no silent fallback.

    suppress_errors is switched through torch's own context manager, never by assignment:
    only config.patch() undoes exactly what it changed."""
    _collect_what_earlier_tests_left(request.node.nodeid)
    before = {name: _config_picture(mod) for name, mod in _config_modules().items()}
    torch._dynamo.reset()
    dynamo_ext.enable()
    with torch._dynamo.config.patch(suppress_errors=False):
        yield
    dynamo_ext.enable()  # a test that disabled it must not leak that into the next
    torch._dynamo.reset()
    problems = config_changes(before)
    assert not problems, "the test changed torch config outside config.patch(): " + "; ".join(problems)


# --------------------------------------------------------------------------- garbage between tests
# Every test starts on a heap without the earlier tests' garbage, collected here rather than
# at whatever moment the collector next runs, which may be inside a later test's trace. Some
# of torch's objects change this thread's dispatch key sets when they are freed: a
# dispatch-key guard entered inside a generator that was never finished puts back, when the
# generator is collected, the key set it saved on entry. Freed inside a functionalization
# kernel, that made the kernel functionalize its own output (an INTERNAL ASSERT in
# FunctionalStorageImpl.cpp), in a test that had nothing to do with the object. The key sets
# must be the ones the run started with, before and after the collection: a test that left
# them changed, or left such an object, fails the next test's setup, naming it.

_PREVIOUS_TEST: list[str] = ["(none: the first test)"]
# A whole-heap collection before every test took longer than most tests (about a second once
# the earlier tests' objects fill the heap): what survives a collection is frozen (the
# collector, automatic or not, never scans it again), so the next one scans only what the last
# test made. Every _FULL_EVERY tests the frozen objects are collected too: garbage among them
# (a cache a reset dropped) is collected here, between tests, never inside one.
_COLLECTIONS = [0]
_FULL_EVERY = 100
_KEYS_AT_START: list[tuple[str, str]] = []


def _dispatch_keys() -> tuple[str, str]:
    return str(torch._C._dispatch_tls_local_include_set()), str(torch._C._dispatch_tls_local_exclude_set())


def _collect_what_earlier_tests_left(nodeid: str) -> None:
    previous, _PREVIOUS_TEST[0] = _PREVIOUS_TEST[0], nodeid
    if not _KEYS_AT_START:
        gc.collect()
        gc.freeze()  # what the imports and the collection made lives all run: never scanned again
        _KEYS_AT_START.append(_dispatch_keys())
    before = _dispatch_keys()
    _COLLECTIONS[0] += 1
    if _COLLECTIONS[0] % _FULL_EVERY == 0:
        gc.unfreeze()  # what earlier tests left alive and has died since, collected here too
    gc.collect()
    gc.freeze()  # what lives on is not scanned again by the next tests' collections
    after = _dispatch_keys()
    if before != _KEYS_AT_START[0] or after != before:
        raise AssertionError(
            f"after {previous}: this thread's dispatch key sets (included, excluded) were {_KEYS_AT_START[0]} "
            f"at the start of the run, {before} before collecting the garbage left, {after} after it"
        )


# --------------------------------------------------------------------------- config hygiene
# Tests may change torch's global state only through torch's own context managers
# (``torch._dynamo.config.patch(...)``). pytest's monkeypatch, for one, restores a config
# module's attribute by deleting it on undo in recent releases, after which the option no
# longer exists and every later compile fails. The picture of every config module taken at
# the start of the run must be the one at its end.

_MISSING = object()


def _config_modules() -> dict[str, ConfigModule]:
    return {name: mod for name, mod in list(sys.modules.items()) if isinstance(mod, ConfigModule)}


def _config_picture(mod: ConfigModule) -> dict[str, Any]:
    picture = {}
    for key, entry in mod._config.items():
        if entry.hide:  # deleted (what monkeypatch's undo does): the key no longer exists
            continue
        try:
            picture[key] = getattr(mod, key)
        except AttributeError:
            picture[key] = _MISSING
    return picture


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def config_changes(before: dict[str, dict[str, Any]]) -> list[str]:
    """What differs in the config modules seen in ``before`` (lost, gained or changed keys)."""
    problems = []
    now = _config_modules()
    for name, old in before.items():
        mod = now.get(name)
        if mod is None:
            problems.append(f"{name}: module gone")
            continue
        new = _config_picture(mod)
        for key in sorted(old.keys() - new.keys()):
            problems.append(f"{name}.{key}: lost")
        for key in sorted(new.keys() - old.keys()):
            problems.append(f"{name}.{key}: gained")
        for key in sorted(old.keys() & new.keys()):
            if not _same(old[key], new[key]):
                problems.append(f"{name}.{key}: {old[key]!r} -> {new[key]!r}")
    return problems


_AT_START: dict[str, dict[str, Any]] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    # Import the config modules tests may touch, so the picture covers them.
    import torch._functorch.config  # noqa: F401
    import torch._inductor.config  # noqa: F401

    _AT_START.update({name: _config_picture(mod) for name, mod in _config_modules().items()})


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    problems = config_changes(_AT_START)
    if problems:
        print("\nconfig hygiene: torch config modules differ from the start of the run:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
