"""What one pass of a model costs on this machine: ``LinearCost``, fitted to a short calibration
at start-up (``calibrate``, cached on disk per machine, kernel build and model shape) and refitted
to the passes the engine and the proposers time afterwards, so that the model follows the machine
(a shared machine's speed drifts).

    seconds = a + b * rows + b' * max(0, rows - KNEE) + s * chains + c * keys read

for one pass (rows cost less while a pass is short: see KNEE). Attention reads every cached key
for every row, and each chain has its own attention calls, hence the chain and key terms.

The plan that spends these costs (K per sequence, tree sizes, whether to speculate at all) is the
engine's: engine/plan.py. This module only measures; it sits in the models layer so that the
proposers, which time their own passes, can use it without looking up to the engine.
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
from pathlib import Path

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


def write_json(path: Path, data) -> None:
    """``data`` as JSON at ``path``, whole or not at all (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _write_points(path: Path, points: list[tuple]) -> None:
    write_json(path, {"points": points})


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


def describe(cost: dict) -> str:
    """A LinearCost's to_dict() in words."""
    return (f"{cost['a_s'] * 1e3:.1f} ms + {cost['b_s_per_row'] * 1e3:.2f} ms per row "
            f"({cost['b_s_per_row_past_knee'] * 1e3:.2f} past {cost['knee_rows']}) + "
            f"{cost['s_per_chain'] * 1e3:.2f} ms per sequence + {cost['s_per_1k_keys'] * 1e3:.2f} ms per 1000 keys read")
