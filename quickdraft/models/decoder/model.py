"""The decoder-only transformer of the Llama, Mistral, Qwen2, Qwen3 and Gemma 3 families, written
for verification passes.

Llama (Touvron et al. 2023) and its kin share one block: RMSNorm, rotary position embeddings,
grouped-query attention, a gated MLP; what each family adds (biases, q/k norms, sandwich norms,
GELU, sliding windows, scaled embeddings) is described once in models/families.py.
``forward`` takes a *ragged batch*: the new tokens of several sequences concatenated, each sequence
with its own KV-cache slot, its own number of tokens already cached, and an optional mask among
its new tokens (a causal chain by default, a token tree for tree verification). It returns hidden
states; ``logits`` is a separate call so that draft heads can read the hidden states and so that
only the rows a verifier needs pay for the large output projection.

A pass runs its layers one of two ways, with the same bits: in Python (reference.py, the readable
path, one kernel call an operation), or on a CPU with the kernels in C++ (native.py: the whole
pass in one call). On a CUDA device the regular decoding passes replay CUDA graphs (graphs.py).
Batch invariance (docs/design/batch-invariance.md): see ops.py for the projections
and reference.py for attention.
"""

from __future__ import annotations

import collections
from collections.abc import Collection

import torch

from quickdraft.models.kv_cache import KVCache
from quickdraft.models.config import EMBED_SCALE, ModelConfig, activation_dtype
from quickdraft.models.decoder.graphs import CudaGraphs
from quickdraft.models.decoder.metadata import AttentionMetadata, pass_trees
from quickdraft.models.decoder.native import NativeLayers
from quickdraft.models.decoder.ops import Rotary, linear, nbytes, rms_norm
from quickdraft.models.decoder.reference import MAX_ROW_BY_ROW, ReferenceLayers
from quickdraft.models.ggml import BlockWeight, on_blocks
from quickdraft.kernels import Invariance, invariance
from quickdraft.models.memory import into_huge_pages
from quickdraft.models.quant import quantize_weights

EMBED_CACHE_ROWS = 4096  # embedding rows a Decoder on GGUF blocks keeps dequantized (12 MiB for the 1.5B)


class Decoder(ReferenceLayers):
    """The target (or draft) model. ``weights`` uses Hugging Face names (ModelConfig.weight_names)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], quantize: str | None = None,
                 cuda_graphs: bool = True):
        """``quantize="int8"``: int8 projections, one scale per weight row, activations quantized
        per row in the kernel (for a draft model; see quant.py). ``cuda_graphs``: on a CUDA device,
        the regular decoding passes replay CUDA graphs (graphs.py); False runs every pass eagerly."""
        missing = [n for n in config.weight_names() if n not in weights]
        if missing:
            raise ValueError(f"weights are missing {len(missing)} tensors, e.g. {missing[:3]}")
        self.config = config
        self.device = weights["model.norm.weight"].device
        self.dtype = activation_dtype(config, weights)
        embed = weights["model.embed_tokens.weight"]
        self.lm_head = embed if config.tie_word_embeddings else weights["lm_head.weight"]
        if quantize == "int8" and on_blocks(weights):
            raise ValueError("the weights are GGUF blocks already; int8 quantization applies to dense weights")
        if quantize == "int8":
            weights, self.lm_head = quantize_weights(weights, self.lm_head)
            moved = into_huge_pages(weights | {"lm_head.weight": self.lm_head})  # new tensors: see memory.py
            self.lm_head = moved.pop("lm_head.weight")
            weights = moved
        elif quantize is not None:
            raise ValueError(f"unknown quantization {quantize!r}; supported: int8")
        self.w = weights
        tables: dict = {}  # one Rotary for each distinct Rope (Gemma 3: its global and its sliding layers')
        for rope in map(config.rope, range(config.num_layers)):
            if rope not in tables:
                tables[rope] = Rotary(config.head_dim, rope, config.max_position_embeddings, self.device)
        self.rotaries = [tables[config.rope(layer)] for layer in range(config.num_layers)]  # each layer's
        self.scale = config.attention_scale
        self.native = NativeLayers.of(self)  # None where the kernels do not run the layers
        dense = all(isinstance(t, torch.Tensor) for t in self.w.values())
        self.graphs = CudaGraphs(self) if cuda_graphs and dense and self.device.type == "cuda" else None
        self._embed_cache: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()  # _embed_blocks

    @property
    def batch_invariance(self) -> Invariance:
        """What this model's projections promise on this machine (a draft's int8 path is invariant
        too, but only the target's rounding can change the output)."""
        blocks = on_blocks(self.w) or isinstance(self.lm_head, BlockWeight)
        return invariance(self.dtype, self.device, blocks)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decoding step reads (embedding rows excluded: one row per token)."""
        skip = ("model.embed_tokens.weight", "lm_head.weight")
        return sum(nbytes(t) for n, t in self.w.items() if n not in skip) + nbytes(self.lm_head)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [num_tokens] int64, sequences' new tokens concatenated
        positions: torch.Tensor,  # [num_tokens] int64
        kv: KVCache,
        meta: AttentionMetadata,
        num_layers: int | None = None,  # run only the first layers (self-speculation); None = all
        capture: tuple[int, ...] = (),  # layers whose entering states are returned too (EAGLE-3)
        skip_attention: Collection[int] = (),  # layers whose attention sublayer is left out (layer skipping)
        skip_mlp: Collection[int] = (),  # layers whose MLP sublayer is left out
    ) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
        """-> hidden [num_tokens, hidden] after the final norm; with ``capture`` (layer indices
        in 0..num_layers - 1) also the residual stream entering each of those layers,
        concatenated in the order given: [num_tokens, len(capture) * hidden]. Capturing costs a
        copy of the captured states.

        A skipped sublayer adds nothing to the residual stream, and a skipped attention sublayer
        neither writes nor reads the layer's keys and values (SWIFT's self-speculative draft,
        proposers/draft/layer_skip.py).

        Where the kernels run the layers (``native``) and no row is past ``MAX_ROW_BY_ROW`` (a long
        prompt takes the Python layers), the pass is one native call; with skipped sublayers, a
        layer with both kept is one native call, a layer with one kept the Python block (the same
        kernels, one call each). The bits are the same every way. On a CUDA device a regular pass
        (graphs.py: every sequence a chain of the same length, nothing captured or skipped) replays
        a CUDA graph instead, with the rounding of its padded shape."""
        layers = num_layers if num_layers is not None else self.num_layers
        if self.graphs is not None and not capture and not skip_attention and not skip_mlp:
            hidden = self.graphs.forward(tokens, positions, kv, meta, layers)
            if hidden is not None:
                return hidden
        embed = self.w["model.embed_tokens.weight"]
        if isinstance(embed, BlockWeight):
            x = self._embed_blocks(embed, tokens)  # [num_tokens, hidden]
        else:
            x = embed[tokens]  # [num_tokens, hidden]
        if self.config.family.embed_scale:
            x = x * self.w[EMBED_SCALE]  # Gemma: times sqrt(hidden) of the dtype, rounded to it
        missing = [i for i in capture if not 0 <= i < layers]
        if missing:
            raise ValueError(f"cannot capture the states entering layers {missing}: the pass ran {layers} layers")
        native = self.native if self.native is not None and max(meta.query_lens) <= MAX_ROW_BY_ROW else None
        trees = pass_trees(meta) if native is not None else None  # once a pass, not once a layer
        if native is not None and native.one_call and not skip_attention and not skip_mlp:
            return native.forward(x, positions, kv, meta, trees, layers, capture)
        states = {}
        for layer in range(layers):
            if layer in capture:
                states[layer] = x
            attention, mlp = layer not in skip_attention, layer not in skip_mlp
            if native is not None and attention and mlp:
                x = native.layer(layer, x, positions, kv, meta, trees)
            elif attention or mlp:
                x = self._block(layer, x, positions, kv, meta, attention, mlp)
        hidden = rms_norm(x, self.w["model.norm.weight"], self.config.rms_norm_eps)
        if not capture:
            return hidden
        return hidden, torch.cat([states[i] for i in capture], dim=-1)

    def _embed_blocks(self, embed: BlockWeight, tokens: torch.Tensor) -> torch.Tensor:
        """Embedding rows from GGUF blocks, the most recently used kept dequantized: unpacking a
        row's tile in numpy took ~0.8 ms a pass (5% of the 0.5B draft's one-row pass), and decoding
        meets the same few thousand tokens again and again. A row's values do not depend on which
        rows are unpacked with it, so the cache changes no bit."""
        if tokens.numel() > EMBED_CACHE_ROWS // 4:  # a long prompt: unpacked in one call, as before
            return embed.dequantize(self.dtype, rows=tokens)
        ids = tokens.tolist()
        cache = self._embed_cache
        missing = list(dict.fromkeys(t for t in ids if t not in cache))
        if missing:
            rows = embed.dequantize(self.dtype, rows=torch.tensor(missing, dtype=torch.long))
            for t, row in zip(missing, rows):
                cache[t] = row.clone()  # its own storage: a view would keep the whole batch alive
        for t in ids:
            cache.move_to_end(t)
        while len(cache) > EMBED_CACHE_ROWS:
            cache.popitem(last=False)
        return torch.stack([cache[t] for t in ids])

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] in float32."""
        return linear(hidden, self.lm_head).float()
