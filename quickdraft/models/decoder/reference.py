"""The decoder layer as plain torch operations and single kernel calls: the readable reference.

A layer is an attention sublayer (RMSNorm, q/k/v projections, each head's q/k norm where the
family has one, rotary, attention over the KV cache within the layer's window, the output
projection, its norm where the family has one, the residual add) and an MLP sublayer (RMSNorm, the
gated MLP, its output norm where the family has one, the residual add), in the order of
transformers' Llama, Qwen2/3, Mistral and Gemma 3 (models/families.py says which). Every
operation here is one call: a projection through ``linear``, a norm through ``rms_norm``,
attention through the chain or tree kernel. native.py runs the same kernels in the same order from
C++ (one call a layer, or one call a pass), and tests/models/test_fused_layer.py and
test_native_forward.py hold it to these bits.

Attention is computed per sequence, each chain row alone over exactly its own keys, so its calls
have the same shapes in a verification pass as in plain decoding (batch invariance,
docs/design/batch-invariance.md).
"""

from __future__ import annotations

import torch

from quickdraft.models.kv_cache import KVCache
from quickdraft.models.decoder.metadata import AttentionMetadata, attention_mask, windowed_mask
from quickdraft.models.decoder.ops import _bmm_rows, act_mul, linear, rms_norm
from quickdraft.kernels import chain_attention, tree_attention

CHAIN_HEAD_DIMS = range(16, 257, 16)  # head sizes kernels/attention.cpp takes
MAX_ROW_BY_ROW = 32  # without the kernels, a chain of at most this many new tokens attends row by row (_attention)


class ReferenceLayers:
    """The Decoder's layers in Python (a mixin: it reads ``config``, ``w``, ``rotaries`` (one a
    layer) and ``scale`` from the Decoder)."""

    def _block(self, layer, x, positions, kv, meta, attention: bool = True, mlp: bool = True) -> torch.Tensor:
        if attention:
            x = self._attention_sublayer(layer, x, positions, kv, meta)
        return self._mlp_sublayer(layer, x) if mlp else x

    def _residual(self, layer: int, x: torch.Tensor, y: torch.Tensor, norm: str) -> torch.Tensor:
        """x + y, y normed first by the layer's ``norm`` where the family has sandwich norms."""
        if self.config.family.sandwich_norms:
            y = rms_norm(y, self.w[f"model.layers.{layer}.{norm}.weight"], self.config.rms_norm_eps)
        return x + y

    def _mlp_sublayer(self, layer, x) -> torch.Tensor:
        """x + the layer's gated MLP of x (SwiGLU, or GeGLU with tanh for Gemma)."""
        p, w, f = f"model.layers.{layer}.", self.w, self.config.family
        h = rms_norm(x, w[p + f.mlp_norm + ".weight"], self.config.rms_norm_eps)
        gate = linear(h, w[p + "mlp.gate_proj.weight"])
        up = linear(h, w[p + "mlp.up_proj.weight"])
        return self._residual(layer, x, linear(act_mul(gate, up, f.activation), w[p + "mlp.down_proj.weight"]),
                              "post_feedforward_layernorm")

    def _attention_sublayer(self, layer, x, positions, kv, meta) -> torch.Tensor:
        """x + the layer's attention over x (its keys and values written to ``kv`` on the way)."""
        q, k, v = self._qkv(layer, x, positions)
        attn = self._attention(layer, q, k, v, kv, meta)  # [n, heads * head_dim]
        return self._attention_output(layer, x, attn)

    def _attention_output(self, layer, x, attn) -> torch.Tensor:
        """x + the output projection of the attention's rows ``attn`` [n, heads * head_dim]."""
        o = linear(attn, self.w[f"model.layers.{layer}.self_attn.o_proj.weight"])
        return self._residual(layer, x, o, "post_attention_layernorm")

    def _qkv(self, layer, x, positions, angles=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's queries [n, heads, d] and keys [n, kv_heads, d], each head normed where the
        family says and rotated to its position (``angles``: the layer's Rotary.angles of them,
        where the caller has them), and values [n, kv_heads, d]."""
        c, p = self.config, f"model.layers.{layer}."
        w = self.w
        h = rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = linear(h, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
        k = linear(h, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
        v = linear(h, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
        n, d = x.shape[0], c.head_dim
        if c.family.qk_norm:  # over each head's d values: [n * heads, d] rows
            q = rms_norm(q.reshape(n * c.num_heads, d), w[p + "self_attn.q_norm.weight"], c.rms_norm_eps)
            k = rms_norm(k.reshape(n * c.num_kv_heads, d), w[p + "self_attn.k_norm.weight"], c.rms_norm_eps)
        rotary = self.rotaries[layer]
        q = rotary.apply(q.view(n, c.num_heads, d), positions, angles)
        k = rotary.apply(k.view(n, c.num_kv_heads, d), positions, angles)
        return q, k, v.view(n, c.num_kv_heads, d)

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
        window = self.config.window(layer)  # 0: every earlier key; else the last `window` of them
        for i, (slot, ctx, qlen) in enumerate(zip(meta.slots, meta.context_lens, meta.query_lens)):
            end = start + qlen
            kv.write(layer, slot, ctx, k[start:end].transpose(0, 1), v[start:end].transpose(0, 1))
            keys, values = kv.read(layer, slot, ctx + qlen)  # [kv_heads, L, d]
            tree = meta.mask(i) is not None
            if tree and kernel is not None:  # each row over its own path, as a chain (kernels/attention.cpp)
                start_idx, path = meta.tree_path(i)
                out.append(tree_attention()(q[start:end].float(), keys, values, ctx, start_idx, path, self.scale, window))
            elif kernel is not None and not tree:  # each row over its own keys, one call (kernels/attention.cpp)
                out.append(kernel(q[start:end].float(), keys, values, ctx, self.scale, window))
            elif tree or qlen > MAX_ROW_BY_ROW:
                mask = windowed_mask(attention_mask(meta, i, ctx, qlen, q.device), window)
                out.append(self._attend(q[start:end], keys.float(), values.float(), mask))
            else:
                keys, values = keys.float(), values.float()
                for j in range(qlen):
                    L = ctx + j + 1
                    first = max(0, L - window) if window else 0
                    out.append(self._attend(q[start + j : start + j + 1], keys[:, first:L], values[:, first:L], None))
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
