"""Hugging Face model directory -> ModelConfig + tensors + Tokenizer.

A directory holds ``config.json`` (one of models/families.py's architectures: Llama, Mistral,
Qwen2, Qwen3, Gemma 3 text), one or more ``*.safetensors`` files (sharded checkpoints are read
whole, every shard) and ``tokenizer.json`` with ``tokenizer_config.json``. Weight names are
already quickdraft's (they are Hugging Face's).

``config.json`` is read as transformers 4 and 5 write it (rotary settings under ``rope_theta`` +
``rope_scaling`` or under ``rope_parameters``: models/rope.py). Every key that changes the
arithmetic is read; a key quickdraft does not know is an error naming it, never a silent default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from quickdraft.errors import ModelFormatError
from quickdraft.models.config import EMBED_SCALE, ModelConfig
from quickdraft.models.families import BY_HF_ARCHITECTURE, GELU_TANH, Family
from quickdraft.models.rope import rope_from_hf, whole_head_only
from quickdraft.models.tokenizer import Tokenizer

# keys of every transformers config that describe, train or generate but change no arithmetic of
# a forward pass (PretrainedConfig's own, and training or generation settings older files carry)
_INERT = frozenset((
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "initializer_range", "attention_dropout", "output_attentions", "output_hidden_states", "return_dict",
    "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "bos_token_id", "eos_token_id", "pad_token_id", "tokenizer_class", "auto_map", "_attn_implementation",
    "_attn_implementation_autoset", "cache_implementation", "unsloth_fixed", "unsloth_version", "pretraining_tp",
    "torchscript", "use_return_dict", "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "finetuning_task", "prefix", "task_specific_params", "decoder_start_token_id", "sep_token_id",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "tf_legacy_loss",
    "pruned_heads", "model_name", "residual_dropout", "embedding_dropout",
    "quickdraft",  # how `quickdraft distill` trained a draft (train/draft.py's save_dir)
))
# keys every family reads (the ones the rotary embedding reads are models/rope.py's)
_COMMON = frozenset((
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "hidden_activation", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
))
_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": GELU_TANH}


def _check_keys(cfg: dict[str, Any], family: Family, source: str) -> None:
    """Every key of ``cfg`` is one quickdraft reads for ``family`` or one that changes nothing."""
    unknown = sorted(k for k in cfg if k not in _INERT and k not in _COMMON and k not in family.hf_keys)
    if unknown:
        raise ModelFormatError(f"{source}: config.json key(s) {', '.join(unknown)} are not understood for a {family.name} "
                               "model: quickdraft refuses what it cannot compute exactly (models/families.py)")
    if cfg.get("quantization_config") is not None:
        raise ModelFormatError(f"{source}: quantized checkpoints (quantization_config) are not supported: give a GGUF file")


def _refuse(cfg: dict[str, Any], source: str, key: str, allowed: Any) -> None:
    """Error unless ``cfg[key]`` is absent or equals ``allowed`` (a value quickdraft computes)."""
    if key in cfg and cfg[key] != allowed and not (allowed is None and cfg[key] is False):
        raise ModelFormatError(f"{source}: config.json {key} = {cfg[key]!r} is not supported (only {allowed!r})")


def _windows(cfg: dict[str, Any], family: Family, num_layers: int, source: str) -> tuple[int, tuple[str, ...]]:
    """(sliding_window, layer_types) as ModelConfig keeps them, from each family's keys."""
    window = cfg.get("sliding_window")
    types = tuple(cfg.get("layer_types") or ())
    if types and (len(types) != num_layers or not set(types) <= {"full_attention", "sliding_attention"}):
        raise ModelFormatError(f"{source}: layer_types must name full_attention or sliding_attention for each of {num_layers} layers")
    if family.name.startswith("qwen") and cfg.get("use_sliding_window"):
        # transformers then slides the layers from max_window_layers on; llama.cpp never does
        raise ModelFormatError(f"{source}: use_sliding_window is true: Qwen's sliding window is not supported")
    if family.sliding == "none":
        return 0, ()  # Qwen's sliding_window and layer_types say nothing while use_sliding_window is off
    if not window:
        return 0, ()
    if family.sliding == "layer_types" and not types:  # Gemma 3 before transformers 4.53: every Nth layer global
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))
    return int(window), types


def config_from_hf(cfg: dict[str, Any], tokenizer: Tokenizer, source: str) -> ModelConfig:
    """ModelConfig from a parsed ``config.json``."""
    archs = cfg.get("architectures") or []
    family = next((BY_HF_ARCHITECTURE[a] for a in archs if a in BY_HF_ARCHITECTURE), None)
    if family is None:
        raise ModelFormatError(f"{source}: architectures {archs} not supported (supported: {', '.join(BY_HF_ARCHITECTURE)})")
    _check_keys(cfg, family, source)

    def need(key: str) -> Any:
        if key not in cfg:
            raise ModelFormatError(f"{source}: config.json has no {key!r}")
        return cfg[key]

    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if _ACTIVATIONS.get(act) != family.activation:
        raise ModelFormatError(f"{source}: activation {act!r} is not {family.name}'s (quickdraft computes "
                               f"{'gelu_pytorch_tanh' if family.activation == GELU_TANH else 'silu'})")
    for key, allowed in (("mlp_bias", False), ("attn_logit_softcapping", None), ("final_logit_softcapping", None),
                         ("use_bidirectional_attention", False)):
        _refuse(cfg, source, key, allowed)
    if not family.qkv_bias:
        _refuse(cfg, source, "attention_bias", False)  # Llama's would bias o_proj too
    hidden, n_head = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or hidden // n_head)
    num_layers = int(need("num_hidden_layers"))
    window, types = _windows(cfg, family, num_layers, source)
    rope = whole_head_only(rope_from_hf(cfg, head_dim, source), head_dim, source)
    local = whole_head_only(rope_from_hf(cfg, head_dim, source, layer_type="sliding_attention"), head_dim, source) \
        if types else None
    eos = cfg.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
    eos_ids = tuple(dict.fromkeys([*tokenizer.eos_token_ids, *eos]))  # dedupe, keep order
    bos = cfg.get("bos_token_id", tokenizer.bos_token_id)
    return ModelConfig(
        arch=family.name,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=num_layers,
        num_heads=n_head,
        num_kv_heads=int(cfg.get("num_key_value_heads") or n_head),
        head_dim=head_dim,
        rope_theta=rope.theta,
        rms_norm_eps=float(need("rms_norm_eps")),
        max_position_embeddings=int(need("max_position_embeddings")),
        tie_word_embeddings=family.always_tied or bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; the others never (a true attention_bias is refused above)
        attention_bias=family.qkv_bias,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        name=str(cfg.get("_name_or_path") or Path(source).name),
        rope_scaling=rope.scaling,
        rotary_dim=rope.rotary_dim,
        sliding_window=window,
        layer_types=types,
        local_rope_theta=local.theta if local is not None else None,
        local_rope_scaling=local.scaling if local is not None else None,
        query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if cfg.get("query_pre_attn_scalar") else None,
    )


def load_hf_dir(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """(config, {HF name: tensor in ``dtype`` on ``device``}, tokenizer) of a model directory.

    Only the tensors the decoder uses are kept: a tied checkpoint's redundant ``lm_head.weight``
    and buffers such as ``rotary_emb.inv_freq`` are dropped; any other tensor is an error (a
    family's weight quickdraft would otherwise ignore). Gemma's norms come back in float32 with
    their 1 added, and its embedding scale as ``EMBED_SCALE`` (families.py).
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
    unit_offset = config.family.unit_offset_norms
    for f in files:
        for name, t in load_file(f).items():
            if name in wanted:
                # Gemma's norms scale by 1 + w in float32, as transformers computes it (families.py)
                norm = unit_offset and name.endswith("norm.weight")
                weights[name] = (1.0 + t.float()).to(device) if norm else t.to(device=device, dtype=dtype)
            elif not _unused(name, config):
                raise ModelFormatError(f"{f}: tensor {name} is not part of a {config.arch} model quickdraft knows")
    if config.family.embed_scale:
        weights[EMBED_SCALE] = torch.tensor(config.hidden_size**0.5, dtype=dtype, device=device)
    missing = sorted(wanted - weights.keys())
    if missing:
        raise ModelFormatError(f"{source}: {len(missing)} tensors are missing, e.g. {missing[:3]}")
    return config, weights, tokenizer


def _unused(name: str, config: ModelConfig) -> bool:
    """Whether a checkpoint tensor the decoder does not read is one it may leave: a tied model's
    copy of its embedding as ``lm_head.weight``, and rotary buffers some writers save."""
    return (name == "lm_head.weight" and config.tie_word_embeddings) or name.endswith("rotary_emb.inv_freq")
