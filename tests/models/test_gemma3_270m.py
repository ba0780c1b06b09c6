"""Gemma 3 270M end to end on its real GGUF (Q4_K_M, the built-in ``gemma3-270m``): the file loads by
name, its SentencePiece tokenizer splits text as transformers' own GGUF tokenizer does, its logits
are transformers' (which reads the same file with ``gguf_file=``, dequantized to float32) on a
prompt longer than the 512-position sliding window, and greedy decoding on the file's blocks as
stored is the same under every proposer that needs no second model (n-gram, suffix, layer
skipping) as without speculation, with the prompt again past the window.

Tolerance against transformers: the same argmax at every position, 1e-4 in the norm of a row's
difference over the norm of transformers' row, and 3e-3 absolute on logits of magnitude ~30
(float32 on both sides, different kernels, summation orders and rotary angles: measured here
4e-5 relative; absolute, 4e-5 over the first 50 positions growing to 1e-3 near position 650).
The same pass without the sliding window is off by far more past position 512, so the window is
what is checked. Losslessness has no tolerance: the tokens are the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.models.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder
from quickdraft.models.loader import load_model

pytestmark = pytest.mark.slow

# ~700 tokens of ordinary prose (its sentences come back, so n-gram and suffix find drafts)
TEXT = " ".join(f"Line {i}: the river runs past the mill, and the miller counts {i * 7} sacks of flour before noon."
                for i in range(30))
RELATIVE, ABSOLUTE = 1e-4, 3e-3


@pytest.fixture(scope="module")
def path(gemma3_path):
    return gemma3_path


def test_loads_by_name_as_gemma3(path) -> None:
    model = load_model("gemma3-270m", torch.bfloat16)
    c = model.config
    assert (c.arch, c.num_layers, c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads) == ("gemma3", 18, 640, 256, 4, 1)
    assert c.sliding_window == 512 and [c.window(i) for i in range(6)] == [512] * 5 + [0]
    assert c.rope(0).theta == 10000.0 and c.rope(5).theta == 1e6
    assert c.tie_word_embeddings and c.vocab_size == 262144


@pytest.fixture(scope="module")
def reference(path):
    """transformers' Gemma3ForCausalLM and tokenizer, read from the same GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


def test_tokenizer_matches_transformers(path, reference) -> None:
    ours = load_model(str(path), torch.bfloat16).tokenizer
    theirs = reference[1]
    for text in (TEXT, "Hello, world!  Two  spaces,\ttabs\nand newlines.", "naïve café — 東京 🙂 <start_of_turn>user\nhi",
                 "def f(x):\n    return x ** 2  # squared", "1234567 + 89 = ?"):
        assert ours.encode(text) == theirs(text)["input_ids"], text


def test_logits_match_transformers_past_the_window(path, reference) -> None:
    loaded = load_model(str(path), torch.float32, quantization="none")
    ids = loaded.tokenizer.encode(TEXT)
    assert len(ids) > 600  # past the sliding window of 512
    with torch.inference_mode():
        theirs = reference[0](torch.tensor([ids])).logits[0].float()
    mine = _logits(loaded.config, loaded.weights, ids)
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
    relative = ((mine - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max().item()
    assert relative < RELATIVE and (mine - theirs).abs().max().item() < ABSOLUTE, relative

    # the local layers as they are (their rotary base included), with a window that never drops a key
    unwindowed = _logits(dataclasses.replace(loaded.config, sliding_window=1 << 20), loaded.weights, ids)
    assert torch.equal(unwindowed[:512], mine[:512])
    assert ((unwindowed - theirs).norm(dim=-1) / theirs.norm(dim=-1))[512:].max().item() > 100 * RELATIVE


def _logits(config, weights, ids: list[int]) -> torch.Tensor:
    """Our float32 logits of ``ids``: a prefill, then three decoding steps reading the cache."""
    decoder = Decoder(config, weights)
    kv = KVCache(config, 1, len(ids) + 8, decoder.dtype)
    rows, at = [], 0
    with torch.inference_mode():
        for n in (len(ids) - 3, 1, 1, 1):
            meta = AttentionMetadata.chain([0], [at], [n])
            rows.append(decoder.logits(decoder.forward(torch.tensor(ids[at:at + n]), meta.positions("cpu"), kv, meta)))
            at += n
    return torch.cat(rows)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "adaptive": False},
    {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False},
    {"method": "layer_skip", "num_speculative_tokens": 3, "skip_layers": [8, 9, 10, 11], "adaptive": False},
], ids=["ngram", "suffix", "layer_skip"])
def test_speculation_equals_plain_on_the_gguf_blocks(path, spec: dict) -> None:
    model = load_model(str(path), torch.bfloat16, quantization="gguf")
    prompts = [TEXT + " Line 30:", "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(model, dtype="bfloat16").generate(prompts, params)]
    llm = LLM(model, speculative_config=spec, dtype="bfloat16")
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.stats.num_draft_tokens > 0
    if spec["method"] != "layer_skip":
        assert llm.engine.stats.num_accepted_tokens > 0  # the repeated lines get accepted drafts


def test_check_passes_on_the_base_model(path, capsys) -> None:
    """`quickdraft check` by name: the built-in chat prompts go in as plain text (no chat template)."""
    import json

    from quickdraft.commands.cli import main

    code = main(["check", "--model", "gemma3-270m", "--speculative-config", '{"method": "ngram"}', "--num-prompts", "3",
                 "--max-tokens", "16", "--num-seeds", "16", "--num-sampled-prompts", "1", "--sample-tokens", "4", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert (code, r["verdict"]) == (0, "PASS") and r["greedy"]["identical"] == 3
    assert [p["prompt"] for p in r["greedy"]["prompts"]] == ["code", "repeat", "primes"]  # "primes" is a chat
