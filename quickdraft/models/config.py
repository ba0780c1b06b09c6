"""The shape of a decoder-only transformer of the llama / qwen2 family.

One frozen dataclass that every loader (GGUF, Hugging Face directory) fills in and the decoder
reads. Weight names inside quickdraft are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``
...), with the rotary layout of Hugging Face (halves rotated, "NeoX" style): the GGUF loader undoes
llama.cpp's q/k permutation for llama files so that one decoder serves both sources.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # qwen2 has biases on q, k and v
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""

    def weight_names(self) -> list[str]:
        """Every tensor the decoder needs, by its Hugging Face name."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            names += [
                p + "input_layernorm.weight",
                p + "post_attention_layernorm.weight",
                p + "self_attn.q_proj.weight",
                p + "self_attn.k_proj.weight",
                p + "self_attn.v_proj.weight",
                p + "self_attn.o_proj.weight",
                p + "mlp.gate_proj.weight",
                p + "mlp.up_proj.weight",
                p + "mlp.down_proj.weight",
            ]
            if self.attention_bias:
                names += [p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"]
        return names
