"""The shape of a decoder-only transformer: Llama, Mistral, Qwen2, Qwen3 or Gemma 3.

One frozen dataclass that every loader (GGUF, Hugging Face directory) fills in and the decoder
reads; what a family's arithmetic adds lives in models/families.py, read through ``family``.
Weight names inside quickdraft are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``
...), with the rotary layout of Hugging Face (halves rotated, "NeoX" style): the GGUF loader undoes
llama.cpp's q/k permutation for llama files so that one decoder serves both sources.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quickdraft.models.families import Family, family
from quickdraft.models.rope import Rope, RopeScaling


# Gemma's sqrt(hidden) as a scalar tensor of the activations' dtype, as transformers keeps it (a
# buffer it casts to the weights' dtype): the loaders add it, and it tells the decoder that dtype
# where every norm is float32 and every matrix GGUF blocks
EMBED_SCALE = "model.embed_scale"


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # the family (models/families.py): "llama" | "mistral" | "qwen2" | "qwen3" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float  # the rotary base of the global (full-attention) layers
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # qwen2 has biases on q, k and v
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""
    rope_scaling: RopeScaling | None = None  # the global layers' (models/rope.py)
    rotary_dim: int | None = None  # partial rotary: the first rotary_dim dims of a head turn (None: all)
    sliding_window: int = 0  # positions a sliding layer's query sees, itself included (0: none)
    # each layer's attention, "full_attention" or "sliding_attention" (transformers' layer_types);
    # empty: every layer sliding where sliding_window is set (Mistral), else every layer full
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None  # the sliding layers' rotary base (Gemma 3), None: the global one
    local_rope_scaling: RopeScaling | None = None
    query_pre_attn_scalar: float | None = None  # attention scores scale by its -1/2 power (Gemma), else head_dim's

    @property
    def family(self) -> Family:
        return family(self.arch)

    def sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends over a sliding window."""
        if not self.sliding_window:
            return False
        return self.layer_types[layer] == "sliding_attention" if self.layer_types else True

    def window(self, layer: int) -> int:
        """The sliding window of ``layer`` in positions, 0 for full attention."""
        return self.sliding_window if self.sliding(layer) else 0

    def rope(self, layer: int) -> Rope:
        """The rotary embedding of ``layer``."""
        if self.sliding(layer) and self.local_rope_theta is not None:
            return Rope(self.local_rope_theta, self.local_rope_scaling, self.rotary_dim)
        return Rope(self.rope_theta, self.rope_scaling, self.rotary_dim)

    @property
    def attention_scale(self) -> float:
        """What a query-key dot product is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def weight_names(self) -> list[str]:
        """Every tensor the decoder needs, by its Hugging Face name."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if self.family.embed_scale:
            names.append(EMBED_SCALE)
        if not self.tie_word_embeddings:
            names.append("lm_head.weight")
        norms = self.family.layer_norm_names()
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            names += [p + n + ".weight" for n in norms]
            names += [
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


def activation_dtype(config: ModelConfig, weights: dict):
    """The dtype a model's weights were loaded in, which its activations take: its final norm's
    (the embedding may be GGUF blocks), or, where the family's norms stay float32 (Gemma), its
    embedding scale's."""
    return weights[EMBED_SCALE if config.family.embed_scale else "model.norm.weight"].dtype
