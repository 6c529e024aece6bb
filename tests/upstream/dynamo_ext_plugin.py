"""pytest plugin: run a whole pytest session with dynamo_ext enabled.

Load it with ``-p dynamo_ext_plugin`` and this directory on ``PYTHONPATH``::

    PYTHONPATH=/path/to/repo:/path/to/repo/tests/upstream \\
        python -m pytest -p dynamo_ext_plugin dynamo/test_subclasses.py

``dynamo_ext.enable()`` is called at session start, before any test module is
imported. The plugin also sets ``DYNAMO_EXT_UPSTREAM_ENABLE=1`` so that
processes the tests spawn (torch's MultiProcessTestCase uses the ``spawn``
start method, which loads no pytest plugin) enable it too, through the
``sitecustomize`` module next to this file.

After every test it checks that dynamo_ext is still enabled (a test that
monkeypatches one of the patched torch attributes could undo it) and reports
the tests after which it was not.
"""

from __future__ import annotations

import os

CHILD_FLAG = "DYNAMO_EXT_UPSTREAM_ENABLE"

_found_disabled: list[str] = []


def pytest_sessionstart(session):
    import dynamo_ext

    dynamo_ext.enable()
    os.environ[CHILD_FLAG] = "1"


def pytest_report_header(config):
    import dynamo_ext

    where = os.path.dirname(os.path.abspath(dynamo_ext.__file__))
    return (
        f"dynamo_ext {dynamo_ext.__version__} from {where}: "
        f"enabled for the session ({len(dynamo_ext.TABLE)} patches)"
    )


def pytest_runtest_logfinish(nodeid, location):
    import dynamo_ext

    if not dynamo_ext.is_enabled():
        _found_disabled.append(nodeid)
        dynamo_ext.enable()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import dynamo_ext

    tr = terminalreporter
    tr.write_sep("-", "dynamo_ext")
    tr.write_line(f"dynamo_ext enabled at session end: {dynamo_ext.is_enabled()}")
    tr.write_line(f"tests after which dynamo_ext was found disabled: {len(_found_disabled)}")
    for nodeid in _found_disabled:
        tr.write_line(f"  {nodeid}")
