"""GGUF block weights kept as stored (models/ggml.py, kernels/blocks.cpp).

Every format: the repacked values dequantize exactly as the gguf package does; the kernel is
close to the float product with those weights (activations are quantized to int8 in blocks of
32, so not equal); each row's bits do not depend on the other rows (1..64 rows, float32 and
bfloat16 activations); and the torch fallback, with the kernels switched off, is the float
product itself."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
import torch

from quickdraft.models.ggml import BLOCKS, BlockWeight
from quickdraft.kernels import amx_active, block_linear

HAS_KERNELS = block_linear() is not None
# where the float16 fields of each block lie (scale d, and min / dmin where there is one)
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random raw bytes of a [rows, cols] tensor in ``kind``, with sane float16 scales."""
    per_block, nbytes = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // per_block, nbytes), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        scale = (rng.uniform(0.002, 0.02, size=len(blocks)) * rng.choice([-1, 1], size=len(blocks))).astype(np.float16)
        blocks[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def gguf_reference(kind: str, raw: np.ndarray, shape) -> torch.Tensor:
    arr = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape)


# (72, 768): three K-quant super-blocks a row (24 blocks of 32, or 48 of 16 for Q6_K); 72 rows:
# four tiles of 16 rows and a fifth of 8, padded with zero rows. (6, 160): a row of 5 blocks, and
# one tile of 6 rows.
SHAPES = [(kind, (72, 768)) for kind in sorted(BLOCKS)] + [(kind, (6, 160)) for kind in ("Q4_0", "Q4_1", "Q5_0", "Q8_0")]


@pytest.fixture(params=SHAPES, ids=[f"{k}-{s[0]}x{s[1]}" for k, s in SHAPES])
def weight(request):
    kind, shape = request.param
    raw = random_blocks(kind, *shape)
    return kind, BlockWeight.from_gguf(kind, raw, shape), gguf_reference(kind, raw, shape)


def test_repacked_values_dequantize_exactly(weight):
    kind, w, ref = weight
    assert w.shape == ref.shape and w.format.bits in (4, 5, 6, 8)
    assert torch.equal(w.dequantize(torch.float32), ref)
    rows = torch.tensor([5, 0, w.shape[0] - 1])
    assert torch.equal(w.dequantize(torch.float32, rows=rows), ref[rows])
    picked = w.select(rows)  # repacked in that order (a truncated head, llama's q/k permutation)
    assert picked.shape == (3, w.shape[1]) and torch.equal(picked.dequantize(torch.float32), ref[rows])


@pytest.mark.skipif(not HAS_KERNELS, reason="the CPU kernels did not build: the fallback runs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_is_close_to_the_float_product(weight, dtype):
    """int8 activations in blocks of 32: within ~2% of the output's scale (measured ~0.5%)."""
    kind, w, ref = weight
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, w.shape[1], generator=g).to(dtype)
    bias = torch.randn(w.shape[0], generator=g).to(dtype)
    want = x.float() @ ref.T + bias.float()
    got = w.linear(x, bias)
    assert got.dtype == dtype and got.shape == (9, w.shape[0])
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < 0.02


@pytest.mark.skipif(not HAS_KERNELS, reason="the CPU kernels did not build: the fallback runs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_do_not_depend_on_the_batch(weight, dtype):
    kind, w, _ = weight
    x = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(2)).to(dtype)
    alone = torch.cat([w.linear(x[r : r + 1]) for r in range(64)])
    for n in range(1, 65):
        assert torch.equal(w.linear(x[:n]), alone[:n]), f"{kind}: {n} rows"


@pytest.mark.skipif(not HAS_KERNELS, reason="the CPU kernels did not build: the fallback runs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_rows_are_the_vnni_rows(weight, dtype):
    """Where AMX runs (an Intel Xeon from Sapphire Rapids), a pass of 40 rows takes it in blocks of
    14, 14 and 12 rows (one tile shape of 14 rows: the last block ignores the 2 past row 40); every
    output has the bits the VNNI tile gives it. (On other CPUs the rows test above covers the one
    path there is.)"""
    if not amx_active():
        pytest.skip("no AMX here (the CPU lacks AMX-INT8, Linux refused its tile state, or QUICKDRAFT_AMX=0)")
    kind, w, _ = weight
    module = block_linear()
    x = torch.randn(40, w.shape[1], generator=torch.Generator().manual_seed(4)).to(dtype)
    bias = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(5))
    on_amx = w.linear(x, bias)
    was = module.use_amx(False)
    try:
        on_vnni = w.linear(x, bias)
    finally:
        module.use_amx(was)
    assert module.amx_active() and torch.equal(on_amx, on_vnni)
    assert not torch.equal(on_amx, torch.zeros_like(on_amx))


def test_fallback_is_the_float_product(weight, no_kernels):
    kind, w, ref = weight
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(3))
    assert torch.allclose(w.linear(x), x @ ref.T, rtol=1e-5, atol=1e-5)


def test_real_file_tensors_match_gguf(smollm2_path):
    """The SmolLM2 file's own Q4_1 and Q8_0 tensors, read as the loader reads them."""
    from quickdraft.models.gguf import _torch_shape, open_gguf

    reader = open_gguf(smollm2_path)
    seen = set()
    for t in reader.tensors:
        if t.tensor_type.name in BLOCKS and t.tensor_type.name not in seen:
            seen.add(t.tensor_type.name)
            w = BlockWeight.from_gguf(t.tensor_type.name, t.data, _torch_shape(t))
            assert torch.equal(w.dequantize(torch.float32), gguf_reference(t.tensor_type.name, t.data, _torch_shape(t)))
    assert seen == {"Q4_1", "Q8_0"}


def test_stored_model_agrees_with_the_dequantized_one(smollm2_path):
    """SmolLM2 on its Q4_1 blocks against the same file dequantized to float32: the rows of q and
    k are reordered right (llama's rotary permutation), the cache returns what the conversion
    produced, and int8 activations keep the greedy choice on most positions."""
    from quickdraft.models.kv_cache import KVCache
    from quickdraft.models.decoder import AttentionMetadata, Decoder
    from quickdraft.models.loader import load_model

    tokens = torch.tensor([1, 504, 3458, 282, 4649, 314, 7042, 30, 378, 3458, 282, 9162, 314, 17473, 30, 378])

    def logits(model):
        m = Decoder(model.config, model.weights)
        kv = KVCache(model.config, 1, 32, torch.float32)
        meta = AttentionMetadata.chain([0], [0], [len(tokens)])
        return m.logits(m.forward(tokens, meta.positions("cpu"), kv, meta))

    stored = logits(load_model(str(smollm2_path), torch.float32, quantization="gguf"))
    again = logits(load_model(str(smollm2_path), torch.float32, quantization="gguf"))  # from the cache
    dense = logits(load_model(str(smollm2_path), torch.float32))
    assert torch.equal(stored, again)
    agree = (stored.argmax(-1) == dense.argmax(-1)).float().mean().item()
    print(f"top-1 agreement {agree:.2f}")
    assert agree >= 0.75, agree
    assert torch.corrcoef(torch.stack([stored.flatten(), dense.flatten()]))[0, 1] > 0.98


def test_cached_embedding_rows_are_the_dequantized_rows(smollm2_path, monkeypatch):
    """A Decoder on blocks keeps recently used embedding rows dequantized: what it returns, for a
    pass's few tokens (repeats, hits, misses, evictions past the bound) or for a long prompt, is
    exactly the dequantized rows."""
    from quickdraft.models.decoder import Decoder
    from quickdraft.models.decoder import model as decoder_module  # where Decoder reads the bound
    from quickdraft.models.loader import load_model

    monkeypatch.setattr(decoder_module, "EMBED_CACHE_ROWS", 16)  # passes of up to 4 tokens use it
    model = load_model(str(smollm2_path), torch.bfloat16, quantization="gguf")
    d = Decoder(model.config, model.weights)
    embed = model.weights["model.embed_tokens.weight"]
    assert isinstance(embed, BlockWeight)
    passes = [[5], [5, 9], [9, 9, 700], [1, 2, 3, 4], [10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21], [5],
              list(range(40, 52))]
    for ids in passes:
        tokens = torch.tensor(ids)
        assert torch.equal(d._embed_blocks(embed, tokens), embed.dequantize(torch.bfloat16, rows=tokens)), ids
        assert len(d._embed_cache) <= 16
    assert list(d._embed_cache)[-1] == 5 and 700 not in d._embed_cache  # the most recent kept, the oldest gone
    assert 40 not in d._embed_cache  # a long prompt's rows are unpacked directly
