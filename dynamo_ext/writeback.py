"""Write-back of data mutations on subclass inputs, at the level of their inner tensors.

AOTAutograd writes an input's data mutation back with ``inpt_old.copy_(inpt_new)``
on the outer tensor: in the traced graph (``apply_in_graph_mutations``) or in the
run-time epilogue (generated ``_apply_mutations``).  For a traceable wrapper subclass
that copy goes through the subclass's own dispatch, which may have no rule for it
even though old and new have the same metadata: DTensor has no sharding strategy for
``copy_`` on a ``_MaskPartial`` placement, and ``_MaskPartial._reduce_value`` masks
the pending tensor's local shard in place, so reducing a partial embedding that came
from another compiled region fails to compile on every AOT backend.

Where old and new are the same subclass with the same flatten ctx, the mutation is
written back inner tensor by inner tensor (recursively), which is what the data
mutation is: AOTAutograd detects it on the inner tensors, and eager's dispatch made it
there (``self.amax_history.copy_(...)``). An inner tensor the graph returned unchanged
(the very input tensor) is left alone, as eager left it. The outer ``copy_`` would go
through the subclass's own dispatch, which may copy only some inner tensors (a
``copy_`` rule unwrapping the data tensor alone drops the history's update). Where the
inner-wise copy is not the same write (another subclass, another ctx), or where
autograd must record the copy on the input, the outer ``copy_`` runs as before.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def _inner_pairs(old: torch.Tensor, new: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The (old, new) inner tensors to copy, or None when the two are not the same
    subclass with the same flatten ctx (then an inner-wise copy would not be the
    same write)."""
    if type(old) is not type(new) or not is_traceable_wrapper_subclass(old):
        return None
    old_attrs, old_ctx = old.__tensor_flatten__()
    new_attrs, new_ctx = new.__tensor_flatten__()
    if list(old_attrs) != list(new_attrs):
        return None
    try:
        same_ctx = bool(old_ctx == new_ctx)
    except Exception:  # a ctx whose __eq__ cannot answer: not provably the same
        return None
    if not same_ctx:
        return None
    return [(getattr(old, a), getattr(new, a)) for a in old_attrs]


def _copy_inner(old: torch.Tensor, new: torch.Tensor, copy: Callable[[torch.Tensor, torch.Tensor], Any], error: BaseException) -> None:
    pairs = _inner_pairs(old, new)
    if pairs is None:
        raise error
    for old_inner, new_inner in pairs:
        copy(old_inner, new_inner)


def make_apply_in_graph_mutations(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply_in_graph_mutations(input_info, inpt_old, inpt_new, f_inpt, input_idx, *rest, **kwargs):
        data_only = not (
            input_info.mutates_metadata
            or input_info.mutates_storage_metadata
            or input_info.mutation_inductor_storage_resize
        )
        # AOTAutograd copies a mutation made under no_grad (or hidden from autograd) under
        # no_grad: autograd records nothing on the input, so the write is inner-wise too (a
        # float8 history rolled under no_grad on a parameter was dropped: the outer copy_ went
        # through the subclass's own rule, which copied the data tensor alone; an outside
        # tester's find)
        hidden = getattr(input_info, "mutations_hidden_from_autograd", False) or getattr(
            input_info, "mutations_under_no_grad_or_inference_mode", False
        )
        with torch.no_grad() if hidden else contextlib.nullcontext():
            pairs = _inner_writes(inpt_old, inpt_new) if data_only else None
        if pairs is not None:
            for old_inner, new_inner in pairs:
                apply_in_graph_mutations(input_info, old_inner, new_inner, f_inpt, input_idx, *rest, **kwargs)
            return None
        try:
            return original(input_info, inpt_old, inpt_new, f_inpt, input_idx, *rest, **kwargs)
        except RuntimeError as e:
            if not data_only:  # the original may have applied part of it already
                raise
            _copy_inner(
                inpt_old,
                inpt_new,
                lambda o, n: apply_in_graph_mutations(input_info, o, n, f_inpt, input_idx, *rest, **kwargs),
                e,
            )

    return apply_in_graph_mutations


def _inner_writes(old: torch.Tensor, new: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The inner tensors to write back one by one (those the graph did not return
    unchanged), where the write is inner-wise: the same subclass with the same ctx, and
    autograd need not record the copy on ``old`` (inner copies would leave its history
    without it, a silently wrong gradient later). None: the outer ``copy_``."""
    pairs = _inner_pairs(old, new)
    if pairs is None or (torch.is_grad_enabled() and old.requires_grad):
        return None
    return [(o, n) for o, n in pairs if n is not o]


def copy_back(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, inner tensor by inner tensor for the same subclass with the same
    ctx (an inner tensor returned unchanged is left alone); the subclass's own ``copy_``
    where that is not the same write, or where autograd must record it (then the
    subclass's own error is raised if it cannot copy)."""
    pairs = _inner_writes(dst, src)
    if pairs is None:
        dst.copy_(src)
        return
    for old_inner, new_inner in pairs:
        copy_back(old_inner, new_inner)


# The run-time epilogue AOTAutograd generates for mutated inputs writes them back with
# ``orig_inputs[i].copy_(updated_inputs[j])`` or ``orig_inputs[i].detach().copy_(...)``.
_EPILOGUE_COPY = re.compile(r"(orig_inputs\[\d+\](?:\.detach\(\))?)\.copy_\(")
_COPY_NAME = "_dynamo_ext_copy_back"


def make_compile_and_exec_source(original: Callable[..., Any]) -> Callable[..., Any]:
    def _compile_and_exec_source(source, globals_dict, fn_name, artifact_name, *args, **kwargs):
        if fn_name == "_apply_mutations":
            rewritten, n = _EPILOGUE_COPY.subn(rf"{_COPY_NAME}(\1, ", source)
            if n != source.count(".copy_("):
                # torch changed the epilogue's shape: never leave a copy_ silently unrouted.
                raise RuntimeError(
                    "dynamo_ext: AOTAutograd's input-mutation epilogue no longer has the shape "
                    f"dynamo_ext rewrites ({n} of {source.count('.copy_(')} copy_ calls matched):\n{source}"
                )
            source = rewritten
            globals_dict = {**globals_dict, _COPY_NAME: copy_back}
        return original(source, globals_dict, fn_name, artifact_name, *args, **kwargs)

    return _compile_and_exec_source
