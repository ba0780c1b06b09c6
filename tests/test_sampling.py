"""logits -> probabilities (temperature, top-k, top-p), inverse-CDF sampling, generators."""

import math

import pytest
import torch

from quickdraft import sampling
from quickdraft.errors import ConfigError
from quickdraft.sampling import (
    BatchSampling,
    SamplingParams,
    draw_uniforms,
    logits_to_probs,
    make_generator,
    sample_from_probs,
)


@pytest.fixture(params=["kernels", "torch"], autouse=True)
def path(request, monkeypatch):
    """Every test on both of logits_to_probs' (and sample_from_probs') paths: the CPU kernels'
    where they build, and torch's (CUDA's, and a CPU without the kernels)."""
    if request.param == "torch":
        monkeypatch.setattr(sampling, "row_kernels", lambda x: None)
    elif sampling.row_kernels(torch.zeros(1, 1)) is None:
        pytest.skip("the CPU kernels are not available here")
    return request.param


def shape(logits, temperature=1.0, top_k=0, top_p=1.0):
    """logits_to_probs with the same params on every row of ``logits`` [N, V]."""
    n = logits.shape[0]
    return logits_to_probs(
        logits,
        torch.full((n,), temperature, dtype=torch.float32),
        torch.full((n,), top_k, dtype=torch.int64),
        torch.full((n,), top_p, dtype=torch.float32),
    )


def test_batch_sampling_from_params():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]
    batch = BatchSampling.from_params(params, "cpu")
    assert batch.temperature.dtype == torch.float32 and batch.top_k.dtype == torch.int64
    assert batch.top_p.dtype == torch.float32 and len(batch) == 2
    assert batch.greedy.tolist() == [True, False]
    assert batch.top_k.tolist() == [0, 5]
    picked = batch.select(torch.tensor([1, 1, 0])).to("cpu")
    assert picked.greedy.tolist() == [False, False, True]
    assert picked.top_p.tolist() == pytest.approx([0.9, 0.9, 1.0])


def test_temperature_one_is_softmax_and_scaling_sharpens():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(shape(logits), torch.softmax(logits, -1))
    assert torch.allclose(shape(logits, temperature=0.5), torch.softmax(logits / 0.5, -1))
    assert torch.allclose(shape(logits, temperature=2.0), torch.softmax(logits / 2.0, -1))


def test_temperature_zero_is_one_hot_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 5.0]])
    probs = shape(logits, temperature=0.0, top_k=2, top_p=0.5)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_top_k_keeps_k_tokens_and_top_k_one_equals_greedy():
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0, 0.0]])
    probs = shape(logits, top_k=2)
    assert (probs > 0).tolist() == [[False, True, False, True, False]]
    assert torch.allclose(probs[0, [1, 3]], torch.softmax(torch.tensor([4.0, 3.0]), -1))
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(shape(logits, temperature=0.8, top_k=1), shape(logits, temperature=0.0))


def test_ties_with_the_cut_off_value_are_kept():
    """The kept set depends on values only, never on how a sort orders equal ones."""
    assert (shape(torch.tensor([[2.0, 1.0, 2.0, 2.0]]), top_k=2) > 0).tolist() == [[True, False, True, True]]
    assert (shape(torch.tensor([[0.0, 1.0, 1.0, -1.0]]), top_p=0.1) > 0).tolist() == [[False, True, True, False]]


def brute_force_keep(row: list[float], top_k: int, top_p: float) -> list[bool]:
    """The kept set by definition: cut-off at the k-th value, then at the nucleus's last value."""
    values = sorted(row, reverse=True)
    kth = values[top_k - 1] if 0 < top_k < len(row) else -math.inf
    kept = [v for v in values if v >= kth]
    total = sum(math.exp(v) for v in kept)
    mass, cutoff = 0.0, -math.inf
    if top_p < 1:
        for v in kept:
            cutoff, mass = v, mass + math.exp(v) / total
            if mass >= top_p:
                break
    return [v >= max(kth, cutoff) for v in row]


def test_top_k_top_p_match_the_definition_on_tied_logits():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randint(-3, 4, (300, 12), generator=gen).float() * 0.5  # many ties
    top_k = torch.randint(-1, 14, (300,), generator=gen)
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.77, 0.95, 1.0]).repeat(50)
    probs = logits_to_probs(logits, torch.ones(300), top_k, top_p)
    for i in range(300):
        expected = brute_force_keep(logits[i].tolist(), int(top_k[i]), float(top_p[i]))
        assert (probs[i] > 0).tolist() == expected, (logits[i], top_k[i], top_p[i])


def test_partial_sort_equals_full_sort(monkeypatch, path):
    """torch's path: rows are first cut among the top 1024 candidates; ones that need more (a flat
    nucleus, a large top_k) fall back to a full sort. Both give exactly the full-sort result. (The
    kernels never sort a whole row: test_flat_rows_and_large_top_k_match_the_definition.)"""
    if path == "kernels":
        pytest.skip("_CANDIDATES is torch's path's")
    gen = torch.Generator().manual_seed(7)
    vocab = 5000
    logits = torch.randn(6, vocab, generator=gen) * torch.tensor([[4.0], [4.0], [0.1], [4.0], [0.1], [1.0]])
    top_k = torch.tensor([0, 40, 0, 2000, 3000, 0])
    top_p = torch.tensor([0.9, 0.8, 0.9, 1.0, 0.5, 0.999])
    temperature = torch.ones(6)
    fast = logits_to_probs(logits, temperature, top_k, top_p)
    monkeypatch.setattr(sampling, "_CANDIDATES", vocab)
    assert torch.equal(fast, logits_to_probs(logits, temperature, top_k, top_p))
    assert int((fast[2] > 0).sum()) > 1024 and int((fast[3] > 0).sum()) == 2000


def test_flat_rows_and_large_top_k_match_the_definition():
    """Nuclei of thousands of tokens and a top_k of thousands (the kernels widen their candidates
    round by round, up to every token): the kept set is the definition's."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(8, 3000, generator=gen) * torch.tensor([[0.05], [0.3], [1.0], [3.0]]).repeat(2, 1)
    top_k = torch.tensor([0, 0, 0, 0, 2500, 1200, 0, 900])
    top_p = torch.tensor([0.5, 0.9, 0.97, 0.999, 1.0, 0.95, 0.3, 0.8])
    probs = logits_to_probs(logits, torch.ones(8), top_k, top_p)
    for i in range(8):
        assert (probs[i] > 0).tolist() == brute_force_keep(logits[i].tolist(), int(top_k[i]), float(top_p[i])), i
    assert int((probs[0] > 0).sum()) > 1000 and int((probs[4] > 0).sum()) == 2500


def test_the_cut_reads_logits_whose_probabilities_underflow():
    """Tokens far below the top one (e^-87 and less) still keep their order: top-k cuts on the
    scaled logits, not on probabilities that round alike (the kernels' exponent stops at e^-87)."""
    logits = torch.tensor([[0.0, -200.0, -10.0, -300.0, -400.0, -500.0, -20.0, -600.0]])
    kept = [[True, False, True, False, False, False, True, False]]
    assert (shape(logits, top_k=3) > 0).tolist() == kept
    assert (shape(logits / 10, temperature=0.1, top_k=3) > 0).tolist() == kept
    # the 3rd token's probability rounds as the ones below it do (to e^-87 in the kernels, to 0 in
    # torch): they are cut all the same
    probs = shape(torch.tensor([[0.0, -10.0, -200.0, -300.0, -400.0, -500.0]]), top_k=3)
    assert probs[0, 3:].tolist() == [0.0, 0.0, 0.0] and probs[0, :2].sum() > 0.99


def test_top_p_keeps_smallest_prefix_reaching_the_mass():
    # probabilities 0.5, 0.3, 0.15, 0.05
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert (shape(logits, top_p=0.5) > 0).tolist() == [[True, False, False, False]]
    assert (shape(logits, top_p=0.51) > 0).tolist() == [[True, True, False, False]]
    assert (shape(logits, top_p=0.9) > 0).tolist() == [[True, True, True, False]]
    kept = shape(logits, top_p=0.9)[0, :3]
    assert torch.allclose(kept, torch.tensor([0.5, 0.3, 0.15]) / 0.95)


def test_top_p_tiny_keeps_only_the_top_token():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(2))
    assert torch.equal(shape(logits, top_p=1e-6), shape(logits, temperature=0.0))
    # a top_p float32 rounds to 0 (the smallest double, which validation lets through) too
    assert torch.equal(shape(logits, top_p=5e-324), shape(logits, temperature=0.0))


def test_top_p_applies_after_top_k_renormalization():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top-2 renormalized: 0.571, 0.429; top_p 0.6 then needs both.
    assert (shape(logits, top_k=2, top_p=0.6) > 0).tolist() == [[True, True, False, False]]


def test_rows_are_shaped_independently_and_sort_is_skipped_when_no_filter():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(3))
    probs = logits_to_probs(
        logits, torch.tensor([1.0, 0.0, 0.5]), torch.tensor([3, 0, 0]), torch.tensor([1.0, 1.0, 0.7])
    )
    assert torch.equal(probs[0], shape(logits[:1], top_k=3)[0])
    assert torch.equal(probs[1], shape(logits[1:2], temperature=0.0)[0])
    assert torch.equal(probs[2], shape(logits[2:], temperature=0.5, top_p=0.7)[0])
    assert torch.allclose(probs.sum(-1), torch.ones(3))


def test_float32_whatever_the_logits_dtype():
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(4)).bfloat16()
    probs = shape(logits, top_p=0.9)
    assert probs.dtype == torch.float32
    assert torch.equal(probs, shape(logits.float(), top_p=0.9))


def test_sample_from_probs_inverse_cdf():
    probs = torch.tensor([[0.25, 0.25, 0.5]] * 5)
    uniforms = torch.tensor([0.0, 0.2499, 0.25, 0.6, 0.9999], dtype=torch.float64)
    assert sample_from_probs(probs, uniforms).tolist() == [0, 0, 1, 2, 2]


def test_sample_from_probs_never_returns_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.0, 0.7, 0.0, 0.3, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    edge = math.nextafter(1.0, 0.0)  # 1 - eps, the largest uniform below 1
    for u in [0.0, 1e-300, 0.5, edge]:
        ids = sample_from_probs(probs, torch.tensor([u, u], dtype=torch.float64))
        assert (probs[torch.arange(2), ids] > 0).all(), (u, ids)
    low = sample_from_probs(probs, torch.tensor([0.0, 0.0], dtype=torch.float64))
    high = sample_from_probs(probs, torch.tensor([edge, edge], dtype=torch.float64))
    assert low.tolist() == [2, 1] and high.tolist() == [4, 1]


def test_sample_from_probs_unnormalized_and_tiny_mass():
    probs = torch.tensor([[0.0, 2.0, 6.0, 0.0], [1e-30, 0.0, 0.0, 0.0]])
    ids = sample_from_probs(probs, torch.tensor([0.3, math.nextafter(1.0, 0.0)], dtype=torch.float64))
    assert ids.tolist() == [2, 0]


def test_sample_from_probs_matches_distribution():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).expand(200_000, 4)
    ids = sample_from_probs(probs, draw_uniforms(make_generator(0), 200_000))
    freq = torch.bincount(ids, minlength=4).double() / 200_000
    assert torch.allclose(freq, probs[0].double(), atol=5 * math.sqrt(0.25 / 200_000))


def test_generators_are_seeded_or_fresh():
    a = draw_uniforms(make_generator(123, "cpu"), 8)
    b = draw_uniforms(make_generator(123, "cpu"), 8)
    c = draw_uniforms(make_generator(124, "cpu"), 8)
    assert a.dtype == torch.float64 and a.shape == (8,)
    assert ((a >= 0) & (a < 1)).all()
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(draw_uniforms(make_generator(None), 8), draw_uniforms(make_generator(None), 8))


@pytest.mark.parametrize("vocab", [151936])
def test_large_vocab_greedy_and_filtered(vocab):
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(5))
    probs = logits_to_probs(logits, torch.tensor([0.0, 0.7]), torch.tensor([0, 50]), torch.tensor([1.0, 0.9]))
    assert probs[0].argmax() == logits[0].argmax() and probs[0].sum() == 1
    assert 1 <= int((probs[1] > 0).sum()) <= 50


def test_min_p_drops_the_unlikely_and_renormalizes():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    probs = logits_to_probs(logits, torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0, 0, 0]), torch.tensor([1.0, 1.0, 1.0]),
                            torch.tensor([0.4, 0.0, 0.4]))
    assert torch.allclose(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))  # 0.15 and 0.05 < 0.4 * 0.5
    assert torch.allclose(probs[1], torch.tensor([0.5, 0.3, 0.15, 0.05]))  # off
    assert probs[2].tolist() == [1.0, 0.0, 0.0, 0.0]  # greedy stays greedy
    with pytest.raises(ConfigError):
        SamplingParams(min_p=1.5)
