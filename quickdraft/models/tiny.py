"""Tiny random models, for tests that need exact control over the weights (and a draft that is,
or is not, the target). Real weights are used everywhere else."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from quickdraft.models.config import ModelConfig

if TYPE_CHECKING:
    from quickdraft.models.loader import LoadedModel


def tiny_config(arch: str = "qwen2", vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 2,
                num_heads: int = 4, num_kv_heads: int = 2, max_positions: int = 512) -> ModelConfig:
    return ModelConfig(
        arch=arch, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=max_positions, tie_word_embeddings=arch == "qwen2",
        attention_bias=arch == "qwen2", bos_token_id=None, eos_token_ids=(), name=f"tiny-{arch}",
    )


def random_weights(config: ModelConfig, seed: int = 0, dtype=torch.float32, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random weights by Hugging Face name. ``scale`` spreads the logits: a larger scale makes
    near-ties between the top two tokens rare, so greedy tests do not hinge on rounding."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name in config.weight_names():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(config.hidden_size, generator=g)
        else:
            t = torch.randn(_shape(config, name), generator=g) * (scale / _fan_in(config, name) ** 0.5)
        weights[name] = t.to(dtype)
    return weights


def _shape(c: ModelConfig, name: str) -> tuple[int, ...]:
    kv = c.num_kv_heads * c.head_dim
    q = c.num_heads * c.head_dim
    table = {
        "embed_tokens.weight": (c.vocab_size, c.hidden_size), "lm_head.weight": (c.vocab_size, c.hidden_size),
        "q_proj.weight": (q, c.hidden_size), "k_proj.weight": (kv, c.hidden_size), "v_proj.weight": (kv, c.hidden_size),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "o_proj.weight": (c.hidden_size, q),
        "gate_proj.weight": (c.intermediate_size, c.hidden_size), "up_proj.weight": (c.intermediate_size, c.hidden_size),
        "down_proj.weight": (c.hidden_size, c.intermediate_size),
    }
    return table[".".join(name.split(".")[-2:])]


def _fan_in(c: ModelConfig, name: str) -> int:
    if "embed_tokens" in name or name.endswith("bias"):
        return 1
    return _shape(c, name)[-1]


def never_agreeing(model: "LoadedModel", name: str = "never") -> "LoadedModel":
    """``model`` with an untied output head whose rows are its embedding's rotated by one: its
    greedy token is always another than the model's own, so as a draft of ``model`` its first
    draft token is always rejected."""
    from quickdraft.models.loader import LoadedModel

    w = dict(model.weights)
    w["lm_head.weight"] = torch.roll(w["model.embed_tokens.weight"], shifts=1, dims=0)
    return LoadedModel(dataclasses.replace(model.config, tie_word_embeddings=False), w, model.tokenizer, name)


def perturbed(model: "LoadedModel", noise: float, seed: int, name: str = "noisy") -> "LoadedModel":
    """``model`` with Gaussian noise of ``noise`` times each matrix's spread added to every
    matrix: a draft that agrees with ``model`` some of the time."""
    from quickdraft.models.loader import LoadedModel

    g = torch.Generator().manual_seed(seed)
    w = {k: v + noise * v.std() * torch.randn(v.shape, generator=g).to(v) if v.ndim == 2 else v
         for k, v in model.weights.items()}
    return LoadedModel(model.config, w, model.tokenizer, name)
