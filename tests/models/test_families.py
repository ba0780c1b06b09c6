"""Every family against transformers: a tiny random model of each (Llama 3 with llama3 rope scaling
and tied embeddings, Mistral with a sliding window, Qwen2 saved by transformers 5, Qwen3 with q/k
norms and YaRN, Gemma 3 with its sandwich norms, GELU, scaled embeddings, query scalar and local
and global layers at two rope bases), loaded from its Hugging Face directory and from a GGUF in
llama.cpp's layout, gives transformers' float32 logits on a prompt past the sliding window and past
the original context of the rope scaling.

Tolerance: 1e-4 absolute on logits of magnitude ~1-10 (different kernels and summation orders in
float32: measured here at most a few 1e-6), and the same argmax at every position. Each path runs:
the native pass (one call), the Python layers with the kernels, and torch alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quickdraft.errors import ModelFormatError
from quickdraft.models.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder
from quickdraft.kernels import isa
from quickdraft.models.loader import load_model
from tests.models.families import random_model, save_hf_dir, transformers_logits, write_gguf

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
PROMPT = [(7 * i + 3) % 250 for i in range(40)]  # 40 tokens: past the window (8) and the original context (16)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """family -> (transformers model, its HF directory, its GGUF file, transformers' logits)."""
    out = {}
    for family in FAMILIES:
        model = random_model(family)
        root = tmp_path_factory.mktemp(family)
        out[family] = (model, save_hf_dir(model, root / "hf"), write_gguf(model, family, root / f"{family}.gguf"),
                       transformers_logits(model, PROMPT))
    return out


def our_logits(decoder: Decoder, ids: list[int], chunks: tuple[int, ...] = ()) -> torch.Tensor:
    """Logits of ``ids`` through our decoder: one pass, or passes of the given lengths (a prompt
    then decoding steps: the cache's keys from earlier passes)."""
    c = decoder.config
    kv = KVCache(c, 1, 64, decoder.dtype)
    sizes = list(chunks) or [len(ids)]
    sizes.append(len(ids) - sum(sizes)) if sum(sizes) < len(ids) else None
    rows, at = [], 0
    with torch.inference_mode():
        for n in sizes:
            meta = AttentionMetadata.chain([0], [at], [n])
            rows.append(decoder.logits(decoder.forward(torch.tensor(ids[at : at + n]), meta.positions("cpu"), kv, meta)))
            at += n
    return torch.cat(rows)


def assert_close(mine: torch.Tensor, theirs: torch.Tensor) -> None:
    assert mine.shape == theirs.shape
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
    err = (mine - theirs).abs().max().item()
    assert err < TOLERANCE, err


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(models, family: str, source: str) -> None:
    _, hf_dir, gguf_file, theirs = models[family]
    loaded = load_model(str(hf_dir if source == "hf" else gguf_file), torch.float32, quantization="none")
    assert loaded.config.arch == family
    decoder = Decoder(loaded.config, loaded.weights)
    assert_close(our_logits(decoder, PROMPT), theirs)
    # a prompt, then one token a pass: each decoding row over the cached keys of earlier passes
    assert_close(our_logits(decoder, PROMPT, (20,) + (1,) * 20), theirs)


@pytest.mark.parametrize("name", [i.name for i in isa.ISAS if isa.runs_here(i)])
@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_instruction_set_here_matches_transformers(models, family: str, source: str, name: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Each instruction set this CPU runs, forced as QUICKDRAFT_ISA forces it (on an AVX-512 CPU:
    avx512, avx2 and portable): transformers' logits, and in float32 the very bits of the default
    path (the kernels promise float32 the same bits on every path)."""
    from quickdraft import kernels

    _, hf_dir, gguf_file, theirs = models[family]
    loaded = load_model(str(hf_dir if source == "hf" else gguf_file), torch.float32, quantization="none")
    default = our_logits(Decoder(loaded.config, loaded.weights), PROMPT)
    module = kernels.build(isa.BY_NAME[name])
    if module is None:
        pytest.skip(f"the {name} kernels did not build")
    monkeypatch.setattr(kernels, "_module", lambda: module)
    forced = Decoder(loaded.config, loaded.weights)
    assert forced.native is not None
    mine = our_logits(forced, PROMPT)
    assert_close(mine, theirs)
    assert torch.equal(mine, default)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_path_gives_the_same_bits(models, family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native pass, the Python layers over the kernels: the same bits; torch alone: close."""
    _, hf_dir, _, theirs = models[family]
    loaded = load_model(str(hf_dir), torch.float32)
    decoder = Decoder(loaded.config, loaded.weights)
    native = our_logits(decoder, PROMPT)
    if decoder.native is not None:
        decoder.native.one_call = False  # a native call a layer
        assert torch.equal(our_logits(decoder, PROMPT), native)
        decoder.native = None  # the Python layers over the same kernels
        assert torch.equal(our_logits(decoder, PROMPT), native)
    monkeypatch.setenv("QUICKDRAFT_KERNELS", "0")
    from quickdraft import kernels

    monkeypatch.setattr(kernels, "_module", lambda: None)
    plain = Decoder(loaded.config, loaded.weights)
    assert plain.native is None
    assert_close(our_logits(plain, PROMPT), theirs)


def test_gemma_norms_are_float32_with_their_unit_offset(models) -> None:
    model, hf_dir, gguf_file, _ = models["gemma3"]
    hf = load_model(str(hf_dir), torch.bfloat16)
    gg = load_model(str(gguf_file), torch.bfloat16, quantization="none")
    w = model.state_dict()["model.layers.0.self_attn.q_norm.weight"]
    for loaded in (hf, gg):
        norm = loaded.weights["model.layers.0.self_attn.q_norm.weight"]
        assert norm.dtype == torch.float32 and torch.equal(norm, 1.0 + w)
        assert loaded.weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert Decoder(hf.config, hf.weights).dtype == torch.bfloat16


def test_configs_read_from_both_layouts(models) -> None:
    llama = load_model(str(models["llama"][1]), torch.float32).config
    assert llama.tie_word_embeddings and llama.rope_theta == 500000.0 and llama.rope_scaling.kind == "llama3"
    qwen2 = load_model(str(models["qwen2"][1]), torch.float32).config
    assert qwen2.rope_theta == 1e6  # transformers 5 writes it under rope_parameters only
    gemma = load_model(str(models["gemma3"][1]), torch.float32).config
    assert [gemma.window(i) for i in range(3)] == [8, 0, 8]
    assert gemma.rope(0).theta == 10000.0 and gemma.rope(1).theta == 1e6 and gemma.rope(1).scaling.factor == 2.0
    assert gemma.attention_scale == 32**-0.5  # a GGUF has no key for it: llama.cpp scales by the head size (but 27B)
    gg = load_model(str(models["gemma3"][2]), torch.float32, quantization="none").config
    assert [gg.window(i) for i in range(3)] == [8, 0, 8] and gg.rope(0).theta == 10000.0
    mistral = load_model(str(models["mistral"][1]), torch.float32).config
    assert all(mistral.window(i) == 8 for i in range(2))


@pytest.mark.parametrize("key, value, words", [
    ("some_new_knob", 3, "some_new_knob"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
    ("hidden_activation", "gelu", "activation"),
    ("partial_rotary_factor", 0.5, "partial rotary embeddings"),
])
def test_a_key_not_understood_is_an_error(models, tmp_path: Path, key: str, value, words: str) -> None:
    import json
    import shutil

    src = models["gemma3"][1]
    dst = tmp_path / "gemma"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match=words) as e:
        load_model(str(dst), torch.float32)
    assert str(dst) in str(e.value)


def test_qwens_sliding_window_is_refused(models, tmp_path: Path) -> None:
    """transformers slides Qwen's layers from max_window_layers on where use_sliding_window is true
    (llama.cpp never does): refused, not computed as full attention."""
    import json
    import shutil

    dst = tmp_path / "qwen"
    shutil.copytree(models["qwen2"][1], dst)
    cfg = json.loads((dst / "config.json").read_text()) | {"use_sliding_window": True, "sliding_window": 8,
                                                              "max_window_layers": 1}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="use_sliding_window"):
        load_model(str(dst), torch.float32)


def test_an_unknown_architecture_names_the_supported_ones(models, tmp_path: Path) -> None:
    import json
    import shutil

    dst = tmp_path / "phi"
    shutil.copytree(models["llama"][1], dst)
    cfg = json.loads((dst / "config.json").read_text()) | {"architectures": ["Phi3ForCausalLM"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="Phi3ForCausalLM.*Gemma3ForCausalLM"):
        load_model(str(dst), torch.float32)
