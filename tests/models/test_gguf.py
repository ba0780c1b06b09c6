"""GGUF reading: every quant type round-trips, llama q/k rows come back in HF order, metadata
becomes the right ModelConfig, bad files fail with ModelFormatError, and the conversion cache is
reused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from quickdraft.errors import ModelFormatError
from quickdraft.models import gguf as qgguf
from quickdraft.models.families import FAMILIES
from quickdraft.models import loader
from quickdraft.models.ggml import BlockWeight
from quickdraft.models.tokenizer import Tokenizer, _byte_alphabet
from tests.conftest import _tiny_rust_tokenizer

Q = gguf.GGMLQuantizationType
QK_K = 256

# --- K-quant encoders -------------------------------------------------------------------------
# gguf-py can dequantize Q4_K / Q5_K / Q6_K but not quantize them, so the tests carry simple
# encoders (one scale per sub-block from its range, not llama.cpp's search for the best scale),
# written from the block layouts in ggml-common.h.


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and 8 six-bit mins ([n, 8] each) into Q4_K/Q5_K's 12 bytes."""
    lo = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    mid = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([lo, mid, hi], axis=1).astype(np.uint8)


def _affine_k(x: np.ndarray, qmax: int) -> tuple[np.ndarray, ...]:
    """x [n, 256] -> (d, dmin [n] f16, sc, m [n, 8] in 0..63, q [n, 8, 32] in 0..qmax)
    with x ~= d * sc * q - dmin * m per 32-value sub-block."""
    sub = x.reshape(len(x), 8, 32)
    mn = np.maximum(0.0, -sub.min(-1))
    scale = (sub.max(-1) + mn) / qmax
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mn.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(mn, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None, None] * sc[..., None]
    q = np.clip(np.rint(_safe_div(sub + (dmin[:, None] * m)[..., None], step)), 0, qmax).astype(np.uint8)
    return d, dmin, sc, m, q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q [n, 8, 32] low nibbles -> 128 bytes: sub-blocks 2p and 2p+1 share bytes 32p..32p+31."""
    q = (q & 0x0F).reshape(len(q), 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(q), 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(x, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _scales_k4(sc, m), _nibbles(q)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(x, 31)
    high = (q >> 4).astype(np.uint8)  # [n, 8, 32]: bit j of qh[b] is the fifth bit of sub-block j
    qh = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _scales_k4(sc, m), qh, _nibbles(q)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """x ~= d * sc * (q - 32), 16 sub-blocks of 16 values, int8 sc, q in 0..63."""
    n = len(x)
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 127).astype(np.int8)
    step = d[:, None, None] * sc[..., None].astype(np.float32)
    q = (np.clip(np.rint(_safe_div(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    ql = ((q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)).reshape(n, 128)
    hi = (q >> 4).reshape(n, 2, 4, 32)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)


def quantize(x: np.ndarray, qtype: Q) -> np.ndarray:
    """x [rows, cols] -> what a GGUF stores for it: float arrays, or uint8 [rows, bytes per row]."""
    encoders = {Q.Q4_K: quantize_q4_k, Q.Q5_K: quantize_q5_k, Q.Q6_K: quantize_q6_k}
    if qtype not in encoders:
        return gguf.quants.quantize(x, qtype)
    rows = x.shape[0]
    return encoders[qtype](x.reshape(-1, QK_K)).reshape(rows, -1)


# Relative RMS error of the quantized values against N(0, 1) data, with about 2x headroom.
TOLERANCE = {
    Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2,
    Q.Q6_K: 4e-2, Q.Q5_0: 8e-2, Q.Q5_K: 8e-2,
    Q.Q4_0: 0.16, Q.Q4_1: 0.16, Q.Q4_K: 0.16,
}


def _write(path: Path, arch: str, tensors: dict[str, np.ndarray | tuple[np.ndarray, Q]], meta=None) -> Path:
    """A GGUF with ``tensors`` (float arrays, or (bytes, qtype) for quantized ones) and metadata."""
    w = gguf.GGUFWriter(path, arch)
    for key, value in (meta or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
def test_every_quant_type_round_trips(tmp_path: Path, qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    data = rng.standard_normal((6, 512)).astype(np.float32)  # [out, in]; K-quants need in % 256 == 0
    raw = quantize(data, qtype)
    stored = (raw, qtype) if raw.dtype == np.uint8 else raw
    reader = qgguf.open_gguf(_write(tmp_path / "t.gguf", "llama", {"w": stored}))
    got = qgguf.dequantize_tensor(reader.tensors[0], "t.gguf")

    assert got.shape == (6, 512) and got.dtype == torch.float32
    expected = gguf.quants.dequantize(raw, qtype).reshape(6, 512)
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32)))
    rel_rms = float(np.sqrt(np.mean((got.numpy() - data) ** 2) / np.mean(data**2)))
    assert rel_rms <= TOLERANCE[qtype], rel_rms
    if qtype != Q.F32:
        assert rel_rms > 0  # the tolerance is not vacuous: the data did go through quantization


# --- a tiny model file --------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 32, 4, 2, 8, 48


def _tokenizer_meta() -> dict:
    tokens = [*_byte_alphabet().values(), "Ġt", "<|im_start|>", "<|im_end|>"]
    types = [1] * 257 + [3, 3]
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["Ġ t"], "tokenizer.ggml.bos_token_id": 257,
        "tokenizer.ggml.eos_token_id": 258,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
    }


def _hf_weights(arch: str, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights of a one-layer model, by Hugging Face name, [out, in]."""
    shapes = {
        "model.embed_tokens.weight": (vocab, HIDDEN), "model.norm.weight": (HIDDEN,), "lm_head.weight": (vocab, HIDDEN),
        "model.layers.0.input_layernorm.weight": (HIDDEN,), "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
        "model.layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        "model.layers.0.mlp.gate_proj.weight": (FFN, HIDDEN), "model.layers.0.mlp.up_proj.weight": (FFN, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, FFN),
    }
    if arch == "qwen2":
        shapes |= {f"model.layers.0.self_attn.{p}_proj.bias": (n * HEAD_DIM,) for p, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows (written out independently
    of quickdraft's permute_rows)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_model(
    path: Path, arch: str = "llama", seed: int = 0, tied: bool = False, extra: dict | None = None
) -> tuple[Path, dict[str, np.ndarray]]:
    """A one-layer ``arch`` GGUF in float32 (plus ``extra`` GGUF tensors); returns (path, the
    HF-layout weights it holds)."""
    meta = _tokenizer_meta()
    hf = _hf_weights(arch, len(meta["tokenizer.ggml.tokens"]), np.random.default_rng(seed))
    if tied:
        del hf["lm_head.weight"]
    to_gguf = {v: k for k, v in {**qgguf._GLOBAL_NAMES}.items()}
    to_gguf |= {f"model.layers.0.{v}.{s}": f"blk.0.{k}.{s}" for k, v in FAMILIES[arch].gguf_block_names().items()
              for s in ("weight", "bias")}
    tensors = {}
    for name, w in hf.items():
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, KV_HEADS)
        tensors[to_gguf[name]] = w
    tensors |= extra or {}
    meta |= {
        f"{arch}.block_count": 1, f"{arch}.embedding_length": HIDDEN, f"{arch}.feed_forward_length": FFN,
        f"{arch}.attention.head_count": HEADS, f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.context_length": 256,
        "general.name": f"tiny-{arch}",
    }
    return _write(path, arch, tensors, meta), hf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_reads_back_in_hf_layout(tmp_path: Path, arch: str) -> None:
    path, hf = write_tiny_model(tmp_path / f"{arch}.gguf", arch)
    config, weights, tok = qgguf.load_gguf(path, progress=False)

    assert set(weights) == set(hf) == set(config.weight_names())
    for name, w in hf.items():  # llama q/k were written permuted: reading must undo it exactly
        assert torch.equal(weights[name], torch.from_numpy(w)), name
    assert (config.arch, config.num_heads, config.num_kv_heads, config.head_dim) == (arch, HEADS, KV_HEADS, HEAD_DIM)
    assert config.vocab_size == 259 and config.rope_theta == 10000.0 and not config.tie_word_embeddings
    assert config.attention_bias == (arch == "qwen2")
    assert config.bos_token_id == 257 and config.eos_token_ids == (258,)
    assert tok.encode("<|im_start|> t") == [257, 256]


def test_permute_and_unpermute_are_inverse() -> None:
    w = torch.randn(4 * 8, 5)
    assert torch.equal(qgguf.permute_rows(w, 4), torch.from_numpy(llama_cpp_permute(w.numpy(), 4)))
    assert torch.equal(qgguf.unpermute_rows(qgguf.permute_rows(w, 4), 4), w)
    b = torch.randn(2 * 8)  # biases are permuted like rows of one column
    assert torch.equal(qgguf.unpermute_rows(qgguf.permute_rows(b, 2), 2), b)


def test_tied_embeddings_and_dtype(tmp_path: Path) -> None:
    path, _ = write_tiny_model(tmp_path / "tied.gguf", tied=True)
    config, weights, _ = qgguf.load_gguf(path, torch.bfloat16, progress=False)
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}  # norms too: the decoder upcasts


def test_unknown_arch_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", "mamba", {"token_embd.weight": np.zeros((4, 4), np.float32)}, _tokenizer_meta())
    with pytest.raises(ModelFormatError, match=r"m\.gguf.*'mamba'"):
        qgguf.load_gguf(path, progress=False)


def test_unknown_tensor_and_unsupported_type(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = write_tiny_model(tmp_path / "a.gguf")
    reader = qgguf.open_gguf(path)

    def refuse(data, qtype):
        raise NotImplementedError(qtype.name)

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    with pytest.raises(ModelFormatError, match=r"a\.gguf: tensor .* has type F32"):
        qgguf.dequantize_tensor(reader.tensors[0], str(path))
    monkeypatch.undo()

    # a tensor the family does not use (a mixture of experts' router, a q norm Llama has not): refused, not ignored
    for name in ("blk.0.ffn_gate_inp.weight", "blk.0.attn_q_norm.weight"):
        extra, _ = write_tiny_model(tmp_path / "b.gguf", extra={name: np.ones(4, np.float32)})
        with pytest.raises(ModelFormatError, match=rf"b\.gguf: tensor {re.escape(name)}"):
            qgguf.load_gguf(extra, progress=False)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelFormatError, match="bad.gguf"):
        qgguf.open_gguf(bad)


def test_conversion_cache_is_reused(tmp_path: Path, tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, hf = write_tiny_model(tmp_path / "tiny.gguf")
    first = loader.load_model(str(path), torch.bfloat16, quantization="none")
    out = loader.conversion_dir(path)
    cached = out / "weights-bfloat16.safetensors"
    mtime = cached.stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(qgguf, "load_gguf", no_conversion)
    monkeypatch.setattr(gguf.quants, "dequantize", no_conversion)
    second = loader.load_model(str(path), torch.bfloat16, quantization="none")

    assert cached.stat().st_mtime_ns == mtime
    assert second.config == first.config and second.source == str(path)
    assert second.weights.keys() == first.weights.keys()
    assert all(torch.equal(second.weights[k], first.weights[k]) for k in first.weights)
    assert second.weights["model.norm.weight"].dtype == torch.bfloat16
    assert second.tokenizer.encode("<|im_start|> t") == first.tokenizer.encode("<|im_start|> t")
    assert not list(out.glob(".*.tmp"))  # atomic writes left no temporaries

    with pytest.raises(AssertionError, match="converted again"):
        loader.load_model(str(path), torch.float32, quantization="none")  # another dtype is another cache entry


def test_changed_file_is_reconverted(tmp_path: Path, tmp_cache: Path) -> None:
    path, _ = write_tiny_model(tmp_path / "m.gguf", seed=1)
    before = loader.conversion_dir(path)
    loader.load_model(str(path))
    path, hf = write_tiny_model(tmp_path / "m.gguf", seed=2)  # same name and size, new weights
    assert loader.conversion_dir(path) != before
    again = loader.load_model(str(path))
    assert torch.equal(again.weights["model.norm.weight"], torch.from_numpy(hf["model.norm.weight"]))


@pytest.mark.slow
def test_smollm2_config(smollm2_gguf, smollm2_tokenizer, smollm2_path: Path) -> None:
    """The real file's metadata (no tensors are dequantized)."""
    meta, shapes = smollm2_gguf
    config = qgguf.config_from_metadata(meta, shapes, smollm2_tokenizer, str(smollm2_path))
    assert (config.arch, config.num_layers, config.hidden_size, config.intermediate_size) == ("llama", 30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (9, 3, 64, 49152)
    assert config.rope_theta == 100000.0 and config.tie_word_embeddings and not config.attention_bias
    assert config.bos_token_id == 1 and config.eos_token_ids == (2, 0)  # <|im_end|>, then <|endoftext|>
    assert config.max_position_embeddings == 8192 and abs(config.rms_norm_eps - 1e-5) < 1e-9


@pytest.mark.slow
def test_qwen05_config(qwen05_gguf, qwen05_tokenizer, qwen05_path: Path) -> None:
    meta, shapes = qwen05_gguf
    config = qgguf.config_from_metadata(meta, shapes, qwen05_tokenizer, str(qwen05_path))
    assert (config.arch, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == ("qwen2", 24, 896, 14, 2)
    assert (config.head_dim, config.vocab_size, config.rope_theta) == (64, 151936, 1e6)
    assert config.attention_bias and not config.tie_word_embeddings  # this file carries output.weight
    assert config.eos_token_ids == (151645, 151643)


def test_damaged_cache_entry_is_reconverted(tmp_path: Path, tmp_cache: Path) -> None:
    path, hf = write_tiny_model(tmp_path / "d.gguf")
    loader.load_model(str(path), quantization="none")
    cached = loader.conversion_dir(path) / "weights-float32.safetensors"
    cached.write_bytes(cached.read_bytes()[:100])  # e.g. a disk that filled up under another tool
    again = loader.load_model(str(path), quantization="none")
    assert torch.equal(again.weights["model.norm.weight"], torch.from_numpy(hf["model.norm.weight"]))
    assert cached.stat().st_size > 100


def test_a_damaged_tokenizer_entry_is_reconverted(tmp_path: Path, tmp_cache: Path) -> None:
    """A tokenizer.json in the cache that the tokenizers library cannot read (another version's,
    or a cut file) makes the loader convert again, not crash."""
    path, _ = write_tiny_model(tmp_path / "t.gguf")
    first = loader.load_model(str(path), quantization="none")
    entry = loader.conversion_dir(path) / "tokenizer.json"
    doc = json.loads(entry.read_text())
    entry.write_text(json.dumps(doc | {"tokenizer": doc["tokenizer"][:100]}))
    again = loader.load_model(str(path), quantization="none")
    assert again.tokenizer.encode("<|im_start|> tt") == first.tokenizer.encode("<|im_start|> tt")
    assert json.loads(entry.read_text())["tokenizer"] == doc["tokenizer"]  # written again whole


def test_same_vocabularies_share_one_parse() -> None:
    """A target and its draft whose chat templates differ share the parsed vocabulary; a draft
    with one token changed does not, and is told apart."""
    tok = Tokenizer(_tiny_rust_tokenizer(), chat_template="a")
    twin = json.loads(tok.to_json()) | {"chat_template": "b"}
    a, b = Tokenizer.from_json(tok.to_json()), Tokenizer.from_json(json.dumps(twin))
    assert a._tok is b._tok and a.chat_template != b.chat_template and a.same_vocabulary(b)
    other = json.loads(a._tok.to_str())
    vocab = other["model"]["vocab"]
    swapped = {k: v for k, v in vocab.items()}
    first, second = sorted(vocab, key=vocab.get)[-2:]
    swapped[first], swapped[second] = vocab[second], vocab[first]
    other["model"]["vocab"] = swapped
    c = Tokenizer.from_json(json.dumps(json.loads(tok.to_json()) | {"tokenizer": json.dumps(other)}))
    assert c._tok is not a._tok and not a.same_vocabulary(c) and a.same_vocabulary(Tokenizer(_tiny_rust_tokenizer()))


def test_selected_rows_are_kept_beside_the_conversion(tmp_path: Path, tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``select_rows`` (a truncated draft head) repacks once; later loads read the file, and a
    damaged file is rebuilt."""
    source = tmp_path / "m.gguf"
    source.write_bytes(np.random.default_rng(0).bytes(4096))
    raw = gguf.quants.quantize(np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32), Q.Q8_0)
    head = BlockWeight.from_gguf("Q8_0", raw, (40, 64))
    model = loader.LoadedModel(None, {"lm_head.weight": head}, None, str(source))
    rows = torch.tensor([39, 3, 17, 0, 21])
    first = loader.select_rows(model, "lm_head.weight", rows)
    assert torch.equal(first.dequantize(), head.dequantize(rows=rows))

    def no_repack(self, rows):
        raise AssertionError("repacked again")

    with monkeypatch.context() as patched:
        patched.setattr(BlockWeight, "select", no_repack)
        second = loader.select_rows(model, "lm_head.weight", rows)
        assert torch.equal(second.data, first.data) and second.shape == first.shape
        with pytest.raises(AssertionError, match="repacked again"):
            loader.select_rows(model, "lm_head.weight", rows[:3])  # other rows: another file
    (file,) = loader.conversion_dir(source).glob("rows-lm_head.weight-*.safetensors")
    file.write_bytes(file.read_bytes()[:50])
    assert torch.equal(loader.select_rows(model, "lm_head.weight", rows).data, first.data)
    assert file.stat().st_size > 50
