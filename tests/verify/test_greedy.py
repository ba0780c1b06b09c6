"""Exact greedy verification from hand-built logits (after vLLM's create_logits_tensor)."""

import torch

from quickdraft.sampling import BatchSampling, SamplingParams
from quickdraft.verify import verify

VOCAB = 12
GREEDY = SamplingParams(temperature=0.0)


def create_logits(token_ids: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    """Target logits [sum(len + 1), vocab]: per sequence, one row per chosen token id with a large
    value there (100) and 0 elsewhere, so the argmax (and, sampled, nearly all the mass) is it."""
    rows = [tok for seq in token_ids for tok in seq]
    logits = torch.zeros(len(rows), vocab)
    logits[torch.arange(len(rows)), torch.tensor(rows, dtype=torch.int64)] = 100.0
    return logits


def run(drafts: list[list[int]], target: list[list[int]], params=None, draft_probs=None, uniforms=None):
    """verify on a ragged batch; ``target[i]`` is the target argmax at each of sequence i's K_i + 1 rows."""
    params = params or [GREEDY] * len(drafts)
    num_draft = [len(d) for d in drafts]
    total = sum(num_draft) + len(drafts)
    if uniforms is None:
        uniforms = torch.full((total,), 0.5, dtype=torch.float64)
    return verify(
        torch.tensor([t for d in drafts for t in d], dtype=torch.int64),
        num_draft,
        create_logits(target),
        draft_probs,
        BatchSampling.from_params(params),
        uniforms,
    )


def test_all_accepted_plus_bonus():
    out = run([[1, 2, 3]], [[1, 2, 3, 4]])
    assert out.token_ids == [[1, 2, 3, 4]] and out.num_accepted == [3]


def test_first_token_rejected():
    out = run([[1, 2, 3]], [[5, 2, 3, 4]])
    assert out.token_ids == [[5]] and out.num_accepted == [0]


def test_mid_rejection_ignores_later_matches():
    out = run([[1, 2, 3, 4]], [[1, 2, 7, 4, 9]])
    assert out.token_ids == [[1, 2, 7]] and out.num_accepted == [2]


def test_k_zero_is_plain_greedy_decoding():
    out = run([[]], [[9]])
    assert out.token_ids == [[9]] and out.num_accepted == [0]


def test_ragged_batch():
    out = run([[1, 2, 3], [], [4, 5]], [[1, 2, 3, 6], [7], [4, 8, 9]])
    assert out.token_ids == [[1, 2, 3, 6], [7], [4, 8]]
    assert out.num_accepted == [3, 0, 1]


def test_ragged_batch_all_empty_drafts():
    out = run([[], [], []], [[1], [2], [3]])
    assert out.token_ids == [[1], [2], [3]] and out.num_accepted == [0, 0, 0]


def test_ties_take_the_lowest_id():
    logits = torch.zeros(2, VOCAB)
    logits[:, [3, 5]] = 1.0
    out = verify(
        torch.tensor([5]), [1], logits, None, BatchSampling.from_params([GREEDY]), torch.zeros(2, dtype=torch.float64)
    )
    assert out.token_ids == [[3]] and out.num_accepted == [0]


def test_greedy_ignores_uniforms_and_draft_probs():
    drafts, target = [[1, 2, 3], [4]], [[1, 2, 5, 0], [4, 6]]
    expected = run(drafts, target)
    edge = torch.tensor([0.0, 1 - 1e-16, 0.3, 0.9, 0.0, 0.99], dtype=torch.float64)
    noise = torch.rand(4, VOCAB, generator=torch.Generator().manual_seed(0))
    for kwargs in [dict(uniforms=edge), dict(draft_probs=noise / noise.sum(-1, keepdim=True))]:
        assert run(drafts, target, **kwargs) == expected


def test_bfloat16_logits():
    logits = create_logits([[1, 2, 3]]).bfloat16()
    out = verify(torch.tensor([1, 4]), [2], logits, None, BatchSampling.from_params([GREEDY]),
                 torch.zeros(3, dtype=torch.float64))
    assert out.token_ids == [[1, 2]] and out.num_accepted == [1]


def test_mixed_greedy_and_sampled_in_one_batch():
    """Sampled rows on peaked logits behave like greedy ones for uniforms away from 0: the peak has
    probability 1 in float32 (accepted when drafted), any other token ~1e-44 (rejected, and the
    recovered draw lands on the peak)."""
    sampled = SamplingParams(temperature=1.0)
    hot = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)
    drafts = [[1, 2, 3], [1, 2, 3], [], [4, 5], [4, 5]]
    target = [[1, 2, 9, 0], [1, 2, 9, 0], [7], [4, 5, 6], [8, 5, 6]]
    params = [GREEDY, sampled, sampled, hot, GREEDY]
    out = run(drafts, target, params=params)
    assert out.token_ids == [[1, 2, 9], [1, 2, 9], [7], [4, 5, 6], [8]]
    assert out.num_accepted == [2, 2, 0, 2, 0]
