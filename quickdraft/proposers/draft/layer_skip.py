"""Method "layer_skip": the target drafts for itself with some of its sublayers left out, chosen
on the fly with no training (SWIFT: Xia et al., ICLR 2025, "SWIFT: On-the-Fly Self-Speculative
Decoding for LLM Inference Acceleration").

The draft is ``Decoder.forward`` of the target with ``skip_attention`` / ``skip_mlp``: the same
weights and the same KV cache. A draft pass feeds the sequence's pending token and then each draft
token at its position, writing keys and values there for the layers whose attention it runs; the
target's verification pass writes every layer at all of those positions again before any row reads
them (a pass writes its positions before it attends), and a sequence's cached length covers only
what verification kept, so nothing the draft wrote is ever read by the target. Drafting stops for
a sequence once the draft's probability of its own token falls below
``draft_confidence_threshold`` (SWIFT's dynamic stop). The draft hands its q on, so sampled
requests stay exact through the standard verifier. Like a draft model's, its output head may be
the target's truncated to the frequent tokens (``draft_vocab_size``, proposers/draft/vocab.py):
on the Qwen 1.5B (GGUF) the head is 19% of a pass's bytes and the 65536 rows kept are 43% of it (on its
GGUF blocks here the head's pass measured 7.5-8 ms at both sizes, so the search's byte count
overstates that saving there).

Which sublayers to skip (``SkipSearch``): SWIFT searches layer masks by random search and Bayesian
optimisation for the best *matchness*, the share of recent context tokens on which the skipping
draft's greedy token equals the one that followed, at a fixed skip ratio. Here a (1+1) local
search does the same job and also chooses the ratio: a candidate is the incumbent with one
sublayer skipped, restored or swapped, and the two are scored on the same windows (the last
``window`` committed tokens of each drafting sequence, teacher-forced in one pass each) by the
speedup the i.i.d. model predicts for that matchness at that skip set's cost: max over k of
(1 + a + ... + a^k) / (1 + k * (draft pass + one verified row)), in target passes. The better one
stays. A scoring pass writes keys and values at committed positions, so those rows are saved
before and put back after it. The search runs every step for the first ``search_steps`` drafting
steps of the engine (the set belongs to the model and the workload, not to one request), then
once every ``search_interval`` steps, so that it follows the traffic.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch

from quickdraft.errors import ConfigError
from quickdraft.models.decoder import AttentionMetadata, Decoder, linear, nbytes
from quickdraft.models.pass_cost import LinearCost, calibrate, key_reads
from quickdraft.proposers.base import DraftProposal, register
from quickdraft.proposers.draft import vocab as draft_vocab
from quickdraft.proposers.draft.load import head_rows
from quickdraft.proposers.draft_sampling import confident_rows, draw, to_vocab
from quickdraft.verify.rejection import expected_tokens

log = logging.getLogger(__name__)

WINDOW = 12  # committed tokens of each drafting sequence a candidate is scored on
MIN_WINDOW = 4  # a sequence with fewer committed tokens than this (and one) is not scored
# A search step costs two passes of WINDOW rows a sequence (about three target passes of the 1.5B
# here), so it runs on the engine's first SEARCH_STEPS drafting steps and then rarely: at
# 24 and 16 it cost about a third of the run's passes in a 12-request bench.
SEARCH_STEPS = 16  # drafting steps of the engine that each run one search step
SEARCH_INTERVAL = 64  # afterwards, one search step every this many drafting steps
ROW_SHARE = 0.1  # one verified row's cost in target passes, when no cost model is timed


@dataclass(frozen=True)
class SkipSet:
    """The sublayers a draft pass leaves out, by layer index."""

    attention: frozenset[int] = frozenset()
    mlp: frozenset[int] = frozenset()

    @classmethod
    def layers(cls, layers) -> "SkipSet":
        """Whole layers skipped."""
        return cls(frozenset(layers), frozenset(layers))

    def flip(self, kind: str, layer: int) -> "SkipSet":
        """``kind`` "attention" or "mlp" of ``layer`` skipped if it was run, run if it was skipped."""
        attention, mlp = set(self.attention), set(self.mlp)
        chosen = attention if kind == "attention" else mlp
        chosen.symmetric_difference_update({layer})
        return SkipSet(frozenset(attention), frozenset(mlp))

    def sublayers(self) -> set[tuple[str, int]]:
        return {("attention", i) for i in self.attention} | {("mlp", i) for i in self.mlp}

    def describe(self) -> str:
        whole = sorted(self.attention & self.mlp)
        parts = [f"layers {_ranges(whole)}"] if whole else []
        if self.attention - self.mlp:
            parts.append(f"attention of {_ranges(sorted(self.attention - self.mlp))}")
        if self.mlp - self.attention:
            parts.append(f"MLP of {_ranges(sorted(self.mlp - self.attention))}")
        return "skip " + "; ".join(parts) if parts else "skip nothing"


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


class SkipSearch:
    """The (1+1) local search over skip sets, without the model: ``candidate`` proposes, ``judge``
    keeps the better of the incumbent and the candidate given their matchness on the same tokens."""

    def __init__(self, num_layers: int, attention_share: list[float], mlp_share: list[float],
                 row_share: float = ROW_SHARE, max_k: int = 8, start: SkipSet | None = None, seed: int = 0,
                 base: float = 1.0):
        """``attention_share[i]`` / ``mlp_share[i]``: the share of a target pass that layer i's
        sublayer costs (its weights' bytes over all the bytes a pass reads, the output head's too);
        ``row_share``: one more verified row, in target passes; ``max_k``: the longest draft;
        ``base``: a draft pass that skips nothing, in target passes (< 1 with a truncated head)."""
        self.num_layers, self.base = num_layers, base
        self.shares = {"attention": attention_share, "mlp": mlp_share}
        self.row_share, self.max_k = row_share, max_k
        self.rng = random.Random(seed)
        # The first and last layers stay (they matter most in every layer-skipping study); the
        # start skips every other layer of the second half but the last: a quarter of the model.
        inner = range(1, num_layers - 1) if num_layers >= 4 else range(num_layers)
        self.eligible = [(kind, i) for i in inner for kind in ("attention", "mlp")]
        self.incumbent = start if start is not None else SkipSet.layers(range(num_layers // 2, num_layers - 1, 2))
        self.trials = self.improvements = 0

    def cost(self, skip: SkipSet) -> float:
        """A draft pass with ``skip``, in target passes."""
        return self.base - sum(self.shares[kind][i] for kind, i in skip.sublayers())

    def speedup(self, matchness: float, skip: SkipSet) -> float:
        """Tokens per target pass's time the i.i.d. model predicts, at the best draft length."""
        alpha = min(max(matchness, 0.0), 0.999)
        step = self.cost(skip) + self.row_share
        return max(expected_tokens(alpha, k) / (1.0 + k * step) for k in range(1, self.max_k + 1))

    def candidate(self) -> SkipSet:
        """The incumbent with one sublayer more skipped, one fewer, or one of each (a swap)."""
        skipped = sorted(self.incumbent.sublayers() & set(self.eligible))
        kept = sorted(set(self.eligible) - set(skipped))
        move = self.rng.choice(["skip", "run", "swap"])
        out = self.incumbent
        if move in ("skip", "swap") and kept:
            out = out.flip(*self.rng.choice(kept))
        if move in ("run", "swap") and skipped:
            out = out.flip(*self.rng.choice(skipped))
        return out if out != self.incumbent else self.incumbent.flip(*self.rng.choice(self.eligible))

    def judge(self, candidate: SkipSet, candidate_match: float, incumbent_match: float) -> bool:
        """Keep the candidate if it promises more; True when it replaced the incumbent."""
        self.trials += 1
        if self.speedup(candidate_match, candidate) > self.speedup(incumbent_match, self.incumbent):
            self.incumbent = candidate
            self.improvements += 1
            return True
        return False


@register("layer_skip")
class LayerSkipProposer:
    def __init__(self, decoder: Decoder, kv, max_k: int, confidence_threshold: float = 0.5,
                 fixed: SkipSet | None = None, calibrate_cost: bool = False, window: int = WINDOW,
                 search_steps: int = SEARCH_STEPS, search_interval: int = SEARCH_INTERVAL,
                 head_ids: torch.Tensor | None = None):
        """``fixed``: draft with this skip set and never search; None: search on the fly.
        ``head_ids`` [N] int64: the draft scores only these tokens (its output head is those rows of
        the target's, proposers/draft/vocab.py; q is zero elsewhere); None: the whole vocabulary."""
        self.model, self.kv = decoder, kv
        self.vocab_size = decoder.config.vocab_size
        self.head = decoder.lm_head if head_ids is None else head_rows(decoder.lm_head, head_ids)
        self.head_ids = None if head_ids is None else head_ids.to(decoder.device)
        self.threshold = confidence_threshold
        self.window, self.search_steps, self.search_interval = window, search_steps, search_interval
        self.fixed = fixed is not None
        target = calibrate(decoder, kv) if calibrate_cost else None
        self._target_cost = target
        one_pass = target(1) if target is not None else None
        row_share = target.row_cost(2) / one_pass if target is not None else ROW_SHARE
        attention, mlp = self._shares(decoder)
        base = 1.0 - (nbytes(decoder.lm_head) - nbytes(self.head)) / decoder.weight_bytes_per_token()
        self.search = SkipSearch(decoder.num_layers, attention, mlp, row_share, max_k, start=fixed, base=base)
        self.steps = 0  # drafting steps so far (propose calls)
        self.cost = self._cost_model()

    @classmethod
    def from_config(cls, spec, ctx) -> "LayerSkipProposer":
        if ctx.decoder is None or ctx.kv is None:
            raise ConfigError('method "layer_skip" drafts with the target itself: the engine must hand it the '
                              "target's decoder and KV cache", "method")
        n = ctx.decoder.num_layers
        fixed = None
        if spec.skip_layers is not None:
            bad = [i for i in spec.skip_layers if not 0 <= i < n]
            if bad:
                raise ConfigError(f"skip_layers {bad} are not layers of the target (0..{n - 1})", "skip_layers")
            fixed = SkipSet.layers(spec.skip_layers)
        return cls(ctx.decoder, ctx.kv, spec.num_speculative_tokens, spec.draft_confidence_threshold, fixed,
                   calibrate_cost=spec.adaptive, head_ids=draft_vocab.resolve(spec, ctx.target))

    @property
    def skip(self) -> SkipSet:
        """The skip set drafts are made with now."""
        return self.search.incumbent

    # -- drafting --------------------------------------------------------------------------
    def propose(self, seqs, num_tokens) -> DraftProposal:
        num_tokens = list(num_tokens)  # shortened below where the draft loses confidence
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        if not self.fixed and self._searching():
            self._search_step([seqs[i] for i in active])
        self.steps += 1
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        sampled = any(not seqs[i].params.greedy for i in active)
        feed = {i: seqs[i].pending_token_ids for i in active}  # the first pass reads the pending token(s)
        ctx = {i: seqs[i].num_cached for i in active}
        for step in range(max(num_tokens, default=0)):
            active = [i for i in active if num_tokens[i] > step]
            if not active:
                break
            started = time.perf_counter()
            logits = self._draft_pass([seqs[i].slot for i in active], [ctx[i] for i in active], [feed[i] for i in active])
            tokens, q = draw([seqs[i] for i in active], logits, sampled)  # rows of the head
            confident = confident_rows(logits, tokens, self.threshold)
            tokens, q = to_vocab(tokens, q, self.head_ids, self.vocab_size)  # ids [n], q [n, V]
            tokens = tokens.tolist()
            if all(len(feed[i]) == 1 for i in active):
                self.cost.observe(len(active), time.perf_counter() - started, len(active),
                                  sum(key_reads(ctx[i], 1) for i in active))
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                if q is not None:
                    probs[i].append(q[row])
                ctx[i] += len(feed[i])
                feed[i] = [tokens[row]]
                if not confident[row]:
                    num_tokens[i] = step + 1  # this token is proposed, no more after it
        flat = [t for d in drafts for t in d]
        q_all = torch.stack([p for ps in probs for p in ps]) if sampled and flat else None
        return DraftProposal(torch.tensor(flat, dtype=torch.long), [len(d) for d in drafts], q_all)

    def _draft_pass(self, slots: list[int], ctx: list[int], feeds: list[list[int]]) -> torch.Tensor:
        """Each sequence's ``feeds[i]`` at positions ctx[i].., through the kept sublayers -> the
        logits of each one's last row over the head's rows [n, N]."""
        meta = AttentionMetadata.chain(slots, ctx, [len(f) for f in feeds])
        device = self.model.device
        tokens = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=device)
        hidden = self.model.forward(tokens, meta.positions(device), self.kv, meta,
                                    skip_attention=self.skip.attention, skip_mlp=self.skip.mlp)
        last = torch.tensor(meta.query_lens).cumsum(0) - 1
        return self._logits(hidden[last.to(hidden.device)])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits over the draft head's rows [n, N], float32."""
        return linear(hidden, self.head).float()

    # -- the search ------------------------------------------------------------------------
    def _searching(self) -> bool:
        return self.steps < self.search_steps or self.steps % self.search_interval == 0

    def _search_step(self, seqs) -> None:
        """Score the incumbent and one candidate on the same recent tokens; keep the better."""
        windows = [(s, min(self.window, s.num_cached - 1)) for s in seqs]
        windows = [(s, n) for s, n in windows if n >= MIN_WINDOW]
        if not windows:
            return
        candidate = self.search.candidate()
        incumbent = self.search.incumbent
        matches = [self.matchness(incumbent, windows), self.matchness(candidate, windows)]
        if self.search.judge(candidate, matches[1], matches[0]):
            self.cost = self._cost_model()
            log.info("layer_skip: %s (matchness %.2f, draft pass %.2f of the target's)", candidate.describe(),
                     matches[1], self.search.cost(candidate))

    def matchness(self, skip: SkipSet, windows) -> float:
        """The share of the windows' tokens on which the draft with ``skip``, teacher-forced on the
        committed tokens before them, puts its argmax on the token that followed. ``windows``:
        (sequence, n) pairs; the sequence's last n committed tokens are fed, at their positions."""
        slots = [s.slot for s, _ in windows]
        starts = [s.num_cached - n for s, n in windows]
        meta = AttentionMetadata.chain(slots, starts, [n for _, n in windows])
        ids = [s.token_ids for s, _ in windows]
        tokens = [t for i, (s, n) in enumerate(windows) for t in ids[i][starts[i] : starts[i] + n]]
        nexts = [t for i, (s, n) in enumerate(windows) for t in ids[i][starts[i] + 1 : starts[i] + n + 1]]
        device = self.model.device
        with self._restored(skip, slots, starts, [n for _, n in windows]):
            hidden = self.model.forward(torch.tensor(tokens, dtype=torch.long, device=device), meta.positions(device),
                                        self.kv, meta, skip_attention=skip.attention, skip_mlp=skip.mlp)
            guess = self._logits(hidden).argmax(-1)
            guess = (guess if self.head_ids is None else self.head_ids[guess]).cpu()
        return float((guess == torch.tensor(nexts)).float().mean())

    def _restored(self, skip: SkipSet, slots, starts, lengths):
        return _SavedRows(self.kv, [i for i in range(self.model.num_layers) if i not in skip.attention],
                          slots, starts, lengths)

    # -- costs ----------------------------------------------------------------------------
    @staticmethod
    def _shares(decoder: Decoder) -> tuple[list[float], list[float]]:
        """Each layer's attention and MLP weights' share of the bytes one target pass reads."""
        total = decoder.weight_bytes_per_token()
        attention, mlp = [], []
        for i in range(decoder.num_layers):
            p = f"model.layers.{i}."
            attention.append(sum(nbytes(decoder.w[p + f"self_attn.{n}_proj.weight"]) for n in "qkvo") / total)
            mlp.append(sum(nbytes(decoder.w[p + f"mlp.{n}_proj.weight"]) for n in ("gate", "up", "down")) / total)
        return attention, mlp

    def _cost_model(self) -> LinearCost:
        """A draft pass's seconds by rows: the target's calibration scaled by the skip set's share of
        the bytes (a one-row pass is memory bound), refitted to the draft passes timed from then on
        (a new skip set starts afresh). Without a calibration (adaptive off), the share alone."""
        share = self.search.cost(self.skip)
        if self._target_cost is None:
            return LinearCost([(1, share), (2, share * (1 + ROW_SHARE))])
        return self._target_cost.scaled(share)

    # -- the protocol's other verbs ----------------------------------------------------------
    def observe(self, seqs, outcome) -> None:
        pass  # the target's verification rewrote every row the draft wrote; lengths are the runner's

    def catchup_rows(self, seq) -> int:
        return 0  # the target's cache is the draft's: nothing to catch up

    def reuse(self, seq, source, num_tokens) -> int:
        return num_tokens  # the engine copies the target's cache, which is the draft's

    def release(self, seq) -> None:
        pass

    def close(self) -> None:
        pass


class _SavedRows:
    """Keys and values of positions start .. start + n - 1 of each slot, in ``layers``, copied on
    entry and written back on exit: a scoring pass over committed tokens leaves the cache as it was."""

    def __init__(self, kv, layers, slots, starts, lengths):
        self.kv, self.layers = kv, layers
        self.rows = list(zip(slots, starts, lengths))
        self.saved = []

    def __enter__(self):
        with torch.inference_mode():
            self.saved = [(cache[slot, :, a : a + n].clone())
                          for layer in self.layers for cache in (self.kv.keys[layer], self.kv.values[layer])
                          for slot, a, n in self.rows]
        return self

    def __exit__(self, *exc):
        with torch.inference_mode():
            it = iter(self.saved)
            for layer in self.layers:
                for cache in (self.kv.keys[layer], self.kv.values[layer]):
                    for slot, a, n in self.rows:
                        cache[slot, :, a : a + n] = next(it)
        return False
