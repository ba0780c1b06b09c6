"""kernels/rowwise.cpp: RMSNorm and rotary in one call each, close to the torch versions the
decoder runs elsewhere, and each row's bits independent of the other rows."""

from __future__ import annotations

import pytest
import torch

from quickdraft.models import decoder
from quickdraft.models.kernels import rowwise

pytestmark = pytest.mark.skipif(rowwise() is None, reason="no CPU kernels here: the decoder's torch ops run")


def _torch_rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _torch_rotary(r: decoder.Rotary, x, positions):
    cos, sin = r.cos[positions].unsqueeze(1), r.sin[positions].unsqueeze(1)
    xf, half = x.float(), x.shape[-1] // 2
    return (xf * cos + torch.cat([-xf[..., half:], xf[..., :half]], dim=-1) * sin).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(9, 200, generator=g) * 3).to(dtype), torch.randn(200, generator=g).to(dtype)
    got = rowwise().rms_norm(x, w, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), _torch_rms_norm(x, w, 1e-6).float(), rtol=tol, atol=tol)
    alone = torch.cat([rowwise().rms_norm(x[i : i + 1], w, 1e-6) for i in range(9)])
    assert torch.equal(got, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary(dtype):
    r = decoder.Rotary(64, 10000.0, 512, "cpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, 64, generator=g).to(dtype)
    positions = torch.tensor([0, 5, 9, 100, 101, 300, 511])
    got = rowwise().rotary(x, r.cos, r.sin, positions)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), _torch_rotary(r, x, positions).float(), rtol=tol, atol=tol)
    alone = torch.cat([rowwise().rotary(x[i : i + 1], r.cos, r.sin, positions[i : i + 1]) for i in range(7)])
    assert torch.equal(got, alone)
    with pytest.raises(RuntimeError, match="past the rotary table"):
        rowwise().rotary(x[:1], r.cos, r.sin, torch.tensor([512]))
