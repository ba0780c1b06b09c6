"""The fast verifier equals the paper-faithful reference draw by draw, for the same uniforms."""

import math
import random

import pytest
import torch

from quickdraft.sampling import BatchSampling, SamplingParams, logits_to_probs, sample_from_probs
from quickdraft.verify import verify
from quickdraft.verify.reference import reference_verify

TEMPERATURES = [0.0, 0.3, 1.0, 1.7]
TOP_KS = [0, -1, 1, 4, 16]
TOP_PS = [1.0, 0.95, 0.6, 0.05]


def shaped(logits, params):
    """logits [n, V] shaped by one request's params -> probs [n, V]."""
    n = logits.shape[0]
    return logits_to_probs(
        logits,
        torch.full((n,), float(params.temperature)),
        torch.full((n,), params.top_k, dtype=torch.int64),
        torch.full((n,), float(params.top_p)),
    )


def random_sequence(rng: random.Random, gen: torch.Generator, vocab: int, point_mass: bool):
    """One sequence's (params, draft ids [K], target logits [K + 1, V], q [K, V], uniforms [K + 1])."""
    k = rng.choice([0, 1, 2, 3, 5])
    params = SamplingParams(temperature=rng.choice(TEMPERATURES), top_k=rng.choice(TOP_KS), top_p=rng.choice(TOP_PS))
    target = torch.randn(k + 1, vocab, generator=gen) * rng.choice([0.5, 2.0, 5.0])
    # Drafts from near-copies of the target (high acceptance) to unrelated models (low).
    draft_logits = target[:k] + torch.randn(k, vocab, generator=gen) * rng.choice([0.1, 1.0, 4.0])
    q = shaped(draft_logits, params) if k else torch.zeros(0, vocab)
    if point_mass:
        ids = torch.randint(vocab, (k,), generator=gen) if rng.random() < 0.5 else target[:k].argmax(-1)
    elif k:
        ids = sample_from_probs(q, torch.rand(k, generator=gen, dtype=torch.float64))
    else:
        ids = torch.zeros(0, dtype=torch.int64)
    uniforms = torch.rand(k + 1, generator=gen, dtype=torch.float64)
    edge = rng.random()
    if edge < 0.1:
        uniforms[:] = 0.0
    elif edge < 0.2:
        uniforms[:] = math.nextafter(1.0, 0.0)
    return params, ids, target, q, uniforms


def check_batch(seqs, point_mass: bool):
    """verify on the concatenated batch == reference_verify on each sequence alone."""
    params, ids, target, q, uniforms = zip(*seqs)
    out = verify(
        torch.cat(ids),
        [len(i) for i in ids],
        torch.cat(target),
        None if point_mass else torch.cat(q),
        BatchSampling.from_params(params),
        torch.cat(uniforms),
    )
    for i, (p_i, ids_i, target_i, q_i, u_i) in enumerate(seqs):
        expected = reference_verify(ids_i.tolist(), target_i, None if point_mass else q_i, p_i, u_i)
        assert (out.token_ids[i], out.num_accepted[i]) == expected, (i, p_i)
    return out


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("vocab", [7, 64, 2000])  # 2000: partial sorts, and full ones
def test_fast_equals_reference_on_random_ragged_batches(point_mass, vocab):
    rng = random.Random(vocab * 2 + point_mass)
    gen = torch.Generator().manual_seed(vocab * 2 + point_mass)
    accepted = rejected = 0
    for _ in range(60):
        seqs = [random_sequence(rng, gen, vocab, point_mass) for _ in range(rng.randint(1, 6))]
        out = check_batch(seqs, point_mass)
        accepted += sum(out.num_accepted)
        rejected += sum(n < len(s[1]) for n, s in zip(out.num_accepted, seqs))
    assert accepted > 50 and rejected > 50  # both branches were exercised


def test_reference_names_follow_the_paper_on_a_hand_case():
    """gamma = 2, p_1 accepts x_1 = 0 surely (p >= q), x_2 = 1 is rejected (r_2 >= p/q), and t is
    drawn from norm(max(0, p_2 - q_2)) with the last uniform."""
    p = torch.tensor([[0.6, 0.2, 0.2], [0.5, 0.1, 0.4], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.6, 0.2]])
    params = SamplingParams(temperature=1.0)
    uniforms = torch.tensor([0.99, 0.5, 0.5], dtype=torch.float64)
    tokens, n = reference_verify([0, 1], p.log(), q, params, uniforms)
    # residual (0.3, 0, 0.2) -> 0.5 * 0.5 = 0.25 falls in token 0's 0.3.
    assert (tokens, n) == ([0, 0], 1)
    out = verify(torch.tensor([0, 1]), [2], p.log(), q, BatchSampling.from_params([params]), uniforms)
    assert (out.token_ids[0], out.num_accepted[0]) == (tokens, n)
