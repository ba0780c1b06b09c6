"""One description per model family: what a decoder layer's arithmetic has beyond Llama's.

Llama (Touvron et al. 2023), Mistral (Jiang et al. 2023), Qwen2 (Yang et al. 2024), Qwen3 (Yang et
al. 2025) and Gemma 3 (Gemma Team 2025) share one block: RMSNorm, rotary attention with grouped
queries, a gated MLP. What differs is a handful of facts, and they live here and nowhere else:
the loaders read the names and keys, the decoder (models/decoder/) and the native pass
(kernels/layer.h's LayerSpec) read the arithmetic. A sixth family is one more entry, as in
llama.cpp's per-architecture tensor tables and vLLM's model files, without a branch elsewhere.

Terms:
- *qk norm*: an RMSNorm over each head's query and key, before rotary (Qwen3, Gemma 3).
- *sandwich norms*: the attention's and the MLP's outputs are normed again before their residual
  add (Gemma 2 and 3: ``post_attention_layernorm`` there is that output norm, and the MLP's input
  norm is ``pre_feedforward_layernorm``).
- *unit offset*: Gemma's RMSNorm scales by ``1 + w`` in float32. The loaders fold the 1 into the
  weight and keep it in float32 (llama.cpp's converter writes Gemma's norms with the 1 added), so
  the kernels' norm with a float32 weight computes exactly that (kernels/rowwise.h's rms_rows).
- *embed scale*: the token embeddings times sqrt(hidden size), rounded to the weights' dtype first.
- *window*: sliding-window attention; a key at position p is seen from position t while t - p is
  below the window. Mistral's applies to every layer; Gemma 3's to the layers ``layer_types``
  marks ``sliding_attention``, which rotate at their own base (``rope_local_base_freq``).
"""

from __future__ import annotations

from dataclasses import dataclass

from quickdraft.errors import ModelFormatError

SILU, GELU_TANH = 0, 1  # kernels/rowwise.h's Activation


@dataclass(frozen=True)
class Family:
    name: str  # quickdraft's name, ModelConfig.arch
    hf_architectures: tuple[str, ...]  # config.json's "architectures" that load as this family
    gguf_arch: str  # general.architecture in a GGUF file (Mistral's GGUFs say "llama")
    activation: int = SILU  # the MLP gate's function: SILU or GELU_TANH
    qkv_bias: bool = False  # biases on q, k and v always (Qwen2); else only where config says attention_bias
    qk_norm: bool = False
    sandwich_norms: bool = False
    unit_offset_norms: bool = False
    embed_scale: bool = False
    gguf_qk_permuted: bool = False  # llama.cpp's converter interleaves q/k rows (its "norm" rope)
    sliding: str = "none"  # "none" | "all" (Mistral's sliding_window) | "layer_types" (Gemma 3)
    always_tied: bool = False  # the output head is the embedding, whatever config.json says (Gemma)
    # config.json keys this family reads besides the common ones (a key that changes the
    # arithmetic and is not in either list is an error: hf.py)
    hf_keys: tuple[str, ...] = ()

    @property
    def mlp_norm(self) -> str:
        """The Hugging Face name of the MLP's input norm."""
        return "pre_feedforward_layernorm" if self.sandwich_norms else "post_attention_layernorm"

    def layer_norm_names(self) -> tuple[str, ...]:
        """Every norm of a layer by its Hugging Face name (after ``model.layers.N.``)."""
        names = ["input_layernorm", self.mlp_norm]
        if self.sandwich_norms:
            names += ["post_attention_layernorm", "post_feedforward_layernorm"]
        if self.qk_norm:
            names += ["self_attn.q_norm", "self_attn.k_norm"]
        return tuple(names)

    def gguf_block_names(self) -> dict[str, str]:
        """llama.cpp's per-layer tensor names (``blk.N.<name>``) -> Hugging Face's (after ``model.layers.N.``)."""
        names = {
            "attn_norm": "input_layernorm",
            "ffn_norm": self.mlp_norm,
            "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj",
        }
        if self.qk_norm:
            names |= {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
        if self.sandwich_norms:
            names |= {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
        return names


FAMILIES = {f.name: f for f in (
    Family("llama", ("LlamaForCausalLM",), "llama", gguf_qk_permuted=True, hf_keys=("attention_bias", "mlp_bias")),
    Family("mistral", ("MistralForCausalLM",), "llama", gguf_qk_permuted=True, sliding="all", hf_keys=("sliding_window",)),
    Family("qwen2", ("Qwen2ForCausalLM",), "qwen2", qkv_bias=True,
           hf_keys=("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")),
    Family("qwen3", ("Qwen3ForCausalLM",), "qwen3", qk_norm=True,
           hf_keys=("attention_bias", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types")),
    Family("gemma3", ("Gemma3ForCausalLM",), "gemma3", activation=GELU_TANH, qk_norm=True, sandwich_norms=True,
           unit_offset_norms=True, embed_scale=True, sliding="layer_types", always_tied=True,
           hf_keys=("query_pre_attn_scalar", "sliding_window", "layer_types", "sliding_window_pattern",
                    "_sliding_window_pattern", "use_bidirectional_attention",
                    "attn_logit_softcapping", "final_logit_softcapping", "rope_local_base_freq", "attention_bias")),
)}

BY_HF_ARCHITECTURE = {a: f for f in FAMILIES.values() for a in f.hf_architectures}
# the GGUF architectures whose files load, each as one family (Mistral's GGUFs are "llama" files)
BY_GGUF_ARCH = {"llama": FAMILIES["llama"], "qwen2": FAMILIES["qwen2"], "qwen3": FAMILIES["qwen3"], "gemma3": FAMILIES["gemma3"]}


def family(name: str) -> Family:
    """The family ModelConfig.arch names."""
    if name not in FAMILIES:
        raise ModelFormatError(f"model family {name!r} is not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[name]
