"""verify/step.py, the verifier's one call a step: the rule it picks for a batch, the rows it fails,
the uniforms it draws; and the kernels' tree paths built from the parents, equal to those read
back from the mask."""

from __future__ import annotations

import random

import torch

from quickdraft.engine.runner import _tree_mask
from quickdraft.models.decoder import tree_paths, tree_paths_from_parents
from quickdraft.sampling import BatchSampling, SamplingParams, draw_uniforms, make_generator
from quickdraft.verify.rejection import verify
from quickdraft.verify.step import verify_step

V = 8


def _rows(*argmax: int) -> torch.Tensor:
    logits = torch.zeros(len(argmax), V)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


def test_a_greedy_chain_batch_walks_the_argmax():
    greedy = SamplingParams(temperature=0.0)
    out, ok = verify_step(torch.tensor([3, 4, 1]), [2, 1], _rows(3, 5, 0, 1, 2), [greedy, greedy], [None, None])
    assert ok == [True, True]
    assert out.token_ids == [[3, 5], [1, 2]] and out.num_accepted == [1, 1]


def test_a_sequence_whose_rows_are_not_finite_fails_alone():
    greedy = SamplingParams(temperature=0.0)
    logits = _rows(3, 5, 0, 1)
    logits[3, 2] = float("nan")
    out, ok = verify_step(torch.tensor([3, 1]), [1, 1], logits, [greedy, greedy], [None, None])
    assert ok == [True, False]
    assert out.token_ids[0] == [3, 5] and torch.equal(logits[2:], torch.zeros(2, V))


def test_sampled_chains_draw_each_requests_uniforms_and_match_verify():
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=2)]
    drafts, counts = torch.tensor([1, 2, 3, 4, 5]), [2, 1, 2]
    logits = torch.randn(sum(counts) + len(counts), V, generator=torch.Generator().manual_seed(0))
    gens = [make_generator(1), None, make_generator(2)]
    out, ok = verify_step(drafts, counts, logits.clone(), params, gens)
    coins = torch.cat([draw_uniforms(make_generator(1), 3), torch.zeros(2, dtype=torch.float64),
                       draw_uniforms(make_generator(2), 3)])
    want = verify(drafts, counts, logits, None, BatchSampling.from_params(params, "cpu"), coins)
    assert ok == [True] * 3 and out.token_ids == want.token_ids and out.num_accepted == want.num_accepted


def test_a_tree_batch_reports_each_trees_depth_and_path():
    greedy = SamplingParams(temperature=0.0)
    # sequence 0: a tree (node 0 and node 1 both children of the root, node 2 under node 0); sequence 1: a chain
    drafts, counts = torch.tensor([3, 4, 6, 1]), [3, 1]
    logits = _rows(3, 6, 0, 0, 1, 2)  # row 0 after the root, row i + 1 after node i; then the chain's
    out, ok = verify_step(drafts, counts, logits, [greedy, greedy], [None, None], parents=[[-1, -1, 0], None])
    assert ok == [True, True]
    assert out.token_ids == [[3, 6, 0], [1, 2]] and out.num_accepted == [2, 1]
    assert out.trees == [(2, False, [0, 2]), None]


def test_tree_paths_from_the_parents_are_those_of_the_mask():
    rng = random.Random(0)
    for _ in range(300):
        pending, n = rng.randint(1, 4), rng.randint(0, 10)
        parents = [rng.randint(-1, i - 1) for i in range(n)]
        for a, b in zip(tree_paths(_tree_mask(pending, parents)), tree_paths_from_parents(pending, parents)):
            assert torch.equal(a, b) and a.dtype == b.dtype
