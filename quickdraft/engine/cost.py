"""What a step costs, and how many draft tokens pay for it: K chosen per sequence, per step.

Speculation pays only while the tokens it gains are worth more than the rows it adds to the
target's pass and the draft passes it runs. On a CPU neither is free: verifying K+1 rows of a
1.5B model costs ~11 ms a row on top of ~120 ms for the pass (compute, not bandwidth, once there
are a few rows), and the target's cost grows with the batch's total rows. A fixed K or a fixed
batch-size switch (vLLM's ``disable_by_batch_size``) is right for one workload and wrong for the
next, so the engine plans each step the way SmartSpec (Liu et al. 2024, "goodput") does:

* ``LinearCost``: seconds = a + b * rows for one pass of a model, fitted by least squares to a
  short calibration at start-up and refitted to every pass the engine times afterwards, so the
  model follows the machine (a shared machine's speed drifts).
* Each sequence's acceptance rate alpha is estimated from its own recent passes, shrunk towards
  the engine-wide rate while it has few; under the usual i.i.d. model a chain of k drafts yields
  1 + alpha + ... + alpha^k tokens on average (Leviathan et al. 2023, eq. 1).
* ``plan_draft_lengths`` picks the K_i that maximize expected tokens per second of the whole
  step: sequences whose drafts keep failing get K = 0, and once the batch is large enough that
  rows are dear, every K shrinks, down to plain decoding.

The plan changes nothing but speed: it only decides how many draft tokens the verifier sees.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import numpy as np
import torch

CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32)
RECENT = 64  # passes kept for the refit
ANCHOR_WEIGHT = 4.0  # a calibration point weighs as much as this many timed passes


class LinearCost:
    """seconds(rows) = a + b * rows, for one forward pass of one model over a batch of rows."""

    def __init__(self, points: list[tuple[int, float]]):
        if not points:
            raise ValueError("a cost model needs at least one calibration point")
        self._anchors = list(points)
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=RECENT)
        self._fit()

    @property
    def a(self) -> float:
        return self._a

    @property
    def b(self) -> float:
        return self._b

    def __call__(self, rows: int) -> float:
        return self._a + self._b * rows

    def observe(self, rows: int, seconds: float) -> None:
        self._recent.append((rows, seconds))
        self._fit()

    def _fit(self) -> None:
        pts = self._anchors + list(self._recent)
        w = np.array([ANCHOR_WEIGHT] * len(self._anchors) + [1.0] * len(self._recent))
        x = np.array([p[0] for p in pts], dtype=np.float64)
        y = np.array([p[1] for p in pts], dtype=np.float64)
        if np.ptp(x) == 0:  # one row count only: no slope to learn, so assume rows cost in proportion
            self._a, self._b = 0.0, float(np.average(y, weights=w)) / max(x[0], 1.0)
            return
        xm, ym = np.average(x, weights=w), np.average(y, weights=w)
        b = float(np.sum(w * (x - xm) * (y - ym)) / np.sum(w * (x - xm) ** 2))
        b = max(b, 0.0)
        self._a, self._b = max(float(ym - b * xm), 0.0), b

    def to_dict(self) -> dict:
        return {"a_s": self._a, "b_s_per_row": self._b}


def calibrate(decoder, kv, slot: int = 0, rows=CALIBRATION_ROWS, repeats: int = 2) -> LinearCost:
    """Time ``decoder`` on chains of ``rows`` new tokens at the start of ``slot`` (best of
    ``repeats``). It writes keys there, so call it before any sequence holds that slot."""
    from quickdraft.models.decoder import AttentionMetadata

    rows = [r for r in rows if r <= kv.max_len]
    points = []
    device = decoder.device
    for n in rows:
        meta = AttentionMetadata.chain([slot], [0], [n])
        tokens = torch.zeros(n, dtype=torch.long, device=device)
        positions = meta.positions(device)
        best = float("inf")
        for _ in range(repeats + 1):  # the first run warms caches and kernels
            t0 = time.perf_counter()
            decoder.logits(decoder.forward(tokens, positions, kv, meta)[-1:]).cpu()
            best = min(best, time.perf_counter() - t0)
        points.append((n, best))
    return LinearCost(points)


@dataclass
class Acceptance:
    """Decayed counts of accepted drafts and of chains that ended in a rejection, so that
    alpha = hits / (hits + misses) follows the text as it changes (the geometric model's MLE)."""

    hits: float = 0.0
    misses: float = 0.0
    decay: float = 0.9

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.hits = self.decay * self.hits + num_accepted
        self.misses = self.decay * self.misses + (1.0 if num_accepted < num_drafts else 0.0)

    def rate(self, prior: float, prior_weight: float = 2.0) -> float:
        """The posterior mean, with ``prior_weight`` pseudo-trials at ``prior``."""
        return (self.hits + prior_weight * prior) / (self.hits + self.misses + prior_weight)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one pass yields with k drafts accepted i.i.d. at rate alpha: 1 + alpha + ... + alpha^k."""
    return sum(alpha**j for j in range(k + 1))


def plan_draft_lengths(
    alphas: list[float],  # [batch] acceptance estimate per sequence
    caps: list[int],  # [batch] the most drafts each may take (0: none this step)
    base_rows: int,  # rows the target runs whatever the plan (every sequence's pending tokens)
    target: LinearCost,
    draft: LinearCost | None,  # None: drafts cost nothing to make (ngram)
    catchup: list[float] | None = None,  # [batch] rows the draft must read before it drafts (or a share of them)
) -> list[int]:
    """The K_i that maximize expected tokens per second of this step; [0] * batch = plain.

    For each draft depth L the fixed cost is L draft passes; then draft tokens are added in
    order of their expected gain alpha_i^j while each one's gain per second beats the step's
    tokens per second so far (adding a better-than-average item raises the average). The best L
    wins. Costs are linear in rows, so the marginal cost of a token is one target row plus one
    draft row, plus the draft's catch-up rows for a sequence's first draft."""
    batch = len(alphas)
    catchup = catchup or [0] * batch
    a_d, b_d = (draft.a, draft.b) if draft is not None else (0.0, 0.0)
    best_ks, best_rate = [0] * batch, batch / max(target(base_rows), 1e-9)
    for depth in range(1, max(caps, default=0) + 1):
        items = sorted(
            ((alphas[i] ** j, i, j) for i in range(batch) for j in range(1, min(depth, caps[i]) + 1)),
            key=lambda item: (-item[0], item[2], item[1]),
        )
        ks = [0] * batch
        tokens, seconds = float(batch), target(base_rows) + depth * a_d
        for gain, i, j in items:
            if ks[i] != j - 1:
                continue  # its earlier draft was not worth it, so this one is not either
            cost = target.b + b_d + (b_d * catchup[i] if j == 1 else 0.0)
            if gain * seconds > tokens * cost:
                ks[i] = j
                tokens += gain
                seconds += cost
        if any(ks) and tokens / seconds > best_rate:
            best_ks, best_rate = ks, tokens / seconds
    return best_ks


def step_rate(ks: list[int], alphas: list[float], base_rows: int, target: LinearCost,
              draft: LinearCost | None) -> float:
    """Expected tokens per second of one step with draft lengths ``ks`` (what the plan maximizes)."""
    seconds = target(base_rows + sum(ks))
    if draft is not None and any(ks):
        seconds += sum(draft(sum(k >= j for k in ks)) for j in range(1, max(ks) + 1))
    return sum(expected_tokens(a, k) for a, k in zip(alphas, ks)) / seconds
