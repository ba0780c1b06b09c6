"""EAGLE-3 at a tiny size: the training loss falls, training's unrolled steps compute what serving
computes, the trained head drafts tokens the target accepts, and speculative output is plain
decoding's (greedy: token for token; sampled: the TV permutation test of `quickdraft check`)."""

from __future__ import annotations

import json

import pytest
import torch

from quickdraft.errors import ConfigError
from quickdraft.evaluation.stats import tv_test
from quickdraft.models import eagle3 as head_file
from quickdraft.models.loader import LoadedModel
from quickdraft.models.tiny import random_weights
from quickdraft.proposers.heads.common import embed_rows
from quickdraft.proposers.heads.eagle3 import Eagle3Proposer
from quickdraft.sampling import SamplingParams
from quickdraft.train import eagle3 as trainer
from tests.train.conftest import CONFIG, PROMPTS, TARGET, run


@pytest.fixture(scope="module")
def trained(tiny_windows, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle3")
    head, losses = trainer.train(TARGET, tiny_windows, out, steps=120, draft_vocab_size=64, batch_size=4, lr=3e-3,
                                 progress=False)
    return head, losses, out


def test_the_loss_falls(trained):
    _, losses, _ = trained
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.3 * first


def test_training_unrolls_what_serving_drafts(tiny_windows):
    """Step j of the training-time test at index i is the head's (j+1)-th draft after position i
    when serving (same positions, same keys), given the same tokens."""
    torch.manual_seed(0)
    ids = torch.arange(CONFIG.vocab_size)
    head = head_file.Eagle3Head(head_file.Eagle3Config.for_target(TARGET, ids.numel()), ids)
    for p in head.parameters():  # random, not the identity-like init: every part of the layer matters
        torch.nn.init.normal_(p, std=0.2)
    w = tiny_windows[0]
    embed = lambda t: embed_rows(TARGET.weights, t.reshape(-1)).view(*t.shape, -1)  # noqa: E731
    with torch.no_grad():
        unrolled = list(trainer.unroll(head, embed, w.aux[None].float(), w.tokens[None], 3))
    proposer = Eagle3Proposer(head, TARGET.weights, CONFIG.vocab_size, 1, 64)
    seq = type("Seq", (), {"slot": 0})()
    i = 20
    with torch.no_grad():
        out = proposer._layer([seq], embed_rows(TARGET.weights, w.tokens[1 : i + 2]),
                              head.fc(w.aux[: i + 1].float()), torch.arange(i + 1), [i + 1])[-1:]
        for j in range(3):
            if j:
                out = proposer._layer([seq], embed_rows(TARGET.weights, w.tokens[i + j + 1 : i + j + 2]), out,
                                      torch.tensor([i + j]), [1])
            torch.testing.assert_close(head.logits(out)[0], unrolled[j][0, i], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_plain_and_the_head_drafts(trained, plain, greedy_params, k):
    head, _, _ = trained
    outs, stats = run({"method": "eagle3", "model": head, "num_speculative_tokens": k}, PROMPTS, greedy_params)
    assert [o.token_ids for o in outs] == plain
    # the trained head drafts what the target writes, on prompts it was not trained on
    assert stats.accepted_per_position[0] > 0.5 * stats.drafts_per_position[0] > 0
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens


@pytest.mark.parametrize("adaptive", [False, True])
def test_token_trees_equal_plain_and_accept_more(trained, plain, greedy_params, adaptive):
    """Trees grown a level a head pass, each node over the committed rows, its ancestors and
    itself in the head's cache; the runner hands over the target's states along the accepted path.
    Fixed size: more tokens a pass than the chain."""
    head, _, _ = trained
    chain = run({"method": "eagle3", "model": head, "num_speculative_tokens": 3}, PROMPTS, greedy_params)[1]
    outs, stats = run({"method": "eagle3", "model": head, "num_speculative_tokens": 3, "num_branches": 3,
                       "adaptive": adaptive}, PROMPTS, greedy_params)
    assert [o.token_ids for o in outs] == plain
    assert len(stats.drafts_per_position) <= 3  # positions are depths
    if not adaptive:
        assert stats.num_draft_tokens > chain.num_draft_tokens
        assert stats.mean_accepted_length > chain.mean_accepted_length


def test_one_branch_is_the_chain(trained, greedy_params):
    """A tree of one branch is the chain, token for token (its rows' masks are the chain's)."""
    from quickdraft.config import EngineConfig, SpeculativeConfig
    from quickdraft.engine.engine import Engine

    head, _, _ = trained
    spec = SpeculativeConfig.parse({"method": "eagle3", "model": head, "num_speculative_tokens": 3, "adaptive": False,
                                    "draft_confidence_threshold": 0.0})  # trees have no confidence stop
    drafts = {}
    for tree in (False, True):
        engine = Engine(EngineConfig(model="tiny", dtype="float32", max_num_seqs=4, speculative=spec), target=TARGET)
        proposer, seen = engine.proposer, []
        if tree:
            proposer.branching, proposer.branches = True, 1
        propose = proposer.propose
        proposer.propose = lambda seqs, k: seen.append(p := propose(seqs, k)) or p
        engine.generate_ids(PROMPTS, greedy_params)
        drafts[tree] = [p.token_ids.tolist() for p in seen]
        assert tree == any(p.parents is not None for p in seen)
    assert drafts[True] == drafts[False]


def test_an_untrained_head_is_worse_and_still_exact(plain, greedy_params, trained):
    ids = torch.arange(64)
    head = head_file.Eagle3Head(head_file.Eagle3Config.for_target(TARGET, 64), ids)
    outs, stats = run({"method": "eagle3", "model": head, "num_speculative_tokens": 4}, PROMPTS, greedy_params)
    assert [o.token_ids for o in outs] == plain
    _, trained_stats = run({"method": "eagle3", "model": trained[0], "num_speculative_tokens": 4}, PROMPTS, greedy_params)
    assert stats.num_accepted_tokens < trained_stats.num_accepted_tokens


def samples(spec, seeds, temperature=1.0):
    """8 tokens of PROMPTS[0] for each seed, 48 requests at a time (the engine's queue holds 64)."""
    seeds, out = list(seeds), []
    for a in range(0, len(seeds), 48):
        params = [SamplingParams(max_tokens=8, temperature=temperature, seed=s) for s in seeds[a : a + 48]]
        out += [o.token_ids for o in run(spec, [PROMPTS[0]] * len(params), params, max_num_seqs=8)[0]]
    return out


def test_sampled_output_follows_the_target(trained):
    spec = {"method": "eagle3", "model": trained[0], "num_speculative_tokens": 3}
    plain, speculative = samples(None, range(96)), samples(spec, range(96, 192))
    assert tv_test(speculative, plain, 8).p_value > 0.001


def test_a_wrong_q_is_detected(trained, monkeypatch):
    """The test has power: q claimed uniform over the draft vocabulary while the tokens come from
    the head's peaked q over-accepts the head's tokens, and the TV test sees it."""
    import quickdraft.proposers.heads.common as heads

    real = heads.sample_rows

    def wrong(seqs, logits, head_ids, vocab_size, sampled, threshold=0.0):
        ids, q, confident = real(seqs, logits * 3.0, head_ids, vocab_size, sampled, threshold)  # sharper than it says
        if q is not None:
            q = torch.where(q > 0, 1.0 / 64, 0.0)
        return ids, q, confident

    monkeypatch.setattr("quickdraft.proposers.heads.eagle3.sample_rows", wrong)
    spec = {"method": "eagle3", "model": trained[0], "num_speculative_tokens": 3}
    plain, speculative = samples(None, range(96)), samples(spec, range(96, 192))
    assert tv_test(speculative, plain, 8).p_value < 0.01


def test_speculators_format_round_trip(trained, tmp_path):
    head, _, out = trained
    doc = json.loads((out / "config.json").read_text())
    assert doc["speculators_model_type"] == "eagle3" and doc["draft_vocab_size"] == 64
    assert doc["eagle_aux_hidden_state_layer_ids"] == list(head_file.default_aux_layers(CONFIG.num_layers))
    assert doc["speculators_config"]["algorithm"] == "eagle3"
    assert doc["speculators_config"]["verifier"]["name_or_path"] == "tiny-qwen2"
    assert {"hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
            "rms_norm_eps", "rope_theta"} <= set(doc["transformer_layer_config"])
    from safetensors.torch import load_file

    w = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "layers.0.self_attn.q_proj.weight",
            "layers.0.hidden_norm.weight", "layers.0.mlp.down_proj.weight"} <= set(w)
    assert w["t2d"].dtype == torch.bool and int(w["t2d"].sum()) == 64
    assert torch.equal(torch.arange(64) + w["d2t"], head.draft_ids)  # draft row i -> target id i + d2t[i]
    loaded = head_file.load(out)
    x = torch.randn(5, CONFIG.hidden_size)
    assert torch.equal(loaded.logits(x), head.logits(x)) and torch.equal(loaded.draft_ids, head.draft_ids)
    # SpecForge's layout: the decoder layer's tensors under midlayer.*
    from safetensors.torch import save_file

    forge = tmp_path / "specforge"
    forge.mkdir()
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in w.items()}, str(forge / "model.safetensors"))
    layer = dict(doc["transformer_layer_config"], draft_vocab_size=64,
                 eagle_config={"eagle_aux_hidden_state_layer_ids": doc["eagle_aux_hidden_state_layer_ids"]})
    (forge / "config.json").write_text(json.dumps(layer))
    assert torch.equal(head_file.load(forge).logits(x), head.logits(x))
    # speculators 0.9's later variants are another network: refused, not run wrongly
    (forge / "config.json").write_text(json.dumps(dict(doc, norm_before_fc=True)))
    with pytest.raises(ConfigError, match="norm_before_fc"):
        head_file.load(forge)


def test_a_head_for_another_target_is_refused(trained):
    head, _, out = trained
    other = LoadedModel(CONFIG, random_weights(CONFIG, seed=2, scale=2.0), None, "tiny-other")
    with pytest.raises(ConfigError, match="another model than this target"):
        run({"method": "eagle3", "model": str(out), "num_speculative_tokens": 2}, PROMPTS, [SamplingParams()],
            target=other)
    wide = head_file.Eagle3Head(head_file.Eagle3Config.for_target(TARGET, 64), torch.arange(64))
    wide.config = head_file.Eagle3Config(**{**wide.config.__dict__, "vocab_size": 128})
    with pytest.raises(ConfigError, match="vocabulary 128"):
        run({"method": "eagle3", "model": wide, "num_speculative_tokens": 2}, PROMPTS, [SamplingParams()])


def test_a_missing_head_prints_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="quickdraft train eagle3 --model tiny-qwen2"):
        run({"method": "eagle3", "num_speculative_tokens": 2}, PROMPTS, [SamplingParams()])


def counters(o) -> tuple:
    s = o.spec
    return s.num_target_passes, s.num_draft_tokens, s.num_accepted_tokens, tuple(s.accepted_per_position)


SYSTEM = [11, 60, 3, 27, 90, 14, 8, 71, 35, 52]  # a system prompt the requests below share


def turns(spec: dict, on: bool, spied, monkeypatch):
    """Requests that reuse cached prefixes in each way (engine/prefix_cache.py), greedy, on an
    engine of two slots with the prefix cache ``on`` or off: (a) a first turn; (b) its second turn,
    the first answer included, in place; (e, f) two prompts admitted together that share only the
    system prompt with the free slot, one copied into the empty slot and one in place; (h) one that
    arrives while e decodes and shares e's prompt, copied from e's running slot. -> the outputs in
    that order, the prefix stats, and each request's draft logits, in order (those the proposer
    module ``spied`` hands to sample_rows)."""
    from quickdraft.config import EngineConfig, SpeculativeConfig
    from quickdraft.engine.engine import Engine

    logits: dict[str, list[torch.Tensor]] = {}

    def sample_rows(seqs, rows, *args, **kwargs):
        for s, row in zip(seqs, rows):
            logits.setdefault(s.request_id, []).append(row.clone())
        return drafted(seqs, rows, *args, **kwargs)

    drafted = spied.sample_rows
    spec = SpeculativeConfig.parse({"adaptive": False, "num_speculative_tokens": 3, **spec})
    engine = Engine(EngineConfig(model="tiny", dtype="float32", max_num_seqs=2, enable_prefix_caching=on,
                                 speculative=spec), target=TARGET)
    final = {}

    def until(*ids):
        while not all(i in final for i in ids):
            final.update((o.request_id, o) for o in engine.step() if o.finished)

    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    with monkeypatch.context() as patch:
        patch.setattr(spied, "sample_rows", sample_rows)
        a = engine.add_request(SYSTEM + [5, 17, 33, 2], greedy(12))
        until(a)
        b = engine.add_request(SYSTEM + [5, 17, 33, 2] + final[a].token_ids + [40, 41, 42], greedy(8))
        until(b)
        e, f = engine.add_request(SYSTEM + [7, 7, 9], greedy(16)), engine.add_request(SYSTEM + [1, 2, 3], greedy(4))
        until(f)
        assert e not in final
        h = engine.add_request(SYSTEM + [7, 7, 9, 30, 44], greedy(6))
        until(e, h)
    ids = [a, b, e, f, h]
    return [final[i] for i in ids], engine.prefix_cache.stats, [logits.get(i, []) for i in ids]


def same_with_the_cache_on_and_off(spec: dict, spied, monkeypatch):
    """``turns`` with the cache off and on: the same tokens, the same counters and the same draft
    logits at every step (a wrong reused head row would change the logits, though rarely the output:
    that is lossless either way). -> the outputs with the cache on, and its stats."""
    (off, _, off_logits), (on, stats, on_logits) = (turns(spec, c, spied, monkeypatch) for c in (False, True))
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [counters(o) for o in on] == [counters(o) for o in off]
    for got, want in zip(on_logits, off_logits):
        assert len(got) == len(want) > 0
        torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-4, atol=1e-4)
    assert [o.num_cached_tokens for o in off] == [0] * len(off)
    assert stats.hits == sum(o.num_cached_tokens for o in on)
    assert stats.copied == on[2].num_cached_tokens + on[4].num_cached_tokens  # e's and h's were copied
    assert sum(o.spec.num_accepted_tokens for o in on) > 0.3 * sum(o.spec.num_draft_tokens for o in on) > 0
    return on, stats


def test_prefix_caching_reuses_the_heads_cache(trained, monkeypatch):
    """With the prefix cache on, each request reuses its prefix, and the head drafts from exactly
    the context it has with the cache off. Where the head's rows go past the shared prefix (e, f,
    h), the row of the prefix's last token is the target's to compute again (Eagle3Proposer.reuse)."""
    from quickdraft.proposers.heads import eagle3

    on, _ = same_with_the_cache_on_and_off({"method": "eagle3", "model": trained[0]}, eagle3, monkeypatch)
    a = on[0]
    assert [o.num_cached_tokens for o in on] == [0, len(a.prompt_token_ids) + len(a.token_ids) - 1,
                                                 len(SYSTEM) - 1, len(SYSTEM) - 1, len(SYSTEM) + 3 - 1]


def test_a_reused_prefix_keeps_the_head_rows_and_features_inside_it(trained):
    """The head's row t reads token t + 1: of a slot whose head holds rows 0..5 and waits with the
    target's features of positions 6..8, a prefix of 8 tokens keeps the rows and the features of
    6 and 7; a prefix of 4 keeps rows 0..2 only (row 3 read token 4, past it), and the prefix
    shrinks to 3, whose row the target's prompt pass computes again; a miss keeps nothing."""
    from types import SimpleNamespace

    proposer = Eagle3Proposer(trained[0], TARGET.weights, CONFIG.vocab_size, 3, 64)
    proposer.keys[0].normal_()
    features = torch.randn(3, 3 * CONFIG.hidden_size)
    proposer._cached[0], proposer._features[0] = 6, features
    new = SimpleNamespace(slot=1)
    assert proposer.reuse(new, 0, 8) == 8
    assert proposer._cached[1] == 6 and torch.equal(proposer._features[1], features[:2])
    assert torch.equal(proposer.keys[1, :6], proposer.keys[0, :6])
    assert proposer.reuse(new, 0, 4) == 3 and proposer._cached[1] == 3 and proposer._features[1] is None
    assert proposer.reuse(SimpleNamespace(slot=0), 0, 0) == 0 and proposer._cached[0] == 0
    assert proposer._features[0] is None


def test_a_head_served_from_blocks_reads_a_quarter_and_drafts_the_same(trained):
    """On the CPU's block kernels a head's matrices are served as Q8_0 (proposers/heads/common.py): a
    quarter of float32's bytes, logits within int8 rounding of the float head's, the trained head
    itself untouched; and the output stays plain decoding's (the verifier decides)."""
    from quickdraft.kernels import block_linear
    from quickdraft.proposers.heads.common import BlockLinear, head_bytes, serving_head

    if block_linear() is None:
        pytest.skip("no GGUF block kernels on this CPU")
    head = trained[0]
    served = serving_head(head, "auto", "cpu")
    blocks = [m for m in served.modules() if isinstance(m, BlockLinear)]
    assert len(blocks) == 9 and not any(isinstance(m, BlockLinear) for m in head.modules())
    assert head_bytes(served) < 0.35 * head_bytes(serving_head(head, None, "cpu"))
    x = torch.randn(7, CONFIG.hidden_size)
    with torch.no_grad():
        want, got = head.logits(x), served.logits(x)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    with pytest.raises(ConfigError, match="q4_0"):
        serving_head(head, "q4_0", "meta")
