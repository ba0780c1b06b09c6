"""Medusa heads at a tiny size: the loss falls, the trained heads draft tokens the target accepts,
speculative output is plain decoding's (greedy token for token, sampled by the TV permutation
test), and the files follow vLLM's Medusa layout."""

from __future__ import annotations

import json

import pytest
import torch

from quickdraft.errors import ConfigError
from quickdraft.evaluation.stats import tv_test
from quickdraft.models import medusa as head_file
from quickdraft.models.loader import LoadedModel
from quickdraft.models.tiny import random_weights
from quickdraft.sampling import SamplingParams
from quickdraft.train import medusa as trainer
from tests.train.conftest import CONFIG, PROMPTS, TARGET, run
from tests.train.test_eagle3 import SYSTEM, same_with_the_cache_on_and_off, samples


@pytest.fixture(scope="module")
def trained(tiny_windows, tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa")
    heads, losses = trainer.train(TARGET, tiny_windows, out, steps=120, num_heads=3, draft_vocab_size=64,
                                  batch_size=4, lr=3e-3, progress=False)
    return heads, losses, out


def test_the_loss_falls(trained):
    _, losses, _ = trained
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_plain_and_the_heads_draft(trained, plain, greedy_params, k):
    heads, _, _ = trained
    outs, stats = run({"method": "medusa", "model": heads, "num_speculative_tokens": k}, PROMPTS, greedy_params)
    assert [o.token_ids for o in outs] == plain
    assert len(stats.drafts_per_position) == min(k, 3)  # K is capped at the number of heads
    assert stats.accepted_per_position[0] > 0.4 * stats.drafts_per_position[0] > 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_token_trees_equal_plain_and_accept_more(trained, plain, greedy_params, adaptive):
    """Trees from the heads' top 3 at each offset: the target verifies them in one pass, the runner
    hands over the state of the accepted path's last node (not of the tree's last row), and the
    output stays plain decoding's. Fixed size: more tokens a pass than the chain."""
    heads, _, _ = trained
    chain = run({"method": "medusa", "model": heads, "num_speculative_tokens": 3}, PROMPTS, greedy_params)[1]
    outs, stats = run({"method": "medusa", "model": heads, "num_speculative_tokens": 3, "num_branches": 3,
                       "adaptive": adaptive}, PROMPTS, greedy_params)
    assert [o.token_ids for o in outs] == plain
    assert len(stats.drafts_per_position) <= 3  # positions are depths
    if not adaptive:
        assert stats.num_draft_tokens > chain.num_draft_tokens
        assert stats.mean_accepted_length > chain.mean_accepted_length


def test_prefix_caching_leaves_the_heads_drafts_as_they_are(trained, monkeypatch):
    """The heads read only the last committed row's state, which the prompt pass over the uncached
    rows computes: with the prefix cache on, every request reuses its whole shared prefix and
    drafts exactly what it drafts with the cache off."""
    from quickdraft.proposers.heads import medusa

    on, _ = same_with_the_cache_on_and_off({"method": "medusa", "model": trained[0]}, medusa, monkeypatch)
    a = on[0]
    assert [o.num_cached_tokens for o in on] == [0, len(a.prompt_token_ids) + len(a.token_ids) - 1,
                                                 len(SYSTEM), len(SYSTEM), len(SYSTEM) + 3]


def test_sampled_output_follows_the_target(trained):
    spec = {"method": "medusa", "model": trained[0], "num_speculative_tokens": 3}
    assert tv_test(samples(spec, range(96, 192)), samples(None, range(96)), 8).p_value > 0.001


def test_vllm_medusa_layout_round_trip(trained, tmp_path):
    heads, _, out = trained
    doc = json.loads((out / "config.json").read_text())
    assert (doc["model_type"], doc["architectures"], doc["num_heads"], doc["num_hidden_layers"]) == \
        ("medusa", ["MedusaModel"], 3, 1)
    assert (doc["hidden_size"], doc["vocab_size"], doc["truncated_vocab_size"]) == (CONFIG.hidden_size, 96, 64)
    from safetensors.torch import load_file, save_file

    w = load_file(str(out / "model.safetensors"))
    assert {"blocks.0.layers.0.weight", "blocks.2.layers.0.bias", "lm_heads.2.weight", "token_map"} <= set(w)
    x = torch.randn(4, CONFIG.hidden_size)
    assert torch.equal(head_file.load(out)(x), heads(x))
    # the original Medusa repository's prefix, which vLLM strips too
    other = tmp_path / "prefixed"
    other.mkdir()
    save_file({f"medusa_heads.{k}": v for k, v in w.items()}, str(other / "model.safetensors"))
    (other / "config.json").write_text(json.dumps(doc))
    assert torch.equal(head_file.load(other)(x), heads(x))


def test_heads_for_another_target_are_refused(trained):
    _, _, out = trained
    other = LoadedModel(CONFIG, random_weights(CONFIG, seed=2, scale=2.0), None, "tiny-other")
    with pytest.raises(ConfigError, match="another model than this target"):
        run({"method": "medusa", "model": str(out), "num_speculative_tokens": 2}, PROMPTS, [SamplingParams()], target=other)


def test_missing_heads_print_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="quickdraft train medusa --model tiny-qwen2"):
        run({"method": "medusa", "num_speculative_tokens": 2}, PROMPTS, [SamplingParams()])
