"""NestedTensor (jagged layout): its lazily cached seqlen metadata under torch.compile.

What torch 2.13 does: an NJT built from a list computes min/max_seqlen at construction;
one built from values/offsets computes them lazily in ``_get_max_seqlen()``, caching them
in ``_metadata_cache`` (an in-place dict update, not an attribute assignment). Under
torch.compile that computation is data-dependent and Dynamo refuses it, stock or not, and
ops such as ``to_padded_tensor`` do not cache. These tests pin down that dynamo_ext keeps
that behaviour exactly: same outputs, same caches, same refusal.
"""

from __future__ import annotations

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
