"""The decoder's layers on the CPU kernels, in C++: the whole pass in one call (kernels/forward.cpp),
or one call a layer (kernels/layer.cpp).

Both run reference.py's kernels and torch operations in the same order, so their hidden states and
KV caches are reference.py's bit for bit (tests/models/test_fused_layer.py,
test_native_forward.py). The one-call pass keeps the weights, as the kernels take them, in a C++
object made once, and a workspace of activations that every layer of every pass reuses: a draft's
one-row pass makes one call from Python instead of one (and ~18 allocations) a layer.
"""

from __future__ import annotations

import torch

from quickdraft.kv_cache import KVCache
from quickdraft.models.decoder.metadata import AttentionMetadata
from quickdraft.models.ggml import LANES, BlockWeight
from quickdraft.models.kernels import fused_layer, native_decoder

DENSE = -1  # kernels/layer.h's kind of a dense projection of the activations' dtype
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class NativeLayers:
    """A Decoder's layers as the kernels take them. ``one_call`` (the default) runs a pass's layers
    and final norm in one call; False runs one call a layer from Python (how it ran before, kept to
    measure one against the other)."""

    def __init__(self, decoder, layers: list[tuple[list, list, list]]):
        c = decoder.config
        self.config = c
        self.layers = layers  # per layer: (weights [9], kinds [7], biases [3])
        self.rotary = decoder.rotary
        self.scale = decoder.scale
        self.one_call = True
        self._model = native_decoder()(  # kernels/forward.cpp's NativeDecoder: the lists flattened layer by layer
            [w for weights, _, _ in layers for w in weights], [k for _, kinds, _ in layers for k in kinds],
            [b for _, _, biases in layers for b in biases], decoder.w["model.norm.weight"], self.rotary.cos, self.rotary.sin,
            c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, self.scale)

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
            weights = [decoder.w[p + "input_layernorm.weight"], *data[:4], decoder.w[p + "post_attention_layernorm.weight"], *data[4:]]
            # biases as the kernels read them, float32 (the same values: a bfloat16 converts exactly):
            # converted once here, not at every call (~30 us a layer at one row, kernels/blocks.cpp)
            biases = [b.float().contiguous() if b is not None else None
                      for b in (decoder.w.get(p + n + ".bias") for n in PROJECTIONS[:3])]
            layers.append((weights, kinds, biases))
        return cls(decoder, layers)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: KVCache, meta: AttentionMetadata, trees,
                num_layers: int, capture: tuple[int, ...]) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
        """x [num_tokens, hidden] (the embeddings) -> what Decoder.forward returns, in one call."""
        out = self._model.forward(x, positions, kv.keys, kv.values, meta.slots, meta.context_lens, meta.query_lens,
                                  *trees, num_layers, list(capture))
        return out[0] if not capture else (out[0], out[1])

    def layer(self, layer: int, x: torch.Tensor, positions: torch.Tensor, kv: KVCache, meta: AttentionMetadata,
              trees) -> torch.Tensor:
        """x after one layer, in one call (reference.py's _block with both sublayers)."""
        weights, kinds, biases = self.layers[layer]
        c = self.config
        return fused_layer()(x, positions, weights, kinds, biases, self.rotary.cos, self.rotary.sin,
                             kv.keys[layer], kv.values[layer], meta.slots, meta.context_lens, meta.query_lens,
                             *trees, c.num_heads, c.num_kv_heads, c.rms_norm_eps, self.scale)
