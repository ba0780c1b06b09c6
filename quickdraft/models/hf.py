"""Hugging Face model directory -> ModelConfig + tensors + Tokenizer.

A directory holds ``config.json`` (LlamaForCausalLM or Qwen2ForCausalLM), one or more
``*.safetensors`` files (sharded checkpoints are read whole, every shard) and ``tokenizer.json``
with ``tokenizer_config.json``. Weight names are already quickdraft's (they are Hugging Face's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from quickdraft.errors import ModelFormatError
from quickdraft.models.config import ModelConfig
from quickdraft.models.tokenizer import Tokenizer

_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def config_from_hf(cfg: dict[str, Any], tokenizer: Tokenizer, source: str) -> ModelConfig:
    """ModelConfig from a parsed ``config.json``."""
    archs = cfg.get("architectures") or []
    arch = next((_ARCHS[a] for a in archs if a in _ARCHS), None)
    if arch is None:
        raise ModelFormatError(f"{source}: architectures {archs} not supported (supported: {', '.join(_ARCHS)})")
    if cfg.get("rope_scaling"):
        raise ModelFormatError(f"{source}: rope_scaling {cfg['rope_scaling']} is not supported")

    def need(key: str) -> Any:
        if key not in cfg:
            raise ModelFormatError(f"{source}: config.json has no {key!r}")
        return cfg[key]

    hidden, n_head = int(need("hidden_size")), int(need("num_attention_heads"))
    eos = cfg.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
    eos_ids = tuple(dict.fromkeys([*tokenizer.eos_token_ids, *eos]))  # dedupe, keep order
    bos = cfg.get("bos_token_id", tokenizer.bos_token_id)
    return ModelConfig(
        arch=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=n_head,
        num_kv_heads=int(cfg.get("num_key_value_heads") or n_head),
        head_dim=int(cfg.get("head_dim") or hidden // n_head),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(need("rms_norm_eps")),
        max_position_embeddings=int(need("max_position_embeddings")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama only when config says attention_bias.
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        name=str(cfg.get("_name_or_path") or Path(source).name),
    )


def load_hf_dir(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """(config, {HF name: tensor in ``dtype`` on ``device``}, tokenizer) of a model directory.

    Only the tensors the decoder uses are kept: a tied checkpoint's redundant ``lm_head.weight``
    and buffers such as ``rotary_emb.inv_freq`` are dropped.
    """
    path = Path(path)
    source = str(path)
    if not (path / "config.json").exists():
        raise ModelFormatError(f"{source}: not a model directory (no config.json)")
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelFormatError(f"{path / 'config.json'}: not valid JSON ({e})") from e
    tokenizer = Tokenizer.from_hf_dir(path)
    config = config_from_hf(cfg, tokenizer, source)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{source}: no *.safetensors files")
    wanted = set(config.weight_names())
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(f).items():
            if name in wanted:
                weights[name] = t.to(device=device, dtype=dtype)
    missing = sorted(wanted - weights.keys())
    if missing:
        raise ModelFormatError(f"{source}: {len(missing)} tensors are missing, e.g. {missing[:3]}")
    return config, weights, tokenizer
