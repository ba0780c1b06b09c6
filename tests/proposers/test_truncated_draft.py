"""End to end on tiny random models, float32: a draft_model proposer with a truncated vocabulary
(proposers/draft/vocab.py) changes only the speed. Greedy output equals plain decoding token for
token, with a subset that holds every token the target picks (a self-draft then accepts all) and
with subsets that leave out tokens the target wants (rejections); the draft proposes only subset
tokens, and its q is a distribution over the whole vocabulary, zero outside the subset. The
sampled distribution with truncation is tested in tests/verify/test_statistics.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from quickdraft.config import EngineConfig, SpeculativeConfig
from quickdraft.engine.engine import Engine
from quickdraft.models.ggml import BlockWeight
from quickdraft.models.loader import LoadedModel, load_model
from quickdraft.models.quant import Int8Weight
from quickdraft.models.tiny import random_weights, tiny_config
from quickdraft.sampling import SamplingParams

CONFIG = tiny_config("qwen2", vocab_size=96, hidden_size=64, num_layers=2)
TARGET = LoadedModel(CONFIG, random_weights(CONFIG, seed=1, scale=2.0), None, "tiny-target")
NOISY = LoadedModel(CONFIG, {k: v + 0.3 * v.std() * torch.randn(v.shape, generator=torch.Generator().manual_seed(3))
                             if v.ndim == 2 else v for k, v in TARGET.weights.items()}, None, "tiny-noisy")
PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 42, 43, 44, 45, 46, 47, 1, 2, 3], [7]]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def engine(spec: dict | None, target=TARGET, dtype="float32") -> Engine:
    spec = None if spec is None else {"adaptive": False, "draft_confidence_threshold": 0.0, **spec}
    return Engine(EngineConfig(model="tiny", dtype=dtype, max_num_seqs=4, speculative=SpeculativeConfig.parse(spec)),
                  target=target)


def recorded(eng: Engine) -> list:
    """Every DraftProposal the engine's proposer makes, kept as it runs."""
    proposals = []
    propose = eng.proposer.propose

    def wrapped(seqs, num_tokens):
        proposals.append(propose(seqs, num_tokens))
        return proposals[-1]

    eng.proposer.propose = wrapped
    return proposals


def subset_file(tmp_path, ids) -> str:
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(sorted(ids)))
    return str(path)


@pytest.fixture(scope="module")
def plain():
    return [o.token_ids for o in engine(None).generate_ids(PROMPTS, [GREEDY] * len(PROMPTS))]


def test_subset_with_every_target_token_accepts_all(plain, tmp_path):
    wanted = {t for out in plain for t in out}
    ids = wanted | set(range(0, 96, 3))
    eng = engine({"method": "draft_model", "model": TARGET, "num_speculative_tokens": 4,
                  "draft_vocab_file": subset_file(tmp_path, ids)})
    assert eng.proposer.model.lm_head.shape == (len(ids), 64)  # the head has the subset's rows only
    outs = eng.generate_ids(PROMPTS, [GREEDY] * len(PROMPTS))
    assert [o.token_ids for o in outs] == plain
    assert eng.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("draft", [TARGET, NOISY], ids=["self", "noisy"])
@pytest.mark.parametrize("k", [1, 4])
def test_subset_without_target_tokens_is_lossless(plain, tmp_path, draft, k):
    """The most frequent third of the target's tokens is left out: drafts are rejected there."""
    counts = torch.bincount(torch.tensor([t for out in plain for t in out]), minlength=96)
    left_out = set(counts.argsort(descending=True)[: len(counts.nonzero()) // 3].tolist())
    ids = set(range(96)) - left_out
    eng = engine({"method": "draft_model", "model": draft, "num_speculative_tokens": k,
                  "draft_vocab_file": subset_file(tmp_path, ids)})
    proposals = recorded(eng)
    outs = eng.generate_ids(PROMPTS, [GREEDY] * len(PROMPTS))
    assert [o.token_ids for o in outs] == plain
    proposed = {t for p in proposals for t in p.token_ids.tolist()}
    assert proposed and proposed <= ids  # never a token outside the subset
    assert eng.stats.num_accepted_tokens < eng.stats.num_draft_tokens  # rejections happened
    assert eng.stats.num_accepted_tokens > 0


def test_sampled_q_is_zero_outside_the_subset(tmp_path):
    ids = set(range(0, 96, 2)) | {95}
    eng = engine({"method": "draft_model", "model": NOISY, "num_speculative_tokens": 3,
                  "draft_vocab_file": subset_file(tmp_path, ids)})
    proposals = recorded(eng)
    params = [SamplingParams(max_tokens=16, temperature=t, top_p=0.9, top_k=k, seed=s)
              for t, k, s in ((1.0, 0, 1), (0.7, 5, 2), (0.0, 0, 3))]  # a greedy row in a sampled batch
    eng.generate_ids(PROMPTS, params)
    outside = torch.tensor([i not in ids for i in range(96)])
    # [num_draft_tokens, 96]: the native chains give q over the subset's ids (probs_columns), spread here
    q = torch.cat([p.spread().probs for p in proposals if p.probs is not None])
    native = eng.proposer.native_chains and eng.proposer.model.native is not None and eng.proposer.model.native.one_call
    assert any(p.probs_columns is not None for p in proposals) == native  # and the verifier read them so
    tokens = torch.cat([p.token_ids for p in proposals if p.probs is not None])
    assert q.shape[1] == 96 and q.shape[0] == tokens.shape[0] > 0
    assert torch.allclose(q.sum(-1), torch.ones(q.shape[0]), atol=1e-5)
    assert (q[:, outside] == 0).all()
    assert (q[torch.arange(q.shape[0]), tokens] > 0).all()  # each token was drawn from its q


def test_seeded_sampling_is_reproducible(tmp_path):
    spec = {"method": "draft_model", "model": NOISY, "num_speculative_tokens": 3,
            "draft_vocab_file": subset_file(tmp_path, range(0, 96, 2))}
    params = [SamplingParams(max_tokens=20, temperature=4.0, top_p=0.95, seed=s) for s in (1, 2, 1)]
    a = [o.token_ids for o in engine(spec).generate_ids(PROMPTS[:1] * 3, params)]
    b = [o.token_ids for o in engine(spec).generate_ids(PROMPTS[:1] * 3, params)]
    assert a == b and a[0] == a[2] and a[0] != a[1]


def test_int8_draft_head_is_truncated_before_quantizing(plain, tmp_path):
    ids = set(range(96)) - {plain[0][0], plain[1][0]}
    eng = engine({"method": "draft_model", "model": TARGET, "num_speculative_tokens": 3, "quantization": "int8",
                  "draft_vocab_file": subset_file(tmp_path, ids)}, target=LoadedModel(
                      CONFIG, {k: v.bfloat16() for k, v in TARGET.weights.items()}, None, "tiny-bf16"), dtype="bfloat16")
    head = eng.proposer.model.lm_head
    assert isinstance(head, Int8Weight) and head.shape == (len(ids), 64)
    eng.generate_ids(PROMPTS, [GREEDY] * len(PROMPTS))
    assert eng.stats.num_draft_tokens > 0


def test_counted_subset_on_a_model_with_a_tokenizer(tiny_hf_dir, tmp_cache, tmp_path, monkeypatch):
    """draft_vocab_size counts over the corpus (here a small one) and truncates a GGUF-less model."""
    from quickdraft.proposers.draft import vocab as draft_vocab

    text = tmp_path / "corpus.py"
    text.write_text("def f(x):\n    return x + 1\n" * 20)
    monkeypatch.setattr(draft_vocab, "corpus_files", lambda: [text])
    model = load_model(str(tiny_hf_dir[0]))
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3, "draft_vocab_size": 256}
    eng = engine(spec, target=model)
    assert eng.proposer.head_ids.shape == (256,) and eng.proposer.head_ids[-3:].tolist() == [257, 258, 259]
    prompts = [model.tokenizer.encode("def f(x):"), model.tokenizer.encode("return")]
    spec_out = [o.token_ids for o in eng.generate_ids(prompts, [GREEDY] * 2)]
    assert spec_out == [o.token_ids for o in engine(None, target=model).generate_ids(prompts, [GREEDY] * 2)]


def test_block_weight_head_is_selected(tmp_path):
    """A GGUF head kept as stored blocks is truncated with BlockWeight.select."""
    from quickdraft.proposers.draft.load import truncated_head

    cfg = tiny_config("qwen2", vocab_size=8, hidden_size=64)
    w = random_weights(cfg)
    g = np.random.default_rng(0)
    blocks = np.zeros((16, 34), dtype=np.uint8)  # 8 rows of 64 weights: two Q8_0 blocks a row
    blocks[:, 0:2] = np.asarray(g.uniform(0.01, 0.1, (16, 1)), dtype=np.float16).view(np.uint8)
    blocks[:, 2:] = g.integers(-127, 128, (16, 32)).astype(np.int8).view(np.uint8)
    q8 = BlockWeight.from_gguf("Q8_0", blocks.reshape(-1), (8, 64))
    config, weights = truncated_head(LoadedModel(cfg, {**w, "model.embed_tokens.weight": q8}, None, "q8"),
                                     torch.tensor([1, 4, 6]))
    head = weights["lm_head.weight"]
    assert not config.tie_word_embeddings and isinstance(head, BlockWeight)
    assert torch.equal(head.dequantize(), q8.dequantize()[[1, 4, 6]])
    assert weights["model.embed_tokens.weight"] is q8  # the embedding keeps every row
