"""The decoder's layers on the CPU kernels, in C++: the whole pass in one call (kernels/forward.cpp),
or one call a layer (kernels/layer.cpp).

Both run reference.py's kernels and torch operations in the same order, so their hidden states and
KV caches are reference.py's bit for bit (tests/models/test_fused_layer.py,
test_native_forward.py). The one-call pass keeps the weights, as the kernels take them, in a C++
object made once, and a workspace of activations that every layer of every pass reuses: a draft's
one-row pass makes one call from Python instead of one (and ~18 allocations) a layer.

A draft model's greedy chains go one step further (``chains``): all K passes, with the token
table's rows, the output head and the argmax between them, in one call, so that no Python runs
between a draft's passes (proposers/draft/model.py): on an AMD EPYC Zen 1, the 0.5B draft proposed
1, 2 and 3 tokens in 20.5, 35.9 and 53.2 ms (medians) against 21.5, 39.0 and 56.1 with the Python
loop between its passes.
"""

from __future__ import annotations

import torch

from quickdraft.models.kv_cache import KVCache
from quickdraft.models.config import EMBED_SCALE
from quickdraft.models.decoder.metadata import AttentionMetadata
from quickdraft.models.ggml import LANES, BlockWeight
from quickdraft.kernels import fused_layer, native_decoder

DENSE = -1  # kernels/layer.h's kind of a dense projection of the activations' dtype
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class NativeLayers:
    """A Decoder's layers as the kernels take them. ``one_call`` (the default) runs a pass's layers
    and final norm in one call; False runs one call a layer from Python (how it ran before, kept to
    measure one against the other)."""

    def __init__(self, decoder, layers: list[tuple[list, list, list, list]]):
        c = decoder.config
        self.config = c
        self.layers = layers  # per layer: (weights [9], kinds [7], biases [3], norms [4]: kernels/layer.h's LayerSpec's)
        self.rotaries = decoder.rotaries
        self.scale = decoder.scale
        self.one_call = True
        tables = list({id(r): r for r in self.rotaries}.values())  # each distinct table once
        embed_scale = float(decoder.w[EMBED_SCALE]) if c.family.embed_scale else 0.0
        self._model = native_decoder()(  # kernels/forward.cpp's NativeDecoder: the lists flattened layer by layer
            [w for weights, _, _, _ in layers for w in weights], [k for _, kinds, _, _ in layers for k in kinds],
            [b for _, _, biases, _ in layers for b in biases], [n for _, _, _, norms in layers for n in norms],
            [t.cos for t in tables], [t.sin for t in tables], [tables.index(r) for r in self.rotaries],
            [c.window(layer) for layer in range(c.num_layers)], c.family.activation, embed_scale,
            decoder.w["model.norm.weight"], torch.empty(0, dtype=decoder.dtype), c.num_heads, c.num_kv_heads, c.head_dim,
            c.rms_norm_eps, self.scale)

    @classmethod
    def of(cls, decoder) -> "NativeLayers | None":
        """Where the kernels run the decoder's layers: on a CPU with the kernels, head sizes the
        chain attention takes, and every projection either GGUF blocks of whole tiles (rows a
        multiple of 16, as in every model) or dense in the activations' dtype (the int8 draft
        format keeps the Python path). None elsewhere."""
        from quickdraft.models.decoder.reference import CHAIN_HEAD_DIMS

        if decoder.device.type != "cpu" or decoder.dtype not in (torch.float32, torch.bfloat16):
            return None
        if fused_layer() is None or native_decoder() is None or decoder.config.head_dim not in CHAIN_HEAD_DIMS:
            return None
        layers = []
        for layer in range(decoder.num_layers):
            p = f"model.layers.{layer}."
            kinds = []
            for name in PROJECTIONS:
                w = decoder.w[p + name + ".weight"]
                if isinstance(w, BlockWeight) and w.out_features % LANES == 0:  # no padded rows to drop
                    kinds.append(w.format.kind)
                elif isinstance(w, torch.Tensor) and w.dtype == decoder.dtype and w.is_contiguous():
                    kinds.append(DENSE)
                else:
                    return None
            data = [w.data if isinstance(w, BlockWeight) else w
                    for w in (decoder.w[p + n + ".weight"] for n in PROJECTIONS)]
            f = decoder.config.family
            weights = [decoder.w[p + "input_layernorm.weight"], *data[:4], decoder.w[p + f.mlp_norm + ".weight"], *data[4:]]
            # LayerSpec's q, k, attention-output and MLP-output norms, where the family has them
            norms = [decoder.w.get(p + n + ".weight") for n in ("self_attn.q_norm", "self_attn.k_norm")] if f.qk_norm else [None, None]
            norms += ([decoder.w[p + n + ".weight"] for n in ("post_attention_layernorm", "post_feedforward_layernorm")]
                      if f.sandwich_norms else [None, None])
            # biases as the kernels read them, float32 (the same values: a bfloat16 converts exactly):
            # converted once here, not at every call (~30 us a layer at one row, kernels/blocks.cpp)
            biases = [b.float().contiguous() if b is not None else None
                      for b in (decoder.w.get(p + n + ".bias") for n in PROJECTIONS[:3])]
            layers.append((weights, kinds, biases, norms))
        return cls(decoder, layers)

    def set_head(self, decoder, head_ids: torch.Tensor | None) -> bool:
        """Hand ``decoder``'s token table and output head to the kernels, for ``chains``;
        ``head_ids`` [N]: a truncated head's vocabulary id of each row (None: row r is token r).
        False where either is in a form the kernels do not take."""
        tables = []
        for w in (decoder.w["model.embed_tokens.weight"], decoder.lm_head):
            if isinstance(w, BlockWeight) and w.in_features == self.config.hidden_size:
                tables += [w.data, w.format.kind, w.out_features]
            elif isinstance(w, torch.Tensor) and w.dtype == decoder.dtype and w.dim() == 2 and w.is_contiguous():
                tables += [w, DENSE, w.shape[0]]
            else:
                return False
        self._model.set_head(*tables, None if head_ids is None else head_ids.to("cpu", torch.long).contiguous())
        return True

    @torch.inference_mode()  # as Decoder.forward: the caches and the workspace are inference tensors
    def chains(self, kv: KVCache, slots: list[int], cached: list[int], feeds: list[list[int]], ks: list[int],
               threshold: float, temperatures: list[float] | None = None, uniforms: torch.Tensor | None = None,
               filters: tuple[list[int], list[float], list[float]] | None = None,
               ) -> tuple[list[list[int]], list[float], torch.Tensor | None]:
        """Draft chains in one call (after ``set_head``): sequence i reads ``feeds[i]`` at
        positions ``cached[i]``.. of slot ``slots[i]``, then drafts pass by pass, each token read
        by the next pass, until it has ``ks[i]`` tokens or its last token's probability (the
        head's softmax) is below ``threshold`` (<= 0: never); its last token is not read. Greedy
        (the head's argmax), or with ``temperatures`` [batch] (0: greedy) and ``uniforms`` [batch,
        max K] float64, sequence i's j-th token drawn at temperatures[i] with uniforms[i, j],
        and with ``filters`` (top_k, top_p, min_p [batch]) under sequence i's (the kernels' shaping
        and draw, as sampling.logits_to_probs and sample_from_probs take them on the CPU). What
        DraftModelProposer's Python loop does, with the same bits. -> (each sequence's draft tokens, each pass's seconds, and
        where sampled q [batch, max K, head rows] float32: the distribution each token was drawn
        from, row j of sequence i for its j-th token; else None)."""
        tokens = torch.tensor([t for f in feeds for t in f], dtype=torch.long)
        out, counts, seconds, q = self._model.chains(tokens, kv.keys, kv.values, slots, cached, [len(f) for f in feeds], ks,
                                                     threshold, temperatures or [], uniforms, *(filters or ([], [], [])))
        flat, drafts, at = out.tolist(), [], 0
        for n in counts.tolist():
            drafts.append(flat[at : at + n])
            at += n
        return drafts, seconds.tolist(), q if temperatures else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: KVCache, meta: AttentionMetadata, trees,
                num_layers: int, capture: tuple[int, ...]) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
        """x [num_tokens, hidden] (the embeddings) -> what Decoder.forward returns, in one call."""
        out = self._model.forward(x, positions, kv.keys, kv.values, meta.slots, meta.context_lens, meta.query_lens,
                                  *trees, num_layers, list(capture))
        return out[0] if not capture else (out[0], out[1])

    def layer(self, layer: int, x: torch.Tensor, positions: torch.Tensor, kv: KVCache, meta: AttentionMetadata,
              trees) -> torch.Tensor:
        """x after one layer, in one call (reference.py's _block with both sublayers)."""
        weights, kinds, biases, norms = self.layers[layer]
        c, rotary = self.config, self.rotaries[layer]
        return fused_layer()(x, positions, weights, kinds, biases, norms, rotary.cos, rotary.sin, c.window(layer),
                             c.family.activation, kv.keys[layer], kv.values[layer], meta.slots, meta.context_lens, meta.query_lens,
                             *trees, c.num_heads, c.num_kv_heads, c.rms_norm_eps, self.scale)
