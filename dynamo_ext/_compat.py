"""Version facts, resolved once.

dynamo_ext hooks private torch internals whose names and call sites are specific
to one torch release (see the patch table in ``_patches.py``).  Everything that
depends on the torch version is decided here, as named predicates; call sites
never look at ``torch.__version__`` themselves.
"""

from __future__ import annotations

import torch
from torch.torch_version import Version

#: The torch release line the patch table was written and tested against.
SUPPORTED_TORCH = "2.13"

TORCH_VERSION = Version(torch.__version__)

#: True when the installed torch is the release line the patch table targets.
IS_SUPPORTED_TORCH = (TORCH_VERSION.major, TORCH_VERSION.minor) == (2, 13)

#: DTensor (and its placement types) can be imported.
HAS_DISTRIBUTED = torch.distributed.is_available()


def check_supported() -> None:
    """Raise one clear error when the installed torch is not the supported line."""
    if not IS_SUPPORTED_TORCH:
        raise RuntimeError(
            f"dynamo_ext supports torch {SUPPORTED_TORCH}.x; found torch {TORCH_VERSION}. "
            f"Install torch=={SUPPORTED_TORCH}.0 (pip install 'torch=={SUPPORTED_TORCH}.0') "
            "or a dynamo_ext release built for your torch."
        )
