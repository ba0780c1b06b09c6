"""Rotary position embeddings and their context-extension variants: read from a Hugging Face
``config.json`` or from GGUF metadata, turned into the cos/sin tables the decoder multiplies by.

* RoPE itself (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding"):
  dims i and i + d/2 of a head turn by the angle ``pos * theta^(-2i/d)`` (Hugging Face's
  rotate-half layout).
* ``linear``: position interpolation (Chen et al. 2023, "Extending Context Window of Large
  Language Models via Positional Interpolation"), every frequency divided by ``factor``.
* ``dynamic``: NTK-aware scaling (bloc97 2023, "NTK-Aware Scaled RoPE", r/LocalLLaMA) in its
  dynamic form, the base raised with the sequence's length past the trained one.
* ``yarn``: YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language
  Models"): interpolate the long wavelengths, keep the short ones, ramp between, and scale cos and
  sin by an attention factor.
* ``llama3``: Meta's Llama 3.1 scaling (``apply_scaling`` in Meta's llama-models reference code):
  low frequencies divided by ``factor``, high ones kept, a smooth step between.
* ``factors``: llama.cpp's ``rope_freqs.weight``, one divisor per frequency (its converter writes
  Llama 3.1's scaling that way).

Hugging Face layouts read: transformers 4.x (top-level ``rope_theta`` + ``rope_scaling`` whose type
is under ``type`` or ``rope_type``), transformers 5.x (``rope_parameters`` with ``rope_theta``
inside, flat or keyed by layer type), Gemma 3's legacy ``rope_local_base_freq``, and
``partial_rotary_factor``. GGUF: llama.cpp's ``{arch}.rope.*`` keys and ``rope_freqs.weight``.
Whatever changes the arithmetic and is not understood is a ModelFormatError naming the file and
the key: a silently ignored rotary setting gives plausible text and wrong logits.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from quickdraft.errors import ModelFormatError

KINDS = ("linear", "dynamic", "yarn", "llama3", "factors")


@dataclass(frozen=True)
class RopeScaling:
    """What changes a rotary table beyond its base; None of it for plain RoPE."""

    kind: str  # "linear" | "dynamic" | "yarn" | "llama3" | "factors"  ("factors": GGUF rope_freqs)
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # dynamic: the config's max_position_embeddings
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn (None: 32)
    beta_slow: float | None = None  # yarn (None: 1)
    attention_factor: float | None = None  # multiplies cos and sin (yarn's default when None: from factor, mscale)
    mscale: float | None = None  # yarn (DeepSeek-style), where given
    mscale_all_dim: float | None = None
    truncate: bool | None = None  # yarn, transformers 5 (None: True)
    freq_factors: tuple[float, ...] = ()  # "factors": one per frequency (rotary_dim/2 of them)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"RopeScaling kind {self.kind!r} is not one of {', '.join(KINDS)}")


@dataclass(frozen=True)
class Rope:
    theta: float
    scaling: RopeScaling | None = None
    rotary_dim: int | None = None  # None: the whole head; else the first rotary_dim dims rotate (partial rotary)


# --- reading numbers ------------------------------------------------------------------------------


def _number(value: Any, source: str, key: str, *, positive: bool = True) -> float:
    """``value`` as a float: a real number (not a bool), finite, and > 0 where ``positive``."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        need = "a positive number" if positive else "a finite number"
        raise ModelFormatError(f"{source}: {key} = {value!r} is not {need}")
    return float(value)


def _count(value: Any, source: str, key: str) -> int:
    """``value`` as a positive int (a float that is a whole number passes: JSON writers differ)."""
    if _number(value, source, key) != int(value):
        raise ModelFormatError(f"{source}: {key} = {value!r} is not a whole number")
    return int(value)


def _optional(value: Any, source: str, key: str, *, positive: bool = True) -> float | None:
    return None if value is None else _number(value, source, key, positive=positive)


def _rotary_dim(fraction: Any, head_dim: int, source: str, key: str) -> int | None:
    """The rotated dims from a partial_rotary_factor (transformers: ``int(head_dim * factor)``)."""
    if fraction is None:
        return None
    fraction = _number(fraction, source, key)
    dim = int(head_dim * fraction)
    if fraction > 1 or dim < 2 or dim % 2:
        raise ModelFormatError(f"{source}: {key} = {fraction!r} gives {dim} rotated dims of {head_dim}: "
                               "need an even count between 2 and the head size")
    return None if dim == head_dim else dim


def hf_rope_scaling(s: RopeScaling) -> dict:
    """``s`` as transformers 4's ``rope_scaling`` dict, which rope_from_hf reads back as ``s``."""
    if s.kind == "factors":
        raise ValueError("per-frequency factors (a GGUF's rope_freqs) have no transformers form")
    out: dict = {"rope_type": s.kind, "factor": s.factor}
    names = ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
             "attention_factor", "mscale", "mscale_all_dim", "truncate")
    out |= {n: getattr(s, n) for n in names if getattr(s, n) is not None}
    if s.kind == "dynamic":  # read back from max_position_embeddings, not from the dict
        out.pop("original_max_position_embeddings", None)
    return out


def whole_head_only(rope: Rope, head_dim: int, source: str) -> Rope:
    """``rope`` when it turns every dim of a head. The loaders do not reorder the q/k rows that
    partial rotary needs (partial_rotary_order), so a partial one is refused, never computed wrong."""
    if rope.rotary_dim is not None:
        raise ModelFormatError(f"{source}: partial rotary embeddings ({rope.rotary_dim} of {head_dim} dims per head) "
                               "are not supported")
    return rope


# --- Hugging Face config.json ----------------------------------------------------------------------

# transformers' default base where a config has none: RotaryEmbeddingConfigMixin.default_theta
# (10,000), overridden per model type by a class attribute ``default_theta``. The values below are
# transformers 5.24's (models/*/configuration_*.py) for the text decoders whose default is not
# 10,000; transformers 4.x had the same defaults as ``rope_theta=`` arguments. Qwen2, Qwen3,
# Llama and Mistral default to 10,000 in both (their checkpoints always write their own base).
_GEMMA_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # default_theta global/local
_DEFAULT_THETA: dict[str, float | dict[str, float]] = {
    "gemma3": _GEMMA_THETA, "gemma3_text": _GEMMA_THETA, "gemma3n": _GEMMA_THETA, "gemma3n_text": _GEMMA_THETA,
    "apertus": 12_000_000.0, "bitnet": 500_000.0, "cohere": 500_000.0, "cwm": 1_000_000.0,
    "ernie4_5": 500_000.0, "ernie4_5_moe": 500_000.0, "exaone": 500_000.0, "flex_olmo": 500_000.0,
    "gpt_oss": 150_000.0, "helium": 100_000.0, "lfm2": 1_000_000.0, "lfm2_moe": 1_000_000.0,
    "llama4_text": 500_000.0, "longcat_flash": 10_000_000.0, "minimax": 1_000_000.0, "minimax_m2": 5_000_000.0,
    "mixtral": 1_000_000.0, "olmo3": 500_000.0, "phimoe": 1_000_000.0, "smollm3": 2_000_000.0,
    "solar_open": 1_000_000.0,
}
_MIXIN_THETA = 10_000.0
# Gemma 3 (and 3n) keep one rotary setting per layer type; their 4.x configs put the local base in
# rope_local_base_freq and rope_scaling applies to the global layers only (configuration_gemma3.py)
_GEMMA = frozenset(("gemma3", "gemma3_text", "gemma3n", "gemma3n_text"))
_LAYER_TYPES = ("full_attention", "sliding_attention")

# rope types and the keys each reads beyond _COMMON: (required, optional), as transformers 5.24's
# _validate_<type>_rope_parameters lists them (it warns on an unknown key; we refuse it)
_COMMON = frozenset(("rope_type", "type", "rope_theta", "partial_rotary_factor"))
_TYPE_KEYS: dict[str, tuple[frozenset, frozenset]] = {
    "default": (frozenset(), frozenset()),
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor"}), frozenset()),
    "yarn": (frozenset({"factor"}), frozenset({"original_max_position_embeddings", "attention_factor", "beta_fast",
                                               "beta_slow", "mscale", "mscale_all_dim", "truncate"})),
    "llama3": (frozenset({"factor", "low_freq_factor", "high_freq_factor"}),
               frozenset({"original_max_position_embeddings"})),
}
_REFUSED = {  # rope types transformers knows that a cached table here does not compute
    "longrope": "its frequencies switch between two factor lists with the sequence's length",
    "su": "LongRoPE under its old name: its frequencies switch with the sequence's length",
    "proportional": "Gemma 4's proportional RoPE",
    "mrope": "multimodal RoPE (3-D positions)",
}
# types a config class renames before computing: Phi-3's "yarn" (and "su") is LongRoPE
# (configuration_phi3.py and configuration_phi4_multimodal.py, for backward compatibility)
_RENAMED = {"phi3": {"yarn": "longrope", "su": "longrope"}, "phi4_multimodal": {"yarn": "longrope", "su": "longrope"}}
_TOP_KEYS = frozenset(("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor"))


def _check_top_keys(cfg: dict, model_type: str, source: str) -> None:
    """Refuse a top-level rotary key this module does not read (no_rope_layers, rope_interleave,
    rotary_pct, ...): each changes which dims turn or how, and ignoring it would be silent."""
    known = _TOP_KEYS | ({"rope_local_base_freq"} if model_type in _GEMMA else set())
    unknown = sorted(k for k in cfg if ("rope" in k or "rotary" in k) and k not in known)
    if unknown:
        raise ModelFormatError(f"{source}: config.json key(s) {', '.join(unknown)} are not understood "
                               f"(rotary keys read: {', '.join(sorted(known))})")
    if isinstance(cfg.get("text_config"), dict):
        raise ModelFormatError(f"{source}: the rotary settings are under text_config: read that dict")


def _dict_or_none(value: Any, source: str, key: str) -> dict | None:
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise ModelFormatError(f"{source}: {key} = {value!r} is not a JSON object")
    return value


def _nested_keys(params: dict, cfg: dict) -> list[str]:
    """The layer types ``params`` is keyed by (transformers: keys among the config's layer types)."""
    types = cfg.get("layer_types")
    labels = {t for t in types if isinstance(t, str)} if isinstance(types, list) else set()
    labels |= set(_LAYER_TYPES)
    return [k for k in params if k in labels]


def _nested(params: dict, cfg: dict, layer_type: str, source: str, missing_ok: bool = False) -> dict:
    """The dict of ``layer_type`` in a ``rope_parameters`` keyed by layer type."""
    labels = _nested_keys(params, cfg)
    if len(labels) != len(params):
        stray = sorted(set(params) - set(labels))
        raise ModelFormatError(f"{source}: rope_parameters mixes layer types {labels} with other keys {stray}")
    if layer_type not in params:
        if missing_ok:
            return {}
        raise ModelFormatError(f"{source}: rope_parameters has no entry for layer type {layer_type!r} (has: {labels})")
    if params[layer_type] is None:
        raise ModelFormatError(f"{source}: rope_parameters[{layer_type!r}] is null: layers without rotary "
                               "embeddings (NoPE) are not supported")
    return dict(_dict_or_none(params[layer_type], source, f"rope_parameters[{layer_type!r}]") or {})


def _gemma_params(cfg: dict, scaling: dict | None, params: dict | None, layer_type: str,
                  source: str) -> tuple[dict, str, Any, str]:
    """Gemma 3's per-layer-type settings: 5.x keys them by layer type, 4.x has rope_theta (global),
    rope_local_base_freq (local) and a rope_scaling for the global layers only."""
    if layer_type not in _LAYER_TYPES:
        raise ModelFormatError(f"{source}: layer type {layer_type!r} is not one of {', '.join(_LAYER_TYPES)}")
    legacy = "rope_theta" if layer_type == "full_attention" else "rope_local_base_freq"
    theta = cfg.get(legacy)
    theta, theta_key = (_GEMMA_THETA[layer_type], "default_theta") if theta is None else (theta, legacy)
    if params is not None:
        if not _nested_keys(params, cfg):  # transformers' Gemma3 config fills in defaults and ignores it
            raise ModelFormatError(f"{source}: a Gemma 3 rope_parameters must be keyed by layer type "
                                   f"({', '.join(_LAYER_TYPES)}), not flat")
        where = f"rope_parameters[{layer_type!r}]"
        return _nested(params, cfg, layer_type, source, missing_ok=True), where, theta, theta_key
    chosen = scaling if layer_type == "full_attention" and scaling is not None else {}
    return dict(chosen), "rope_scaling", theta, theta_key


def _layer_params(cfg: dict, model_type: str, layer_type: str, source: str) -> tuple[dict, str, tuple, bool]:
    """(the rope dict that applies to ``layer_type``, its name for messages, (the base to use where
    it has none, that base's key), whether it is a flat dict) from whichever layout ``cfg`` has."""
    scaling = _dict_or_none(cfg.get("rope_scaling"), source, "rope_scaling")
    params = _dict_or_none(cfg.get("rope_parameters"), source, "rope_parameters")
    if scaling is not None and params is not None:
        # transformers 5 would take rope_scaling whole and drop rope_parameters, its rope_theta too
        raise ModelFormatError(f"{source}: both rope_scaling (transformers 4) and rope_parameters (transformers 5) "
                               "are set: keep one")
    if model_type in _GEMMA:
        params, where, theta, theta_key = _gemma_params(cfg, scaling, params, layer_type, source)
        return params, where, (theta, theta_key), False
    theta = (cfg["rope_theta"], "rope_theta") if cfg.get("rope_theta") is not None else (
        _DEFAULT_THETA.get(model_type, _MIXIN_THETA), "default_theta")
    if params is not None and _nested_keys(params, cfg):
        return _nested(params, cfg, layer_type, source), f"rope_parameters[{layer_type!r}]", theta, False
    if scaling is not None:
        return dict(scaling), "rope_scaling", theta, True
    return dict(params or {}), "rope_parameters", theta, True


def _rope_type(params: dict, model_type: str, where: str, source: str) -> str:
    """The rope type of ``params`` ("type" in transformers 4, "rope_type" since), checked."""
    kind = params.get("rope_type", params.get("type", "default"))
    if "type" in params and "rope_type" in params and params["type"] != params["rope_type"]:
        raise ModelFormatError(f"{source}: {where} has type {params['type']!r} and rope_type {params['rope_type']!r}")
    supported = ", ".join(_TYPE_KEYS)
    if not isinstance(kind, str):
        raise ModelFormatError(f"{source}: {where}['rope_type'] = {kind!r} is not a rope type (supported: {supported})")
    named = kind
    kind = _RENAMED.get(model_type, {}).get(kind, kind)
    if kind in _REFUSED:
        also = f", which a {model_type} config calls {named!r}" if named != kind else ""
        raise ModelFormatError(f"{source}: {where} rope type {kind!r}{also} is not supported ({_REFUSED[kind]}; "
                               f"supported: {supported})")
    if kind not in _TYPE_KEYS:
        raise ModelFormatError(f"{source}: {where} rope type {kind!r} is not understood (supported: {supported})")
    required, optional = _TYPE_KEYS[kind]
    unknown = sorted(set(params) - _COMMON - required - optional)
    if unknown:
        reads = ", ".join(sorted(_COMMON | required | optional))
        raise ModelFormatError(f"{source}: {where} key(s) {', '.join(unknown)} are not understood for rope type "
                               f"{kind!r} (it reads: {reads})")
    missing = sorted(required - set(params))
    if missing:
        raise ModelFormatError(f"{source}: {where} lacks {', '.join(missing)}, which rope type {kind!r} needs")
    return kind


def _max_positions(cfg: dict, source: str, why: str) -> int:
    if cfg.get("max_position_embeddings") is None:
        raise ModelFormatError(f"{source}: config.json has no max_position_embeddings, which {why} needs")
    return _count(cfg["max_position_embeddings"], source, "max_position_embeddings")


def _original(params: dict, cfg: dict, flat: bool, where: str, source: str, kind: str) -> int:
    """The pre-training context of yarn and llama3, where transformers' standardize_rope_params
    finds it: a top-level original_max_position_embeddings wins for a flat dict (Phi-3 writes it
    there), then the dict's own, then max_position_embeddings."""
    if flat and cfg.get("original_max_position_embeddings") is not None:
        return _count(cfg["original_max_position_embeddings"], source, "original_max_position_embeddings")
    if params.get("original_max_position_embeddings") is not None:
        key = f"{where}['original_max_position_embeddings']"
        return _count(params["original_max_position_embeddings"], source, key)
    return _max_positions(cfg, source, f"rope type {kind!r} without original_max_position_embeddings")


def _hf_yarn(params: dict, cfg: dict, flat: bool, where: str, source: str) -> RopeScaling:
    original = _original(params, cfg, flat, where, source, "yarn")
    factor = params["factor"]
    if factor is None:  # transformers (DeepSeek-V3's configs): the ratio of the two context lengths
        factor = _max_positions(cfg, source, "a yarn factor of null") / original
    truncate = params.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        raise ModelFormatError(f"{source}: {where}['truncate'] = {truncate!r} is not true or false")
    # transformers reads truncate from the top of rope_parameters even when that is keyed by layer
    # type (where it can never be); we read it where it is written
    key = lambda k: f"{where}[{k!r}]"  # noqa: E731
    return RopeScaling(
        "yarn", _number(factor, source, key("factor")), original,
        beta_fast=_optional(params.get("beta_fast"), source, key("beta_fast"), positive=False),
        beta_slow=_optional(params.get("beta_slow"), source, key("beta_slow"), positive=False),
        attention_factor=_optional(params.get("attention_factor"), source, key("attention_factor")),
        mscale=_optional(params.get("mscale"), source, key("mscale"), positive=False),
        mscale_all_dim=_optional(params.get("mscale_all_dim"), source, key("mscale_all_dim"), positive=False),
        truncate=truncate,
    )


def _hf_scaling(kind: str, params: dict, cfg: dict, flat: bool, where: str, source: str) -> RopeScaling | None:
    if kind == "default":
        return None
    if kind == "yarn":
        return _hf_yarn(params, cfg, flat, where, source)
    factor = _number(params["factor"], source, f"{where}['factor']")
    if kind == "linear":
        return RopeScaling("linear", factor)
    if kind == "dynamic":  # transformers scales from max_position_embeddings (not an original length)
        return RopeScaling("dynamic", factor, _max_positions(cfg, source, "rope type 'dynamic'"))
    low = _number(params["low_freq_factor"], source, f"{where}['low_freq_factor']")
    high = _number(params["high_freq_factor"], source, f"{where}['high_freq_factor']")
    if high <= low:
        raise ModelFormatError(f"{source}: {where} high_freq_factor {high} is not above low_freq_factor {low}")
    return RopeScaling("llama3", factor, _original(params, cfg, flat, where, source, kind), low, high)


def rope_from_hf(cfg: dict, head_dim: int, source: str, layer_type: str = "full_attention") -> Rope:
    """The rotary embedding of ``layer_type``'s layers in a parsed ``config.json`` (the text
    model's dict: Gemma 3's multimodal config keeps it under text_config).

    Reads transformers 4.x (``rope_theta`` + ``rope_scaling``, type under "type" or "rope_type"),
    5.x (``rope_parameters`` with ``rope_theta`` inside, flat or keyed by layer type), Gemma 3's
    legacy ``rope_local_base_freq`` for its sliding layers, and ``partial_rotary_factor`` (top level
    or inside) as ``rotary_dim``. A missing base is the model type's default in transformers
    (``_DEFAULT_THETA``). An unknown rope type, key or malformed value: ModelFormatError naming
    ``source`` and the key."""
    if not isinstance(cfg, dict):
        raise ModelFormatError(f"{source}: config.json is not a JSON object")
    model_type = str(cfg.get("model_type") or "")
    _check_top_keys(cfg, model_type, source)
    params, where, theta, flat = _layer_params(cfg, model_type, layer_type, source)
    kind = _rope_type(params, model_type, where, source)
    if params.get("rope_theta") is not None:
        theta = (params["rope_theta"], f"{where}['rope_theta']")
    theta = _number(theta[0], source, theta[1])
    # transformers 5 moves a top-level partial_rotary_factor into the dict; the dict's wins
    fraction, key = params.get("partial_rotary_factor"), f"{where}['partial_rotary_factor']"
    if fraction is None:
        fraction, key = cfg.get("partial_rotary_factor"), "partial_rotary_factor"
    rotary = _rotary_dim(fraction, head_dim, source, key)
    return Rope(theta, _hf_scaling(kind, params, cfg, flat, where, source), rotary)


# --- GGUF metadata (llama.cpp) ---------------------------------------------------------------------

# the {arch}.rope.* keys read (gguf-py's Keys.Rope, and "scale_linear", llama.cpp's older name of
# scaling.factor); scaling.finetuned only documents
_GGUF_KEYS = frozenset((
    "dimension_count", "dimension_count_swa", "freq_base", "freq_base_swa", "scale_linear", "scaling.type",
    "scaling.factor", "scaling.attn_factor", "scaling.original_context_length", "scaling.finetuned",
    "scaling.yarn_beta_fast", "scaling.yarn_beta_slow", "scaling.yarn_ext_factor", "scaling.yarn_log_multiplier",
))
_GGUF_REFUSED = {
    # the converter writes transformers' attention_factor here, which transformers puts in place of
    # YaRN's own factor, while llama.cpp recomputes that factor over it for most architectures
    "scaling.yarn_attn_factor": "transformers and llama.cpp disagree on what it multiplies",
    "scaling.alpha": "NTK-alpha scaling",
    "dimension_sections": "multimodal RoPE sections",
}
# llama.cpp's Gemma 3: sliding layers turn at base 10,000 without scaling (llama-model.cpp sets
# rope_freq_base_train_swa and rope_freq_scale_train_swa for LLM_ARCH_GEMMA3); freq_base_swa, where
# a file has it, is read first
_GGUF_SWA_PLAIN = {"gemma3": 10_000.0, "gemma3n": 10_000.0, "gemma-embedding": 10_000.0}


def _check_gguf_keys(meta: dict, prefix: str, source: str) -> None:
    for name in sorted(k[len(prefix):] for k in meta if k.startswith(prefix)):
        if name in _GGUF_REFUSED:
            raise ModelFormatError(f"{source}: metadata key {prefix}{name} is not supported ({_GGUF_REFUSED[name]})")
        if name not in _GGUF_KEYS:
            raise ModelFormatError(f"{source}: metadata key {prefix}{name} is not understood (rope keys read: "
                                   f"{', '.join(sorted(_GGUF_KEYS))})")


def _freq_factors(rope_freqs: Any, rotary: int, source: str) -> tuple[float, ...]:
    """rope_freqs.weight as a tuple: one divisor per frequency, each positive."""
    try:
        values = np.asarray(rope_freqs, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{source}: rope_freqs.weight is not an array of numbers ({e})") from e
    if values.ndim != 1 or values.shape[0] != rotary // 2:
        raise ModelFormatError(f"{source}: rope_freqs.weight has shape {tuple(values.shape)}, not ({rotary // 2},): "
                               "one factor per rotary frequency")
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ModelFormatError(f"{source}: rope_freqs.weight holds factors that are not positive numbers")
    return tuple(float(v) for v in values)


def _gguf_yarn_extras(get, kind: str, prefix: str, source: str) -> None:
    """Refuse what llama.cpp computes beyond the YaRN transformers does: an extrapolation mix other
    than its default (1 for yarn, 0 otherwise) and DeepSeek's log multiplier."""
    ext, default = get("scaling.yarn_ext_factor"), 1.0 if kind == "yarn" else 0.0
    if ext is not None and _number(ext, source, prefix + "scaling.yarn_ext_factor", positive=False) != default:
        raise ModelFormatError(f"{source}: {prefix}scaling.yarn_ext_factor = {ext!r} is not supported "
                               f"(only llama.cpp's default for scaling type {kind!r})")
    log_mul = get("scaling.yarn_log_multiplier")
    if log_mul is not None and _number(log_mul, source, prefix + "scaling.yarn_log_multiplier", positive=False):
        raise ModelFormatError(f"{source}: {prefix}scaling.yarn_log_multiplier = {log_mul!r} is not supported")


def _gguf_scaling(meta: dict, arch: str, rotary: int, rope_freqs: Any, source: str) -> RopeScaling | None:
    prefix = f"{arch}.rope."
    get = lambda key, default=None: meta.get(prefix + key, default)  # noqa: E731
    kind = get("scaling.type", "linear")  # llama.cpp's default: a factor alone is linear
    if kind not in ("none", "linear", "yarn"):
        raise ModelFormatError(f"{source}: {prefix}scaling.type = {kind!r} is not supported "
                               "(supported: none, linear, yarn)")
    _gguf_yarn_extras(get, kind, prefix, source)
    factor = get("scaling.factor", get("scale_linear"))
    # llama.cpp: no factor or 0 is 1, and type none never scales
    factor = 1.0 if kind == "none" or not factor else _number(factor, source, prefix + "scaling.factor")
    # rope_attn_factor: llama.cpp multiplies cos and sin by it, over YaRN's own factor
    attn = _number(get("scaling.attn_factor", 1.0), source, prefix + "scaling.attn_factor")
    if rope_freqs is not None:
        if kind == "yarn" or factor != 1.0:
            raise ModelFormatError(f"{source}: rope_freqs.weight with {prefix}scaling.type {kind!r} and factor {factor} "
                                   "is not supported (only rope_freqs alone)")
        return RopeScaling("factors", freq_factors=_freq_factors(rope_freqs, rotary, source),
                           attention_factor=None if attn == 1.0 else attn)
    if kind == "yarn":
        original = get("scaling.original_context_length", meta.get(f"{arch}.context_length"))
        if original is None:
            raise ModelFormatError(f"{source}: yarn needs {prefix}scaling.original_context_length "
                                   f"or {arch}.context_length")
        s = RopeScaling("yarn", factor, _count(original, source, prefix + "scaling.original_context_length"),
                        beta_fast=_optional(get("scaling.yarn_beta_fast"), source, prefix + "scaling.yarn_beta_fast"),
                        beta_slow=_optional(get("scaling.yarn_beta_slow"), source, prefix + "scaling.yarn_beta_slow"),
                        truncate=True)  # ggml_rope_yarn_corr_dims always floors and ceils
        return s if attn == 1.0 else replace(s, attention_factor=_yarn_attention(s) * attn)
    if factor == 1.0 and attn == 1.0:
        return None
    return RopeScaling("linear", factor, attention_factor=None if attn == 1.0 else attn)


def rope_from_gguf(meta: dict, arch: str, head_dim: int, rope_freqs: Any, source: str,
                   layer_type: str = "full_attention") -> Rope:
    """The rotary embedding of ``layer_type``'s layers from GGUF metadata as llama.cpp reads it.

    ``rope_freqs``: the ``rope_freqs.weight`` tensor (numpy, [rotary_dim/2]) or None; llama.cpp
    divides each frequency by its factor. Sliding layers ("sliding_attention") read
    ``freq_base_swa`` and ``dimension_count_swa`` where present; Gemma 3's turn plainly at 10,000
    otherwise, as in llama.cpp. The caller undoes llama.cpp's q/k row interleaving for "norm"-style
    architectures (llama); the tables here are rotate-half."""
    prefix = f"{arch}.rope."
    _check_gguf_keys(meta, prefix, source)
    get = lambda key, default=None: meta.get(prefix + key, default)  # noqa: E731
    theta = _number(get("freq_base", 10_000.0), source, prefix + "freq_base")  # llama.cpp's default base
    rotary = _count(get("dimension_count", head_dim), source, prefix + "dimension_count")
    sliding = layer_type == "sliding_attention"
    if sliding:
        rotary = _count(get("dimension_count_swa", rotary), source, prefix + "dimension_count_swa")
        base = get("freq_base_swa")
        theta = _number(base, source, prefix + "freq_base_swa") if base is not None else _GGUF_SWA_PLAIN.get(arch, theta)
    if rotary > head_dim or rotary % 2:
        raise ModelFormatError(f"{source}: {prefix}dimension_count = {rotary} does not fit a head of {head_dim} dims "
                               "(need an even count up to it)")
    partial = None if rotary == head_dim else rotary
    if sliding and arch in _GGUF_SWA_PLAIN:
        return Rope(float(theta), None, partial)
    return Rope(float(theta), _gguf_scaling(meta, arch, rotary, rope_freqs, source), partial)


# --- tables -----------------------------------------------------------------------------------------


def _need(s: RopeScaling, name: str) -> Any:
    value = getattr(s, name)
    if value is None:
        raise ValueError(f"RopeScaling {s.kind!r} needs {name}")
    return value


def _yarn_attention(s: RopeScaling) -> float:
    """YaRN's default factor on cos and sin: 0.1 ln(factor) + 1, or DeepSeek's ratio of two such
    terms when both mscale and mscale_all_dim are set (transformers' _compute_yarn_parameters)."""
    def term(scale: float, m: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if s.mscale and s.mscale_all_dim:
        return term(s.factor, s.mscale) / term(s.factor, s.mscale_all_dim)
    return term(s.factor, 1.0)


def _yarn(inv: torch.Tensor, s: RopeScaling, dim: int, base: float) -> torch.Tensor:
    """Interpolate (divide by factor) the frequencies that turn fewer than beta_slow times over the
    original context, keep those that turn more than beta_fast times, ramp linearly between."""
    original = _need(s, "original_max_position_embeddings")

    def dim_of(turns: float) -> float:  # the (fractional) dim index whose wavelength fits `turns` in the context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.beta_fast or 32.0), dim_of(s.beta_slow or 1.0)
    if s.truncate is None or s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width 0 would divide by 0
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    return inv * (1 - ramp) + (inv / s.factor) * ramp


def _llama3(inv: torch.Tensor, s: RopeScaling, dim: int, base: float) -> torch.Tensor:
    """Wavelengths above original/low_freq_factor: divided by factor; below original/high_freq_factor:
    kept; between: a smooth step in original/wavelength."""
    original = _need(s, "original_max_position_embeddings")
    low, high = _need(s, "low_freq_factor"), _need(s, "high_freq_factor")
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    out = torch.where(wavelen > original / low, inv / s.factor, inv * ((1 - smooth) / s.factor + smooth))
    return torch.where(wavelen < original / high, inv, out)


def _factors(inv: torch.Tensor, s: RopeScaling, dim: int, base: float) -> torch.Tensor:
    if len(s.freq_factors) != dim // 2:
        raise ValueError(f"RopeScaling 'factors' has {len(s.freq_factors)} factors for {dim // 2} frequencies")
    return inv / torch.tensor(s.freq_factors, dtype=torch.float64)


_SCALE = {
    "linear": lambda inv, s, dim, base: inv / s.factor,
    "dynamic": lambda inv, s, dim, base: inv,  # its change is to the base, in inverse_frequencies
    "yarn": _yarn,
    "llama3": _llama3,
    "factors": _factors,
}


def inverse_frequencies(rope: Rope, rotary_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(float64 [rotary_dim/2] inverse frequencies, the factor on cos and sin): what transformers'
    ROPE_INIT_FUNCTIONS return as (inv_freq, attention_scaling), for a table of ``max_positions``."""
    s, base = rope.scaling, float(rope.theta)
    if s is not None and s.kind == "dynamic" and max_positions > _need(s, "original_max_position_embeddings"):
        # transformers' dynamic_rope_update: the base grows with the sequence past the trained length
        if rotary_dim <= 2:
            raise ValueError("dynamic scaling needs more than 2 rotary dims")
        grown = s.factor * max_positions / s.original_max_position_embeddings - (s.factor - 1)
        base = base * grown ** (rotary_dim / (rotary_dim - 2))
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if s is None:
        return inv, 1.0
    inv = _SCALE[s.kind](inv, s, rotary_dim, float(rope.theta))
    if s.attention_factor is not None:
        return inv, float(s.attention_factor)
    return inv, _yarn_attention(s) if s.kind == "yarn" else 1.0


def _check_dims(head_dim: int, rotary_dim: int) -> None:
    if head_dim < 2 or head_dim % 2 or rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} and head_dim {head_dim}: need even sizes, rotary_dim <= head_dim")


def rotary_tables(rope: Rope, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: float32 [max_positions, head_dim] in Hugging Face's rotate-half layout (the angles
    of frequency i at dims i and i + head_dim/2), computed in float64 then rounded, each multiplied
    by the attention factor (transformers' attention_scaling). Plain full RoPE gives the very bits
    of decoder/ops.py's original table.

    "dynamic": transformers recomputes the frequencies from the current sequence's length, which a
    cached table cannot follow; the table is the one transformers uses for a sequence of
    ``max_positions`` tokens (plain RoPE when that is within max_position_embeddings), so shorter
    sequences differ from transformers' by as much as their lengths do.

    Partial rotary (``rope.rotary_dim`` < head_dim): the table of the head's dims reordered by
    partial_rotary_order; frequencies past rotary_dim/2 have angle 0 and no attention factor
    (cos 1, sin 0), so those dims pass through."""
    rotary = rope.rotary_dim or head_dim
    _check_dims(head_dim, rotary)
    inv, scale = inverse_frequencies(rope, rotary, max_positions)
    if rotary < head_dim:
        inv = torch.cat([inv, inv.new_zeros((head_dim - rotary) // 2)])
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], dim=-1)  # [max_positions, head_dim]
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        turns = torch.arange(head_dim) % (head_dim // 2) < rotary // 2  # the pass-through dims keep cos 1
        cos, sin = torch.where(turns, cos * scale, cos), torch.where(turns, sin * scale, sin)
    return cos.float(), sin.float()


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """A permutation of a head's dims [head_dim] that turns transformers' partial rotate-half
    (pairs i, i + rotary_dim/2 for i < rotary_dim/2; dims from rotary_dim on pass through) into a
    full-head rotate-half (pairs i, i + head_dim/2) whose extra pairs are pass-through dims.

    Apply it to the rows of q_proj and k_proj of each head (and their biases and per-head norm
    weights): ``w.view(heads, head_dim, -1)[:, order]``. A dot product of q and k is unchanged by
    the same permutation of both, and rotary_tables' partial table rotates the reordered dims."""
    _check_dims(head_dim, rotary_dim)
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([
        torch.arange(0, half),  # first halves of the rotated pairs
        torch.arange(rotary_dim, rotary_dim + rest),  # first half of the pass-through dims
        torch.arange(half, rotary_dim),  # second halves of the rotated pairs
        torch.arange(rotary_dim + rest, head_dim),  # second half of the pass-through dims
    ])
