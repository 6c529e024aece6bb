"""NestedTensor (jagged layout): its lazily cached seqlen metadata under torch.compile.

What torch 2.13 does: an NJT built from a list computes min/max_seqlen at construction;
one built from values/offsets computes them lazily in ``_get_max_seqlen()``, caching them
in ``_metadata_cache`` (an in-place dict update, not an attribute assignment). Under
torch.compile that computation is data-dependent and Dynamo refuses it, stock or not, and
ops such as ``to_padded_tensor`` do not cache. These tests pin down that dynamo_ext keeps
that behaviour exactly: same outputs, same caches, same refusal.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from harness import stock_torch


def from_list():
    return torch.nested.nested_tensor(
        [torch.arange(8.0).view(2, 4), torch.arange(20.0).view(5, 4), torch.arange(12.0).view(3, 4)],
        layout=torch.jagged,
    )


def from_jagged():
    return torch.nested.nested_tensor_from_jagged(torch.arange(40.0).view(10, 4), torch.tensor([0, 2, 7, 10]))


def padded_sum(nt):
    return (nt * 2).to_padded_tensor(0.0).sum()


def _cache(nt):
    return {k: (v.shape if isinstance(v, torch.Tensor) else v) for k, v in nt._metadata_cache.items()}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("make", [from_list, from_jagged])
def test_outputs_and_metadata_cache_match_eager(make, backend):
    e, c = make(), make()
    expected = padded_sum(e)
    got = torch.compile(padded_sum, backend=backend, fullgraph=True)(c)
    torch.testing.assert_close(got, expected)
    assert _cache(c) == _cache(e)


def test_lazy_max_seqlen_is_refused_as_on_stock():
    def max_seqlen(nt):
        return nt._get_max_seqlen() * 1

    with stock_torch():
        with pytest.raises(Exception, match="data-dependent") as stock:
            torch.compile(max_seqlen, backend="aot_eager", fullgraph=True)(from_jagged())
    with pytest.raises(type(stock.value), match="data-dependent"):
        torch.compile(max_seqlen, backend="aot_eager", fullgraph=True)(from_jagged())


@pytest.mark.parametrize(
    "backend,flags",
    [("eager", "011"), ("eager", "110"), ("aot_eager", "111"), ("aot_eager", "101")],
    ids=["eager-dense_base-leaf_view", "eager-nt_base-no_grad_view", "aot_eager-nt_base-leaf_view", "aot_eager-nt_base"],
)
def test_compiled_fn_on_njt_views(backend, flags):
    """torch's size caches on an NJT (``_sym_sizes_capsule``/``_len``) are not subclass
    state: never answered from the real input (that aborted the process in C++), never
    counted as writes (that refused them as opaque values). torch's own
    test_inputs_to_compiled_fn_are_views cases."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = os.path.join(os.path.dirname(__file__), "_njt_view_child.py")
    proc = subprocess.run([sys.executable, child, backend, *flags], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "equal"
