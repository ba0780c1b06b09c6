"""What a step costs, and how many draft tokens pay for it: K chosen per sequence, per step.

Speculation pays only while the tokens it gains are worth more than the rows it adds to the
target's pass and the draft passes it runs. On a CPU neither is free: verifying K+1 rows of a
1.5B model costs ~11 ms a row on top of ~120 ms for the pass (compute, not bandwidth, once there
are a few rows), and the target's cost grows with the batch's total rows. A fixed K or a fixed
batch-size switch (vLLM's ``disable_by_batch_size``) is right for one workload and wrong for the
next, so the engine plans each step the way SmartSpec (Liu et al. 2024, "goodput") does:

* ``LinearCost``: seconds = a + b * rows + b' * max(0, rows - KNEE) + s * chains + c * keys
  read, for one pass of a model (rows cost less while a pass is short: see KNEE), fitted by
  least squares to a short calibration at start-up (9 s for a 1.5B on this CPU, once per loaded
  model and process) and refitted to the passes the engine times afterwards, so
  the model follows the machine (a shared machine's speed drifts).
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
import hashlib
import json
import logging
import math
import os
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

log = logging.getLogger("quickdraft.engine")

# Calibration passes: (chains, new tokens per chain, context before them). Context and chain
# count matter beside rows: attention reads every cached key for every row, and each chain has
# its own attention calls (models/decoder/reference.py), so a batch of 8 chains of 5 costs more than one
# chain of 40 (572 against ~475 ms for the 1.5B here).
CALIBRATION = ((1, 1, 0), (1, 4, 0), (1, 16, 0), (1, 32, 0), (1, 1, 256), (1, 8, 256), (4, 1, 256),
               (4, 4, 256), (8, 2, 256))
RECENT = 64  # passes kept for the refit
# Rows past this many cost more each: the stored-block kernels are near the memory bound for a few
# rows and compute bound past it (AMD EPYC, 2 cores, Q4_K_M blocks; the 1.5B: ~7 ms a row from 1
# to 4 rows, ~12 past 8; the 0.5B draft: ~1.5 ms a row, then ~4). One straight line through 1..32
# rows put the 1.5B's one-row pass at 31 ms for a measured 36-43 and the draft's at 10.5 for
# 13.5-14, and so planned K=1 where fixed K=4 was faster (tests/engine/test_cost.py).
KNEE = 4
# Passes of a kind (draft passes, verification passes of several rows) the refit must have timed
# before the plan is trusted to keep a due probe from drafting (engine.py, _num_draft).
TRUSTED_PASSES = 16
ANCHOR_WEIGHT = 2.0  # a calibration point weighs as much as this many timed passes
# The scaled normal equations' condition number past which a fit is left to lstsq over the points
# (rounding in them grows with its square)
NEAR_SINGULAR = 1e8


def key_reads(context: int, rows: int) -> int:
    """Keys a chain of ``rows`` new tokens after ``context`` cached ones attends over in all."""
    return rows * context + rows * (rows + 1) // 2


class LinearCost:
    """seconds = a + b * rows + b_more * max(0, rows - KNEE) + s * chains + c * key_reads, for one
    forward pass of one model.

    Fitted by weighted least squares with every coefficient kept >= 0 (a feature that comes out
    negative is dropped and the rest refitted); a feature the points do not vary is left at 0.
    Points are (rows, seconds), or (rows, chains, key_reads, seconds).

    The engine refits after every pass it times, so the fit is kept cheap: the normal equations'
    sums (X^T W X [5, 5] and X^T W y [5]) are updated as a point comes and the oldest goes (O(1),
    recomputed from the points every RECENT passes so that rounding cannot build up), and solving
    them, columns scaled to a unit diagonal, is a 5 x 5 system. That is ``lstsq``'s answer to
    rounding; where the points leave the system near singular (fewer distinct points than
    features) the fit falls back to ``lstsq`` over the points, whose minimum-norm answer it then is."""

    def __init__(self, points: list[tuple]):
        if not points:
            raise ValueError("a cost model needs at least one calibration point")
        self._anchors = [self._point(*p) for p in points]
        self._recent: collections.deque[tuple[float, ...]] = collections.deque(maxlen=RECENT)
        x = np.array(self._anchors)[:, :5]
        self._anchor_varies = [bool(np.ptp(x[:, j]) > 0) for j in range(5)]
        self._anchor_value = x[0].tolist()  # a feature's value where the anchors do not vary it
        self._coef: tuple[float, ...] | None = None  # fitted when first read after a change
        self._resum()

    @staticmethod
    def _point(*p) -> tuple[float, ...]:
        rows, chains, keys, seconds = (p[0], 1, 0, p[1]) if len(p) == 2 else p
        return (1.0, float(rows), float(max(0, rows - KNEE)), float(chains), float(keys), float(seconds))

    @property
    def coef(self) -> tuple[float, ...]:
        """(a, b, b_more, s, c). A draft model observes K passes a step and the plan reads the fit
        once, so the fit runs on the first read after new observations, not on each. Python
        floats: the plan does scalar arithmetic with them, where numpy's scalars cost ~10x."""
        if self._coef is None:
            self._coef = tuple(self._fit())
        return self._coef

    a = property(lambda self: self.coef[0])
    b = property(lambda self: self.coef[1])
    b_more = property(lambda self: self.coef[2])
    per_chain = property(lambda self: self.coef[3])
    per_key = property(lambda self: self.coef[4])

    def __call__(self, rows: int, chains: int = 1, keys: int = 0) -> float:
        a, b, b_more, s, c = self.coef
        return a + b * rows + b_more * max(0, rows - KNEE) + s * chains + c * keys

    def row_cost(self, rows: int) -> float:
        """Seconds one more row adds to a pass of ``rows`` rows."""
        return self.b + (self.b_more if rows >= KNEE else 0.0)

    def scaled(self, factor: float) -> "LinearCost":
        """A model whose calibration points cost ``factor`` times this one's, with no timed passes
        yet: where a pass reads a share of this model (layer skipping's draft, proposers/draft/layer_skip.py)."""
        return LinearCost([(rows, chains, keys, seconds * factor) for _, rows, _, chains, keys, seconds in self._anchors])

    def observe(self, rows: int, seconds: float, chains: int = 1, keys: int = 0) -> None:
        point = self._point(rows, chains, keys, seconds)
        if len(self._recent) == RECENT:
            self._add(self._recent[0], -1.0)
        self._recent.append(point)
        self._add(point, 1.0)
        self._changes += 1
        if self._changes >= RECENT:
            self._resum()
        self._coef = None

    def observed(self, min_rows: int = 1) -> int:
        """Passes of at least ``min_rows`` rows timed since the calibration (the last RECENT)."""
        return sum(1 for p in self._recent if p[1] >= min_rows)

    def _add(self, point: tuple[float, ...], weight: float) -> None:
        """A timed pass's point into the sums (weight 1) or out of them (-1). Python lists, not
        numpy: at 5 x 5 scalar arithmetic costs less than numpy's calls (see _solve), and a draft
        model observes K passes a step."""
        for r in range(5):
            wr = weight * point[r]
            row = self._gram[r]
            for c in range(5):
                row[c] += wr * point[c]
            self._rhs[r] += wr * point[5]
        for j in range(5):
            if not self._anchor_varies[j] and point[j] != self._anchor_value[j]:
                self._differ[j] += int(weight)

    def _resum(self) -> None:
        """The sums from the points themselves."""
        pts, w = self._points()
        x = pts[:, :5]
        self._gram = ((x * w[:, None]).T @ x).tolist()  # [5][5]
        self._rhs = ((x * w[:, None]).T @ pts[:, 5]).tolist()  # [5]
        self._differ = [sum(1 for p in self._recent if p[j] != self._anchor_value[j]) for j in range(5)]
        self._changes = 0

    def _points(self) -> tuple[np.ndarray, np.ndarray]:
        """[points, 6] every point (features, seconds), [points] its weight."""
        pts = np.array(self._anchors + list(self._recent))
        return pts, np.array([ANCHOR_WEIGHT] * len(self._anchors) + [1.0] * len(self._recent))

    def _fit(self) -> list[float]:
        coef = [0.0] * 5
        # the intercept, and each feature the points vary
        active = [0] + [j for j in range(1, 5) if self._anchor_varies[j] or self._differ[j] > 0]
        if active == [0]:  # one shape only: no slope to learn, so assume rows cost in proportion
            coef[1] = self._rhs[0] / self._gram[0][0] / max(self._anchors[0][1], 1.0)
            return coef
        while True:
            sol = self._solve(active)
            negative = [j for j, v in zip(active, sol) if v < 0 and j != 0]
            if not negative:
                break
            active = [j for j in active if j not in negative]
        for j, v in zip(active, sol):
            coef[j] = max(v, 0.0)
        return coef

    def _solve(self, active: list[int]) -> list[float]:
        """The least-squares coefficients of the ``active`` features, from the normal equations.

        Solved in Python by Cholesky, with the columns scaled to a unit diagonal (keys, ~1e4,
        beside the intercept, 1): numpy's calls cost more than a 5 x 5 system's arithmetic (a refit
        of the 1.5B's model 165 -> 93 us, and ``observe`` 34 -> 14 us, on an AMD EPYC Zen 1; the
        engine refits twice a step, the target's model and the draft's).
        The system is trusted where a bound on its condition number is below NEAR_SINGULAR: with a
        unit diagonal the largest eigenvalue is at most n (the trace) and the smallest at least
        1 / trace(inverse), so cond <= n * trace(inverse), the inverse's trace read from L's
        inverse. Where the bound is not met (or Cholesky finds no positive pivot), numpy's
        eigenvalues decide, as before, and a near-singular system goes to lstsq."""
        n = len(active)
        gram = self._gram
        scale = [1.0 / math.sqrt(gram[j][j]) for j in active]
        a = [[gram[r][c] * scale[x] * scale[y] for y, c in enumerate(active)] for x, r in enumerate(active)]
        low = _cholesky(a)
        if low is not None:
            inv = _lower_inverse(low)
            trace = 0.0
            for row in inv:
                for v in row:
                    trace += v * v
            if n * trace < NEAR_SINGULAR:
                # a^-1 b = L^-T (L^-1 b), b the scaled right-hand side
                b = [self._rhs[j] * s for j, s in zip(active, scale)]
                y = [0.0] * n
                for r in range(n):
                    v, row = 0.0, inv[r]
                    for c in range(r + 1):
                        v += row[c] * b[c]
                    y[r] = v
                sol = [0.0] * n
                for c in range(n):
                    v = 0.0
                    for r in range(c, n):
                        v += inv[r][c] * y[r]
                    sol[c] = scale[c] * v
                return sol
        idx = np.asarray(active)
        gram, rhs = np.array(self._gram)[idx[:, None], idx], np.array(self._rhs)[idx]
        scaled = gram * np.outer(scale, scale)
        eig = np.linalg.eigvalsh(scaled)
        if eig[0] > 0 and eig[-1] < NEAR_SINGULAR * eig[0]:
            return (np.array(scale) * np.linalg.solve(scaled, rhs * np.array(scale))).tolist()
        return fit_lstsq(*self._points(), active).tolist()

    def to_dict(self) -> dict:
        a, b, b_more, s, c = self.coef
        return {"a_s": float(a), "b_s_per_row": float(b), "knee_rows": KNEE, "b_s_per_row_past_knee": float(b + b_more),
                "s_per_chain": float(s), "s_per_1k_keys": float(c * 1000)}


def fit_lstsq(points: np.ndarray, weights: np.ndarray, active: list[int]) -> np.ndarray:
    """The weighted least-squares coefficients of the ``active`` features of ``points`` [n, 6]
    (features, seconds) with ``weights`` [n], by lstsq (its minimum-norm answer where the points
    do not determine them)."""
    w = np.sqrt(weights)
    sol, *_ = np.linalg.lstsq(points[:, active] * w[:, None], points[:, 5] * w, rcond=None)
    return sol


def _cholesky(a: list[list[float]]) -> list[list[float]] | None:
    """L with L L^T = ``a`` (symmetric, n x n lists), or None where a pivot is not positive.
    Plain loops: generator sums cost more than the arithmetic at this size."""
    n = len(a)
    low = [[0.0] * n for _ in range(n)]
    for r in range(n):
        lr, ar = low[r], a[r]
        for c in range(r):
            lc, v = low[c], ar[c]
            for k in range(c):
                v -= lr[k] * lc[k]
            lr[c] = v / lc[c]
        v = ar[r]
        for k in range(r):
            v -= lr[k] * lr[k]
        if not v > 0.0:
            return None
        lr[r] = math.sqrt(v)
    return low


def _lower_inverse(low: list[list[float]]) -> list[list[float]]:
    """The inverse of a lower triangular matrix with a positive diagonal (lower triangular too)."""
    n = len(low)
    inv = [[0.0] * n for _ in range(n)]
    for c in range(n):
        inv[c][c] = 1.0 / low[c][c]
        for r in range(c + 1, n):
            lr, v = low[r], 0.0
            for k in range(c, r):
                v -= lr[k] * inv[k][c]
            inv[r][c] = v / lr[r]
    return inv


# Calibration points by (weights in memory, kind, shapes, threads): engines that share a loaded
# model (the bench's variants, a test's LLMs) time it once per process. Each engine still gets a
# LinearCost of its own, refitted to its own passes. It takes ~9 s for the 1.5B here and ~3 s
# for the int8 0.5B, so the points are also kept on disk (``calibration/`` in the cache), keyed by
# what decides a pass's cost: this CPU, the model's shapes, bytes and weight formats, the kernels'
# sources, threads and versions. A later process starts from them; the online refit corrects them.
_CALIBRATED: dict[tuple, tuple[weakref.ref, list[tuple]]] = {}


def _disk_key(decoder, shapes) -> str:
    from quickdraft.version import __version__
    from quickdraft.kernels import cpu_model, source_hash

    c = decoder.config
    parts = {
        "cpu": cpu_model(), "kernels": source_hash(), "torch": torch.__version__, "quickdraft": __version__,
        "threads": torch.get_num_threads(), "device": str(decoder.device), "dtype": str(decoder.dtype),
        "path": decoder.batch_invariance.path, "head": type(decoder.lm_head).__name__,
        "formats": sorted({getattr(w, "ggml_type", None) or type(w).__name__ for w in decoder.w.values()}),
        "bytes": decoder.weight_bytes_per_token(), "shapes": [list(x) for x in shapes],
        "model": [c.arch, c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size, c.num_heads,
                  c.num_kv_heads, c.head_dim],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


# A calibration timed while other processes held the cores is slow by their share, and, kept on
# disk, it priced drafts out of every later run: on the Qwen pair the draft model's chain fell
# from 3.17 to 1.28 tokens a pass (Intel Xeon) until the file was deleted (the online refit corrects a prior
# only as fast as it times passes of each kind). So points are cached only when, while they were
# timed, other processes (and the hypervisor's steal) took at most this share of the machine's
# CPU time; otherwise they serve this process alone and the next one times them again.
CONTENDED = 0.15


def cpu_sample() -> tuple[float, float, float] | None:
    """(the machine's busy CPU seconds, its total CPU seconds, this process's CPU seconds) from
    /proc/stat's first line (every CPU; idle and iowait are not busy, steal is), or None where
    there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(ticks) < 5:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    total = sum(ticks)  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return (total - ticks[3] - ticks[4]) / hz, total / hz, time.process_time()


def others_share(before, after) -> float | None:
    """The share of the machine's CPU time that went to other processes between two
    ``cpu_sample``s, or None when unknown (no /proc/stat, or under a second of CPU time in all,
    where its 10 ms ticks would swamp the figure)."""
    if before is None or after is None or after[1] - before[1] < 1.0:
        return None
    others = (after[0] - before[0]) - (after[2] - before[2])
    return max(0.0, others) / (after[1] - before[1])


def _read_points(path: Path) -> list[tuple] | None:
    try:
        return [tuple(p) for p in json.loads(path.read_text())["points"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or damaged: time it again


def _write_points(path: Path, points: list[tuple]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"points": points}))
    os.replace(tmp, path)  # whole or not at all


def calibrate(decoder, kv, slot: int = 0, shapes=CALIBRATION) -> LinearCost:
    """Time ``decoder`` on the passes of ``shapes`` (best of two after a warm-up), all on ``slot``:
    it first fills the context, and each chain of a pass writes over the same positions. Call it
    before any sequence holds that slot. Known points (this process, or the cache) are reused."""
    from quickdraft.models.registry import cache_dir

    device = decoder.device
    shapes = [(n, q, ctx) for n, q, ctx in shapes if ctx + q <= kv.max_len]
    anchor = decoder.w["model.norm.weight"]  # a dense tensor of this model's, whatever its weight format
    key = (anchor.data_ptr(), decoder.weight_bytes_per_token(), decoder.num_layers, type(decoder.lm_head).__name__,
           str(decoder.dtype), str(device), torch.get_num_threads(), tuple(shapes))
    ref, points = _CALIBRATED.get(key, (None, None))
    if ref is not None and ref() is anchor:  # the same tensor, not a new one at a freed address
        return LinearCost(points)
    disk = cache_dir() / "calibration" / f"{_disk_key(decoder, shapes)}.json"
    points = _read_points(disk)
    if points is None:
        before = cpu_sample()
        points = _time_passes(decoder, kv, slot, shapes)
        share = others_share(before, cpu_sample())
        if share is None or share <= CONTENDED:
            _write_points(disk, points)
        else:
            log.warning("the cost calibration was timed while other processes took %.0f%% of the CPUs: it serves "
                        "this process only and is not cached (the next run times it again)", 100 * share)
    _CALIBRATED[key] = (weakref.ref(anchor), points)
    return LinearCost(points)


def _time_passes(decoder, kv, slot, shapes) -> list[tuple]:
    """(rows, chains, keys read, best seconds) of each pass shape."""
    from quickdraft.models.decoder import AttentionMetadata

    device = decoder.device
    context = max((ctx for _, _, ctx in shapes), default=0)
    if context:
        meta = AttentionMetadata.chain([slot], [0], [context])
        decoder.forward(torch.zeros(context, dtype=torch.long, device=device), meta.positions(device), kv, meta)
    points = []
    for n, q, ctx in shapes:
        meta = AttentionMetadata.chain([slot] * n, [ctx] * n, [q] * n)
        tokens = torch.zeros(n * q, dtype=torch.long, device=device)
        positions = meta.positions(device)
        best = float("inf")
        for run in range(3):  # the first run warms caches and kernels
            t0 = time.perf_counter()
            decoder.logits(decoder.forward(tokens, positions, kv, meta)[-n:]).cpu()
            if run:
                best = min(best, time.perf_counter() - t0)
        points.append((n * q, n, n * key_reads(ctx, q), best))
    return points


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

    def rate(self, prior: float, prior_weight: float = 4.0) -> float:
        """The posterior mean, with ``prior_weight`` pseudo-trials at ``prior``."""
        return (self.hits + prior_weight * prior) / (self.hits + self.misses + prior_weight)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one pass yields with k drafts accepted i.i.d. at rate alpha: 1 + alpha + ... + alpha^k."""
    return sum(alpha**j for j in range(k + 1))


def plan_draft_lengths(
    alphas: list[float],  # [batch] acceptance estimate per sequence
    caps: list[int],  # [batch] the most drafts each may take (0: none this step)
    target: LinearCost,
    draft: LinearCost | None,  # None: drafts cost nothing to make (ngram)
    pending: list[int] | None = None,  # [batch] tokens each feeds the target whatever the plan (default 1)
    contexts: list[int] | None = None,  # [batch] tokens each has in the target's cache (default 0)
    catchup: list[float] | None = None,  # [batch] rows the draft must read before it drafts
    shares: list[float] | None = None,  # [batch] steps that catch-up's cost is shared over (default 1)
) -> list[int]:
    """The K_i that maximize expected tokens per second of this step; [0] * batch = plain.

    For each draft depth L the fixed cost is L draft passes; then draft tokens are added in
    order of their expected gain alpha_i^j while each one's gain per second beats the step's
    tokens per second so far (adding a better-than-average item raises the average). The best L
    wins. A token's cost is one target row and one draft row (one chain of a draft pass), each
    priced at the row count its pass has reached (``LinearCost.row_cost``), both dearer for a
    longer context, plus the draft's catch-up rows for a sequence's first draft."""
    batch = len(alphas)
    pending = pending or [1] * batch
    contexts = contexts or [0] * batch
    catchup = catchup or [0.0] * batch
    base = target(sum(pending), batch, sum(key_reads(c, p) for c, p in zip(contexts, pending)))
    ctx = [c + p for c, p in zip(contexts, pending)]  # where a sequence's drafts start
    # besides the rows' own cost, which depends on how many rows their pass has (see KNEE)
    token_cost = [target.per_key * ctx[i] for i in range(batch)]
    if draft is not None:
        for i in range(batch):
            token_cost[i] += draft.per_chain + draft.per_key * ctx[i]
    shares = shares or [1.0] * batch
    # catch-up rows ride on the first draft pass, a long one for a prompt: rows past KNEE at their dearer rate
    first_cost = [(draft.b * catchup[i] + draft.b_more * max(0.0, catchup[i] + 1 - KNEE) + draft.per_key * catchup[i] * ctx[i])
                  / shares[i] if draft is not None else 0.0 for i in range(batch)]
    a_d = draft.a if draft is not None else 0.0
    best_ks, best_rate = [0] * batch, batch / max(base, 1e-9)
    for depth in range(1, max(caps, default=0) + 1):
        items = sorted(
            ((alphas[i] ** j, i, j) for i in range(batch) for j in range(1, min(depth, caps[i]) + 1)),
            key=lambda item: (-item[0], item[2], item[1]),
        )
        ks = [0] * batch
        tokens, seconds = float(batch), base + depth * a_d
        rows, chains = sum(pending), [0] * (depth + 1)  # the target pass's rows; each draft pass's chains
        for gain, i, j in items:
            if ks[i] != j - 1:
                continue  # its earlier draft was not worth it, so this one is not either
            cost = token_cost[i] + target.row_cost(rows) + (first_cost[i] if j == 1 else 0.0)
            if draft is not None:
                cost += draft.row_cost(chains[j])
            if gain * seconds > tokens * cost:
                ks[i] = j
                tokens += gain
                seconds += cost
                rows += 1
                chains[j] += 1
        if any(ks) and tokens / seconds > best_rate:
            best_ks, best_rate = ks, tokens / seconds
    return best_ks


def plan_tree_sizes(values: list[list[float] | None], target: LinearCost, rows: int, keys: int,
                    contexts: list[int], spent: float = 0.0) -> list[int]:
    """How many nodes of each valued tree (``values[i]``: each node's chance of being accepted,
    from the proposer; None: not a valued tree) the target verifies: its most valuable ones, taken
    across the batch in order of value while each one's value per second of its row beats the
    step's expected tokens per second so far, the rule of plan_draft_lengths with a node's value
    for alpha^j. The tree's size is then a decision priced at this batch's rows (EAGLE-2 fixes it
    instead). ``rows`` and ``keys``: the pass's rows and key reads besides the trees' nodes
    (pending tokens, chains' drafts); ``contexts`` [batch]: where each tree starts; ``spent``:
    seconds the drafts took already, part of the step's rate though no longer a choice.
    -> [batch] nodes to keep (a sequence without values: all of its drafts)."""
    batch = len(values)
    keep = [0 if v is not None else -1 for v in values]
    items = sorted(((v, i, j) for i, vs in enumerate(values) if vs is not None
                    for j, v in enumerate(sorted(vs, reverse=True))), key=lambda item: (-item[0], item[1], item[2]))
    tokens, seconds = float(batch), spent + target(rows, batch, keys)
    for value, i, j in items:
        if keep[i] != j:
            continue  # a more valuable node of its tree did not pay
        cost = target.row_cost(rows) + target.per_key * contexts[i]
        if value * seconds > tokens * cost:
            keep[i] += 1
            tokens += value
            seconds += cost
            rows += 1
    return keep


class TreeChoice:
    """Whether token trees pay on this machine, measured rather than modelled: decayed tokens per
    second of the steps that verified a grown tree against those that verified chains, each the
    whole step's wall time (draft passes, the target's pass, verification, the trees' upkeep).
    plan_tree_sizes prices a tree's rows; this catches what it does not price (a tree's wider draft
    passes, the rows past the kernels' cheap range). Trees are grown while they are ahead, and
    every ``probe``-th step tries the other shape, so that a change of text or load is seen."""

    def __init__(self, probe: int = 8, decay: float = 0.9):
        self.probe, self.decay = probe, decay
        self.tokens = {True: 0.0, False: 0.0}
        self.seconds = {True: 0.0, False: 0.0}
        self.steps = 0

    def rate(self, trees: bool) -> float | None:
        return self.tokens[trees] / self.seconds[trees] if self.seconds[trees] > 0 else None

    def use_trees(self) -> bool:
        self.steps += 1
        tree, chain = self.rate(True), self.rate(False)
        if tree is None or chain is None:
            return chain is not None  # try each once: chains first, then trees
        ahead = tree >= chain
        return ahead != (self.steps % self.probe == 0)

    def record(self, trees: bool, tokens: int, seconds: float) -> None:
        self.tokens[trees] = self.decay * self.tokens[trees] + tokens
        self.seconds[trees] = self.decay * self.seconds[trees] + seconds


class SpeculationSwitch:
    """Whether speculating pays at each batch size, measured: vLLM's ``disable_by_batch_size``
    learned on this machine instead of set by hand.

    The plan (plan_draft_lengths) prices drafts by a fitted cost model, and where that model is
    wrong (a calibration timed while the machine was busy, rows dearer under load than the fit
    says, a draft's catch-up after a pause) a batch that speculates can run slower than the same
    batch decoding plainly: four clients at a time on the Qwen2.5-Coder pair went 0.87x plain.
    So, as TreeChoice does for trees, each batch size keeps the tokens per second of its whole
    decoding steps (drafting, the target's pass, verification) in each mode, and runs the faster:

    * a batch size starts speculating (the plan decides K), unless a smaller one was measured
      to lose, in which case it starts plain;
    * while speculating, plain decoding is tried for ``run`` steps only where speculation looks
      doubtful: its measured rate is below ``margin`` times the plain rate the target's cost model
      predicts (so one request whose drafts pay 1.5x never spends a step on a plain probe);
    * while plain, speculation is tried for ``run`` steps every ``interval`` steps, the interval
      doubling each time the probe loses (up to ``longest``), so that a batch that never pays
      costs less and less to keep checking, and a change of text or load is still seen;
    * the first step of each run is not measured: the draft model reads what it missed while it
      did not draft (its catch-up), a cost of switching, not of the mode.

    Decisions change nothing but speed: either mode's output is the target's."""

    def __init__(self, run: int = 4, interval: int = 16, longest: int = 256, margin: float = 1.15, decay: float = 0.95):
        self.run, self.interval, self.longest, self.margin, self.decay = run, interval, longest, margin, decay
        self._batches: dict[int, _BatchMode] = {}

    def _mode(self, batch: int) -> "_BatchMode":
        mode = self._batches.get(batch)
        if mode is None:
            starts_on = all(m.on for b, m in self._batches.items() if b < batch)
            mode = self._batches[batch] = _BatchMode(on=starts_on, interval=self.interval)
        return mode

    def preferred(self, batch: int) -> bool:
        """Whether a step of ``batch`` sequences speculates, without counting it as a decoding step
        (a step that reads prompts)."""
        m = self._mode(batch)
        return m.on != (m.probe_left > 0)

    def pays(self, batch: int) -> bool:
        """Speculating at ``batch`` has been measured, and not found slower than decoding plainly."""
        m = self._batches.get(batch)
        if m is None or not m.on or m.rate(True) is None:
            return False
        return m.rate(False) is None or m.rate(True) >= m.rate(False)

    def speculate(self, batch: int, plain_estimate: "Callable[[], float] | None" = None) -> bool:
        """Whether this decoding step of ``batch`` sequences speculates (the step is then
        ``record``ed). ``plain_estimate``: the tokens per second the cost model predicts for a plain
        step of this batch, which decides whether plain decoding is worth a probe (called only
        when a probe is due, not every step)."""
        m = self._mode(batch)
        if m.probe_left:
            return not m.on
        m.since += 1
        if m.since < m.interval:
            return m.on
        if m.on:
            rate = m.rate(True)
            doubtful = rate is not None and (plain_estimate is None or rate < self.margin * plain_estimate())
            if not doubtful:
                return True
        m.start_probe(self.run)
        return not m.on

    def record(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decoding step of ``batch`` sequences that ``speculated`` (its mode, whatever K the
        plan gave) made ``tokens`` tokens in ``seconds``."""
        m = self._batches.get(batch)
        if m is None or seconds <= 0:
            return
        if m.skip:  # the first step of a run: the switch's own cost
            m.skip = False
        elif m.probe_left:
            m.probe[0] += tokens
            m.probe[1] += seconds
        else:
            m.tokens[speculated] = self.decay * m.tokens[speculated] + tokens
            m.seconds[speculated] = self.decay * m.seconds[speculated] + seconds
        if m.probe_left:
            m.probe_left -= 1
            if not m.probe_left:
                self._decide(m)

    def _decide(self, m: "_BatchMode") -> None:
        """A probe of the other mode has ended: switch to it where it was faster than the current
        mode's recent steps."""
        other = not m.on
        probe_rate = m.probe[0] / m.probe[1] if m.probe[1] > 0 else None
        if probe_rate is not None:  # the probe's steps become that mode's record
            m.tokens[other], m.seconds[other] = m.probe
        current = m.rate(m.on)
        if probe_rate is not None and (current is None or probe_rate > current):
            m.on, m.interval, m.skip = other, self.interval, True
        else:
            m.interval = min(2 * m.interval, self.longest)
            m.skip = True  # back to the current mode: a draft that paused catches up again

    def to_dict(self) -> dict:
        """Each batch size's mode and measured rates (tokens per second), for reports."""
        return {b: {"speculating": m.on, "speculative_tok_s": m.rate(True), "plain_tok_s": m.rate(False)}
                for b, m in sorted(self._batches.items())}


@dataclass
class _BatchMode:
    on: bool
    interval: int
    since: int = 0  # decoding steps since the last probe
    probe_left: int = 0  # steps left in a probe of the other mode
    skip: bool = False  # the next step is the first of a run: not measured
    probe: list = field(default_factory=lambda: [0.0, 0.0])  # [tokens, seconds] of the probe under way
    tokens: dict = field(default_factory=lambda: {True: 0.0, False: 0.0})  # decayed, by mode (speculating?)
    seconds: dict = field(default_factory=lambda: {True: 0.0, False: 0.0})

    def rate(self, mode: bool) -> float | None:
        return self.tokens[mode] / self.seconds[mode] if self.seconds[mode] > 0 else None

    def start_probe(self, run: int) -> None:
        self.probe_left, self.probe, self.since, self.skip = run, [0.0, 0.0], 0, True


def step_rate(ks: list[int], alphas: list[float], target: LinearCost, draft: LinearCost | None,
              contexts: list[int] | None = None) -> float:
    """Expected tokens per second of one decoding step (one pending token each) with draft
    lengths ``ks``: what the plan maximizes, computed pass by pass."""
    contexts = contexts or [0] * len(ks)
    seconds = target(len(ks) + sum(ks), len(ks), sum(key_reads(c, 1 + k) for c, k in zip(contexts, ks)))
    if draft is not None and any(ks):
        for j in range(1, max(ks) + 1):
            drafting = [i for i, k in enumerate(ks) if k >= j]
            seconds += draft(len(drafting), len(drafting), sum(contexts[i] + j for i in drafting))
    return sum(expected_tokens(a, k) for a, k in zip(alphas, ks)) / seconds


def describe(cost: dict) -> str:
    """A LinearCost's to_dict() in words."""
    return (f"{cost['a_s'] * 1e3:.1f} ms + {cost['b_s_per_row'] * 1e3:.2f} ms per row "
            f"({cost['b_s_per_row_past_knee'] * 1e3:.2f} past {cost['knee_rows']}) + "
            f"{cost['s_per_chain'] * 1e3:.2f} ms per sequence + {cost['s_per_1k_keys'] * 1e3:.2f} ms per 1000 keys read")
