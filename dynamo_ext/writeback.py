"""Write-back of data mutations on subclass inputs, at the level of their inner tensors.

AOTAutograd writes an input's data mutation back with ``inpt_old.copy_(inpt_new)``
on the outer tensor: in the traced graph (``apply_in_graph_mutations``) or in the
run-time epilogue (generated ``_apply_mutations``).  For a traceable wrapper subclass
that copy goes through the subclass's own dispatch, which may have no rule for it
even though old and new have the same metadata: DTensor has no sharding strategy for
``copy_`` on a ``_MaskPartial`` placement, and ``_MaskPartial._reduce_value`` masks
the pending tensor's local shard in place, so reducing a partial embedding that came
from another compiled region fails to compile on every AOT backend.

When the outer ``copy_`` raises and old and new are the same subclass with the same
flatten ctx, the mutation is written back inner tensor by inner tensor (recursively),
which is what the data mutation is: AOTAutograd detects it on the inner tensors.
When the outer ``copy_`` works, nothing changes.
"""

from __future__ import annotations

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
        try:
            return original(input_info, inpt_old, inpt_new, f_inpt, input_idx, *rest, **kwargs)
        except RuntimeError as e:
            data_only = not (
                input_info.mutates_metadata
                or input_info.mutates_storage_metadata
                or input_info.mutation_inductor_storage_resize
            )
            if not data_only:  # the original may have applied part of it already
                raise
            _copy_inner(
                inpt_old,
                inpt_new,
                lambda o, n: apply_in_graph_mutations(input_info, o, n, f_inpt, input_idx, *rest, **kwargs),
                e,
            )

    return apply_in_graph_mutations


def copy_back(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, inner tensor by inner tensor where the subclass cannot copy.

    Not where autograd must record the copy on ``dst`` (grad mode on and ``dst``
    requires grad): inner copies would leave ``dst``'s autograd history without it,
    a silently wrong gradient later; the subclass's own error is raised instead.
    """
    try:
        dst.copy_(src)
    except RuntimeError as e:
        if torch.is_grad_enabled() and dst.requires_grad:
            raise
        _copy_inner(dst, src, copy_back, e)


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
