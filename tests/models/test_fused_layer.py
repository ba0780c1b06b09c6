"""kernels/layer.cpp runs a decoder layer in one call; it must be the Python path bit for bit
(test_native_forward.py holds the whole pass in one call to the same).

Both paths run the same passes on their own KV caches (several sequences, chains of 1 to 32 new
tokens, token trees beside chains, a partial-depth pass as self-speculation runs), with dense
float32 and bfloat16 weights and with every GGUF block format; hidden states and caches must be
equal, not close. Where the fused path does not apply (long prefills, the int8 draft format) the
decoder must take the Python path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quickdraft.models.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder
from quickdraft.models.ggml import BLOCKS, BlockWeight
from quickdraft.kernels import block_linear
from quickdraft.kernels import fused_layer
from quickdraft.models.tiny import random_weights, tiny_config

pytestmark = pytest.mark.skipif(fused_layer() is None, reason="the CPU kernels are not available here")

# "mixed": one format a projection, so that every format passes through the fused layer alone;
# "runs": q, k, v of one format and gate, up of another (each run is one linear_blocks_many call);
# "q4_k_m": q and k of one format, v of another, as in the layers of a Q4_K_M file
LAYOUTS = {
    "mixed": {"q_proj": "Q4_K", "k_proj": "Q4_0", "v_proj": "Q6_K", "o_proj": "Q8_0", "gate_proj": "Q5_0",
              "up_proj": "Q4_1", "down_proj": "Q4_K"},
    "runs": {"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q5_0", "o_proj": "Q4_0", "gate_proj": "Q4_K",
             "up_proj": "Q4_K", "down_proj": "Q6_K"},
    "q4_k_m": {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q4_K",
               "up_proj": "Q4_K", "down_proj": "Q6_K"},
}
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}


def random_block_weight(kind: str, shape: tuple[int, int], rng: np.random.Generator) -> BlockWeight:
    rows, cols = shape
    per_block, nbytes = BLOCKS[kind]
    raw = rng.integers(0, 256, size=(rows * cols // per_block, nbytes), dtype=np.uint8)
    for at in F16_FIELDS[kind]:  # sane float16 scales; the rest of the bytes random
        scale = (rng.uniform(0.002, 0.02, size=len(raw)) * rng.choice([-1, 1], size=len(raw))).astype(np.float16)
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return BlockWeight.from_gguf(kind, raw, shape)


def model(dtype: torch.dtype, layout: str | None) -> Decoder:
    """A 2-layer model with dense weights (layout None) or GGUF blocks in ``LAYOUTS[layout]``."""
    config = tiny_config(hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=2)  # head_dim 64
    weights = random_weights(config, seed=3, dtype=dtype)
    if layout is not None:
        rng = np.random.default_rng(0)
        for name, w in list(weights.items()):
            kind = LAYOUTS[layout].get(name.split(".")[-2])
            if kind is not None and name.endswith(".weight"):
                weights[name] = random_block_weight(kind, tuple(w.shape), rng)
    return Decoder(config, weights)


def run(decoder: Decoder, mode: str, passes, **forward) -> tuple[list, KVCache]:
    """The passes on a fresh cache, the layers run ``mode``: "python" (reference.py), "layer"
    (one native call a layer) or "pass" (one native call a pass)."""
    keep = decoder.native
    assert keep is not None
    decoder.native = None if mode == "python" else keep
    keep.one_call = mode == "pass"
    kv = KVCache(decoder.config, 3, 128, decoder.dtype)
    outs = []
    try:
        for meta, layers in passes:
            tokens = torch.arange(sum(meta.query_lens)) * 7 % decoder.config.vocab_size
            outs.append(decoder.forward(tokens, positions(meta), kv, meta, num_layers=layers, **forward))
    finally:
        decoder.native = keep
        keep.one_call = True
    return outs, kv


def positions(meta: AttentionMetadata) -> torch.Tensor:
    """Chains: ctx, ctx + 1, ...; a tree's node: ctx + its depth (its ancestors among the new tokens)."""
    out = []
    for i, (ctx, qlen) in enumerate(zip(meta.context_lens, meta.query_lens)):
        mask = meta.masks[i] if meta.masks is not None else None
        out.append(ctx + (mask.sum(1) - 1 if mask is not None else torch.arange(qlen)))
    return torch.cat(out)


def tree_mask(parents: list[int]) -> torch.Tensor:
    """Node i's parent is parents[i] (-1: the root) -> [n, n] bool, True where a node sees another."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


# a root and two branches of 2 and 3 nodes: what a verification pass of num_branches=2 holds
TREE = tree_mask([-1, 0, 1, 0, 3, 4])
PASSES = [
    (AttentionMetadata.chain([0, 2], [0, 0], [40, 9]), None),  # prefills (40 rows: the Python path in both)
    (AttentionMetadata.chain([0, 2], [40, 9], [1, 5]), None),  # a plain step and a verification pass together
    (AttentionMetadata.chain([1], [0], [32]), None),  # the longest chain attended row by row
    (AttentionMetadata.chain([2], [14], [3]), 1),  # the first layer only (self-speculation's draft)
    (AttentionMetadata.chain([0, 1, 2], [41, 32, 17], [4, 1, 2]), None),
    (AttentionMetadata([0, 1, 2], [45, 33, 19], [6, 2, 6], [TREE, None, tree_mask([-1, 0, 0, 1, 2, 2])]), None),  # trees beside a chain
    (AttentionMetadata([1], [35], [6], [TREE]), 1),  # a tree through the first layer only
]


@pytest.mark.parametrize("layout", [None, *LAYOUTS], ids=["dense", *LAYOUTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fused_layer_is_the_python_path_bit_for_bit(dtype, layout):
    decoder = model(dtype, layout)
    assert decoder.native is not None
    fused, kv_fused = run(decoder, "layer", PASSES)
    python, kv_python = run(decoder, "python", PASSES)
    for i, (a, b) in enumerate(zip(fused, python)):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), f"pass {i}: largest difference {(a.float() - b.float()).abs().max()}"
    for layer in range(decoder.num_layers):
        assert torch.equal(kv_fused.keys[layer], kv_python.keys[layer])
        assert torch.equal(kv_fused.values[layer], kv_python.values[layer])


def test_fused_layer_is_used_for_chains_and_trees_not_long_prefills():
    decoder = model(torch.float32, None)
    decoder.native.one_call = False
    calls = []
    original = decoder.native.layer
    decoder.native.layer = lambda *a: calls.append(1) or original(*a)
    kv = KVCache(decoder.config, 1, 128, decoder.dtype)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # two branches after a root
    meta = AttentionMetadata.chain([0], [0], [33])
    decoder.forward(torch.zeros(33, dtype=torch.long), meta.positions("cpu"), kv, meta)
    assert not calls  # a 33-row prefill takes the Python path
    for meta in (AttentionMetadata([0], [33], [3], [tree]), AttentionMetadata.chain([0], [36], [2])):
        decoder.forward(torch.zeros(sum(meta.query_lens), dtype=torch.long), positions(meta), kv, meta)
    assert len(calls) == 2 * decoder.num_layers  # a token tree and a chain: one call a layer


def test_int8_draft_keeps_the_python_path():
    config = tiny_config(hidden_size=256, num_heads=4, num_kv_heads=2)
    decoder = Decoder(config, random_weights(config, dtype=torch.bfloat16), quantize="int8")
    assert decoder.native is None


@pytest.mark.parametrize("rows", [1, 5, 11])
def test_many_weights_in_one_call_are_one_call_each(rows):
    rng = np.random.default_rng(1)
    ws = [random_block_weight("Q4_K", (n, 512), rng) for n in (96, 32, 32)]
    biases = [torch.randn(96), None, torch.randn(32)]
    x = torch.randn(rows, 512).to(torch.bfloat16)
    many = block_linear().linear_blocks_many(x, [w.data for w in ws], ws[0].format.kind, 512, biases)
    for w, b, y in zip(ws, biases, many):
        assert torch.equal(y, w.linear(x, b))
    with pytest.raises(RuntimeError, match="bytes a tile"):  # one format and one K, or a clear error
        block_linear().linear_blocks_many(x, [ws[0].data, random_block_weight("Q4_K", (8, 256), rng).data],
                                                ws[0].format.kind, 512, [None, None])
