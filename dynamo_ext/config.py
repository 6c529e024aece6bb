"""Switches of dynamo_ext, read at trace time.

Built with torch's own config-module machinery (``torch.utils._config_module``), like
``torch._dynamo.config``: change a switch for a block with
``dynamo_ext.config.patch(dynamo_layer=False)``; assignments to names that do not
exist raise.
"""

import sys

from torch.utils._config_module import install_config_module

#: Record dispatch writes in Dynamo's SideEffects (the primary path). When False,
#: Dynamo's fake example values are still kept consistent and restored, and the
#: AOTAutograd layer alone plans and replays the writes (backends built on
#: AOTAutograd; with backend="eager" dispatch runs for real at run time anyway).
dynamo_layer: bool = True

#: Catch, unwind and replay writes in AOTAutograd's tracing passes.
aot_layer: bool = True

install_config_module(sys.modules[__name__])
