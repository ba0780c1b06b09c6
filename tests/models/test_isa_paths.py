"""Every instruction set's kernels that this CPU runs, side by side through torch (each a module of
its own, built on first use): with QUICKDRAFT_ISA a user picks any of them, so each must keep the
promises of simd.h. Each ISA's rows are batch invariant; and its bits are the portable
reference's wherever simd.h says so: the GGUF block linear for every format, the float32 and int8
linears, attention, RMSNorm and rotary. Only the bfloat16 dense linear may differ on AVX512-BF16
(vdpbf16ps rounds its own way). So the losslessness proven end to end on one path holds on the
others for every float32 and GGUF-block model (tests/native covers ARM64 the same way)."""

from __future__ import annotations

import pytest
import torch
from test_gguf_blocks import random_blocks  # tests/models is on the path, as pytest collects it

from quickdraft import kernels
from quickdraft.models.ggml import BLOCKS, BlockWeight
from quickdraft.kernels import isa
from quickdraft.models.quant import Int8Weight

HERE = [i for i in isa.ISAS if isa.runs_here(i)]


@pytest.fixture(scope="module")
def reference():
    module = kernels.build(isa.BY_NAME["portable"])
    if module is None:
        pytest.skip("the portable kernels did not build (no C++ compiler?)")
    return module


@pytest.fixture(scope="module", params=[i.name for i in HERE if i.name != "portable"] or ["portable"])
def module(request):
    built = kernels.build(isa.BY_NAME[request.param])
    if built is None:
        pytest.skip(f"the {request.param} kernels did not build")
    assert built.isa() == request.param
    return built


def _bf16_exact(m) -> bool:
    return not (m.isa() == "avx512" and "avx512_bf16" in isa.cpu_features())


@pytest.mark.parametrize("kind", sorted(BLOCKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_linear_bits_are_the_portable_ones_and_rows_are_invariant(module, reference, kind, dtype):
    rows, cols = 40, 512
    w = BlockWeight.from_gguf(kind, random_blocks(kind, rows, cols), (rows, cols))  # random values, sane scales
    x = torch.randn(20, cols, generator=torch.Generator().manual_seed(2)).to(dtype)
    bias = torch.randn(rows)

    def run(m, xs):
        return m.linear_blocks(xs.contiguous(), w.data, w.format.kind, cols, bias)

    full = run(module, x)
    assert torch.equal(full, run(reference, x)), f"{module.isa()} {kind}: not the portable bits"
    for n in (1, 3, 8, 13, 19):
        assert torch.equal(run(module, x[:n]), full[:n]), f"{module.isa()} {kind}: {n} rows"
    assert torch.equal(run(module, x[7:8]), full[7:8])


@pytest.mark.parametrize("k", [64, 100, 896])
def test_dense_linears(module, reference, k):
    g = torch.Generator().manual_seed(k)
    x, w, b = torch.randn(9, k, generator=g), torch.randn(33, k, generator=g), torch.randn(33, generator=g)
    f32 = module.linear_f32(x, w, b)
    assert torch.equal(f32, reference.linear_f32(x, w, b))
    assert torch.equal(module.linear_f32(x[4:5], w, b), f32[4:5])
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    bf16 = module.linear_bf16(xb, wb, b.to(torch.bfloat16))
    assert torch.equal(module.linear_bf16(xb[2:7], wb, b.to(torch.bfloat16)), bf16[2:7])
    ref = reference.linear_bf16(xb, wb, b.to(torch.bfloat16))
    if _bf16_exact(module):
        assert torch.equal(bf16, ref)
    else:  # one bfloat16 rounding of float32 sums taken in another order
        assert torch.allclose(bf16.float(), ref.float(), rtol=2**-7, atol=2**-7 * ref.float().abs().max().item())
    q = Int8Weight.quantize(w)
    int8 = module.linear_w8(xb, q.q, q.scale, q.qsum, None)
    assert torch.equal(int8, reference.linear_w8(xb, q.q, q.scale, q.qsum, None))
    assert torch.equal(module.linear_w8(xb[:1], q.q, q.scale, q.qsum, None), int8[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_and_rowwise(module, reference, dtype):
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, ctx, m = 4, 2, 64, 37, 5
    q = torch.randn(m, heads, d, generator=g)
    keys, values = (torch.randn(kv_heads, ctx + m + 3, d, generator=g).to(dtype) for _ in range(2))
    chain = module.attend_chain(q, keys, values, ctx, 0.125)
    assert torch.equal(chain, reference.attend_chain(q, keys, values, ctx, 0.125))
    start, path = torch.tensor([0, 1, 3, 5, 7, 10]), torch.tensor([0, 0, 1, 0, 2, 0, 3, 0, 1, 4])
    tree = module.attend_tree(q, keys, values, ctx, start, path, 0.125)
    assert torch.equal(tree, reference.attend_tree(q, keys, values, ctx, start, path, 0.125))
    x, w = torch.randn(6, 200, generator=g).to(dtype), torch.randn(200, generator=g).to(dtype)
    assert torch.equal(module.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    cos, sin = torch.randn(50, 16, generator=g), torch.randn(50, 16, generator=g)
    xr, pos = torch.randn(6, 3, 16, generator=g).to(dtype), torch.tensor([0, 5, 9, 49, 2, 3])
    assert torch.equal(module.rotary(xr, cos, sin, pos), reference.rotary(xr, cos, sin, pos))
