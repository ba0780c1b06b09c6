"""models/rope.py against transformers 5.24's own rotary code and llama.cpp's GGUF conventions.

* Tables: every rope type (default, linear, dynamic, yarn with and without attention_factor or
  mscale, llama3) against transformers' ROPE_INIT_FUNCTIONS (inv_freq and attention_scaling) for
  a config built with its config classes, at positions up to 4x original_max_position_embeddings.
  Tolerances: inverse frequencies within 1e-6 relative of transformers as it runs (float32: its
  base ** x is rounded to ~1e-7); tables within 1e-6 absolute of transformers' own code run in
  float64 (its module's float32 mapped to float64: in float32 the angle pos * inv_freq is rounded
  by pos * 6e-8, 2e-4 at position 4096, which would hide any real difference).
* Layouts: rope_from_hf on config.to_dict() and saved config.json files of Llama (llama3), Qwen2
  (rope_theta 1e6 only inside rope_parameters), Qwen3 (yarn), Mistral, Gemma 3 (global and local
  layers differ), and on transformers 4.x dicts written by hand.
* GGUF: rope_freqs factors computed as llama.cpp's converter does give llama3's tables; linear and
  yarn metadata give the HF tables; the keys read are gguf-py's.
* Refusals: unknown types and keys, malformed values: ModelFormatError naming the file and key.
* Partial rotary: transformers' partial rotate-half then q.k equals the permuted full-table one.
"""

from __future__ import annotations

import json
import math

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers import modeling_rope_utils
from transformers.models.llama import modeling_llama
from transformers.models.phi3 import modeling_phi3
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

from quickdraft.errors import ModelFormatError
from quickdraft.models import rope as qrope
from quickdraft.models.rope import (
    Rope,
    RopeScaling,
    inverse_frequencies,
    partial_rotary_order,
    rope_from_gguf,
    rope_from_hf,
    rotary_tables,
)

HEAD_DIM = 64
ORIGINAL = 1024  # original_max_position_embeddings of the scaled cases
POSITIONS = 4 * ORIGINAL  # tables reach 4x past it
INV_RTOL = 1e-6
TABLE_ATOL = 1e-6


class _Float64Torch:
    """torch, with float32 (and torch.float) meaning float64: transformers' rope functions name
    float32 explicitly, so this is how to run its very code in double precision."""

    float = torch.float64
    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@pytest.fixture
def float64_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(modeling_rope_utils, "torch", _Float64Torch())
    monkeypatch.setattr(modeling_llama, "torch", _Float64Torch())
    monkeypatch.setattr(modeling_phi3, "torch", _Float64Torch())


def llama_config(rope_parameters: dict, max_positions: int = POSITIONS, **kw) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_hidden_layers=1,
                                    max_position_embeddings=max_positions, rope_parameters=dict(rope_parameters), **kw)


def transformers_frequencies(config, kind: str, seq_len: int) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) as transformers computes them for a sequence of seq_len."""
    if kind == "default":  # each model's own; Phi-3's reads partial_rotary_factor, Llama's does not
        model = modeling_phi3.Phi3RotaryEmbedding if config.model_type == "phi3" else modeling_llama.LlamaRotaryEmbedding
        return model.compute_default_rope_parameters(config)
    kwargs = {"seq_len": seq_len} if kind == "dynamic" else {}  # others ignore it (dynamic_rope_update's call)
    return modeling_rope_utils.ROPE_INIT_FUNCTIONS[kind](config, None, **kwargs)


def reference_tables(inv: torch.Tensor, scale: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' forward: cat(freqs, freqs), cos and sin times attention_scaling (float64 here)."""
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv.double())
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * scale, angles.sin() * scale


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "default-500k": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": YARN,
    "yarn-attention-factor": YARN | {"attention_factor": 0.8},
    "yarn-mscale": YARN | {"rope_theta": 1e6, "mscale": 1.0, "mscale_all_dim": 0.8},
    "yarn-betas-untruncated": YARN | {"beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL},
}


@pytest.mark.parametrize("name", CASES)
def test_tables_match_transformers(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    params = CASES[name]
    # dynamic scales from max_position_embeddings; the others reach 4x their original length
    config = llama_config(params, ORIGINAL if name == "dynamic" else POSITIONS)
    rope = rope_from_hf(config.to_dict(), HEAD_DIM, "test")
    assert (rope.scaling is None) == (params["rope_type"] == "default")
    mine, scale = inverse_frequencies(rope, HEAD_DIM, POSITIONS)

    inv32, scale32 = transformers_frequencies(config, params["rope_type"], POSITIONS)
    assert inv32.dtype == torch.float32
    assert torch.allclose(mine, inv32.double(), rtol=INV_RTOL, atol=0)
    assert scale == pytest.approx(scale32, rel=1e-12)  # Python floats on both sides

    monkeypatch.setattr(modeling_rope_utils, "torch", _Float64Torch())
    monkeypatch.setattr(modeling_llama, "torch", _Float64Torch())
    inv64, scale64 = transformers_frequencies(config, params["rope_type"], POSITIONS)
    assert inv64.dtype == torch.float64
    cos_ref, sin_ref = reference_tables(inv64, scale64, POSITIONS)
    cos, sin = rotary_tables(rope, HEAD_DIM, POSITIONS)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (POSITIONS, HEAD_DIM)
    assert (cos.double() - cos_ref).abs().max() < TABLE_ATOL
    assert (sin.double() - sin_ref).abs().max() < TABLE_ATOL


def test_scaled_tables_differ_from_plain_past_the_original_length() -> None:
    """The comparison above has teeth: each scaling moves the table away from plain RoPE."""
    plain, _ = rotary_tables(Rope(10000.0), HEAD_DIM, POSITIONS)
    for name in ("linear", "dynamic", "yarn", "llama3"):
        config = llama_config(CASES[name] | {"rope_theta": 10000.0}, ORIGINAL if name == "dynamic" else POSITIONS)
        cos, _ = rotary_tables(rope_from_hf(config.to_dict(), HEAD_DIM, "t"), HEAD_DIM, POSITIONS)
        assert (cos - plain)[ORIGINAL:].abs().max() > 0.1, name


def test_yarn_attention_factor_scales_cos_and_sin() -> None:
    base = rope_from_hf(llama_config(YARN).to_dict(), HEAD_DIM, "t")
    given = rope_from_hf(llama_config(YARN | {"attention_factor": 0.8}).to_dict(), HEAD_DIM, "t")
    assert base.scaling.attention_factor is None and given.scaling.attention_factor == 0.8
    cos, sin = rotary_tables(base, HEAD_DIM, 64)
    cos8, sin8 = rotary_tables(given, HEAD_DIM, 64)
    default = 0.1 * math.log(4.0) + 1.0  # YaRN's own: 0.1 ln(factor) + 1
    assert torch.allclose(cos8.double() / 0.8, cos.double() / default, atol=1e-6)
    assert torch.allclose(sin8.double() / 0.8, sin.double() / default, atol=1e-6)


def test_plain_tables_are_the_original_bits() -> None:
    """Plain full RoPE: exactly decoder/ops.py's Rotary table as it was before scaling existed."""
    for theta, positions in ((10000.0, 300), (1e6, 2048), (500000.0, 1)):
        inv = 1.0 / (theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
        angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = rotary_tables(Rope(theta), HEAD_DIM, positions)
        assert torch.equal(cos, angles.cos().float()) and torch.equal(sin, angles.sin().float())


def test_dynamic_within_the_trained_length_is_plain() -> None:
    """transformers keeps plain RoPE until a sequence outgrows max_position_embeddings."""
    rope = rope_from_hf(llama_config(CASES["dynamic"], ORIGINAL).to_dict(), HEAD_DIM, "t")
    assert rope.scaling == RopeScaling("dynamic", 2.0, ORIGINAL)
    for n in (1, ORIGINAL // 2, ORIGINAL):
        mine, plain = rotary_tables(rope, HEAD_DIM, n), rotary_tables(Rope(10000.0), HEAD_DIM, n)
        assert torch.equal(mine[0], plain[0]) and torch.equal(mine[1], plain[1])
    inv32, _ = transformers_frequencies(llama_config(CASES["dynamic"], ORIGINAL), "dynamic", ORIGINAL // 2)
    assert torch.allclose(inverse_frequencies(rope, HEAD_DIM, ORIGINAL // 2)[0], inv32.double(), rtol=INV_RTOL)


# --- layouts -----------------------------------------------------------------------------------


def saved(config, tmp_path) -> dict:
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_llama3_config_and_saved_json(tmp_path) -> None:
    config = llama_config(CASES["llama3"], 8 * ORIGINAL)
    want = Rope(500000.0, RopeScaling("llama3", 8.0, ORIGINAL, 1.0, 4.0))
    assert rope_from_hf(config.to_dict(), HEAD_DIM, "t") == want
    assert rope_from_hf(saved(config, tmp_path), HEAD_DIM, "t") == want


def test_qwen2_saved_by_transformers5_keeps_its_base(tmp_path) -> None:
    """transformers 5 writes rope_theta only inside rope_parameters: reading the top level alone
    gave 10,000 for a 1e6 model."""
    qwen2 = transformers.Qwen2Config(num_hidden_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cfg = saved(qwen2, tmp_path)
    assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] == 1e6
    assert rope_from_hf(cfg, 128, "t") == Rope(1e6)
    legacy = {"model_type": "qwen2", "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 32768}
    assert rope_from_hf(legacy, 128, "t") == Rope(1e6)


def test_qwen3_yarn_and_mistral(tmp_path) -> None:
    qwen3 = transformers.Qwen3Config(num_hidden_layers=1, head_dim=128, max_position_embeddings=131072, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768})
    want = Rope(1e6, RopeScaling("yarn", 4.0, 32768))
    assert rope_from_hf(saved(qwen3, tmp_path / "q"), 128, "t") == want
    # the Qwen model card's way: rope_scaling added by hand to a transformers 4 config
    legacy = {"model_type": "qwen3", "rope_theta": 1000000, "max_position_embeddings": 40960,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert rope_from_hf(legacy, 128, "t") == want
    mistral = transformers.MistralConfig(num_hidden_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert rope_from_hf(saved(mistral, tmp_path / "m"), 128, "t") == Rope(1e6)


def test_gemma3_global_and_local_layers(tmp_path) -> None:
    config = transformers.Gemma3TextConfig(num_hidden_layers=6, head_dim=HEAD_DIM, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    cfg = saved(config, tmp_path)
    full, local = Rope(1e6, RopeScaling("linear", 8.0)), Rope(10000.0)
    assert rope_from_hf(cfg, HEAD_DIM, "t") == full
    assert rope_from_hf(cfg, HEAD_DIM, "t", layer_type="sliding_attention") == local
    # transformers 4.x's Gemma 3 config: rope_scaling is the global layers', rope_local_base_freq the local base
    legacy = {"model_type": "gemma3_text", "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 6}
    assert rope_from_hf(legacy, HEAD_DIM, "t") == full
    assert rope_from_hf(legacy, HEAD_DIM, "t", layer_type="sliding_attention") == local
    # transformers' own per-layer-type frequencies
    emb = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(config)
    for layer_type, rope in (("full_attention", full), ("sliding_attention", local)):
        inv, scale = inverse_frequencies(rope, HEAD_DIM, 16)
        assert torch.allclose(inv, getattr(emb, f"{layer_type}_inv_freq").double(), rtol=INV_RTOL, atol=0)
        assert scale == getattr(emb, f"{layer_type}_attention_scaling")


def test_gemma3_defaults() -> None:
    """Gemma 3's config class defaults: global 1e6, local 10,000, from either layout."""
    assert rope_from_hf({"model_type": "gemma3_text"}, HEAD_DIM, "t") == Rope(1e6)
    assert rope_from_hf({"model_type": "gemma3_text"}, HEAD_DIM, "t", "sliding_attention") == Rope(10000.0)
    cfg = transformers.Gemma3TextConfig(num_hidden_layers=2).to_dict()
    assert rope_from_hf(cfg, HEAD_DIM, "t") == Rope(1e6)
    assert rope_from_hf(cfg, HEAD_DIM, "t", "sliding_attention") == Rope(10000.0)


@pytest.mark.parametrize("model_type", [t for t in qrope._DEFAULT_THETA if t not in ("gemma3", "gemma3n")]
                         + ["llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "gemma2", "phi3"])
def test_default_base_is_the_config_class_default(model_type: str) -> None:
    """A config without any base gets what transformers' class for its model_type defaults to."""
    theirs = transformers.AutoConfig.for_model(model_type).rope_parameters
    theirs = theirs.get("full_attention", theirs)["rope_theta"]
    assert rope_from_hf({"model_type": model_type}, HEAD_DIM, "t").theta == theirs


LEGACY = {  # transformers 4.x configs as they are on the Hub
    "llama-3.1": {"model_type": "llama", "rope_theta": 500000.0, "max_position_embeddings": 131072, "rope_scaling": {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"}},
    "linear-type": {"model_type": "llama", "rope_theta": 10000.0, "max_position_embeddings": 8192,
                    "rope_scaling": {"type": "linear", "factor": 2.0}},
    "dynamic-type": {"model_type": "llama", "rope_theta": 10000.0, "max_position_embeddings": 4096,
                     "rope_scaling": {"type": "dynamic", "factor": 2.0}},
    "qwen2.5-yarn": {"model_type": "qwen2", "rope_theta": 1000000.0, "max_position_embeddings": 32768,
                     "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}},
    "deepseek-yarn": {"model_type": "llama", "rope_theta": 10000, "max_position_embeddings": 163840, "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}},
    "partial": {"model_type": "llama", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "no-rope-keys": {"model_type": "mistral"},
}


@pytest.mark.parametrize("name", LEGACY)
def test_legacy_layout_reads_as_transformers5_writes_it(name: str) -> None:
    """A 4.x dict and the 5.x dict transformers makes of it give the same Rope."""
    cfg = LEGACY[name]
    cls = transformers.AutoConfig.for_model(cfg["model_type"]).__class__
    modern = cls.from_dict(json.loads(json.dumps(cfg))).to_dict()
    assert "rope_scaling" not in modern and "rope_parameters" in modern
    assert rope_from_hf(cfg, HEAD_DIM, "t") == rope_from_hf(modern, HEAD_DIM, "t")


def test_legacy_values() -> None:
    assert rope_from_hf(LEGACY["llama-3.1"], 128, "t") == Rope(500000.0, RopeScaling("llama3", 8.0, 8192, 1.0, 4.0))
    assert rope_from_hf(LEGACY["dynamic-type"], 128, "t") == Rope(10000.0, RopeScaling("dynamic", 2.0, 4096))
    deepseek = rope_from_hf(LEGACY["deepseek-yarn"], 128, "t").scaling
    assert (deepseek.factor, deepseek.mscale, deepseek.mscale_all_dim, deepseek.beta_fast) == (40.0, 1.0, 1.0, 32.0)
    assert inverse_frequencies(Rope(1e4, deepseek), 128, 8)[1] == 1.0  # mscale / mscale_all_dim
    assert rope_from_hf(LEGACY["partial"], HEAD_DIM, "t") == Rope(10000.0, None, HEAD_DIM // 2)


def test_top_level_original_length_wins_for_a_flat_dict() -> None:
    """transformers' standardize_rope_params: Phi-3 style original_max_position_embeddings at the
    top. The config object still shows the dict's value; the rotary module's init runs the
    standardization again, with the attribute set by then, and computes with the top-level one."""
    cfg = {"model_type": "llama", "max_position_embeddings": 8192, "original_max_position_embeddings": 2048,
           "hidden_size": 4 * HEAD_DIM, "num_attention_heads": 4,
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}
    rope = rope_from_hf(cfg, HEAD_DIM, "t")
    assert rope.scaling.original_max_position_embeddings == 2048
    config = transformers.LlamaConfig.from_dict(cfg)
    emb = modeling_llama.LlamaRotaryEmbedding(config)
    assert config.rope_parameters["original_max_position_embeddings"] == 2048
    assert torch.allclose(inverse_frequencies(rope, HEAD_DIM, 8)[0], emb.inv_freq.double(), rtol=INV_RTOL, atol=0)
    del cfg["original_max_position_embeddings"], cfg["rope_scaling"]["original_max_position_embeddings"]
    assert rope_from_hf(cfg, HEAD_DIM, "t").scaling.original_max_position_embeddings == 8192


# --- GGUF --------------------------------------------------------------------------------------


def converter_llama3_factors(rope: dict, dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors)
    computes it from the HF llama3 parameters: float32 frequencies, then per frequency 1 (short
    wavelength), factor (long) or 1 / ((1 - smooth) / factor + smooth) between; stored float32."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def test_gguf_rope_freqs_give_llama3_tables(tmp_path) -> None:
    params = CASES["llama3"]
    hf = rope_from_hf(llama_config(params, 8 * ORIGINAL).to_dict(), HEAD_DIM, "t")
    factors = converter_llama3_factors(params, HEAD_DIM)
    assert sorted(set(factors[[0, -1]].tolist())) == [1.0, 8.0]  # both ends of the step, and a middle:
    assert ((factors > 1) & (factors < 8)).any()
    meta = {"llama.rope.freq_base": 500000.0, "llama.rope.dimension_count": HEAD_DIM,
            "llama.context_length": 8 * ORIGINAL}
    gg = rope_from_gguf(meta, "llama", HEAD_DIM, factors, "t.gguf")
    assert gg.scaling.kind == "factors" and len(gg.scaling.freq_factors) == HEAD_DIM // 2
    # float32 factors (as the file stores them) and float32 frequencies in the converter's smooth
    # step: frequencies agree to ~1e-7 relative, angles at position 4095 to ~2e-6 (measured)
    inv_gg, inv_hf = inverse_frequencies(gg, HEAD_DIM, 1)[0], inverse_frequencies(hf, HEAD_DIM, 1)[0]
    assert torch.allclose(inv_gg, inv_hf, rtol=1e-6, atol=0)
    for a, b in zip(rotary_tables(gg, HEAD_DIM, POSITIONS), rotary_tables(hf, HEAD_DIM, POSITIONS)):
        assert (a - b).abs().max() < 2e-5
    # through a real file: gguf-py writes the metadata as float32/uint32 and the tensor
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_tensor("rope_freqs.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    read = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    assert rope_from_gguf(read, "llama", HEAD_DIM, np.array(tensor.data), "m.gguf") == gg


def test_gguf_linear_and_yarn_match_hf() -> None:
    for params, meta in (
        (CASES["linear"], {"scaling.type": "linear", "scaling.factor": 4.0}),
        ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, {"scale_linear": 2.0}),  # older key, no type
        (YARN, {"scaling.type": "yarn", "scaling.factor": 4.0, "scaling.original_context_length": ORIGINAL}),
        (YARN | {"beta_fast": 16.0, "beta_slow": 2.0}, {"scaling.type": "yarn", "scaling.factor": 4.0,
         "scaling.yarn_beta_fast": 16.0, "scaling.yarn_beta_slow": 2.0, "scaling.original_context_length": ORIGINAL}),
    ):
        hf = rope_from_hf(llama_config(params).to_dict(), HEAD_DIM, "t")
        meta = {f"qwen2.rope.{k}": v for k, v in meta.items()} | {"qwen2.rope.freq_base": 10000.0}
        gg = rope_from_gguf(meta, "qwen2", HEAD_DIM, None, "t.gguf")
        for a, b in zip(rotary_tables(gg, HEAD_DIM, POSITIONS), rotary_tables(hf, HEAD_DIM, POSITIONS)):
            assert (a - b).abs().max() < 1e-6
    # yarn's original length falls back to context_length, as in llama.cpp
    meta = {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0, "qwen2.context_length": 4096}
    assert rope_from_gguf(meta, "qwen2", HEAD_DIM, None, "t").scaling.original_max_position_embeddings == 4096


def test_gguf_plain_none_and_attn_factor() -> None:
    assert rope_from_gguf({}, "llama", HEAD_DIM, None, "t") == Rope(10000.0)  # llama.cpp's default base
    none = {"llama.rope.freq_base": 1e6, "llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 8.0}
    assert rope_from_gguf(none, "llama", HEAD_DIM, None, "t") == Rope(1e6)  # type none never scales
    yarn = {"q.rope.scaling.type": "yarn", "q.rope.scaling.factor": 4.0, "q.rope.scaling.original_context_length": 512}
    plain_yarn = rope_from_gguf(yarn, "q", HEAD_DIM, None, "t")
    # llama.cpp multiplies cos and sin by rope.scaling.attn_factor over YaRN's own factor
    scaled = rope_from_gguf(yarn | {"q.rope.scaling.attn_factor": 1.5}, "q", HEAD_DIM, None, "t")
    assert inverse_frequencies(scaled, HEAD_DIM, 8)[1] == pytest.approx(1.5 * (0.1 * math.log(4.0) + 1.0))
    assert torch.equal(inverse_frequencies(scaled, HEAD_DIM, 8)[0], inverse_frequencies(plain_yarn, HEAD_DIM, 8)[0])
    phi = rope_from_gguf({"p.rope.scaling.attn_factor": 1.19}, "p", HEAD_DIM, None, "t")
    assert phi.scaling == RopeScaling("linear", 1.0, attention_factor=1.19)


def test_gguf_sliding_layers() -> None:
    meta = {"gemma3.rope.freq_base": 1e6, "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    assert rope_from_gguf(meta, "gemma3", HEAD_DIM, None, "t") == Rope(1e6, RopeScaling("linear", 8.0))
    # llama.cpp's Gemma 3: local layers at 10,000 without scaling, unless the file gives the base
    assert rope_from_gguf(meta, "gemma3", HEAD_DIM, None, "t", "sliding_attention") == Rope(10000.0)
    meta["gemma3.rope.freq_base_swa"] = 20000.0
    assert rope_from_gguf(meta, "gemma3", HEAD_DIM, None, "t", "sliding_attention") == Rope(20000.0)
    other = {"x.rope.freq_base": 1e6, "x.rope.freq_base_swa": 1e4, "x.rope.dimension_count_swa": HEAD_DIM // 2}
    assert rope_from_gguf(other, "x", HEAD_DIM, None, "t", "sliding_attention") == Rope(1e4, None, HEAD_DIM // 2)


def test_gguf_keys_are_gguf_pys() -> None:
    """Every {arch}.rope.* key gguf-py 0.19 defines is either read or refused by name."""
    theirs = {v.format(arch="a")[len("a.rope."):] for k, v in vars(gguf.Keys.Rope).items() if k.isupper()}
    assert theirs == (set(qrope._GGUF_KEYS) - {"scale_linear"}) | set(qrope._GGUF_REFUSED)


# --- refusals ----------------------------------------------------------------------------------

HF_BAD = [  # (config, what the message must name)
    ({"rope_scaling": {"rope_type": "fancy", "factor": 2.0}}, "'fancy'"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "'longrope'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0, "extrapolation": 1.0}}, "extrapolation"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}, "high_freq_factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2x"}}, "factor"),
    ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": True}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}}, "factor"),
    ({"partial_rotary_factor": 0.3}, "partial_rotary_factor"),
    ({"no_rope_layers": [1, 0]}, "no_rope_layers"),
    ({"rope_interleave": True}, "rope_interleave"),
    ({"rope_local_base_freq": 1e4}, "rope_local_base_freq"),  # Gemma 3's key, on a Llama
    ({"rope_scaling": {"type": "linear", "rope_type": "yarn", "factor": 2.0}}, "rope_type"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": {"rope_theta": 1e6}}, "rope_parameters"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024.5}},
     "original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": "no"}}, "truncate"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192}}, "high_freq_factor"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": None},
     "max_position_embeddings"),
    ({"rope_scaling": [1, 2]}, "rope_scaling"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e6}, "rope_type": "default"}}, "rope_type"),
    ({"rope_parameters": {"full_attention": None}}, "full_attention"),
]


@pytest.mark.parametrize("bad, key", HF_BAD, ids=[k for _, k in HF_BAD])
def test_bad_hf_config_is_refused_by_name(bad: dict, key: str) -> None:
    cfg = {"model_type": "llama", "max_position_embeddings": 4096} | bad
    with pytest.raises(ModelFormatError) as e:
        rope_from_hf(cfg, HEAD_DIM, "bad/config.json")
    assert "bad/config.json" in str(e.value) and key in str(e.value)


def test_model_specific_refusals() -> None:
    # Phi-3's config class turns "yarn" into LongRoPE
    phi3 = {"model_type": "phi3",
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}}
    with pytest.raises(ModelFormatError, match="p.json.*'longrope'.*'yarn'"):
        rope_from_hf(phi3, HEAD_DIM, "p.json")

    flat = {"model_type": "gemma3_text", "rope_parameters": {"rope_type": "linear", "factor": 8.0}}
    with pytest.raises(ModelFormatError, match="g.json.*keyed by layer type"):
        rope_from_hf(flat, HEAD_DIM, "g.json")
    with pytest.raises(ModelFormatError, match="g.json.*'chunked'"):
        rope_from_hf({"model_type": "gemma3_text"}, HEAD_DIM, "g.json", "chunked")
    with pytest.raises(ModelFormatError, match="g.json.*text_config"):
        rope_from_hf({"model_type": "gemma3", "text_config": {}}, HEAD_DIM, "g.json")


GGUF_BAD = [  # (metadata, rope_freqs, what the message must name)
    ({"llama.rope.scaling.wild": 1.0}, None, "llama.rope.scaling.wild"),
    ({"llama.rope.scaling.type": "longrope"}, None, "llama.rope.scaling.type"),
    ({"llama.rope.scaling.yarn_attn_factor": 0.9}, None, "llama.rope.scaling.yarn_attn_factor"),
    ({"llama.rope.scaling.yarn_log_multiplier": 0.1}, None, "llama.rope.scaling.yarn_log_multiplier"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.yarn_ext_factor": 0.5,
      "llama.context_length": 4096}, None, "llama.rope.scaling.yarn_ext_factor"),
    ({"llama.rope.dimension_sections": [16, 24, 24, 0]}, None, "llama.rope.dimension_sections"),
    ({"llama.rope.freq_base": "abc"}, None, "llama.rope.freq_base"),
    ({"llama.rope.dimension_count": 63}, None, "llama.rope.dimension_count"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, None, "original_context_length"),
    ({}, np.ones(HEAD_DIM // 2 - 1, np.float32), "rope_freqs.weight"),
    ({}, np.zeros(HEAD_DIM // 2, np.float32), "rope_freqs.weight"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0, "llama.context_length": 4096},
     np.ones(HEAD_DIM // 2, np.float32), "rope_freqs.weight"),
]


@pytest.mark.parametrize("meta, freqs, key", GGUF_BAD, ids=[k for *_, k in GGUF_BAD])
def test_bad_gguf_metadata_is_refused_by_name(meta: dict, freqs, key: str) -> None:
    with pytest.raises(ModelFormatError) as e:
        rope_from_gguf(meta, "llama", HEAD_DIM, freqs, "bad.gguf")
    assert "bad.gguf" in str(e.value) and key in str(e.value)


# --- partial rotary ----------------------------------------------------------------------------


def test_partial_rotary_order_is_a_permutation() -> None:
    assert torch.equal(partial_rotary_order(HEAD_DIM, HEAD_DIM), torch.arange(HEAD_DIM))
    order = partial_rotary_order(8, 4)
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    for rd in (2, 16, 32, 48):
        assert sorted(partial_rotary_order(HEAD_DIM, rd).tolist()) == list(range(HEAD_DIM))


@pytest.mark.parametrize("params", [CASES["default"], YARN], ids=["default", "yarn"])
def test_partial_rotary_matches_transformers(params: dict, float64_transformers) -> None:
    """transformers' partial rotate-half (Phi-3's apply_rotary_pos_emb) then q.k equals ours:
    the head's dims permuted, then the full-head table. Also the rotated vectors themselves."""
    rd = HEAD_DIM // 4
    # Phi-3 rotates part of its heads; its config turns yarn into longrope, so yarn goes on a Llama
    # config, whose yarn function reads partial_rotary_factor too
    cls = transformers.Phi3Config if params["rope_type"] == "default" else transformers.LlamaConfig
    config = cls(hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_hidden_layers=1, max_position_embeddings=POSITIONS,
                 rope_parameters=dict(params) | {"partial_rotary_factor": rd / HEAD_DIM})
    rope = rope_from_hf(config.to_dict(), HEAD_DIM, "t")
    assert rope.rotary_dim == rd
    inv, scale = transformers_frequencies(config, params["rope_type"], POSITIONS)
    assert inv.shape == (rd // 2,)
    cos_hf, sin_hf = reference_tables(inv, scale, POSITIONS)  # [positions, rd]
    cos, sin = rotary_tables(rope, HEAD_DIM, POSITIONS)
    order = partial_rotary_order(HEAD_DIM, rd)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 1, HEAD_DIM, generator=gen, dtype=torch.float64)  # [heads, 1, head_dim]
    for pq, pk in ((3000, 17), (ORIGINAL + 5, ORIGINAL - 5), (POSITIONS - 1, 0)):
        q_hf, _ = apply_rotary_pos_emb(q, q, cos_hf[pq][None], sin_hf[pq][None], unsqueeze_dim=0)
        k_hf, _ = apply_rotary_pos_emb(k, k, cos_hf[pk][None], sin_hf[pk][None], unsqueeze_dim=0)
        q_ours = full_rotate(q[..., order], cos[pq].double(), sin[pq].double())
        k_ours = full_rotate(k[..., order], cos[pk].double(), sin[pk].double())
        assert torch.allclose(q_ours, q_hf[..., order], atol=1e-6)
        dots_hf, dots = (q_hf * k_hf).sum(-1), (q_ours * k_ours).sum(-1)
        assert torch.allclose(dots, dots_hf, atol=1e-5), (dots - dots_hf).abs().max()
    # the pass-through frequencies: cos 1 and sin 0, the attention factor not applied to them
    extra = (torch.arange(HEAD_DIM) % (HEAD_DIM // 2)) >= rd // 2
    assert torch.equal(cos[:, extra], torch.ones_like(cos[:, extra])) and not sin[:, extra].any()


def full_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate-half over the whole head (the decoder's Rotary.apply)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
