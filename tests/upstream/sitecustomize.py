"""Enable dynamo_ext in processes spawned by an upstream test session.

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry
that has it; run_upstream.py puts this directory on ``PYTHONPATH``. It does
nothing unless ``DYNAMO_EXT_UPSTREAM_ENABLE=1``, which dynamo_ext_plugin sets
in the pytest process of an enabled run, so spawned children of a stock run
stay stock.
"""

import os
import sys

if os.environ.get("DYNAMO_EXT_UPSTREAM_ENABLE") == "1":
    try:
        import dynamo_ext

        dynamo_ext.enable()
    except Exception as exc:  # never keep a child from starting
        sys.stderr.write(f"sitecustomize: dynamo_ext.enable() failed in pid {os.getpid()}: {exc!r}\n")
