"""Token trees from a draft model (proposers/draft/model.py, ``num_branches`` > 1), on tiny random
models in float32: the tree's shape, its identity with the chain at one branch, the draft cache
after a tree (the accepted path's keys moved into place, bit for bit what a fresh draft computes),
greedy output equal to plain decoding, sampled trees shaped before their draws and sampled output
distributed as plain sampling's (with a wrong q detected), and the planner that trims a tree to the rows that pay
(engine/plan.py's plan_tree_sizes, DraftProposal.trimmed)."""

from __future__ import annotations

import pytest
import torch

from quickdraft.config import EngineConfig, SpeculativeConfig
from quickdraft.engine.engine import Engine
from quickdraft.engine.plan import TreeChoice, plan_tree_sizes
from quickdraft.engine.sequence import Sequence
from quickdraft.errors import ConfigError
from quickdraft.models.decoder import Decoder
from quickdraft.models.loader import LoadedModel
from quickdraft.models.pass_cost import LinearCost
from quickdraft.models.tiny import random_weights, tiny_config
from quickdraft.proposers.base import DraftProposal
from quickdraft.proposers.draft.model import DraftModelProposer
from quickdraft.proposers.tree_drafts import DraftTreeState, EdgeCalibration
from quickdraft.sampling import SamplingParams
from quickdraft.verify.rejection import VerifyOutput

CONFIG = tiny_config("qwen2", vocab_size=96, hidden_size=64, num_layers=2)
TARGET = LoadedModel(CONFIG, random_weights(CONFIG, seed=1, scale=2.0), None, "tiny-target")
# the target's weights with noise: a draft that agrees often, not always (rejections mid-tree)
NOISY = LoadedModel(CONFIG, {k: v + 0.3 * v.std() * torch.randn(v.shape, generator=torch.Generator().manual_seed(3))
                             if v.ndim == 2 else v for k, v in TARGET.weights.items()}, None, "tiny-noisy")
PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 42, 43, 44, 45, 46, 47, 1, 2, 3], [7]]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def engine(spec: dict | None, dtype="float32") -> Engine:
    spec = None if spec is None else {"adaptive": False, "draft_confidence_threshold": 0.0, **spec}
    return Engine(EngineConfig(model="tiny", dtype=dtype, max_num_seqs=4, speculative=SpeculativeConfig.parse(spec)),
                  target=TARGET)


def proposer(branches: int) -> DraftModelProposer:
    return DraftModelProposer(Decoder(CONFIG, NOISY.weights), num_slots=4, max_len=64, num_branches=branches)


def sequences(prompts=PROMPTS, params=GREEDY) -> list[Sequence]:
    seqs = []
    for slot, p in enumerate(prompts):
        s = Sequence(f"r{slot}", list(p), params, torch.Generator().manual_seed(slot))
        s.slot = slot
        seqs.append(s)
    return seqs


def test_one_branch_is_the_greedy_chain_token_for_token():
    """With one branch the tree is the chain (same tokens, parents a chain) and a chain's draft
    passes give the tree passes' bits (the tree attention kernel is the chain's)."""
    chain = proposer(1).propose(sequences(), [4, 4, 4])
    tree = proposer(1)
    tree.branches = 1  # force the tree path with one branch
    grown = tree._grow_trees(sequences(), [4, 4, 4])
    at = 0
    for (tokens, parents, values), k in zip(grown, chain.num_tokens):
        assert tokens == chain.token_ids[at : at + k].tolist()
        assert parents == list(range(-1, k - 1))
        assert all(a >= b for a, b in zip(values, values[1:]))
        at += k


def test_the_tree_has_the_shape_it_promises():
    p = proposer(3)
    proposal = p.propose(sequences(), [4, 0, 3])
    assert proposal.num_tokens[1] == 0
    at = 0
    for i, k in enumerate(proposal.num_tokens):
        if k == 0:
            continue
        parents, values = proposal.tree(i), proposal.values[i]
        tokens = proposal.token_ids[at : at + k].tolist()
        assert k <= [4, 0, 3][i] * 3
        for n, parent in enumerate(parents):
            assert -1 <= parent < n
            if parent >= 0:
                assert values[n] <= values[parent]
        depth = [0] * k
        for n, parent in enumerate(parents):
            depth[n] = 1 if parent < 0 else depth[parent] + 1
        assert max(depth) <= [4, 0, 3][i]
        siblings = {}
        for n, parent in enumerate(parents):
            siblings.setdefault(parent, []).append(tokens[n])
        assert all(len(set(v)) == len(v) for v in siblings.values())  # distinct tokens among siblings
        assert any(len(v) > 1 for v in siblings.values())  # it branches
        at += k


def test_after_a_tree_the_draft_cache_holds_what_a_fresh_draft_computes():
    """Accept a path through a non-first child: the keys of its expanded nodes are moved into
    place (KVCache.keep_path), and the next proposal equals, token for token, that of a draft that
    reads the whole grown sequence afresh."""
    p = proposer(3)
    seqs = sequences()
    proposal = p.propose(seqs, [4, 4, 4])
    outcome_tokens, accepted, at = [], [], 0
    for i, k in enumerate(proposal.num_tokens):
        parents, tokens = proposal.tree(i), proposal.token_ids[at : at + k].tolist()
        # the deepest path that ends at a node with a sibling before it (a second or third choice)
        leaf = max((n for n in range(k) if parents.index(parents[n]) != n),
                   key=lambda n: (len(_path(parents, n)), -n), default=k - 1)
        path = _path(parents, leaf)
        outcome_tokens.append([tokens[n] for n in path] + [11])
        accepted.append(len(path))
        at += k
    p.observe(seqs, VerifyOutput(outcome_tokens, accepted))
    for s, tokens in zip(seqs, outcome_tokens):
        s.output_token_ids += tokens
    fresh = proposer(3)
    assert torch.equal(p.propose(seqs, [4, 4, 4]).token_ids, fresh.propose(sequences([s.token_ids for s in seqs]), [4, 4, 4]).token_ids)


def _path(parents, n):
    path = []
    while n >= 0:
        path.append(n)
        n = parents[n]
    return path[::-1]


@pytest.fixture(scope="module")
def plain():
    return [o.token_ids for o in engine(None).generate_ids(PROMPTS, [GREEDY] * len(PROMPTS))]


@pytest.mark.parametrize("adaptive", [False, True])
def test_tree_drafts_equal_plain_greedy(plain, adaptive):
    eng = engine({"method": "draft_model", "model": NOISY, "num_speculative_tokens": 4, "num_branches": 3,
                  "adaptive": adaptive})
    moved = []
    keep = eng.proposer.kv.keep_path
    eng.proposer.kv.keep_path = lambda slot, start, nodes: moved.append(list(nodes)) or keep(slot, start, nodes)
    assert [o.token_ids for o in eng.generate_ids(PROMPTS, [GREEDY] * len(PROMPTS))] == plain
    assert eng.stats.num_accepted_tokens > 0
    if not adaptive:
        assert any(nodes != list(range(len(nodes))) for nodes in moved)  # a path through a later child


def test_a_sampled_request_drafts_a_tree_shaped_before_its_draws():
    """A sampled request under a branching config drafts a tree: the most valuable node of each
    level expanded, ``num_branches`` distinct children drawn from q without replacement, every
    node proposed with the q it was drawn from (siblings share it), nothing valued for a trim;
    the same seed draws the same tree."""
    def propose(seed):
        eng = engine({"method": "draft_model", "model": NOISY, "num_speculative_tokens": 3, "num_branches": 3})
        seqs = sequences(params=SamplingParams(max_tokens=8, temperature=0.8, seed=1))
        for s in seqs:
            s.generator.manual_seed(seed)
        return eng.proposer.propose(seqs, [3, 3, 3])

    proposal = propose(5)
    assert proposal.parents is not None and proposal.probs is not None and proposal.values == [None] * 3
    at = 0
    for i, k in enumerate(proposal.num_tokens):
        parents, tokens = proposal.parents[i], proposal.token_ids[at : at + k].tolist()
        q = proposal.probs[at : at + k]
        assert k == 9  # K x branches: three levels of three
        kids = {}
        for n, p in enumerate(parents):
            kids.setdefault(p, []).append(n)
        assert len(kids) == 3 and all(len(c) == 3 for c in kids.values())  # one node expanded a level
        for p, c in kids.items():
            assert len({tokens[n] for n in c}) == 3  # without replacement
            assert all(torch.equal(q[n], q[c[0]]) for n in c)  # drawn from one q
            assert all(q[n, tokens[n]] > 0 for n in c)
            assert p == -1 or p in kids[parents[p]]
        assert torch.allclose(q.sum(-1), torch.ones(k))
        at += k
    again = propose(5)
    assert torch.equal(again.token_ids, proposal.token_ids) and again.parents == proposal.parents
    assert not torch.equal(propose(6).token_ids, proposal.token_ids)


def _samples(spec: dict | None, seeds, temperature: float = 10.0) -> list[list[int]]:
    """8 tokens of PROMPTS[0] for each seed, a batch of 4 at a time. The tiny target is so sure
    of itself (its top token at 1 - 1e-10) that only a high temperature leaves anything to sample:
    at 10, its first token is 9 for about 3 seeds in 4, and 9 to 23 tokens are seen a position."""
    eng = engine(spec)
    seeds, out = list(seeds), []
    for a in range(0, len(seeds), 4):
        params = [SamplingParams(max_tokens=8, temperature=temperature, seed=s, ignore_eos=True) for s in seeds[a : a + 4]]
        out += [o.token_ids for o in eng.generate_ids([PROMPTS[0]] * len(params), params)]
    return out


SAMPLED_TREES = {"method": "draft_model", "model": NOISY, "num_speculative_tokens": 3, "num_branches": 2}


def test_sampled_tree_drafts_follow_the_target():
    """Rejection sampling over the tree's siblings (verify/tree.py) keeps the target's
    distribution: per-position TV against plain sampling, beside its permutation null."""
    from quickdraft.evaluation.stats import tv_test

    plain, speculative = _samples(None, range(160)), _samples(SAMPLED_TREES, range(160, 320))
    assert tv_test(speculative, plain, 8).p_value > 0.001


def test_a_wrong_q_under_sampled_trees_is_detected(monkeypatch):
    """The test above has power: children drawn from a sharpened q, but q handed on as drawn from
    the draft's own, over-accepts the draft's likeliest tokens, and the TV test sees it."""
    from quickdraft.evaluation.stats import tv_test
    from quickdraft.proposers import tree_drafts

    real = tree_drafts.sampled_children

    def wrong(logits, seq, count, head_ids, vocab_size):
        children, _ = real(logits * 4.0, seq, count, head_ids, vocab_size)
        _, q = real(logits, seq, 0, head_ids, vocab_size)
        return children, q

    monkeypatch.setattr("quickdraft.proposers.draft.model.sampled_children", wrong)
    plain, speculative = _samples(None, range(160)), _samples(SAMPLED_TREES, range(160, 320))
    assert tv_test(speculative, plain, 8).p_value < 0.01


def test_a_text_draft_takes_no_branches():
    with pytest.raises(ConfigError, match="num_branches"):
        SpeculativeConfig.parse({"method": "draft_model", "model": "x", "cross_tokenizer": True, "num_branches": 2})


def test_the_planner_keeps_the_nodes_whose_rows_pay():
    cheap = LinearCost([(1, 0.010), (16, 0.0115)])  # rows nearly free: every node worth anything pays
    dear = LinearCost([(1, 0.010), (16, 0.160)])  # a row costs as much as a pass
    values = [[0.9, 0.5, 0.3, 0.05], None, [0.2, 0.1]]
    assert plan_tree_sizes(values, cheap, rows=3, keys=0, contexts=[0, 0, 0]) == [4, -1, 2]
    kept = plan_tree_sizes(values, dear, rows=3, keys=0, contexts=[0, 0, 0])
    assert kept[1] == -1 and kept[0] < 4 and kept[2] == 0
    # a node is taken only after every more valuable node of its tree
    assert plan_tree_sizes([[0.9, 0.8, 0.7]], dear, rows=1, keys=0, contexts=[0])[0] >= 1


def test_trimming_keeps_a_tree():
    proposal = DraftProposal(torch.tensor([1, 2, 3, 4, 5, 6]), [4, 2], None,
                             [[-1, -1, 0, 2], None], [[0.9, 0.4, 0.6, 0.3], None])
    out = proposal.trimmed([3, -1])
    assert out.token_ids.tolist() == [1, 2, 3, 5, 6] and out.num_tokens == [3, 2]
    assert out.parents == [[-1, -1, 0], None] and out.values == [[0.9, 0.4, 0.6], None]


def test_edge_calibration_follows_what_the_target_takes():
    cal = EdgeCalibration(decay=0.5, prior=1.0)
    for _ in range(20):  # the draft says 0.9 for its first child; the target never takes it
        tree = DraftTreeState()
        tree.add_children(-1, [(1, 0.9), (2, 0.05)], cal)
        cal.record(tree, [], [7])
    assert cal.scale(1) < 0.05
    per_depth = EdgeCalibration(levels=2, decay=0.5, prior=1.0)
    for _ in range(20):  # the first level always right, the second never
        tree = DraftTreeState()
        tree.add_children(-1, [(1, 0.5)], per_depth)
        tree.fed[0] = 0
        tree.add_children(0, [(2, 0.5)], per_depth)
        per_depth.record(tree, [0], [1, 9])
    assert per_depth.scale(1) > 1.5 and per_depth.scale(2) < 0.05 and per_depth.scale(5) == per_depth.scale(2)


def test_trees_are_grown_while_they_are_measured_faster():
    choice = TreeChoice(probe=4)
    assert choice.use_trees() is False  # each shape once: chains first
    choice.record(False, 10, 1.0)
    assert choice.use_trees() is True
    choice.record(True, 12, 1.0)  # trees ahead: grown, but for every 4th step's probe of chains
    picks = [choice.use_trees() for _ in range(8)]
    assert picks.count(False) == 2 and picks.count(True) == 6
    for _ in range(30):
        choice.record(True, 5, 1.0)  # then trees fall behind: chains, trees only as the probe
    picks = [choice.use_trees() for _ in range(8)]
    assert picks.count(True) == 2


def test_the_engine_measures_trees_against_chains(plain):
    eng = engine({"method": "draft_model", "model": NOISY, "num_speculative_tokens": 4, "num_branches": 2,
                  "adaptive": True})
    assert [o.token_ids for o in eng.generate_ids(PROMPTS, [GREEDY] * len(PROMPTS))] == plain
    choice = eng.runner.trees
    assert choice.rate(True) is not None and choice.rate(False) is not None
