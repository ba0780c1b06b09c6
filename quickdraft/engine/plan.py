"""How many draft tokens pay for a step: K chosen per sequence, per step, from what the passes cost.

Speculation pays only while the tokens it gains are worth more than the rows it adds to the
target's pass and the draft passes it runs. On a CPU neither is free: verifying K+1 rows of a
1.5B model costs ~11 ms a row on top of ~120 ms for the pass (compute, not bandwidth, once there
are a few rows), and the target's cost grows with the batch's total rows. A fixed K or a fixed
batch-size switch (vLLM's ``disable_by_batch_size``) is right for one workload and wrong for the
next, so the engine plans each step the way SmartSpec (Liu et al. 2024, "goodput") does:

* ``LinearCost`` (models/pass_cost.py): seconds = a + b * rows + b' * max(0, rows - KNEE) +
  s * chains + c * keys read, for one pass of a model, fitted by least squares to a short
  calibration at start-up (9 s for a 1.5B on this CPU, once per loaded model and process) and
  refitted to the passes the engine times afterwards, so the model follows the machine (a shared
  machine's speed drifts).
* Each sequence's odds are estimated from its own recent passes, depth by depth, shrunk towards
  the engine-wide odds while it has few (``Acceptance``, ``ChainOdds``): the chance that its j-th
  draft is accepted given that the ones before it were, and the chance that the proposer makes a
  j-th draft at all (a draft model stops where it loses confidence). A chain capped at k drafts
  then yields 1 + g_1 + ... + g_k tokens on average, g_j the chance that its first j drafts are
  all accepted; under the usual i.i.d. model g_j = alpha^j (Leviathan et al. 2023, eq. 1;
  verify/rejection.py, ``expected_tokens``).
* ``plan_draft_lengths`` picks the K_i that maximize expected tokens per second of the whole
  step: sequences whose drafts keep failing get K = 0, and once the batch is large enough that
  rows are dear, every K shrinks, down to plain decoding.

The plan changes nothing but speed: it only decides how many draft tokens the verifier sees.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Callable

from quickdraft.models.pass_cost import KNEE, LinearCost, key_reads


# Passes of a kind (draft passes, verification passes of several rows) the refit must have timed
# before the plan is trusted to keep a due probe from drafting (engine.py, _num_draft).
TRUSTED_PASSES = 16


@dataclass(frozen=True)
class ChainOdds:
    """What a sequence's next chain of drafts is expected to do, depth by depth (j = 1, 2, ...):
    ``accept[j-1]``, the chance that its j-th draft is accepted given that the j-1 before it were;
    ``reach[j-1]``, the chance that the proposer makes a j-th draft given that it made j-1. A draft
    model stops where its own confidence falls (``draft_confidence_threshold``), a lookup where its
    match ends: K is a cap, and a draft not made costs neither a draft pass nor a target row. A plain
    rate alpha is the i.i.d. model (``geometric``): alpha at every depth, every draft made. Past the
    last depth given, the last one's odds hold."""

    accept: tuple[float, ...]
    reach: tuple[float, ...]

    @classmethod
    def geometric(cls, alpha: float, depth: int) -> "ChainOdds":
        return cls((alpha,) * max(depth, 1), (1.0,) * max(depth, 1))

    def at(self, j: int) -> tuple[float, float]:
        """Depth j's (acceptance, reach); past the last depth given, the last one's."""
        i = min(j, len(self.accept)) - 1
        return self.accept[i], self.reach[i]

    def gains(self, depth: int) -> list[float]:
        """[depth]: the chance that the first j drafts are all accepted: the j-th draft's expected
        tokens."""
        return list(itertools.accumulate((self.at(j)[0] for j in range(1, depth + 1)), operator.mul))

    def reaches(self, depth: int) -> list[float]:
        """[depth]: the chance that a j-th draft is made: its expected rows."""
        return list(itertools.accumulate((self.at(j)[1] for j in range(1, depth + 1)), operator.mul))

    def expected_tokens(self, depth: int) -> float:
        """Tokens one verification of a chain capped at ``depth`` yields: its accepted drafts and one."""
        return 1.0 + sum(self.gains(depth))

    def at_least(self, alpha: float) -> "ChainOdds":
        """These odds with every depth's acceptance raised to ``alpha`` (a probe's)."""
        return ChainOdds(tuple(max(a, alpha) for a in self.accept), self.reach)


def as_odds(alpha: "float | ChainOdds", depth: int) -> ChainOdds:
    return alpha if isinstance(alpha, ChainOdds) else ChainOdds.geometric(alpha, depth)


@dataclass
class Acceptance:
    """Decayed counts of how a sequence's (or the engine's) chains of drafts went, kept two ways:

    * ``hits`` and ``misses``, accepted drafts and chains that ended in a rejection, whose ratio
      is the geometric model's MLE (``rate``: one number for reports and sizing);
    * for each depth j, over the steps whose cap allowed a j-th draft, the steps whose first j-1
      drafts were accepted and those whose first j were, and the steps that drafted j-1 and j
      tokens (``odds``). Measured, a draft's acceptance is not the same at every depth (the
      Qwen2.5-Coder 0.5B drafting for the 1.5B on a HumanEval prompt: 0.72 at the first, 0.92
      at the second given the first), and a draft model with a confidence threshold makes fewer
      drafts than its cap (a fourth in 17 of 41 steps at K = 4). Planned as i.i.d. drafts that are
      always made, the plan capped K at 2-3 where a cap of 4 ran faster on the first request of a
      process (0.89x the best fixed K; AMD EPYC Zen 4)."""

    hits: float = 0.0
    misses: float = 0.0
    decay: float = 0.9
    # [j-1]: decayed [first j-1 accepted, first j accepted, drafted >= j-1, drafted >= j], over steps whose cap was >= j
    depths: list = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int, cap: int | None = None) -> None:
        """A step's chain: ``num_drafts`` made, ``num_accepted`` of them accepted, under a cap of
        ``cap`` drafts (None: the drafts made; a cap below them counts as theirs)."""
        if num_drafts == 0:
            return
        d = self.decay
        self.hits = d * self.hits + num_accepted
        self.misses = d * self.misses + (1.0 if num_accepted < num_drafts else 0.0)
        cap = max(num_drafts, cap or 0)
        while len(self.depths) < cap:
            self.depths.append([0.0, 0.0, 0.0, 0.0])
        for j, c in enumerate(self.depths, start=1):
            c[0] *= d
            c[1] *= d
            c[2] *= d
            c[3] *= d
            if j <= cap:
                c[0] += num_accepted >= j - 1
                c[1] += num_accepted >= j
                c[2] += num_drafts >= j - 1
                c[3] += num_drafts >= j

    def rate(self, prior: float, prior_weight: float = 4.0) -> float:
        """The geometric model's posterior mean, with ``prior_weight`` pseudo-trials at ``prior``."""
        return (self.hits + prior_weight * prior) / (self.hits + self.misses + prior_weight)

    def to_dict(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "depths": self.depths}

    @classmethod
    def from_dict(cls, data, decay: float, steps: float) -> "Acceptance | None":
        """Counts kept by another process (``to_dict``), scaled to weigh as ``steps`` steps at
        most: a drafter's history is a prior that this process's own steps soon outweigh. None
        where ``data`` is not such counts."""
        if not isinstance(data, dict):
            return None
        try:
            hits, misses = float(data["hits"]), float(data["misses"])
            depths = [[float(v) for v in c] for c in data["depths"]]
        except (KeyError, TypeError, ValueError):
            return None
        if (any(len(c) != 4 for c in depths) or not all(math.isfinite(v) and v >= 0 for c in depths for v in c)
                or not (math.isfinite(hits) and math.isfinite(misses) and hits >= 0 and misses >= 0)):
            return None
        seen = depths[0][0] if depths else 0.0  # the steps the counts hold (decayed)
        scale = min(1.0, steps / seen) if seen > 0 else 1.0
        return cls(hits * scale, misses * scale, decay, [[v * scale for v in c] for c in depths])

    def odds(self, depth: int, prior: "float | ChainOdds", prior_weight: float = 4.0) -> ChainOdds:
        """Each depth's acceptance and reach to ``depth``, each shrunk with ``prior_weight``
        pseudo-steps towards ``prior``'s at that depth. A rate for a prior is the first depth's
        acceptance; each later depth is shrunk towards the one before it, so that a depth no step
        has tried yet is expected to go as the deepest tried one went (a draft's acceptance given
        its predecessors' rarely falls with depth), and the plan can try it."""
        accept: list[float] = []
        reach: list[float] = []
        for j in range(1, depth + 1):
            if isinstance(prior, ChainOdds):
                pa, pr = prior.at(j)
            else:
                pa, pr = (prior, 1.0) if j == 1 else (accept[-1], reach[-1])
            c = self.depths[j - 1] if j <= len(self.depths) else (0.0, 0.0, 0.0, 0.0)
            accept.append((c[1] + prior_weight * pa) / (c[0] + prior_weight))
            reach.append((c[3] + prior_weight * pr) / (c[2] + prior_weight))
        return ChainOdds(tuple(accept), tuple(reach))


def _chance_any(chances) -> float:
    """The chance that at least one of independent events of these chances happens."""
    none = 1.0
    for p in chances:
        none *= 1.0 - p
    return 1.0 - none


def plan_draft_lengths(
    alphas: list["float | ChainOdds"],  # [batch] acceptance per sequence: a rate (i.i.d. drafts) or depth by depth
    caps: list[int],  # [batch] the most drafts each may take (0: none this step)
    target: LinearCost,
    draft: LinearCost | None,  # None: drafts cost nothing to make (ngram)
    pending: list[int] | None = None,  # [batch] tokens each feeds the target whatever the plan (default 1)
    contexts: list[int] | None = None,  # [batch] tokens each has in the target's cache (default 0)
    catchup: list[float] | None = None,  # [batch] rows the draft must read before it drafts
    shares: list[float] | None = None,  # [batch] steps that catch-up's cost is shared over (default 1)
) -> list[int]:
    """The K_i that maximize expected tokens per second of this step; [0] * batch = plain.

    For each draft depth L the fixed cost is the L draft passes, each priced at the chance that
    some chain reaches it; then draft tokens are added in order of their value (the chance the
    j-th is accepted given that it is made, ChainOdds) while each one's expected gain per second
    beats the step's tokens per second so far (adding a better-than-average item raises the
    average). The best L wins, its passes priced at the K chosen. A draft's cost is one target row
    and one draft row (one chain of a draft pass), each priced at the row count its pass has
    reached (``LinearCost.row_cost``), both dearer for a longer context, times the chance that the
    draft is made; plus the draft's catch-up rows for a sequence's first draft."""
    batch = len(alphas)
    pending = pending or [1] * batch
    contexts = contexts or [0] * batch
    catchup = catchup or [0.0] * batch
    odds = [as_odds(a, cap) for a, cap in zip(alphas, caps)]
    gains = [o.gains(cap) for o, cap in zip(odds, caps)]  # [batch][cap]
    reach = [o.reaches(cap) for o, cap in zip(odds, caps)]
    # a draft's value per expected row, made non-increasing along its chain so that the order of
    # the items below is each chain's own order
    value = []
    for g, r in zip(gains, reach):
        v, low = [], float("inf")
        for gj, rj in zip(g, r):
            low = min(low, gj / max(rj, 1e-12))
            v.append(low)
        value.append(v)
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

    def passes(ks: list[int], depth: int) -> float:
        """The draft passes expected to run to ``depth`` where each sequence may draft ks[i]."""
        return sum(_chance_any(reach[i][j - 1] for i in range(batch) if ks[i] >= j) for j in range(1, depth + 1))

    best_ks, best_rate = [0] * batch, batch / max(base, 1e-9)
    for depth in range(1, max(caps, default=0) + 1):
        items = sorted(
            ((value[i][j - 1], i, j) for i in range(batch) for j in range(1, min(depth, caps[i]) + 1)),
            key=lambda item: (-item[0], item[2], item[1]),
        )
        ks = [0] * batch
        charged = a_d * passes(caps, depth)
        tokens, seconds = float(batch), base + charged
        rows, chains = float(sum(pending)), [0.0] * (depth + 1)  # the target pass's rows; each draft pass's chains (expected)
        for _, i, j in items:
            if ks[i] != j - 1:
                continue  # its earlier draft was not worth it, so this one is not either
            made = reach[i][j - 1]
            cost = target.row_cost(rows) + token_cost[i]
            if draft is not None:
                cost += draft.row_cost(chains[j])
            cost = made * cost + (first_cost[i] if j == 1 else 0.0)
            gain = gains[i][j - 1]
            if gain * seconds > tokens * cost:
                ks[i] = j
                tokens += gain
                seconds += cost
                rows += made
                chains[j] += made
        if any(ks):
            seconds += a_d * passes(ks, depth) - charged  # the passes these K run, not those charged up front
            if tokens / seconds > best_rate:
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
    decoding steps (drafting, the target's pass, verification), those that verified drafts and
    those that did not (a step of the speculating mode that the plan gave no drafts counts as
    plain), and runs the faster mode:

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
        """A decoding step of ``batch`` sequences made ``tokens`` tokens in ``seconds``;
        ``speculated``: it verified drafts (a step of the speculating mode that the plan gave no
        drafts is plain decoding, and counts as such)."""
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


def step_rate(ks: list[int], alphas: list["float | ChainOdds"], target: LinearCost, draft: LinearCost | None,
              contexts: list[int] | None = None) -> float:
    """Expected tokens per second of one decoding step (one pending token each) with draft caps
    ``ks``: what the plan maximizes, computed pass by pass, each draft priced at the chance that it
    is made and each draft pass at the chance that some chain reaches it."""
    contexts = contexts or [0] * len(ks)
    odds = [as_odds(a, max(k, 1)) for a, k in zip(alphas, ks)]
    reach = [o.reaches(k) for o, k in zip(odds, ks)]
    rows = [sum(r) for r in reach]  # expected drafts of each
    # keys: the pending token's row reads c + 1 of them, a draft's at depth j c + 1 + j (key_reads)
    keys = sum(c + 1 + sum(p * (c + 1 + j) for j, p in enumerate(r, start=1)) for c, r in zip(contexts, reach))
    seconds = target(len(ks) + sum(rows), len(ks), keys)
    if draft is not None and any(ks):
        for j in range(1, max(ks) + 1):
            drafting = [i for i, k in enumerate(ks) if k >= j]
            chance = _chance_any(reach[i][j - 1] for i in drafting)
            n = sum(reach[i][j - 1] for i in drafting)
            seconds += draft(n, n, sum(reach[i][j - 1] * (contexts[i] + j) for i in drafting)) - (1.0 - chance) * draft.a
    return sum(o.expected_tokens(k) for o, k in zip(odds, ks)) / seconds
