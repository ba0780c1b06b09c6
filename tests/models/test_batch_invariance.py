"""Batch invariance, op by op and for the whole decoder (ARCHITECTURE.md point 11).

A row's result must not depend on how many other rows share the op. These tests compare bit for
bit (torch.equal), no tolerance: they are what lets speculative output equal plain output exactly,
in float32 and in bfloat16."""

from __future__ import annotations

import pytest
import torch

from quickdraft.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder, _bmm_rows, linear, rms_norm
from quickdraft.models.tiny import random_weights, tiny_config

DTYPES = [torch.float32, torch.bfloat16]


def _rows_alone(fn, x):
    return torch.cat([fn(x[r : r + 1]) for r in range(x.shape[0])])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 96), (576, 1536), (1536, 8960), (896, 4864)])
def test_linear_rows_do_not_depend_on_the_batch(dtype, shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape[1], shape[0], generator=g).to(dtype)
    x = torch.randn(19, shape[0], generator=g).to(dtype)
    alone = _rows_alone(lambda r: linear(r, w), x)
    for n in range(1, 20):
        assert torch.equal(linear(x[:n], w), alone[:n]), f"{n} rows"


def test_unpadded_float32_matmul_is_not_invariant():
    """The reason for the padding: without it, the float32 kernel's tail rows round differently.
    If torch ever fixes this, this test says the padding can go."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(256, 512, generator=g), torch.randn(5, 512, generator=g)
    full = torch.nn.functional.linear(x, w)
    alone = torch.cat([torch.nn.functional.linear(x[r : r + 1], w) for r in range(5)])
    assert not torch.equal(full, alone)


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch,heads,kv_heads", [("qwen2", 4, 2), ("llama", 9, 3)])
@pytest.mark.parametrize("chunk", [2, 3, 5, 8, 17])
def test_decoder_chunked_equals_token_by_token(dtype, arch, heads, kv_heads, chunk):
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
    assert torch.equal(torch.cat(out), ref)


def test_tree_mask_scores_each_branch_as_its_own_chain():
    """A token tree (root -> a, root -> b) in one pass: each leaf's logits equal those of its own
    chain. The tree path takes one masked matmul over all rows, so equality is to float32
    rounding (1e-5), not bit for bit; chains, which is what the engine verifies today, are exact."""
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
