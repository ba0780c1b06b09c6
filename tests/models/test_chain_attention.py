"""kernels/attention.cpp: a chain's attention in one call. Row j attends over keys 0..ctx+j; it is
close to torch's softmax attention, and bit for bit the row computed alone (batch invariance)."""

from __future__ import annotations

import pytest
import torch

from quickdraft.kernels import chain_attention

pytestmark = pytest.mark.skipif(chain_attention() is None, reason="no CPU kernels here: the decoder's torch loop runs")


def _inputs(dtype, m=7, ctx=45, heads=6, kv_heads=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(m, heads, d, generator=g)
    # a cache longer than what is read, as the decoder's slot is: rows are strided
    keys = torch.randn(kv_heads, ctx + m + 9, d, generator=g).to(dtype)
    values = torch.randn(kv_heads, ctx + m + 9, d, generator=g).to(dtype)
    return q, keys, values


def _reference(q, keys, values, ctx, scale):
    m, heads, d = q.shape
    group = heads // keys.shape[0]
    out = []
    for j in range(m):
        k = keys[:, : ctx + j + 1].float().repeat_interleave(group, 0)  # [heads, L, d]
        v = values[:, : ctx + j + 1].float().repeat_interleave(group, 0)
        p = torch.softmax(torch.einsum("hd,hld->hl", q[j].double(), k.double()) * scale, dim=-1)
        out.append(torch.einsum("hl,hld->hd", p, v.double()).reshape(-1))
    return torch.stack(out).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_close_to_softmax_attention(dtype):
    q, keys, values = _inputs(dtype)
    ctx, scale = 45, 64**-0.5
    got = chain_attention()(q, keys, values, ctx, scale)
    assert got.shape == (7, 6 * 64)
    torch.testing.assert_close(got, _reference(q, keys, values, ctx, scale), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_does_not_depend_on_the_chain(dtype):
    q, keys, values = _inputs(dtype, m=12)
    kernel, ctx, scale = chain_attention(), 45, 64**-0.5
    alone = torch.cat([kernel(q[j : j + 1], keys, values, ctx + j, scale) for j in range(12)])
    for m in range(1, 13):
        assert torch.equal(kernel(q[:m], keys, values, ctx, scale), alone[:m]), f"{m} rows"


def test_bad_shapes_are_refused():
    q, keys, values = _inputs(torch.float32)
    with pytest.raises(RuntimeError, match="ctx \\+ m"):
        chain_attention()(q, keys, values, keys.shape[1], 0.1)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        chain_attention()(q[:, :5], keys, values, 3, 0.1)
