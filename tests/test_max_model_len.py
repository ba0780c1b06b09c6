"""The default max model len: the model's own context length, less where the KV cache of every
sequence would not fit in the memory left after the weights; a length given beyond either is an
error that names it. Tiny models with known max_position_embeddings, the free memory monkeypatched."""

from __future__ import annotations

import pytest
import torch

from quickdraft.engine import engine as engine_module
from quickdraft.errors import ConfigError
from quickdraft.models.kv_cache import (CPU_KV_SPACE_ENV, DEFAULT_CPU_KV_BYTES, HEADROOM_MIN_BYTES, KVCache,
                                         fit_max_model_len)
from quickdraft.llm import LLM
from quickdraft.models.loader import LoadedModel
from quickdraft.models.tiny import random_weights, tiny_config
from quickdraft.sampling import SamplingParams

CONFIG = tiny_config("llama", vocab_size=64, hidden_size=32, num_layers=1, max_positions=8192)  # beyond 4096
TINY = LoadedModel(CONFIG, random_weights(CONFIG, seed=0), None, "tiny")
PER_TOKEN = KVCache.bytes_per_token(CONFIG, torch.float32)  # one position of one sequence
GiB = 2**30


def free(monkeypatch, n: int | None) -> None:
    monkeypatch.setattr(engine_module, "free_memory", lambda device="cpu": n)


def test_the_default_is_the_models_context_not_4096(monkeypatch):
    free(monkeypatch, 16 * GiB)
    llm = LLM(TINY, dtype="float32", max_num_seqs=2)
    assert llm.engine.max_model_len == 8192 and llm.engine.kv.max_len == 8192
    assert llm.max_model_len_reason == "max model len 8192 (the model's context)"
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_the_default_fits_the_kv_cache_in_the_memory_left(monkeypatch):
    # 1 MiB for the cache once the headroom is taken: 1 MiB / (4 sequences x PER_TOKEN) positions
    free(monkeypatch, HEADROOM_MIN_BYTES + 2**20)
    llm = LLM(TINY, dtype="float32", max_num_seqs=4)
    fits = 2**20 // (4 * PER_TOKEN)
    assert fits < 8192 and llm.engine.max_model_len == fits // 256 * 256
    assert llm.max_model_len_reason == (f"max model len {fits // 256 * 256} (KV memory: 1 MiB free after the weights, "
                                        "for 4 sequences; the model allows 8192: --max-model-len asks for more)")
    # the same memory holds twice the length for half the sequences
    assert fit_max_model_len(CONFIG, None, 2, torch.float32, free=HEADROOM_MIN_BYTES + 2**20)[0] == 2 * fits // 256 * 256


def test_on_a_cpu_the_default_stays_within_the_default_kv_space(monkeypatch):
    """A context that would need more than the default KV space on a CPU (a 32k-token model for 8
    sequences: 7.5 GB, zeroed) is cut to what fits in it, however much memory is free; a length
    given is not cut; QUICKDRAFT_CPU_KV_SPACE sets another space."""
    monkeypatch.delenv(CPU_KV_SPACE_ENV, raising=False)  # the suite's own (tests/conftest.py)
    big = tiny_config("llama", vocab_size=64, hidden_size=1536, num_layers=28, max_positions=32768)
    per_position = KVCache.bytes_per_token(big, torch.bfloat16) * 8
    assert per_position * 32768 > DEFAULT_CPU_KV_BYTES
    length, why = fit_max_model_len(big, None, 8, torch.bfloat16, free=64 * GiB)
    assert length == DEFAULT_CPU_KV_BYTES // per_position // 256 * 256 and "the CPU KV space, 4.0 GiB" in why
    assert fit_max_model_len(big, None, 8, torch.bfloat16, free=None)[0] == length
    assert fit_max_model_len(big, 32768, 8, torch.bfloat16, free=64 * GiB)[0] == 32768
    assert fit_max_model_len(big, None, 8, torch.bfloat16, device="cuda", free=64 * GiB)[0] == 32768
    monkeypatch.setenv(CPU_KV_SPACE_ENV, "8")
    length, why = fit_max_model_len(big, None, 8, torch.bfloat16, free=64 * GiB)
    assert length == 8 * GiB // per_position // 256 * 256 and "the CPU KV space, 8.0 GiB" in why
    monkeypatch.setenv(CPU_KV_SPACE_ENV, "lots")
    with pytest.raises(ConfigError, match="QUICKDRAFT_CPU_KV_SPACE must be a positive number of GiB"):
        fit_max_model_len(big, None, 8, torch.bfloat16, free=64 * GiB)


def test_no_memory_figure_means_the_models_context(monkeypatch):
    free(monkeypatch, None)
    assert LLM(TINY, dtype="float32", max_num_seqs=1).engine.max_model_len == 8192


def test_a_length_given_is_kept_where_it_fits(monkeypatch):
    free(monkeypatch, 16 * GiB)
    llm = LLM(TINY, dtype="float32", max_num_seqs=1, max_model_len=300)
    assert llm.engine.max_model_len == 300 and llm.max_model_len_reason.startswith("max model len 300 (as given")


def test_a_length_beyond_the_models_context_is_an_error_naming_both(monkeypatch):
    free(monkeypatch, 16 * GiB)
    with pytest.raises(ConfigError, match="max_model_len 10000 is more than tiny-llama's context length, 8192"):
        LLM(TINY, dtype="float32", max_num_seqs=1, max_model_len=10000)


def test_a_length_beyond_the_memory_is_an_error_saying_what_it_needs(monkeypatch):
    free(monkeypatch, HEADROOM_MIN_BYTES + 2**20)
    need = 8192 * 4 * PER_TOKEN
    with pytest.raises(ConfigError, match=rf"max_model_len 8192 needs {need // 2**20} MiB of KV cache for 4 "
                                          r"sequences, and 1 MiB is free for it after the weights"):
        LLM(TINY, dtype="float32", max_num_seqs=4, max_model_len=8192)


def test_the_cli_says_what_it_chose(monkeypatch, capsys):
    from quickdraft.commands import generate

    free(monkeypatch, 16 * GiB)
    monkeypatch.setattr(engine_module, "load_model", lambda *a, **kw: TINY)
    with pytest.raises(AttributeError):  # the tiny model has no tokenizer: the line is printed before it is used
        generate.generate(parse("generate", "tiny", "hello"))
    assert "quickdraft: max model len 8192 (the model's context)" in capsys.readouterr().err


def parse(*argv):
    from quickdraft.arguments import resolve_model_args
    from quickdraft.commands.cli import build_parser, parse as cli_parse

    return resolve_model_args(cli_parse(build_parser(), list(argv)))

