"""The truncated draft vocabulary's subset (proposers/draft/vocab.py): ranking, counting once per
tokenizer and corpus into the cache, a user's id file, and the config keys' validation."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from quickdraft.config import SpeculativeConfig
from quickdraft.errors import ConfigError
from quickdraft.models.loader import load_model
from quickdraft.proposers.draft import vocab as draft_vocab

# the tiny Hugging Face model of conftest: 257 byte-level tokens, then <|endoftext|> <|im_start|>
# <|im_end|> (257..259); eos ids 259 and 257
SPECIALS = [257, 258, 259]


@pytest.fixture
def tiny(tiny_hf_dir):
    return load_model(str(tiny_hf_dir[0]))


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """A two-file corpus in place of the standard library: 'a' most frequent, then 'b', then 'c'."""
    files = [tmp_path / "one.py", tmp_path / "two.txt"]
    files[0].write_text("aaaa bb c")
    files[1].write_text("aaa b")
    monkeypatch.setattr(draft_vocab, "corpus_files", lambda: files)
    return files


def test_top_ids_keeps_specials_then_frequency_then_lowest_id():
    counts = np.array([0, 5, 9, 5, 0, 1, 0, 0])
    assert draft_vocab.top_ids(counts, 4, keep=[7]).tolist() == [1, 2, 3, 7]
    # ties by lowest id, tokens never seen by lowest id too (BPE ids follow merge rank)
    assert draft_vocab.top_ids(counts, 6, keep=[7]).tolist() == [0, 1, 2, 3, 5, 7]
    with pytest.raises(ConfigError, match="smaller than the 2 special"):
        draft_vocab.top_ids(counts, 1, keep=[6, 7])


def test_always_kept_are_the_added_tokens_and_eos(tiny):
    assert draft_vocab.always_kept(tiny.tokenizer, tiny.config) == SPECIALS


def test_counted_once_then_read_from_the_cache(tiny, corpus, tmp_cache, monkeypatch):
    tok, cfg = tiny.tokenizer, tiny.config
    a, b, c = (tok.encode(x)[0] for x in ("a", "b", "c"))
    ids = draft_vocab.frequent_ids(tok, cfg, 5, progress=False)
    assert ids.tolist() == sorted([a, b] + SPECIALS)
    written = sorted(p.name for p in (tmp_cache / "draft_vocab").iterdir())
    assert len(written) == 2 and written[0].endswith("-counts.npy") and written[1].endswith("-top5.json")

    def no_counting(*args, **kwargs):
        raise AssertionError("counted again")

    monkeypatch.setattr(draft_vocab, "count_tokens", no_counting)
    assert draft_vocab.frequent_ids(tok, cfg, 5).tolist() == ids.tolist()  # the id list is cached
    # another size ranks the cached counts: 'c' is third; the space (b' ' as 'Ġ') is in the counts too
    six = draft_vocab.frequent_ids(tok, cfg, 6)
    assert set(ids.tolist()) < set(six.tolist()) and len(six) == 6
    doc = json.loads((tmp_cache / "draft_vocab" / written[1]).read_text())
    assert doc["size"] == 5 and doc["corpus_tokens"] > 0 and 0 < doc["coverage"] <= 1


def test_another_corpus_or_tokenizer_is_counted_again(tiny, corpus, tmp_cache, monkeypatch):
    tok, cfg = tiny.tokenizer, tiny.config
    draft_vocab.frequent_ids(tok, cfg, 5, progress=False)
    corpus[1].write_text("cccccccc c c")  # another size: another corpus key
    ids = draft_vocab.frequent_ids(tok, cfg, 5, progress=False)
    assert tok.encode("c")[0] in ids.tolist()
    monkeypatch.setattr(draft_vocab, "tokenizer_key", lambda t: "another")
    calls = []
    real = draft_vocab.count_tokens
    monkeypatch.setattr(draft_vocab, "count_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    draft_vocab.frequent_ids(tok, cfg, 5, progress=False)
    assert calls == [1]


def test_corpus_is_the_standard_library_without_its_tests():
    files = draft_vocab.corpus_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = {f.relative_to(stdlib).as_posix() for f in files if stdlib in f.parents}
    assert "os.py" in names and "json/decoder.py" in names
    assert not any(n.startswith(("test/", "site-packages/")) or "/tests/" in n for n in names)
    assert files == sorted(files)


@pytest.mark.parametrize("text", ["[5, 3, 5, 9]", '{"ids": [5, 3, 9], "size": 3}', "5\n3\n9\n", "5 3 9"])
def test_id_file_formats(tiny, tmp_path, text):
    path = tmp_path / "ids"
    path.write_text(text)
    assert draft_vocab.read_id_file(path, tiny.tokenizer, tiny.config).tolist() == [3, 5, 9] + SPECIALS


@pytest.mark.parametrize("text, error", [("[1, 260]", "outside 0..259"), ("[]", "no token ids"),
                                         ('["x"]', "must hold token ids"), ("1 two", "must hold token ids")])
def test_bad_id_files(tiny, tmp_path, text, error):
    path = tmp_path / "ids"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        draft_vocab.read_id_file(path, tiny.tokenizer, tiny.config)
    with pytest.raises(ConfigError, match="cannot be read"):
        draft_vocab.read_id_file(tmp_path / "missing", tiny.tokenizer, tiny.config)


def test_resolve(tiny, corpus, tmp_cache, tmp_path):
    spec = SpeculativeConfig(method="draft_model", model="x", draft_vocab_size=256)
    assert draft_vocab.resolve(spec, tiny).tolist()[-3:] == SPECIALS and len(draft_vocab.resolve(spec, tiny)) == 256
    assert draft_vocab.resolve(SpeculativeConfig(method="draft_model", model="x", draft_vocab_size=None), tiny) is None
    # a size that covers the whole vocabulary is no truncation
    assert draft_vocab.resolve(SpeculativeConfig(method="draft_model", model="x", draft_vocab_size=4096), tiny) is None
    path = tmp_path / "ids.json"
    path.write_text("[1, 2]")
    by_file = SpeculativeConfig(method="draft_model", model="x", draft_vocab_size=256, draft_vocab_file=str(path))
    assert draft_vocab.resolve(by_file, tiny).tolist() == [1, 2] + SPECIALS  # the file wins


@pytest.mark.parametrize("value", [0, 255, -1, 1.5, "32768", True])
def test_config_rejects_bad_sizes(value):
    with pytest.raises(ConfigError, match="draft_vocab_size must be null") as e:
        SpeculativeConfig.parse({"method": "draft_model", "model": "m", "draft_vocab_size": value})
    assert e.value.param == "draft_vocab_size"


def test_config_accepts_sizes_and_files():
    spec = SpeculativeConfig.parse('{"method": "draft_model", "model": "m", "draft_vocab_size": 32768}')
    assert spec.draft_vocab_size == 32768
    assert SpeculativeConfig.parse({"method": "draft_model", "model": "m", "draft_vocab_size": None}).draft_vocab_size is None
    assert SpeculativeConfig.parse({"method": "draft_model", "model": "m", "draft_vocab_file": "ids.txt"}).draft_vocab_file
    with pytest.raises(ConfigError, match="draft_vocab_file must be a path"):
        SpeculativeConfig.parse({"method": "draft_model", "model": "m", "draft_vocab_file": 3})


def test_count_tokens_counts_every_file(tiny, corpus):
    counts = draft_vocab.count_tokens(tiny.tokenizer, corpus, tiny.config.vocab_size, progress=False)
    a = tiny.tokenizer.encode("a")[0]
    assert counts.shape == (260,) and counts[a] == 7 and counts.sum() == sum(
        len(tiny.tokenizer.encode(f.read_text())) for f in corpus)
    assert counts.dtype == np.int64 and torch.tensor(counts).sum() > 0


def test_without_a_tokenizer_the_head_stays_whole():
    """Only a model built in code has no tokenizer; the default size must not fail it."""
    from quickdraft.models.loader import LoadedModel
    from quickdraft.models.tiny import tiny_config

    model = LoadedModel(tiny_config(vocab_size=300), {}, None, "tiny")
    spec = SpeculativeConfig(method="draft_model", model="x")
    assert spec.draft_vocab_size == 65536
    assert draft_vocab.resolve(spec, model) is None  # 300 rows: the default covers them
    with pytest.warns(UserWarning, match="no tokenizer"):
        assert draft_vocab.resolve(SpeculativeConfig(method="draft_model", model="x", draft_vocab_size=256), model) is None
