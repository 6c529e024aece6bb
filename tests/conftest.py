import os
import sys

import pytest
import torch
import torch._dynamo

sys.path.insert(0, os.path.dirname(__file__))

import dynamo_ext  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts from a clean Dynamo, with dynamo_ext enabled and no silent fallback."""
    torch._dynamo.reset()
    saved = torch._dynamo.config.suppress_errors
    torch._dynamo.config.suppress_errors = False
    dynamo_ext.enable()
    yield
    torch._dynamo.config.suppress_errors = saved
    dynamo_ext.enable()  # a test that disabled it must not leak that into the next
    torch._dynamo.reset()
