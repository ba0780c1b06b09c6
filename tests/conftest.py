"""Shared fixtures: the built-in models' files (skipped with the pip line when not installed), their
tokenizers, and a private conversion cache per test.

Real-weight fixtures are session-scoped and resolve through the registry before any test swaps
``$QUICKDRAFT_CACHE`` (pytest sets up session fixtures first), so a split model is reassembled
once into the user's cache and reused across runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

# The suite keeps many engines alive in one process (module fixtures), each with a KV cache
# allocated whole and zeroed: with the default CPU KV space (4 GiB an engine) it outgrew this
# machine's 24 GiB. Its prompts are short: 0.75 GiB an engine is about the 4096 tokens SmolLM2's
# 8 sequences had before the default became the model's context. Tests of the default unset it.
os.environ.setdefault("QUICKDRAFT_CPU_KV_SPACE", "0.75")

from quickdraft.errors import ModelNotInstalledError  # noqa: E402
from quickdraft.models import registry
from quickdraft.models.gguf import _torch_shape, open_gguf, read_metadata
from quickdraft.models.tokenizer import Tokenizer, _byte_alphabet


def _builtin_path(name: str) -> Path:
    try:
        return registry.model_path(name)
    except ModelNotInstalledError as e:
        if os.environ.get("CI"):  # `make test` installs them: in CI a missing model is a failure
            pytest.fail(str(e))
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB, llama arch)."""
    return _builtin_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct GGUF (491 MB, qwen2 arch)."""
    return _builtin_path("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M (base), Q4_K_M GGUF (253 MB, gemma3 arch)."""
    return _builtin_path("gemma3-270m")


def _gguf_header(path: Path) -> tuple[dict, dict]:
    reader = open_gguf(path)
    return read_metadata(reader), {t.name: _torch_shape(t) for t in reader.tensors}


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_path: Path) -> tuple[dict, dict]:
    """(metadata, {GGUF tensor name: torch shape}) of SmolLM2's file; no tensor is read."""
    return _gguf_header(smollm2_path)


@pytest.fixture(scope="session")
def qwen05_gguf(qwen05_path: Path) -> tuple[dict, dict]:
    # Parsing the metadata of a 150k-token vocabulary takes the gguf package about 8 s: once.
    return _gguf_header(qwen05_path)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf, smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm2_gguf[0], str(smollm2_path))


@pytest.fixture(scope="session")
def qwen05_tokenizer(qwen05_gguf, qwen05_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(qwen05_gguf[0], str(qwen05_path))


@pytest.fixture(autouse=True)
def _no_acceptance_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines neither read nor write their drafter's acceptance history (engine.HISTORY_STEPS): a
    test's plan must not depend on the tests, or the runs, before it. Its own test turns it on."""
    from quickdraft.engine import engine

    monkeypatch.setattr(engine, "HISTORY_STEPS", 0)


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh ``$QUICKDRAFT_CACHE`` for this test only."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(cache))
    return cache


TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_HF_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 260, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 128,
    "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": 259, "rope_scaling": None,
}


def _tiny_rust_tokenizer() -> RustTokenizer:
    """Byte-level BPE over the 256 byte symbols plus one merge ("Ġt") and three special tokens."""
    vocab = {c: i for i, c in enumerate(_byte_alphabet().values())} | {"Ġt": 256}
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "t")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    return tok


def write_tiny_hf_dir(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A two-layer Qwen2 directory, weights split over two shards; returns the weights the
    decoder needs (a tied lm_head.weight and a rotary buffer are in the files but not returned)."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    c = TINY_HF_CONFIG
    kv = c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    weights = {"model.embed_tokens.weight": (c["vocab_size"], 32), "model.norm.weight": (32,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": (32,), p + "post_attention_layernorm.weight": (32,),
                    p + "self_attn.q_proj.weight": (32, 32), p + "self_attn.q_proj.bias": (32,),
                    p + "self_attn.k_proj.weight": (kv, 32), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.weight": (kv, 32), p + "self_attn.v_proj.bias": (kv,),
                    p + "self_attn.o_proj.weight": (32, 32), p + "mlp.gate_proj.weight": (48, 32),
                    p + "mlp.up_proj.weight": (48, 32), p + "mlp.down_proj.weight": (32, 48)}
    tensors = {k: torch.randn(s, generator=g) for k, s in weights.items()}
    extras = {"lm_head.weight": tensors["model.embed_tokens.weight"].clone(), "model.rotary_emb.inv_freq": torch.ones(4)}
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[: len(names) // 2]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[len(names) // 2 :]} | extras, str(path / "model-00002-of-00002.safetensors"))
    (path / "config.json").write_text(json.dumps(c))
    _tiny_rust_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": TINY_TEMPLATE}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [259, 257]}))
    return tensors


@pytest.fixture
def tiny_hf_dir(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """(directory, weights) of a random two-layer Qwen2 model in Hugging Face's format."""
    path = tmp_path / "tiny-qwen2"
    return path, write_tiny_hf_dir(path)


@pytest.fixture
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch fallback, as where the CPU kernels do not build or with ``QUICKDRAFT_KERNELS=0``."""
    from quickdraft import kernels

    monkeypatch.setenv("QUICKDRAFT_KERNELS", "0")
    monkeypatch.setattr(kernels, "_module", lambda: None)


@pytest.fixture
def trace_draft_passes(monkeypatch: pytest.MonkeyPatch):
    """trace(module) -> a list that gets, for every later ``draft_pass`` of ``module`` (a proposer's,
    proposers/draft/load.py), the number of tokens each sequence fed it; a greedy chain run in one
    native call (models/decoder/native.py's ``chains``) adds its first pass's (its later passes
    read one token each)."""
    from quickdraft.models.decoder import NativeLayers

    def trace(module) -> list[list[int]]:
        fed: list[list[int]] = []
        traced, chains = module.draft_pass, NativeLayers.chains

        def draft_pass(model, kv, slots, cached, feeds):
            fed.append([len(f) for f in feeds])
            return traced(model, kv, slots, cached, feeds)

        def native_chains(self, kv, slots, cached, feeds, *rest):
            fed.append([len(f) for f in feeds])
            return chains(self, kv, slots, cached, feeds, *rest)

        monkeypatch.setattr(module, "draft_pass", draft_pass)
        monkeypatch.setattr(NativeLayers, "chains", native_chains)
        return fed

    return trace
