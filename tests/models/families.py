"""Tiny random models of every family, built with transformers' own config classes and saved with
``save_pretrained``, and the same weights written as a GGUF in llama.cpp's layout (its tensor names,
metadata keys, Llama's q/k row order, Gemma's norms with their 1 added, Llama 3's rope_freqs).
Shared by tests/models/test_families.py and the losslessness tests."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import torch

from quickdraft.models.families import FAMILIES
from tests.conftest import _tiny_rust_tokenizer
from tests.models.test_gguf import _tokenizer_meta, _write, llama_cpp_permute
from tests.models.test_rope import converter_llama3_factors

transformers = __import__("pytest").importorskip("transformers")

VOCAB = 259  # _tokenizer_meta's tokens
SLIDING = 8  # a window short enough for the tests' prompts to pass it
ORIGINAL_MAX = 16  # Llama 3's and YaRN's original context: the prompts go past it


def hf_config(family: str):
    """A transformers config of ``family`` with every feature the family has switched on."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=257, eos_token_id=258, pad_token_id=None)
    if family == "llama":  # Llama 3.2: tied embeddings, llama3 rope scaling
        return transformers.LlamaConfig(num_hidden_layers=2, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL_MAX}, **common)
    if family == "mistral":
        return transformers.MistralConfig(num_hidden_layers=2, sliding_window=SLIDING, head_dim=16,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)
    if family == "qwen2":  # the layout whose rope_theta was read as 10,000
        return transformers.Qwen2Config(num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                        tie_word_embeddings=True, **common)
    if family == "qwen3":
        return transformers.Qwen3Config(num_hidden_layers=2, head_dim=32, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX},
            tie_word_embeddings=False, **common)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=32, sliding_window=SLIDING,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            hidden_activation="gelu_pytorch_tanh", **common)
    raise ValueError(family)


def random_model(family: str, seed: int = 0):
    """transformers' model of ``family`` with every weight random (norms near their unit scale),
    in float32 and eval mode."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's scale by 1 + w: near zero there, near one elsewhere
                base = 0.0 if FAMILIES[family].unit_offset_norms else 1.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 2.0 / math.sqrt(p.shape[-1]))
    return model


def save_hf_dir(model, path: Path) -> Path:
    """``model`` as a Hugging Face directory (save_pretrained) with a tiny tokenizer."""
    model.save_pretrained(path)
    _tiny_rust_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"bos_token": null, "eos_token": "<|im_end|>"}')
    return path


# llama.cpp's names (gguf-py's tensor map) of the Hugging Face ones, written out for the test
_GGUF_BLOCK = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_feedforward_layernorm": "post_ffw_norm", "pre_feedforward_layernorm": "ffn_norm",
}


def _gguf_name(name: str, family: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if name in glob:
        return glob[name]
    _, _, layer, rest = name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    if part == "post_attention_layernorm":  # Gemma's is the attention's output norm, Llama's the MLP's input norm
        gg = "post_attention_norm" if family == "gemma3" else "ffn_norm"
    else:
        gg = _GGUF_BLOCK[part]
    return f"blk.{layer}.{gg}.{kind}"


def write_gguf(model, family: str, path: Path) -> Path:
    """``model``'s weights as llama.cpp's converter writes them, float32, with its metadata."""
    c = model.config
    arch = "llama" if family == "mistral" else family
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    meta = _tokenizer_meta() | {
        f"{arch}.block_count": c.num_hidden_layers, f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.feed_forward_length": c.intermediate_size, f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": c.num_key_value_heads, f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim, f"{arch}.attention.layer_norm_rms_epsilon": c.rms_norm_eps,
        f"{arch}.context_length": c.max_position_embeddings, "general.name": f"tiny-{family}",
    }
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    meta[f"{arch}.rope.freq_base"] = float(rope["rope_theta"])
    tensors = {}
    if rope["rope_type"] == "llama3":
        tensors["rope_freqs.weight"] = converter_llama3_factors(rope, head_dim)
    elif rope["rope_type"] in ("linear", "yarn"):
        meta[f"{arch}.rope.scaling.type"] = rope["rope_type"]
        meta[f"{arch}.rope.scaling.factor"] = float(rope["factor"])
        if "original_max_position_embeddings" in rope:
            meta[f"{arch}.rope.scaling.original_context_length"] = rope["original_max_position_embeddings"]
    if getattr(c, "sliding_window", None):  # a Mistral file states it under "llama" (llama.cpp itself ignores it)
        meta[f"{arch}.attention.sliding_window"] = c.sliding_window
    if family == "gemma3":
        meta[f"{arch}.rope.freq_base_swa"] = float(c.rope_parameters["sliding_attention"]["rope_theta"])
        meta[f"{arch}.attention.sliding_window_pattern"] = 2  # the test model's layer_types: S F S
    for name, w in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = w.float().numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, c.num_key_value_heads)
        if family == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp's Gemma converter folds RMSNorm's unit offset into the weight
        tensors[_gguf_name(name, family)] = w
    return _write(path, arch, tensors, meta)


def transformers_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


__all__ = ["gguf", "hf_config", "random_model", "save_hf_dir", "write_gguf", "transformers_logits"]
