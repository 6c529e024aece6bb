"""Version facts, resolved once.

dynamo_ext hooks private torch internals whose names and call sites differ between
releases (see the patch table in ``patch_table.py``, whose rows say which releases they
apply to).  Everything that depends on the torch version is decided here, as named
predicates; call sites never look at ``torch.__version__`` themselves.
"""

from __future__ import annotations

import torch
from torch.torch_version import Version

#: The release lines the patch table was written and tested against: [first, last].
SUPPORTED = ((2, 13), (2, 15))

TORCH_VERSION = Version(torch.__version__)
TORCH_LINE = (TORCH_VERSION.major, TORCH_VERSION.minor)

#: True when the installed torch is a supported release line.
IS_SUPPORTED_TORCH = SUPPORTED[0] <= TORCH_LINE <= SUPPORTED[1]

#: AOTAutograd builds its run-time epilogues with ``codegen.PySourceBuilder`` (2.14+); before,
#: ``subclass_codegen._compile_and_exec_source`` compiled them.
HAS_PY_SOURCE_BUILDER = TORCH_LINE >= (2, 14)

#: DTensor's detach/alias of a ``_MaskPartial`` DTensor redistributes it to Replicate
#: (2.14+), which fakifying a partial DTensor that requires grad runs (See Note [A pending
#: DTensor mask in a fake copy] in dynamo_layer.py).
DETACH_REDISTRIBUTES_MASK_PARTIAL = TORCH_LINE >= (2, 14)

#: Stock torch.compile of a vocab-parallel embedding on its own fails with "Mixing fake
#: modes NYI" (fixed upstream in 2.14). Used by tests that pin stock's behaviour.
STOCK_EMBEDDING_REGION_MIXES_FAKE_MODES = TORCH_LINE < (2, 14)

#: DTensor (and its placement types) can be imported.
HAS_DISTRIBUTED = torch.distributed.is_available()


def applies(versions: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    """Whether a patch row written for the release lines ``[first, last]`` applies here."""
    return versions[0] <= TORCH_LINE <= versions[1]


def supported_text() -> str:
    (a, b), (c, d) = SUPPORTED
    return f"{a}.{b}-{c}.{d}"


def check_supported() -> None:
    """Raise one clear error when the installed torch is not a supported release line."""
    if not IS_SUPPORTED_TORCH:
        raise RuntimeError(
            f"dynamo_ext supports torch {supported_text()}; found torch {TORCH_VERSION}. "
            f"Install a supported torch (pip install 'torch>={SUPPORTED[0][0]}.{SUPPORTED[0][1]},"
            f"<{SUPPORTED[1][0]}.{SUPPORTED[1][1] + 1}') or a dynamo_ext release built for your torch."
        )
