"""The cost model and the K planner (models/pass_cost.py, engine/plan.py), on hand-made costs: no model, no clock."""

from __future__ import annotations

import itertools
import os
import random

import numpy as np
import pytest

from quickdraft.engine.plan import Acceptance, ChainOdds, SpeculationSwitch, plan_draft_lengths, step_rate
from quickdraft.models.pass_cost import ANCHOR_WEIGHT, KNEE, RECENT, LinearCost
from quickdraft.verify import expected_tokens


def test_linear_cost_fits_its_points_and_follows_what_it_observes():
    cost = LinearCost([(1, 0.12), (9, 0.20), (33, 0.44)])
    assert cost.a == pytest.approx(0.11) and cost.b == pytest.approx(0.01)
    for _ in range(64):  # the machine got twice as slow
        cost.observe(5, 0.30)
        cost.observe(17, 0.54)
    assert cost(5) == pytest.approx(0.30, rel=0.15) and cost(17) == pytest.approx(0.54, rel=0.15)


def test_linear_cost_learns_chains_and_keys():
    truth = lambda r, n, k: 0.1 + 0.01 * r + 0.002 * n + 1e-6 * k  # noqa: E731
    shapes = [(1, 1, 0), (4, 1, 10), (16, 1, 136), (1, 1, 256), (8, 1, 2084), (4, 4, 1028), (16, 8, 4100)]
    cost = LinearCost([(r, n, k, truth(r, n, k)) for r, n, k in shapes])
    assert (cost.a, cost.b, cost.per_chain, cost.per_key) == pytest.approx((0.1, 0.01, 0.002, 1e-6))
    assert cost(40, 8, 12000) == pytest.approx(truth(40, 8, 12000))


def test_linear_cost_never_goes_negative():
    cost = LinearCost([(1, 0.3), (8, 0.1)])  # noise can make a slope negative
    assert cost.b == 0.0 and cost.a > 0
    single = LinearCost([(4, 0.2)])  # no slope to learn: rows are assumed to cost in proportion
    assert single(8) == pytest.approx(0.4)


def test_rows_past_the_knee_cost_more():
    truth = lambda r: 0.03 + 0.008 * r + 0.004 * max(0, r - KNEE)  # noqa: E731
    cost = LinearCost([(r, truth(r)) for r in (1, 2, 4, 8, 16, 32)])
    assert (cost.a, cost.b, cost.b_more) == pytest.approx((0.03, 0.008, 0.004))
    assert cost.row_cost(1) == pytest.approx(0.008) and cost.row_cost(KNEE) == pytest.approx(0.012)
    assert cost(5) == pytest.approx(truth(5)) and cost(40) == pytest.approx(truth(40))
    straight = LinearCost([(r, 0.03 + 0.01 * r) for r in (1, 4, 8, 32)])
    assert straight.b_more == pytest.approx(0.0, abs=1e-12) and straight.row_cost(8) == pytest.approx(0.01)


def lstsq_fit(anchors: list[tuple], recent: list[tuple]) -> np.ndarray:
    """The fit as weighted lstsq over every point, features dropped as LinearCost drops them."""
    pts = np.array([LinearCost._point(*p) for p in anchors] + [LinearCost._point(*p) for p in recent])
    w = np.sqrt(np.array([ANCHOR_WEIGHT] * len(anchors) + [1.0] * len(recent)))
    x, y = pts[:, :5], pts[:, 5]
    coef = np.zeros(5)
    active = [0] + [j for j in range(1, 5) if np.ptp(x[:, j]) > 0]
    if active == [0]:
        coef[1] = float(np.average(y, weights=w**2)) / max(x[0, 1], 1.0)
        return coef
    while True:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        negative = [j for j, v in zip(active, sol) if v < 0 and j != 0]
        if not negative:
            break
        active = [j for j in active if j not in negative]
    coef[active] = np.maximum(sol, 0.0)
    return coef


@pytest.mark.parametrize("anchors", [
    "measured", [(1, 0.12), (9, 0.20), (33, 0.44)], [(1, 0.3), (8, 0.1)], [(4, 0.2)], [(1, 0.12), (33, 0.472)],
])
def test_the_running_fit_equals_lstsq_over_its_points(anchors):
    """The normal equations kept up pass by pass (points in, the oldest out past RECENT, a resum
    every RECENT) give lstsq's coefficients over the same points, on noisy passes that turn
    features on (chains, keys where the anchors had none) and push slopes negative."""
    anchors = TARGET_1_5B if anchors == "measured" else anchors
    rng = random.Random(3)
    cost, recent = LinearCost(anchors), []
    for n in range(3 * RECENT + 5):
        rows, chains = rng.randint(1, 6), rng.choice([1, 1, 2])
        point = (rows, chains, rows * rng.randint(100, 3000), 0.04 + 0.008 * rows + rng.uniform(-0.02, 0.02))
        if n < RECENT // 2:  # one shape first: the chains and keys features stay constant for a while
            point = (1, 1, 0, 0.04 + rng.uniform(0, 0.01))
        cost.observe(point[0], point[3], point[1], point[2])
        recent = (recent + [point])[-RECENT:]
        want = lstsq_fit(anchors, recent)
        assert cost.coef == pytest.approx(want, rel=1e-6, abs=1e-12), n


# passes measured here (AMD EPYC, 2 cores, stored Q4_K_M blocks; rows, chains, keys, seconds)
TARGET_1_5B = [(1, 1, 1, 0.0434), (4, 1, 10, 0.0647), (16, 1, 136, 0.2062), (32, 1, 528, 0.4262), (1, 1, 257, 0.0361),
               (8, 1, 2084, 0.1083), (4, 4, 1028, 0.0758), (16, 4, 4136, 0.2230), (16, 8, 4120, 0.2399)]
DRAFT_0_5B = [(1, 1, 1, 0.0135), (4, 1, 10, 0.0182), (16, 1, 136, 0.0707), (32, 1, 528, 0.1417), (1, 1, 257, 0.0140),
              (8, 1, 2084, 0.0368), (4, 4, 1028, 0.0274), (16, 4, 4136, 0.0815), (16, 8, 4120, 0.0766)]


def test_measured_costs_plan_long_drafts_for_a_good_draft_model():
    """One straight line through these points put a one-row target pass at 31 ms (36-43 measured)
    and a draft pass at 10.5 (13.5-14): the plan then preferred K = 1, where fixed K = 4 was faster."""
    target, draft = LinearCost(TARGET_1_5B), LinearCost(DRAFT_0_5B)
    assert target(1, 1, 200) == pytest.approx(0.040, abs=0.005) and draft(1, 1, 200) == pytest.approx(0.0137, abs=0.002)
    plan = plan_draft_lengths([0.9], [4], target, draft, contexts=[200])
    assert plan[0] >= 3
    assert step_rate(plan, [0.9], target, draft, [200]) > 1.2 * step_rate([0], [0.9], target, draft, [200])
    assert plan_draft_lengths([0.4], [4], target, draft, contexts=[200]) == [0]


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == 1.75


def test_acceptance_is_the_geometric_estimate_shrunk_to_the_prior():
    a = Acceptance(decay=1.0)
    assert a.rate(0.6) == pytest.approx(0.6)  # nothing seen yet
    a.record(4, 4)  # all accepted: 4 hits, no miss
    a.record(4, 1)  # 1 hit, then a miss
    assert a.rate(0.5, prior_weight=0.0) == pytest.approx(5 / 6)
    a.record(0, 0)  # a pass without drafts says nothing
    assert a.rate(0.5, prior_weight=0.0) == pytest.approx(5 / 6)


CHEAP_ROWS = LinearCost([(1, 0.100), (33, 0.132)])  # a row costs 1% of a pass: bandwidth bound
DEAR_ROWS = LinearCost([(1, 0.100), (33, 0.900)])  # a row costs 25%: compute bound


def test_good_drafts_take_the_full_k_when_rows_are_cheap():
    assert plan_draft_lengths([0.9], [8], CHEAP_ROWS, None) == [8]


def test_failing_drafts_are_not_verified():
    assert plan_draft_lengths([0.01], [8], CHEAP_ROWS, None) == [0]
    assert plan_draft_lengths([0.9, 0.01, 0.8], [4, 4, 4], CHEAP_ROWS, None) == [4, 0, 4]


def test_dear_rows_shorten_drafts_and_a_big_batch_turns_them_off():
    draft = LinearCost([(1, 0.02), (33, 0.10)])
    single = plan_draft_lengths([0.8], [8], DEAR_ROWS, draft)
    assert 0 < single[0] < 8
    by_batch = [max(plan_draft_lengths([0.8] * b, [8] * b, DEAR_ROWS, draft)) for b in (1, 2, 4, 8, 16, 32)]
    assert by_batch == sorted(by_batch, reverse=True) and by_batch[-1] == 0


def test_caps_are_respected():
    assert plan_draft_lengths([0.99, 0.99], [2, 0], CHEAP_ROWS, None) == [2, 0]


def test_catching_up_counts_against_drafting():
    draft = LinearCost([(1, 0.01), (33, 0.05)])  # 1.25 ms a row
    rows = LinearCost([(1, 0.100), (33, 0.160)])
    assert plan_draft_lengths([0.3], [1], rows, draft, catchup=[0]) == [1]
    assert plan_draft_lengths([0.3], [1], rows, draft, catchup=[200]) == [0]


@pytest.mark.parametrize("seed", range(40))
def test_the_plan_is_within_two_percent_of_the_best(seed):
    """Against every K vector by brute force, on random batches, acceptance rates and costs."""
    rng = random.Random(seed)
    batch, k = rng.randint(1, 4), rng.randint(1, 4)
    alphas = [rng.random() for _ in range(batch)]
    contexts = [rng.randint(0, 2000) for _ in range(batch)]

    def cost(a, b, s, c):  # points from known coefficients: (rows, chains, keys, seconds)
        shapes = [(1, 1, 0), (32, 1, 0), (8, 8, 4000), (4, 1, 8000), (2, 2, 100)]
        return LinearCost([(r, n, kk, a + b * r + s * n + c * kk) for r, n, kk in shapes])

    target = cost(0.1, rng.uniform(0.0005, 0.03), rng.uniform(0, 0.003), rng.uniform(0, 2e-6))
    draft = None if seed % 2 else cost(rng.uniform(0.002, 0.04), rng.uniform(0, 0.005), rng.uniform(0, 0.002),
                                       rng.uniform(0, 1e-6))
    best = max(step_rate(ks, alphas, target, draft, contexts) for ks in itertools.product(range(k + 1), repeat=batch))
    plan = plan_draft_lengths(alphas, [k] * batch, target, draft, contexts=contexts)
    assert step_rate(plan, alphas, target, draft, contexts) >= 0.98 * best


def test_calibration_runs_once_per_machine_and_model(monkeypatch, tmp_cache):
    """Timed once; then reused in this process and, through the cache, by later processes with
    the same CPU, shapes, formats and kernels. Another shape is timed anew."""
    import torch

    from quickdraft.models import pass_cost as cost
    from quickdraft.models.kv_cache import KVCache
    from quickdraft.models.decoder import Decoder
    from quickdraft.models.tiny import random_weights, tiny_config

    config = tiny_config("qwen2", vocab_size=64, hidden_size=32, num_layers=1)
    weights = random_weights(config, seed=0)
    kv = KVCache(config, 1, 300, torch.float32)
    calls = []
    forward = Decoder.forward
    monkeypatch.setattr(Decoder, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    monkeypatch.setattr(cost, "others_share", lambda before, after: 0.0)  # a quiet machine (next test: a busy one)
    first = cost.calibrate(Decoder(config, weights), kv)
    timed = len(calls)
    assert timed > 0 and len(list((tmp_cache / "calibration").glob("*.json"))) == 1
    again = cost.calibrate(Decoder(config, weights), kv)  # another engine over the same weights
    assert len(calls) == timed and again.to_dict() == first.to_dict()
    monkeypatch.setattr(cost, "_CALIBRATED", {})  # a new process
    later = cost.calibrate(Decoder(config, random_weights(config, seed=1)), kv)  # same shapes: from the cache
    assert len(calls) == timed and later.to_dict() == first.to_dict()
    deeper = tiny_config("qwen2", vocab_size=64, hidden_size=32, num_layers=2)
    cost.calibrate(Decoder(deeper, random_weights(deeper, seed=0)), KVCache(deeper, 1, 300, torch.float32))
    assert len(calls) > timed and len(list((tmp_cache / "calibration").glob("*.json"))) == 2


def test_a_calibration_timed_on_a_busy_machine_is_not_cached(monkeypatch, tmp_cache):
    """Points timed while other processes took the cores serve this process, and are not written
    to the cache: a later process times them again (a cached slow calibration priced drafts out)."""
    import torch

    from quickdraft.models import pass_cost as cost
    from quickdraft.models.kv_cache import KVCache
    from quickdraft.models.decoder import Decoder
    from quickdraft.models.tiny import random_weights, tiny_config

    config = tiny_config("qwen2", vocab_size=64, hidden_size=32, num_layers=1)
    kv = KVCache(config, 1, 300, torch.float32)
    calls = []
    forward = Decoder.forward
    monkeypatch.setattr(Decoder, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    monkeypatch.setattr(cost, "others_share", lambda before, after: 0.5)
    cost.calibrate(Decoder(config, random_weights(config, seed=0)), kv)
    timed = len(calls)
    assert timed > 0 and not list((tmp_cache / "calibration").glob("*.json"))
    monkeypatch.setattr(cost, "_CALIBRATED", {})  # a new process, on a quiet machine: timed again, and cached
    monkeypatch.setattr(cost, "others_share", lambda before, after: cost.CONTENDED)
    cost.calibrate(Decoder(config, random_weights(config, seed=0)), kv)
    assert len(calls) == 2 * timed and len(list((tmp_cache / "calibration").glob("*.json"))) == 1


def test_others_share_counts_what_this_process_did_not_use():
    from quickdraft.models.pass_cost import others_share

    # (machine busy s, machine total s, this process's CPU s): 4 s of 8 busy, 1 of them ours
    assert others_share((10.0, 100.0, 2.0), (14.0, 108.0, 3.0)) == 3.0 / 8.0
    assert others_share((10.0, 100.0, 2.0), (11.0, 108.0, 3.0)) == 0.0  # all ours
    assert others_share((10.0, 100.0, 2.0), (10.2, 100.5, 2.1)) is None  # too short to tell
    assert others_share(None, (10.2, 100.5, 2.1)) is None  # no /proc/stat


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux's /proc/stat")
def test_others_share_sees_a_busy_process():
    """A child spinning on one CPU shows as others' share (at least half a CPU's worth)."""
    import subprocess
    import sys
    import time

    from quickdraft.models.pass_cost import cpu_sample, others_share

    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    try:
        time.sleep(0.2)  # the child's start-up
        before = cpu_sample()
        time.sleep(1.0)
        share = others_share(before, cpu_sample())
    finally:
        child.wait()
    assert share is not None and share > 0.5 / os.cpu_count()


def test_the_condition_bound_holds_and_the_solve_is_numpys():
    """cost._solve trusts a system where n * trace(inverse) < NEAR_SINGULAR: that bounds the
    condition number of a unit-diagonal SPD matrix from above, so no system numpy's eigenvalues
    would have refused is solved by Cholesky (the running fit's test holds its answers to lstsq's)."""
    from quickdraft.models.pass_cost import _cholesky, _lower_inverse

    rng = np.random.default_rng(5)
    for n in range(2, 6):
        for spread in (1.0, 1e-3, 1e-6):
            x = rng.normal(size=(n + 3, n)) * np.array([1.0] * (n - 1) + [spread])
            x[:, -1] += x[:, 0] * (1 - spread)  # nearly collinear as the spread shrinks
            gram = x.T @ x
            scale = 1 / np.sqrt(gram.diagonal())
            a = gram * np.outer(scale, scale)
            low = _cholesky(a.tolist())
            assert low is not None
            inv = np.array(_lower_inverse(low))
            assert np.allclose(inv @ np.array(low), np.eye(n))
            eig = np.linalg.eigvalsh(a)
            assert n * (inv**2).sum() >= eig[-1] / eig[0] * (1 - 1e-9)
    assert _cholesky([[1.0, 1.0], [1.0, 1.0]]) is None  # singular: no positive pivot


def _drive(switch: SpeculationSwitch, batch: int, rates: dict[bool, float], steps: int, plain_estimate=None) -> list[bool]:
    """``steps`` decoding steps of ``batch`` sequences where a speculative step makes tokens at
    rates[True] a second and a plain one at rates[False]; the modes the switch chose."""
    modes = []
    for _ in range(steps):
        on = switch.speculate(batch, lambda: plain_estimate if plain_estimate is not None else rates[False])
        modes.append(on)
        switch.record(batch, on, 10, 10 / rates[on])
    return modes


def test_the_switch_keeps_speculating_where_it_clearly_pays_without_a_plain_probe():
    switch = SpeculationSwitch()
    assert all(_drive(switch, 1, {True: 60.0, False: 30.0}, 300))


def test_the_switch_turns_off_a_batch_size_where_speculation_loses_and_probes_less_and_less():
    switch = SpeculationSwitch(run=4, interval=8, longest=256)
    modes = _drive(switch, 4, {True: 52.0, False: 60.0}, 1000)
    assert not switch.preferred(4)
    plain_share = modes[100:].count(False) / len(modes[100:])
    assert plain_share > 0.97  # the probes of speculation become rare
    # probes grow apart: the gaps between speculative runs after the switch
    starts = [i for i in range(1, len(modes)) if modes[i] and not modes[i - 1]]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 256
    # a larger batch starts plain where a smaller one lost; a smaller one starts speculating
    assert not switch.preferred(6) and switch.preferred(2)


def test_the_switch_turns_back_on_when_speculation_starts_to_pay():
    switch = SpeculationSwitch(run=4, interval=8, longest=64)
    _drive(switch, 3, {True: 40.0, False: 60.0}, 200)
    assert not switch.preferred(3)
    modes = _drive(switch, 3, {True: 90.0, False: 60.0}, 200)
    assert switch.preferred(3) and modes[-100:].count(True) > 95


def test_the_switch_does_not_measure_a_runs_first_step():
    """The first step after a switch carries the draft's catch-up: a slow one there must not
    make the probe lose."""
    switch = SpeculationSwitch(run=4, interval=8)
    _drive(switch, 2, {True: 40.0, False: 60.0}, 14)  # 8 steps, a plain probe of 4, 2 plain steps
    assert not switch.preferred(2)
    modes = []
    for _ in range(300):  # speculation now pays, but each run's first step costs 10x
        on = switch.speculate(2, lambda: 60.0)
        first = bool(modes) and on != modes[-1]
        modes.append(on)
        switch.record(2, on, 10, 10 / (90.0 if on else 60.0) * (10 if first and on else 1))
    assert switch.preferred(2)


def test_odds_are_counted_depth_by_depth_over_the_steps_whose_cap_allowed_them():
    """Acceptance given the drafts before, and the chance a draft is made at all, each depth
    counted only over the steps whose cap reached it."""
    a = Acceptance(decay=1.0)
    a.record(4, 4, cap=4)  # all four made and accepted
    a.record(2, 2, cap=4)  # the proposer stopped after two (its confidence fell): both accepted
    a.record(3, 1, cap=4)  # three made, the second rejected
    a.record(1, 0, cap=1)  # a cap of one: says nothing of depths 2 to 4
    odds = a.odds(4, 0.5, prior_weight=0.0)
    assert odds.accept == pytest.approx((3 / 4, 2 / 3, 1 / 2, 1 / 1))
    assert odds.reach == pytest.approx((1.0, 3 / 3, 2 / 3, 1 / 2))
    assert odds.gains(4) == pytest.approx([3 / 4, 1 / 2, 1 / 4, 1 / 4])
    assert odds.reaches(4) == pytest.approx([1.0, 1.0, 2 / 3, 1 / 3])
    assert odds.expected_tokens(4) == pytest.approx(1 + 3 / 4 + 1 / 2 + 1 / 4 + 1 / 4)
    assert a.rate(0.5, prior_weight=0.0) == pytest.approx(7 / 9)  # the geometric estimate, as before: 7 hits, 2 misses


def test_a_depth_not_tried_goes_as_the_deepest_tried_one():
    """A depth no step has reached takes the odds of the one before it (each depth is shrunk
    towards its predecessor), so that the plan may try it; a prior of odds is followed depth by depth."""
    a = Acceptance(decay=1.0)
    for _ in range(20):
        a.record(2, 2, cap=2)
    odds = a.odds(4, 0.5)
    assert odds.accept[2] == pytest.approx(odds.accept[1]) and odds.accept[1] > 0.8
    assert odds.reach[3] == pytest.approx(odds.reach[1]) == pytest.approx(1.0)
    fresh = Acceptance().odds(4, odds)
    assert fresh.accept == pytest.approx(odds.accept) and fresh.reach == pytest.approx(odds.reach)
    assert Acceptance().odds(3, 0.8) == ChainOdds.geometric(0.8, 3)


def test_drafts_rarely_made_are_cheap_to_allow():
    """A deep draft that the proposer makes only when it is sure (reach) costs its rows only then:
    with the same chance of gaining each token, a cap the i.i.d. model would not pay for pays."""
    target, draft = LinearCost(TARGET_1_5B), LinearCost(DRAFT_0_5B)
    gains = [0.85 ** j for j in range(1, 7)]
    odds = ChainOdds(tuple([0.85] * 6), (1.0, 1.0, 0.5, 0.5, 0.5, 0.5))
    assert odds.gains(6) == pytest.approx(gains)
    geometric = plan_draft_lengths([0.85], [6], target, draft, contexts=[200])[0]
    sure = plan_draft_lengths([odds], [6], target, draft, contexts=[200])[0]
    assert geometric < sure
    assert step_rate([sure], [odds], target, draft, [200]) > step_rate([geometric], [odds], target, draft, [200])


@pytest.mark.parametrize("seed", range(30))
def test_the_plan_of_odds_is_within_two_percent_of_the_best(seed):
    """As the test above, with odds that vary by depth and drafts that are not always made."""
    rng = random.Random(100 + seed)
    batch, k = rng.randint(1, 3), rng.randint(1, 5)
    odds = [ChainOdds(tuple(rng.uniform(0.3, 1.0) for _ in range(k)), (1.0,) + tuple(rng.uniform(0.2, 1.0) for _ in range(k - 1)))
            for _ in range(batch)]
    contexts = [rng.randint(0, 2000) for _ in range(batch)]
    target = LinearCost([(r, n, kk, 0.03 + 0.004 * r + 0.001 * n + 1e-6 * kk)
                         for r, n, kk in [(1, 1, 0), (32, 1, 0), (8, 8, 4000), (4, 1, 8000), (2, 2, 100)]])
    draft = LinearCost([(r, n, kk, rng.uniform(0.002, 0.01) + 0.0005 * r) for r, n, kk in [(1, 1, 0), (32, 1, 0)]])
    best = max(step_rate(list(ks), odds, target, draft, contexts) for ks in itertools.product(range(k + 1), repeat=batch))
    plan = plan_draft_lengths(odds, [k] * batch, target, draft, contexts=contexts)
    assert step_rate(plan, odds, target, draft, contexts) >= 0.98 * best


def test_a_drafters_history_weighs_as_a_few_steps():
    a = Acceptance(decay=1.0)
    for _ in range(40):
        a.record(4, 3, cap=4)
    loaded = Acceptance.from_dict(json_round_trip(a.to_dict()), decay=0.99, steps=8)
    assert loaded.depths[0][0] == pytest.approx(8.0) and loaded.decay == 0.99
    assert loaded.odds(4, 0.5, prior_weight=0.0) == a.odds(4, 0.5, prior_weight=0.0)  # the same odds, less weight
    assert loaded.rate(0.5, prior_weight=0.0) == pytest.approx(a.rate(0.5, prior_weight=0.0))
    for bad in ({}, {"hits": 1, "misses": 0, "depths": [[1, 2]]}, {"hits": "x", "misses": 0, "depths": []},
                {"hits": 1, "misses": -1, "depths": []}, {"hits": 1, "misses": 0, "depths": [[1, 1, float("nan"), 1]]}):
        assert Acceptance.from_dict(bad, decay=0.99, steps=8) is None


def json_round_trip(data):
    import json

    return json.loads(json.dumps(data))

