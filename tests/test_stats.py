"""The statistics of a run (quickdraft/evaluation/stats.py) on hand-made inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quickdraft.evaluation import measure, stats


def test_median_and_percentiles():
    assert stats.median([3, 1, 4, 2]) == 2.5
    assert stats.median([5]) == 5
    assert stats.percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert math.isnan(stats.median([]))


def test_speedup_pairs_by_key_only():
    base = {"a": 10.0, "b": 20.0, "c": 5.0, "z": 0.0}
    var = {"a": 20.0, "b": 20.0, "d": 100.0, "z": 3.0}  # d has no baseline, z a zero one
    assert stats.paired_ratios(base, var) == {"a": 2.0, "b": 1.0}
    s = stats.speedup(base, var)
    assert s["n"] == 2 and s["median"] == 1.5 and s["geomean"] == pytest.approx(math.sqrt(2))
    # pairing matters: the medians of tokens/s alone would say 20 / 10 = 2.0
    assert stats.median(list(var.values())) / stats.median(list(base.values())) != s["median"]


def test_geomean_is_symmetric_in_ratios():
    assert stats.geomean([2.0, 0.5]) == pytest.approx(1.0)


def run(passes, emitted, drafted, accepted, dpp, app):
    return {"num_target_passes": passes, "num_emitted_tokens": emitted, "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted, "drafts_per_position": dpp, "accepted_per_position": app}


def test_pooled_acceptance():
    runs = [run(4, 10, 9, 6, [3, 3, 3], [3, 2, 1]), run(2, 3, 2, 1, [2], [1])]
    a = stats.pooled_acceptance(runs)
    assert a["mean_accepted_length"] == 13 / 6
    assert a["acceptance_rate"] == 7 / 11
    assert a["acceptance_by_position"] == [4 / 5, 2 / 3, 1 / 3]
    assert stats.pooled_acceptance([run(5, 5, 0, 0, [], [])])["mean_accepted_length"] == 1.0


def test_tv_distance_by_hand():
    assert stats.tv_distance([0, 0, 1, 1], [0, 0, 0, 0]) == pytest.approx(0.5)
    assert stats.tv_distance([1, 2, 3], [3, 2, 1]) == 0.0
    assert stats.tv_distance(["a"], ["b"]) == 1.0


def test_tv_test_per_position_with_end_padding():
    a = [[1, 2, 3], [1, 2]]  # the second sequence ended after two tokens
    b = [[1, 2, 3], [1, 5, 3]]
    r = stats.tv_test(a, b, length=3, permutations=50)
    assert r.per_position == pytest.approx([0.0, 0.5, 0.5])
    assert r.tv == pytest.approx(1 / 3)


def test_tv_test_same_distribution_sits_at_its_null_level():
    rng = np.random.default_rng(1)
    probs = [0.5, 0.3, 0.2]
    a = rng.choice(3, size=(200, 4), p=probs).tolist()
    b = rng.choice(3, size=(200, 4), p=probs).tolist()
    r = stats.tv_test(a, b, length=4, permutations=200, seed=2)
    assert r.tv > 0  # finite samples are never identical ...
    assert abs(r.tv - r.null_mean) < 4 * r.null_sd  # ... but are as far apart as sampling makes them
    assert r.p_value > 0.01
    assert 0 < r.null_sd < r.null_mean


def test_tv_test_detects_a_different_distribution():
    rng = np.random.default_rng(3)
    a = rng.choice(3, size=(200, 4), p=[0.5, 0.3, 0.2]).tolist()
    b = rng.choice(3, size=(200, 4), p=[0.3, 0.3, 0.4]).tolist()
    r = stats.tv_test(a, b, length=4, permutations=200)
    assert r.tv > r.null_mean + 4 * r.null_sd
    assert r.p_value == pytest.approx(1 / 201)


def test_fisher_combine():
    assert stats.fisher_combine([0.3]) == pytest.approx(0.3)
    # X = -2 (ln .5 + ln .5) = 2.77, chi2 with 4 dof: exp(-X/2) (1 + X/2)
    assert stats.fisher_combine([0.5, 0.5]) == pytest.approx(0.25 * (1 + 2 * math.log(2)))
    assert stats.fisher_combine([1e-6, 0.9]) < 1e-4


def test_combine_tv():
    r = stats.TVResult(0.2, 0.1, 0.03, 0.5, [], [], 4, 4)
    c = stats.combine_tv([r, r])
    assert c["tv"] == 0.2 and c["tv_null"] == 0.1
    assert c["tv_se"] == pytest.approx(math.sqrt(2 * 0.03**2) / 2)


def test_first_divergence_and_ulp():
    assert stats.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert stats.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert stats.first_divergence([1, 2], [1, 2, 3]) == 2  # one ended early
    assert measure.ulp(20.0, 2**-7) == 16 * 2**-7
    assert measure.ulp(-0.75, 2**-7) == 0.5 * 2**-7
