"""Batch invariance, op by op and for the whole decoder (docs/design/batch-invariance.md).

A row's result must not depend on how many other rows share the op. On the kernel path (every
instruction set the kernels build for: AVX-512, AVX2, NEON, portable) these tests compare bit for bit
(torch.equal), no tolerance: that is what lets speculative output equal plain output exactly, in
float32 and in bfloat16. The torch fallback, forced here as ``QUICKDRAFT_KERNELS=0`` would, promises
no invariance (MKL's float32 rounding depends on the row count, differently on each CPU): its
tests assert that it says so, and that it is still right to rounding."""

from __future__ import annotations

import pytest
import torch

from quickdraft.models.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder, _bmm_rows, linear, rms_norm
from quickdraft.models.invariance import probe, probe_linear
from quickdraft.kernels import block_linear, invariance
from quickdraft.models.quant import Int8Weight
from quickdraft.models.tiny import random_weights, tiny_config

DTYPES = [torch.float32, torch.bfloat16]
HAS_KERNELS = block_linear() is not None
PATHS = [pytest.param("kernel", marks=pytest.mark.skipif(not HAS_KERNELS, reason="the CPU kernels did not build")),
         "fallback"]
# the fallback's error bound against the rows alone: float32 rounding, and one bfloat16 ulp
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2**-6}


@pytest.fixture
def path(request, monkeypatch):
    if request.param == "fallback":
        request.getfixturevalue("no_kernels")
    return request.param


def _rows_alone(fn, x):
    return torch.cat([fn(x[r : r + 1]) for r in range(x.shape[0])])


def _same(got, want, dtype, path) -> bool:
    if path == "kernel":
        return torch.equal(got, want)
    return torch.allclose(got.float(), want.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * want.abs().max().item())


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_path_says_what_it_promises(path, dtype):
    inv = invariance(dtype, "cpu")
    assert inv.promised == (path == "kernel"), inv
    if path == "fallback":
        assert inv.path == "torch-cpu" and "QUICKDRAFT_KERNELS=0" in inv.why
    assert not invariance(dtype, "cuda").promised  # cuBLAS picks its kernel by shape


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 96), (576, 1536), (1536, 8960), (896, 4864), (100, 37)])
def test_linear_rows_do_not_depend_on_the_batch(path, dtype, shape):
    """1..64 rows, every row at every position of the call: the bits it gets alone. (100, 37)
    has an input width no vector length divides: the kernels' masked last step."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape[1], shape[0], generator=g).to(dtype)
    b = torch.randn(shape[1], generator=g).to(dtype)
    x = torch.randn(64, shape[0], generator=g).to(dtype)
    alone = _rows_alone(lambda r: linear(r, w, b), x)
    for n in range(1, 65):
        assert _same(linear(x[:n], w, b), alone[:n], dtype, path), f"{n} rows"


@pytest.mark.skipif(not HAS_KERNELS, reason="the CPU kernels did not build")
@pytest.mark.parametrize("shape", [(896, 4864), (100, 37)])
def test_int8_rows_do_not_depend_on_the_batch(shape):
    """Integer sums are exact and the per-row scales are the row's own: bit for bit."""
    g = torch.Generator().manual_seed(0)
    w = Int8Weight.quantize(torch.randn(shape[1], shape[0], generator=g))
    x = torch.randn(64, shape[0], generator=g).to(torch.bfloat16)
    result = probe_linear("int8", w, None, torch.bfloat16, "int8-vnni", max_rows=64)
    assert result.invariant, result
    assert torch.equal(linear(x[:7], w), _rows_alone(lambda r: linear(r, w), x[:7]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_and_norm_rows_do_not_depend_on_the_batch(dtype):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 11, 32, generator=g).to(dtype)
    b = torch.randn(2, 32, 40, generator=g).to(dtype)
    for n in range(1, 12):
        ref = torch.cat([_bmm_rows(a[:, r : r + 1], b) for r in range(n)], dim=1)
        assert torch.equal(_bmm_rows(a[:, :n], b), ref)
    x, w = torch.randn(13, 64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
    assert torch.equal(rms_norm(x, w, 1e-6), _rows_alone(lambda r: rms_norm(r, w, 1e-6), x))


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch,heads,kv_heads", [("qwen2", 4, 2), ("llama", 9, 3)])
@pytest.mark.parametrize("chunk", [2, 5, 8, 17])
def test_decoder_chunked_equals_token_by_token(path, dtype, arch, heads, kv_heads, chunk):
    """Scoring a chain of tokens in one pass gives exactly the logits of feeding them one by one,
    and a second sequence in the same pass changes nothing."""
    c = tiny_config(arch, num_heads=heads, num_kv_heads=kv_heads, hidden_size=heads * 16, num_layers=2)
    m = Decoder(c, random_weights(c, 0, dtype))
    tokens = torch.randint(0, c.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    kv = KVCache(c, 3, 64, dtype)
    ref = []
    for i in range(40):
        meta = AttentionMetadata.chain([0], [i], [1])
        ref.append(m.logits(m.forward(tokens[i : i + 1], meta.positions("cpu"), kv, meta)))
    ref = torch.cat(ref)
    out, i = [], 0
    while i < 40:
        n = min(chunk, 40 - i)
        # slot 2 decodes an unrelated token alongside, as another request would
        meta = AttentionMetadata.chain([1, 2], [i, i], [n, 1])
        batch = torch.cat([tokens[i : i + n], tokens[:1]])
        out.append(m.logits(m.forward(batch, meta.positions("cpu"), kv, meta))[:n])
        i += n
    assert _same(torch.cat(out), ref, dtype, path)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_probe_reports_each_projection(path, dtype):
    """What `quickdraft check` prints: on the kernel path every probe passes; on the fallback the
    probes run and report the path (whether MKL happens to be invariant there depends on the CPU)."""
    c = tiny_config("qwen2", num_layers=1)
    m = Decoder(c, random_weights(c, 0, dtype))
    results = probe(m, max_rows=20)
    names = [r.name for r in results]
    assert names[-2:] == ["lm_head", "decoder"] and "mlp.down_proj" in names
    assert all(r.path == m.batch_invariance.path for r in results)
    if path == "kernel":
        assert all(r.invariant and r.first_bad_rows is None for r in results), results


def test_probe_catches_a_kernel_that_is_not_invariant(monkeypatch):
    """A linear whose rounding depends on the row count (as MKL's float32 does on some CPUs) is
    caught, with the first row count that differs."""
    from quickdraft.models import invariance as inv

    def leaky(x, w, b=None):
        y = (x[:, None, :] * w[None]).sum(-1)  # [rows, out]: each row reduced alone
        return y + (x.shape[0] >= 13) * 1e-6 * y.abs()

    monkeypatch.setattr(inv, "linear", leaky)
    w = torch.randn(32, 16)
    r = inv.probe_linear("leaky", w, None, torch.float32, "test", max_rows=20)
    assert not r.invariant and r.first_bad_rows == 13 and r.max_abs_diff > 0


def test_tree_mask_scores_each_branch_as_its_own_chain():
    """A token tree (root -> a, root -> b) in one pass: each leaf's logits equal those of its own
    chain. The tree path takes one masked matmul for all rows of its attention, so equality is to
    float32 rounding (1e-5), not bit for bit; chains, which is what the engine verifies today, are exact."""
    c = tiny_config("qwen2", num_layers=2)
    m = Decoder(c, random_weights(c, 0, torch.float32))
    prefix, root, a, b = [3, 14, 15], 9, 26, 53
    kv = KVCache(c, 3, 32, torch.float32)

    def chain(slot, toks):
        meta = AttentionMetadata.chain([slot], [0], [len(toks)])
        return m.logits(m.forward(torch.tensor(toks), meta.positions("cpu"), kv, meta))[-1]

    want_a, want_b = chain(0, prefix + [root, a]), chain(1, prefix + [root, b])
    n = len(prefix)
    mask = torch.ones(n + 3, n + 3, dtype=torch.bool).tril()
    mask[n + 2, n + 1] = False  # b does not see its sibling a
    meta = AttentionMetadata([2], [0], [n + 3], [mask])
    positions = torch.tensor(list(range(n + 2)) + [n + 1])  # a and b share a position
    got = m.logits(m.forward(torch.tensor(prefix + [root, a, b]), positions, kv, meta))
    assert torch.allclose(got[n + 1], want_a, atol=1e-5) and torch.allclose(got[n + 2], want_b, atol=1e-5)
