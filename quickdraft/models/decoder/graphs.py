"""CUDA graphs of the decoding passes: a decode step as one graph replay instead of a few hundred
kernel launches.

On a GPU a small model's decoding pass is bound by launching kernels, not by reading its weights:
a pass runs about fifty kernels a layer (norms, projections, rotary, the cache writes, attention,
the MLP), each a few microseconds of CPU time to launch, while an H200 streams the 1.5B target's
2.6 GB of layer weights in about 0.6 ms. A CUDA graph records the pass once and replays it with one
launch (vLLM's CUDA graph runner, gpt-fast's ``torch.compile(mode="reduce-overhead")``).

A graph has fixed shapes and addresses, so the passes it takes are the regular ones: every
sequence of the pass feeds the same number ``q`` of new tokens as a causal chain (plain decoding's
one token, a draft model's passes, the verification of chains with equal K), ``q`` at most
``MAX_GRAPH_ROWS``. Prompts, token trees, mixed K, layer skipping and passes that capture hidden
states (EAGLE-3) run eagerly. A graph is
keyed by its shape:

- the sequences, padded up to the next of ``BATCH_BUCKETS``; a padding row writes its keys to the
  cache's spare slot (kv_cache.py), which no sequence holds;
- the keys attended: the first L positions of each sequence's slot, L the next power of two at
  least the longest context (``MIN_KEYS`` at least, the cache's length at most), each key past a
  row's own position masked out. The mask comes from the positions tensor, so a replay needs no
  number from the host.

Graphs are captured on first use and kept on the KV cache they write (``KVCache.graphs``), sharing
one memory pool per model; a replay's output is copied out at once, before another graph can
reuse that memory.

Bits: a replay runs the kernels of ``static_pass``, eager, on the same shapes, and gives its bits
(tests/engine/test_cuda_graphs.py). Against the eager ragged path (each row over exactly its own
keys) the rounding differs, as cuBLAS's does between shapes anyway: on CUDA the decoder promises
the plain output up to near-ties (``Decoder.batch_invariance``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quickdraft.models.kv_cache import KVCache
from quickdraft.models.decoder.metadata import AttentionMetadata
from quickdraft.models.config import EMBED_SCALE
from quickdraft.models.decoder.ops import rms_norm

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MAX_GRAPH_ROWS = 16  # new tokens a sequence brings to a graphed pass (a verification's K + 1)
MIN_KEYS = 256  # the fewest cached positions a graph attends over


def static_pass(model, kv: KVCache, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                q: int, num_keys: int, layers: int) -> torch.Tensor:
    """A pass with shapes fixed by (len(slots), q, num_keys) and no host synchronisation: sequence
    b's q new tokens are rows b*q .. b*q + q - 1 of ``tokens`` and ``positions``, its keys and
    values go to slot ``slots[b]``, and row r attends over the slot's first ``num_keys`` positions
    up to its own. -> hidden [len(tokens), hidden] after the final norm."""
    c, w = model.config, model.w
    n, b = tokens.shape[0], slots.shape[0]
    group = c.num_heads // c.num_kv_heads
    row_slots = slots.view(b, 1).expand(b, q).reshape(n)
    # what each row may see, once a pass: [b, 1, group * q, L], row (g, j) of a kv head's queries
    # sees the keys up to its token's position
    keys_at = torch.arange(num_keys, device=tokens.device).view(1, num_keys)
    masks = {}  # by window (0: none): [b, 1, group * q, L], row (g, j) of a kv head's queries sees its keys

    def seen(window: int) -> torch.Tensor:
        if window not in masks:
            m = keys_at <= positions.view(n, 1)  # [n, L]
            if window:
                m = m & (keys_at > positions.view(n, 1) - window)
            masks[window] = m.view(b, 1, 1, q, num_keys).expand(b, 1, group, q, num_keys).reshape(b, 1, group * q, num_keys)
        return masks[window]

    angles = {id(r): r.angles(positions) for r in model.rotaries}  # each distinct table's, once a pass
    x = w["model.embed_tokens.weight"][tokens]
    if c.family.embed_scale:
        x = x * w[EMBED_SCALE]
    for layer in range(layers):
        qs, k, v = model._qkv(layer, x, positions, angles[id(model.rotaries[layer])])
        kv.keys[layer][row_slots, :, positions] = k
        kv.values[layer][row_slots, :, positions] = v
        keys = kv.keys[layer][:, :, :num_keys].index_select(0, slots).float()  # [b, kv_heads, L, d]
        values = kv.values[layer][:, :, :num_keys].index_select(0, slots).float()
        # the queries of one kv head together: [b, kv_heads, group * q, d], row (g, j); in float32
        # as the eager path's attention
        qs = qs.float().view(b, q, c.num_kv_heads, group, c.head_dim).permute(0, 2, 3, 1, 4)
        o = F.scaled_dot_product_attention(qs.reshape(b, c.num_kv_heads, group * q, c.head_dim), keys, values,
                                           attn_mask=seen(c.window(layer)), scale=model.scale)
        o = o.view(b, c.num_kv_heads, group, q, c.head_dim).permute(0, 3, 1, 2, 4)
        o = o.reshape(n, c.num_heads * c.head_dim).to(x.dtype)
        x = model._attention_output(layer, x, o)
        x = model._mlp_sublayer(layer, x)
    return rms_norm(x, w["model.norm.weight"], c.rms_norm_eps)


def batch_bucket(num_seqs: int) -> int | None:
    return next((b for b in BATCH_BUCKETS if b >= num_seqs), None)


def keys_bucket(longest: int, max_len: int) -> int:
    """The positions a graph attends over for contexts up to ``longest``: a power of two, at least
    MIN_KEYS, at most ``max_len``."""
    return min(max(MIN_KEYS, 1 << (longest - 1).bit_length()), max_len)


@dataclass
class _Graph:
    """One captured pass: its input tensors (written before each replay) and its output."""

    tokens: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    slots: torch.Tensor  # [sequences]
    padding: torch.Tensor  # [rows] the padding rows' positions (0 .. q - 1 each)
    run: Callable[[], None]  # replays the graph (or, uncaptured, runs the pass)
    out: list  # [hidden [rows, hidden]] after run()


class CudaGraphs:
    """A Decoder's regular passes, each shape captured once as a CUDA graph and replayed.
    ``record=False`` runs the same padded passes eagerly (the tests' way to check the padding and
    bucketing on a machine without a GPU)."""

    def __init__(self, model, record: bool = True):
        self.model = model
        self.record = record
        self.pool = None  # one memory pool for every graph of this model

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv: KVCache, meta: AttentionMetadata,
                layers: int) -> torch.Tensor | None:
        """hidden [num_tokens, hidden] from a graph, or None where the pass is not one a graph
        takes (the caller then runs it eagerly)."""
        q = meta.query_lens[0]
        if kv.spare_slot is None or not 1 <= q <= MAX_GRAPH_ROWS or any(n != q for n in meta.query_lens):
            return None
        if meta.masks is not None and any(m is not None for m in meta.masks):
            return None
        b = len(meta.slots)
        padded = batch_bucket(b)
        if padded is None:
            return None
        num_keys = keys_bucket(max(meta.context_lens) + q, kv.max_len)
        key = (self, padded, q, num_keys, layers)
        graph = kv.graphs.get(key)
        if graph is None:
            graph = kv.graphs[key] = self._capture(kv, padded, q, num_keys, layers)
        rows = b * q
        graph.tokens[:rows].copy_(tokens)
        graph.positions[:rows].copy_(positions)
        if rows < graph.tokens.shape[0]:  # padding rows: token 0 at positions 0 .. q - 1 of the spare slot
            graph.tokens[rows:].zero_()
            graph.positions[rows:].copy_(graph.padding[rows:])
        graph.slots.copy_(torch.tensor(meta.slots + [kv.spare_slot] * (padded - b), dtype=torch.long))
        graph.run()
        return graph.out[0][:rows].clone()  # the next replay (of any graph in the pool) may overwrite it

    def _capture(self, kv: KVCache, b: int, q: int, num_keys: int, layers: int) -> _Graph:
        device = kv.keys[0].device
        padding = torch.arange(q, device=device).repeat(b)
        tokens = torch.zeros(b * q, dtype=torch.long, device=device)
        positions = padding.clone()
        slots = torch.full((b,), kv.spare_slot, dtype=torch.long, device=device)
        out: list = [None]

        def run_pass():
            out[0] = static_pass(self.model, kv, tokens, positions, slots, q, num_keys, layers)

        if not self.record:
            return _Graph(tokens, positions, slots, padding, run_pass, out)
        # a warm-up pass on a side stream first (on the spare slot alone): cuBLAS chooses its
        # kernels and takes its workspace outside the capture, as torch.cuda.graphs asks
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run_pass()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            run_pass()
        if self.pool is None:
            self.pool = graph.pool()
        return _Graph(tokens, positions, slots, padding, graph.replay, out)
