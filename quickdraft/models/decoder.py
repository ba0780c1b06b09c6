"""The decoder-only transformer of the llama / qwen2 family, written for verification passes.

Llama (Touvron et al. 2023) and Qwen2 (Yang et al. 2024) share one block: RMSNorm, rotary
position embeddings, grouped-query attention, a SwiGLU MLP; Qwen2 adds biases on q, k and v.
``forward`` takes a *ragged batch*: the new tokens of several sequences concatenated, each sequence
with its own KV-cache slot, its own number of tokens already cached, and an optional mask among
its new tokens (a causal chain by default, a token tree for tree verification). It returns hidden
states; ``logits`` is a separate call so that draft heads can read the hidden states and so that
only the rows a verifier needs pay for the large output projection.

Batch invariance (ARCHITECTURE.md point 11): a token's hidden state must not depend on what else
is in the pass, or a verification pass would disagree with single-token decoding by rounding.
The projections take quickdraft's own CPU kernels (kernels/linear.cpp), invariant by construction
in float32, bfloat16 and int8 on every instruction set they are built for (kernels/simd.h: AVX-512,
AVX2, NEON and a portable one). torch's matmul is not: on an
AMD EPYC its float32 tail rows (1..3 past a multiple of four) take another kernel, and on an Intel
Xeon with AMX every float32 row count from 13 up does; so the torch fallback pads rows to a
multiple of ``ROW_MULTIPLE``, which helps on some CPUs, and ``batch_invariance`` says it promises
nothing. Attention is computed per sequence, each chain row alone over exactly its own keys, so
its calls have the same shapes in a verification pass as in plain decoding; norms are per row.
"""

from __future__ import annotations

import collections
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quickdraft.kv_cache import KVCache
from quickdraft.models.config import ModelConfig
from quickdraft.models.kernels import Invariance, chain_attention, dense_linear, fused_layer, invariance, rowwise, tree_attention
from quickdraft.models.ggml import LANES, BlockWeight, on_blocks
from quickdraft.models.memory import into_huge_pages
from quickdraft.models.quant import Int8Weight, quantize_weights

ROW_MULTIPLE = 4
CHAIN_HEAD_DIMS = range(16, 257, 16)  # head sizes kernels/attention.cpp takes
MAX_ROW_BY_ROW = 32  # without the kernels, a chain of at most this many new tokens attends row by row (_attention)


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens go. Passed explicitly to every forward, never stored."""

    slots: list[int]  # [batch] KV-cache slot of each sequence
    context_lens: list[int]  # [batch] tokens of each sequence already in the cache
    query_lens: list[int]  # [batch] new tokens of each sequence in this pass (sum = num_tokens)
    # [batch] None: causal chain among the new tokens; else [query_len, hidden + query_len] bool,
    # True = may attend (for token trees): the last ``hidden`` cached tokens (tree nodes an earlier
    # pass wrote: a draft grows its tree a level a pass), then the new tokens. The cached tokens
    # before those are always visible.
    masks: list[torch.Tensor | None] | None = None

    @classmethod
    def chain(cls, slots, context_lens, query_lens) -> "AttentionMetadata":
        return cls(list(slots), list(context_lens), list(query_lens), None)

    def positions(self, device) -> torch.Tensor:
        """[num_tokens] the position of each new token when the new tokens form chains."""
        return torch.cat([torch.arange(c, c + q) for c, q in zip(self.context_lens, self.query_lens)]).to(device)


EMBED_CACHE_ROWS = 4096  # embedding rows a Decoder on GGUF blocks keeps dequantized (12 MiB for the 1.5B)


def _padded(n: int) -> int:
    return -(-n // ROW_MULTIPLE) * ROW_MULTIPLE


def _pad_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    n = x.shape[0]
    if n % ROW_MULTIPLE == 0:
        return x, n
    return torch.cat([x, x.new_zeros((_padded(n) - n,) + x.shape[1:])]), n


def _bmm_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [batch, rows, k] @ b [batch, k, n], with rows padded to a multiple of ROW_MULTIPLE for batch invariance."""
    padded, rows = _pad_rows(a.transpose(0, 1))  # pad the rows dimension
    return torch.matmul(padded.transpose(0, 1), b)[:, :rows]


def linear(x: torch.Tensor, weight: "torch.Tensor | Int8Weight | BlockWeight", bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] @ weight[out, in].T (+ bias) -> [n, out]. A quantized weight (the int8 draft
    format, models/quant.py; GGUF blocks, models/ggml.py) multiplies itself. A dense one takes our
    batch-invariant CPU kernel for float32 and bfloat16 where the CPU has it (kernels/), else
    torch's linear with the rows padded to a multiple of ROW_MULTIPLE."""
    if not isinstance(weight, torch.Tensor):
        return weight.linear(x, bias)
    kernel = dense_linear(x.dtype, x.device) if x.dtype == weight.dtype and weight.is_contiguous() else None
    if kernel is not None:
        return kernel(x, weight, bias)
    xp, n = _pad_rows(x)
    return F.linear(xp, weight, bias)[:n]


def nbytes(w) -> int:
    """Bytes of a weight in any format (a dense tensor, Int8Weight, BlockWeight)."""
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [n, hidden]: normalized in float32, returned in x's dtype (as Hugging Face's LlamaRMSNorm);
    on the CPU in one call (kernels/rowwise.cpp)."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16):
        kernels = rowwise()
        if kernels is not None:
            return kernels.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Rotary:
    """Rotary position embedding (Su et al. 2021) in the rotate-half layout of Hugging Face."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # [max_positions, head_dim]
        self.cos = angles.cos().float().to(device)
        self.sin = angles.sin().float().to(device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [n, heads, head_dim], positions [n] -> rotated x (computed in float32; on the CPU in
        one call, kernels/rowwise.cpp)."""
        kernels = rowwise() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None
        if kernels is not None:
            return kernels.rotary(x, self.cos, self.sin, positions)
        cos = self.cos[positions].unsqueeze(1)  # [n, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)


class Decoder:
    """The target (or draft) model. ``weights`` uses Hugging Face names (ModelConfig.weight_names)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], quantize: str | None = None):
        """``quantize="int8"``: int8 projections, one scale per weight row, activations quantized
        per row in the kernel (for a draft model; see quant.py)."""
        missing = [n for n in config.weight_names() if n not in weights]
        if missing:
            raise ValueError(f"weights are missing {len(missing)} tensors, e.g. {missing[:3]}")
        self.config = config
        norm = weights["model.norm.weight"]  # the embedding may be a BlockWeight: the norm has the dtype
        self.device = norm.device
        self.dtype = norm.dtype
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
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.max_position_embeddings, self.device)
        self.scale = config.head_dim**-0.5
        self._fused = self._fused_layers()
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
        concatenated in the order given: [num_tokens, len(capture) * hidden]. Capturing keeps a
        reference to a tensor each layer makes anyway, so it costs one concatenation.

        A skipped sublayer adds nothing to the residual stream, and a skipped attention sublayer
        neither writes nor reads the layer's keys and values (SWIFT's self-speculative draft,
        proposers/layer_skip.py). A layer with both kept takes the fused kernel; a layer with one
        kept takes the Python block (the same kernels, one call each)."""
        embed = self.w["model.embed_tokens.weight"]
        if isinstance(embed, BlockWeight):
            x = self._embed_blocks(embed, tokens)  # [num_tokens, hidden]
        else:
            x = embed[tokens]  # [num_tokens, hidden]
        fused = self._fused if self._fused is not None and max(meta.query_lens) <= MAX_ROW_BY_ROW else None
        trees = self._trees(meta) if fused is not None else None  # once a pass, not once a layer
        states = {}
        for layer in range(num_layers if num_layers is not None else self.num_layers):
            if layer in capture:
                states[layer] = x
            attention, mlp = layer not in skip_attention, layer not in skip_mlp
            if fused is not None and attention and mlp:
                x = self._fused_block(fused, layer, x, positions, kv, meta, trees)
            elif attention or mlp:
                x = self._block(layer, x, positions, kv, meta, attention, mlp)
        hidden = rms_norm(x, self.w["model.norm.weight"], self.config.rms_norm_eps)
        if not capture:
            return hidden
        missing = [i for i in capture if i not in states]
        if missing:
            raise ValueError(f"cannot capture the states entering layers {missing}: the pass ran "
                             f"{num_layers if num_layers is not None else self.num_layers} layers")
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

    # -- one call a layer (kernels/layer.cpp) -------------------------------------------------
    _PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

    def _fused_layers(self):
        """Per layer, the weights, formats and biases kernels/layer.cpp takes, where it runs: on a
        CPU with the kernels, head sizes the chain attention takes, and every projection either
        GGUF blocks of whole tiles (rows a multiple of 16, as in every model) or dense in the
        activations' dtype (the int8 draft format keeps the Python path). None elsewhere."""
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
            return None
        if fused_layer() is None or self.config.head_dim not in CHAIN_HEAD_DIMS:
            return None
        layers = []
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}."
            kinds = []
            for name in self._PROJECTIONS:
                w = self.w[p + name + ".weight"]
                if isinstance(w, BlockWeight) and w.out_features % LANES == 0:  # no padded rows to drop
                    kinds.append(w.format.kind)
                elif isinstance(w, torch.Tensor) and w.dtype == self.dtype and w.is_contiguous():
                    kinds.append(-1)  # layer.cpp's DENSE
                else:
                    return None
            data = [w.data if isinstance(w, BlockWeight) else w
                    for w in (self.w[p + n + ".weight"] for n in self._PROJECTIONS)]
            weights = [self.w[p + "input_layernorm.weight"], *data[:4], self.w[p + "post_attention_layernorm.weight"], *data[4:]]
            # a block projection's bias as its kernel reads it, float32 (the same values): converted
            # once here, not at every call (~30 us a layer at one row, kernels/blocks.cpp)
            biases = [b.float().contiguous() if b is not None and kind >= 0 else b
                      for b, kind in zip((self.w.get(p + n + ".bias") for n in self._PROJECTIONS[:3]), kinds)]
            layers.append((weights, kinds, biases))
        return layers

    def _trees(self, meta: AttentionMetadata) -> tuple[list, list]:
        """Each sequence's token tree as attend_tree takes it (start, path: ``_paths``), or None for
        a chain."""
        masks = meta.masks if meta.masks is not None else [None] * len(meta.slots)
        paths = [self._paths(m) if m is not None else (None, None) for m in masks]
        return [p[0] for p in paths], [p[1] for p in paths]

    def _fused_block(self, fused, layer, x, positions, kv, meta, trees) -> torch.Tensor:
        """_block in one call: the same kernels and torch operations in the same order, so the
        same bits (tests/models/test_fused_layer.py)."""
        weights, kinds, biases = fused[layer]
        c = self.config
        return fused_layer()(x, positions, weights, kinds, biases, self.rotary.cos, self.rotary.sin,
                             kv.keys[layer], kv.values[layer], meta.slots, meta.context_lens, meta.query_lens,
                             *trees, c.num_heads, c.num_kv_heads, c.rms_norm_eps, self.scale)

    def _block(self, layer, x, positions, kv, meta, attention: bool = True, mlp: bool = True) -> torch.Tensor:
        c, p = self.config, f"model.layers.{layer}."
        w = self.w
        if attention:
            x = self._attention_sublayer(layer, x, positions, kv, meta)
        if not mlp:
            return x
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = linear(h, w[p + "mlp.gate_proj.weight"])
        up = linear(h, w[p + "mlp.up_proj.weight"])
        return x + linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])

    def _attention_sublayer(self, layer, x, positions, kv, meta) -> torch.Tensor:
        """x + the layer's attention over x (its keys and values written to ``kv`` on the way)."""
        c, p = self.config, f"model.layers.{layer}."
        w = self.w
        h = rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = linear(h, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
        k = linear(h, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
        v = linear(h, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
        n = x.shape[0]
        q = self.rotary.apply(q.view(n, c.num_heads, c.head_dim), positions)
        k = self.rotary.apply(k.view(n, c.num_kv_heads, c.head_dim), positions)
        v = v.view(n, c.num_kv_heads, c.head_dim)
        attn = self._attention(layer, q, k, v, kv, meta)  # [n, heads * head_dim]
        return x + linear(attn, w[p + "self_attn.o_proj.weight"])

    def _attention(self, layer, q, k, v, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """q [n, heads, d], k/v [n, kv_heads, d] -> [n, heads * d]. One sequence at a time.

        Softmax and probs @ values reduce over the keys, and a float32 reduction's rounding
        depends on its length. A chain's token j therefore attends over exactly its own
        ctx + j + 1 keys, as it would when decoded alone, and a token tree's row over its context
        and its own path (kernels/attention.cpp's attend_tree: the bits of the chain with that
        history). The kernel takes chains of any length, prompts too: a key is then the same
        whichever pass computed it, a prompt pass, a decoding step or a verification pass, which
        is what lets the prefix cache (engine/prefix_cache.py) reuse keys without changing a
        token. Where the kernels do not run, long prefills and trees take one masked matmul for
        all rows (invariant no longer: plain and speculative decoding share the prompt's pass,
        but a reused prefix may differ from a recomputed one in rounding)."""
        out = []
        start = 0
        kernel = chain_attention() if q.device.type == "cpu" and self.config.head_dim in CHAIN_HEAD_DIMS else None
        for i, (slot, ctx, qlen) in enumerate(zip(meta.slots, meta.context_lens, meta.query_lens)):
            end = start + qlen
            kv.write(layer, slot, ctx, k[start:end].transpose(0, 1), v[start:end].transpose(0, 1))
            keys, values = kv.read(layer, slot, ctx + qlen)  # [kv_heads, L, d]
            tree = meta.masks is not None and meta.masks[i] is not None
            if tree and kernel is not None:  # each row over its own path, as a chain (kernels/attention.cpp)
                start_idx, path = self._paths(meta.masks[i])
                out.append(tree_attention()(q[start:end].float(), keys, values, ctx, start_idx, path, self.scale))
            elif kernel is not None and not tree:  # each row over its own keys, one call (kernels/attention.cpp)
                out.append(kernel(q[start:end].float(), keys, values, ctx, self.scale))
            elif tree or qlen > MAX_ROW_BY_ROW:
                out.append(self._attend(q[start:end], keys.float(), values.float(), self._mask(meta, i, ctx, qlen, q.device)))
            else:
                keys, values = keys.float(), values.float()
                for j in range(qlen):
                    L = ctx + j + 1
                    out.append(self._attend(q[start + j : start + j + 1], keys[:, :L], values[:, :L], None))
            start = end
        return torch.cat(out).to(q.dtype)

    def _attend(self, q, keys, values, mask) -> torch.Tensor:
        """q [m, heads, d]; keys/values [kv_heads, L, d] float32; mask [m, L] or None -> [m, heads*d]."""
        c = self.config
        m, group = q.shape[0], c.num_heads // c.num_kv_heads
        # the queries that share one kv head, stacked as rows: [kv_heads, group * m, d]
        qs = q.float().view(m, c.num_kv_heads, group, c.head_dim).permute(1, 2, 0, 3)
        qs = qs.reshape(c.num_kv_heads, group * m, c.head_dim)
        rows = group * m
        scores = _bmm_rows(qs, keys.transpose(1, 2)) * self.scale  # [kv_heads, group * m, L]
        if mask is not None:
            scores = scores.view(c.num_kv_heads, group, m, -1).masked_fill(~mask, float("-inf"))
            scores = scores.view(c.num_kv_heads, rows, -1)
        o = _bmm_rows(torch.softmax(scores, dim=-1), values)  # [kv_heads, group * m, d]
        o = o.view(c.num_kv_heads, group, m, c.head_dim).permute(2, 0, 1, 3)
        return o.reshape(m, c.num_heads * c.head_dim)

    @staticmethod
    def _paths(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A token tree's mask [qlen, hidden + qlen] -> (start [qlen + 1], path): row j's visible tree
        tokens (its ancestors and itself, in order, counted from the first hidden one) are
        path[start[j]:start[j + 1]]."""
        rows, cols = mask.cpu().nonzero(as_tuple=True)  # row-major: each row's columns ascending
        counts = torch.bincount(rows, minlength=mask.shape[0])
        return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]), cols.long()

    @staticmethod
    def _mask(meta: AttentionMetadata, i: int, ctx: int, qlen: int, device) -> torch.Tensor:
        """[qlen, ctx + qlen] bool, True = may attend: the cached tokens before the tree's hidden
        nodes, then the tree mask (or a causal chain's)."""
        new = meta.masks[i] if meta.masks is not None and meta.masks[i] is not None else None
        if new is None:
            new = torch.ones(qlen, qlen, dtype=torch.bool, device=device).tril()
        shared = ctx + qlen - new.shape[1]
        return torch.cat([torch.ones(qlen, shared, dtype=torch.bool, device=device), new.to(device)], dim=1)
