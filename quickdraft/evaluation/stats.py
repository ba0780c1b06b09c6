"""The statistics of a run (the bench's, ``quickdraft check``'s and ``advise``'s), as pure functions
of plain numbers.

Terms:
- *tokens/s* of one run: tokens after the first over the time from the first token to the last
  (``quickdraft.evaluation.measure.summarize``), so that time to first token (TTFT) is reported apart.
- *speedup* of a method on a request: its tokens/s over ``none``'s on the same request (and seed),
  both measured in the same run. A group's speedup is the median of those paired ratios; the
  geometric mean is given too (ratios multiply, so it is the mean that is symmetric in them).
- *mean accepted length*: tokens emitted per target pass, the bonus or recovered token counted
  (1.0 for plain decoding), pooled over the group: sum of tokens / sum of passes.
- *acceptance by position*: of the passes that had a draft token at position j, the fraction in
  which it was accepted, pooled over the group.
- *TV distance*: total variation between two empirical token distributions at one position,
  0.5 * sum_x |p(x) - q(x)|. Two finite samples of one distribution are still some way apart, so
  the figure comes with its null level: the same statistic on random splits of the pooled samples
  (a permutation test), whose mean is what sampling alone gives and whose spread is the error.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

END = -1  # the token that stands for "the sequence had already ended" at a position


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between order statistics (numpy's default); NaN when empty."""
    if len(values) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def geomean(values: Sequence[float]) -> float:
    vals = [v for v in values if v > 0]
    if not vals:
        return float("nan")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def paired_ratios(baseline: Mapping[Hashable, float], variant: Mapping[Hashable, float]) -> dict:
    """variant[key] / baseline[key] for every key measured by both (with a positive baseline)."""
    return {k: variant[k] / baseline[k] for k in variant if k in baseline and baseline[k] > 0}


def speedup(baseline: Mapping[Hashable, float], variant: Mapping[Hashable, float]) -> dict:
    """Paired speedup of ``variant`` over ``baseline`` (tokens/s by request key)."""
    ratios = list(paired_ratios(baseline, variant).values())
    return {"n": len(ratios), "median": median(ratios), "geomean": geomean(ratios),
            "p10": percentile(ratios, 10), "p90": percentile(ratios, 90)}


def pooled_acceptance(runs: Sequence[Mapping]) -> dict:
    """Pooled counters of runs with SpecStats' raw fields -> rates (see the module docstring)."""
    passes = sum(r["num_target_passes"] for r in runs)
    emitted = sum(r["num_emitted_tokens"] for r in runs)
    drafted = sum(r["num_draft_tokens"] for r in runs)
    accepted = sum(r["num_accepted_tokens"] for r in runs)
    width = max((len(r["drafts_per_position"]) for r in runs), default=0)
    d = [sum(r["drafts_per_position"][j] for r in runs if j < len(r["drafts_per_position"])) for j in range(width)]
    a = [sum(r["accepted_per_position"][j] for r in runs if j < len(r["accepted_per_position"])) for j in range(width)]
    return {
        "num_target_passes": passes, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
        "mean_accepted_length": emitted / passes if passes else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_by_position": [aj / dj if dj else 0.0 for aj, dj in zip(a, d)],
    }


# -- losslessness at temperature > 0 ---------------------------------------------------------------

def tv_distance(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """Total variation distance between the empirical distributions of samples a and b."""
    if not a or not b:
        raise ValueError("both samples need at least one element")
    pa: dict = {}
    pb: dict = {}
    for x in a:
        pa[x] = pa.get(x, 0) + 1 / len(a)
    for x in b:
        pb[x] = pb.get(x, 0) + 1 / len(b)
    return 0.5 * sum(abs(pa.get(x, 0.0) - pb.get(x, 0.0)) for x in set(pa) | set(pb))


def pad(runs: Sequence[Sequence[int]], length: int) -> np.ndarray:
    """Token sequences -> [n, length] int64, END after a sequence's last token."""
    out = np.full((len(runs), length), END, dtype=np.int64)
    for i, r in enumerate(runs):
        r = list(r)[:length]
        out[i, : len(r)] = r
    return out


def _codes(tokens: np.ndarray) -> tuple[np.ndarray, int]:
    """[n, T] tokens -> [n, T] codes, unique across positions (position t's values get their own
    range), and the number of codes: one bincount then counts every position at once."""
    codes = np.empty_like(tokens)
    offset = 0
    for t in range(tokens.shape[1]):
        _, inverse = np.unique(tokens[:, t], return_inverse=True)
        codes[:, t] = inverse.reshape(-1) + offset
        offset += int(inverse.max()) + 1
    return codes, offset


def _per_position_tv(codes: np.ndarray, in_a: np.ndarray, num_codes: int) -> np.ndarray:
    """[T] TV between the rows in_a and the others, position by position."""
    n_a, n_b = int(in_a.sum()), int((~in_a).sum())
    ca = np.bincount(codes[in_a].reshape(-1), minlength=num_codes) / n_a
    cb = np.bincount(codes[~in_a].reshape(-1), minlength=num_codes) / n_b
    diff = np.abs(ca - cb)
    # every position's codes lie in a contiguous range: sum each range
    bounds = np.concatenate([[0], (codes.max(axis=0) + 1)])
    return np.array([0.5 * diff[bounds[t] : bounds[t + 1]].sum() for t in range(codes.shape[1])])


@dataclass
class TVResult:
    tv: float  # mean over positions of the per-position TV distance
    null_mean: float  # the same statistic's mean over random splits of the pooled samples
    null_sd: float  # its standard deviation: the sampling error of ``tv``
    p_value: float  # P(null >= tv), permutation estimate with the +1 correction
    per_position: list[float]
    per_position_null: list[float]
    n_a: int
    n_b: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def tv_test(runs_a: Sequence[Sequence[int]], runs_b: Sequence[Sequence[int]], length: int,
            permutations: int = 200, seed: int = 0) -> TVResult:
    """Are two sets of sampled sequences drawn from one distribution? Statistic: the mean over
    positions 0..length-1 of the per-position token TV distance (END past a sequence's end).
    Whole sequences are permuted between the sets, so the dependence along a sequence is kept."""
    if not runs_a or not runs_b or length < 1:
        raise ValueError("need at least one sequence on each side and length >= 1")
    tokens = np.concatenate([pad(runs_a, length), pad(runs_b, length)])
    codes, num_codes = _codes(tokens)
    labels = np.zeros(len(tokens), dtype=bool)
    labels[: len(runs_a)] = True
    observed = _per_position_tv(codes, labels, num_codes)
    rng = np.random.default_rng(seed)
    null = np.stack([_per_position_tv(codes, rng.permutation(labels), num_codes) for _ in range(permutations)])
    stat, null_stat = observed.mean(), null.mean(axis=1)
    p = (1 + int((null_stat >= stat - 1e-12).sum())) / (permutations + 1)
    return TVResult(float(stat), float(null_stat.mean()), float(null_stat.std(ddof=1)) if permutations > 1 else 0.0,
                    p, observed.tolist(), null.mean(axis=0).tolist(), len(runs_a), len(runs_b))


def fisher_combine(p_values: Sequence[float]) -> float:
    """Fisher's combined p-value of independent tests: X = -2 sum ln p ~ chi2 with 2k degrees of
    freedom, whose survival function has the closed form exp(-X/2) sum_{i<k} (X/2)^i / i!."""
    ps = [min(max(p, 1e-300), 1.0) for p in p_values]
    if not ps:
        return float("nan")
    half = -sum(math.log(p) for p in ps)  # X / 2
    term, total = 1.0, 1.0
    for i in range(1, len(ps)):
        term *= half / i
        total += term
    return min(1.0, math.exp(-half) * total)


def combine_tv(results: Sequence[TVResult]) -> dict:
    """A group's TV figures: means over its requests; the error of a mean of independent
    requests is the root sum of squares over n; p values combined by Fisher's method."""
    if not results:
        return {"n": 0}
    n = len(results)
    return {
        "n": n,
        "tv": sum(r.tv for r in results) / n,
        "tv_null": sum(r.null_mean for r in results) / n,
        "tv_se": math.sqrt(sum(r.null_sd ** 2 for r in results)) / n,
        "p_value": fisher_combine([r.p_value for r in results]),
        "min_p_value": min(r.p_value for r in results),
    }


# -- losslessness when greedy --------------------------------------------------------------------

def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token sequences differ (one ending early counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


