"""kernels/rows.cpp and verify.cpp: RMSNorm and rotary, and the verifier's and sampler's rows, in one
call each, close to the torch versions the decoder runs elsewhere, and each row's bits independent
of the other rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quickdraft.models import decoder
from quickdraft.kernels import rowwise

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_finite_is_argmax_rows_and_isfinite(dtype):
    """One read a row gives sampling.argmax_rows's index (the lowest on ties, the first NaN) and
    whether the row is finite; rows of a length past a multiple of 16, all negative, so that the
    tail's padding must not win."""
    from quickdraft.sampling import argmax_finite, argmax_rows

    torch.manual_seed(0)
    x = -100 - torch.rand(9, 151936 % 997 + 16 * 40)  # 1,101... values a row: a tail of 13
    x[0, -1] = -1.0  # the maximum in the tail
    x[1, 17] = x[1, 90] = -0.5  # a tie
    x[2, 40], x[2, 30] = float("nan"), float("inf")  # the first NaN, past an infinity
    x[3, 60] = x[3, 61] = float("inf")
    x[4, 3], x[4, 100] = float("-inf"), -2.0
    x[5, 7] = float("nan")
    x[6, :2] = 3.0
    x[7] = -0.0
    x[7, 8] = 0.0
    x[8] = torch.randn(x.shape[1]) * 5
    x = x.to(dtype)
    argmax, fine = argmax_finite(x)
    assert torch.equal(argmax, argmax_rows(x.float())) and argmax.dtype == torch.int64
    assert fine.tolist() == torch.isfinite(x).all(-1).tolist()
    assert [torch.equal(argmax_finite(x[r : r + 1])[0], argmax[r : r + 1]) for r in range(9)] == [True] * 9  # alone as in a batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_sampler_draws_from_the_softmax_it_returns(dtype):
    """kernels.softmax_rows and sample_probs (sampling.logits_to_probs and sample_from_probs on the
    CPU where no row filters; the draft's native chains draw alike): q is softmax(x / t) to
    float32's rounding; a greedy row is one-hot at its argmax; the token is the first whose float64
    cumulative mass passes u x total (checked against numpy's cumulative sum, away from a
    boundary); a row's draw is the same alone as in a batch."""
    from quickdraft.sampling import argmax_rows, logits_to_probs, sample_from_probs

    kernels = rowwise()
    torch.manual_seed(1)
    x = (torch.randn(6, 151936 % 1000 + 4003) * 3).to(dtype)  # a tail past a multiple of 16 and of 256
    t = torch.tensor([1.0, 0.7, 0.0, 2.5, 0.05, 1.3], dtype=torch.float32)
    u = torch.tensor([0.0, 0.3, 0.5, 0.999999, 0.61, 0.9999999999], dtype=torch.float64)
    q = kernels.softmax_rows(x, t)
    rows = kernels.sample_probs(q, u)
    off = torch.zeros(6, dtype=torch.long), torch.ones(6)
    assert torch.equal(logits_to_probs(x, t, *off, torch.zeros(6)), q) and torch.equal(sample_from_probs(q, u), rows)
    want = torch.softmax(x.float() / t.clamp(min=1e-30).unsqueeze(1), -1)
    for r in (0, 1, 3, 4, 5):
        assert torch.allclose(q[r], want[r], rtol=2e-5, atol=1e-30)
        cdf = np.cumsum(q[r].double().numpy())
        point = u[r].item() * cdf[-1]
        token = int(np.searchsorted(cdf, point, side="right"))
        if min(abs(cdf[token] - point), abs(point - (cdf[token - 1] if token else 0.0))) > 1e-9 * cdf[-1]:
            assert rows[r].item() == token, r
        assert q[r, rows[r]] > 0
    assert rows[2].item() == argmax_rows(x[2:3].float()).item() and q[2].sum() == 1 and q[2, rows[2]] == 1
    for r in range(6):  # alone as in the batch
        alone = kernels.softmax_rows(x[r : r + 1].contiguous(), t[r : r + 1])
        assert torch.equal(alone, q[r : r + 1]) and torch.equal(kernels.sample_probs(alone, u[r : r + 1]), rows[r : r + 1])


def test_the_kernels_draws_follow_q():
    """Many draws with uniform u from one row: each token's share is its q (total variation); a
    token of no mass is never drawn, u -> 1 included."""
    kernels = rowwise()
    x = torch.randn(1, 40) * 2
    n = 20000
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    q = kernels.softmax_rows(x, torch.tensor([0.9]))
    rows = kernels.sample_probs(q.expand(n, 40).contiguous(), u)
    counts = torch.bincount(rows, minlength=40).double() / n
    assert 0.5 * (counts - q[0].double()).abs().sum() < 0.02
    holes = q.clone()
    holes[0, ::3] = 0.0
    holes[0, -1] = 0.0
    edge = torch.tensor([0.0, 1 - 2**-53, 0.5] * 100, dtype=torch.float64)
    drawn = kernels.sample_probs(holes.expand(300, 40).contiguous(), edge)
    assert (holes[0, drawn] > 0).all()
    with pytest.raises(RuntimeError, match="temperature"):
        kernels.softmax_rows(x, torch.tensor([-1.0]))


def test_the_kernels_softmax_keeps_masked_logits_at_zero():
    """A logit of -inf (a grammar's mask, a ban) has probability exactly 0, so it is never drawn;
    a row whose maximum is +inf or NaN is NaN throughout, as torch's softmax gives it."""
    kernels = rowwise()
    x = torch.randn(3, 1000)
    x[0, ::7] = float("-inf")
    x[1, 5] = float("inf")
    x[2, 9] = float("nan")
    q = kernels.softmax_rows(x, torch.tensor([0.8, 0.8, 0.8]))
    assert (q[0, ::7] == 0).all() and (q[0] > 0).sum() == 1000 - len(range(0, 1000, 7))
    assert torch.allclose(q[0], torch.softmax(x[0] / 0.8, -1), rtol=2e-5, atol=1e-30)
    assert q[1:].isnan().all()
    drawn = kernels.sample_probs(q[:1].expand(500, 1000).contiguous(), torch.linspace(0, 1 - 2**-53, 500, dtype=torch.float64))
    assert (drawn % 7 != 0).all()
