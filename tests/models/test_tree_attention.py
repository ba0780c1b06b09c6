"""A token tree scored in one pass keeps plain decoding's bits: kernels/attention.cpp's attend_tree
runs each tree row over its context and its own path of new tokens, in order, so the decoder's row
for a node equals, bit for bit, the last row of a chain pass over the same history."""

from __future__ import annotations

import pytest
import torch

from quickdraft.models.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder
from quickdraft.kernels import chain_attention, tree_attention
from quickdraft.models.tiny import random_weights, tiny_config

pytestmark = pytest.mark.skipif(tree_attention() is None, reason="no CPU kernels here: trees take the masked matmul")

# a pending token, then a tree: node i's parent (-1: the pending token)
PARENTS = [-1, -1, 0, 0, 1, 3, 3]


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[1 + n, 1 + n]: row 0 the pending token, row i + 1 node i over its ancestors and itself."""
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[0, 0] = True
    for i, parent in enumerate(parents):
        mask[i + 1] = mask[parent + 1]
        mask[i + 1, i + 1] = True
    return mask


def path_of(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_rows_equal_chain_rows_bit_for_bit(dtype):
    config = tiny_config(hidden_size=128, num_heads=4, num_kv_heads=2, num_layers=3)
    model = Decoder(config, random_weights(config, seed=1, dtype=dtype))
    kv = KVCache(config, num_slots=2, max_len=64, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, config.vocab_size, (23,), generator=g)
    for slot in (0, 1):
        meta = AttentionMetadata.chain([slot], [0], [len(context)])
        model.forward(context, meta.positions("cpu"), kv, meta)
    ctx = len(context)
    pending = torch.randint(0, config.vocab_size, (1,), generator=g)
    nodes = torch.randint(0, config.vocab_size, (len(PARENTS),), generator=g)
    depth = [len(path_of(PARENTS, i)) for i in range(len(PARENTS))]
    positions = torch.tensor([ctx] + [ctx + d for d in depth])
    tree_meta = AttentionMetadata([0], [ctx], [1 + len(PARENTS)], [tree_mask(PARENTS)])
    tree_rows = model.forward(torch.cat([pending, nodes]), positions, kv, tree_meta)

    for i in range(len(PARENTS)):
        history = torch.cat([pending, nodes[path_of(PARENTS, i)]])
        meta = AttentionMetadata.chain([1], [ctx], [len(history)])
        chain_rows = model.forward(history, meta.positions("cpu"), kv, meta)
        assert torch.equal(tree_rows[i + 1], chain_rows[-1]), f"node {i}"
    assert torch.equal(tree_rows[0], chain_rows[0])  # the pending token


def test_the_kernel_checks_the_paths():
    q = torch.randn(2, 2, 16)
    keys = torch.randn(1, 10, 16)
    with pytest.raises(RuntimeError, match="ends at itself"):
        tree_attention()(q, keys, keys, 3, torch.tensor([0, 1, 2]), torch.tensor([0, 0]), 0.25)


def test_a_chain_given_as_a_tree_is_the_chain_kernel():
    g = torch.Generator().manual_seed(2)
    q, keys, values = torch.randn(5, 4, 32, generator=g), torch.randn(2, 40, 32, generator=g), torch.randn(2, 40, 32, generator=g)
    start = torch.tensor([0, 1, 3, 6, 10, 15])
    path = torch.cat([torch.arange(j + 1) for j in range(5)])
    assert torch.equal(tree_attention()(q, keys, values, 30, start, path, 0.2),
                       chain_attention()(q, keys, values, 30, 0.2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_grown_a_level_a_pass_equals_the_tree_in_one_pass(dtype):
    """A draft grows its tree a level a pass: each pass's rows see the nodes earlier passes wrote
    (hidden keys, through their paths only) and get the bits of the tree scored in one pass."""
    config = tiny_config(hidden_size=128, num_heads=4, num_kv_heads=2, num_layers=3)
    model = Decoder(config, random_weights(config, seed=3, dtype=dtype))
    kv = KVCache(config, num_slots=2, max_len=64, dtype=dtype)
    g = torch.Generator().manual_seed(4)
    context = torch.randint(0, config.vocab_size, (19,), generator=g)
    for slot in (0, 1):
        meta = AttentionMetadata.chain([slot], [0], [len(context)])
        model.forward(context, meta.positions("cpu"), kv, meta)
    ctx = len(context)
    tokens = torch.randint(0, config.vocab_size, (1 + len(PARENTS),), generator=g)  # the pending token, then the nodes
    depth = [len(path_of(PARENTS, i)) for i in range(len(PARENTS))]
    positions = torch.tensor([ctx] + [ctx + d for d in depth])
    full = tree_mask(PARENTS)
    whole = model.forward(tokens, positions, kv, AttentionMetadata([0], [ctx], [len(tokens)], [full]))

    grown = []
    levels = [[0] + [1 + i for i, d in enumerate(depth) if d == 1]] + [
        [1 + i for i, d in enumerate(depth) if d == level] for level in range(2, max(depth) + 1)]
    written = 0
    for rows in levels:  # rows of the one-pass tree, in order, each level after the ones before it
        mask = full[rows][:, : written + len(rows)]
        meta = AttentionMetadata([1], [ctx + written], [len(rows)], [mask])
        grown.append(model.forward(tokens[rows], positions[rows], kv, meta))
        written += len(rows)
    assert [r for level in levels for r in level] == list(range(len(tokens)))
    assert torch.equal(torch.cat(grown), whole)
