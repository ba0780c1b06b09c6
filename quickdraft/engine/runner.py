"""One speculative step over a batch, as its phases: propose, build the verification pass,
forward, verify, commit.

For sequence i the target is fed its pending tokens (the whole prompt on its first step, then the
one token emitted last step) followed by its K_i draft tokens, in one ragged pass with every other
sequence. The last K_i + 1 rows of each sequence's chunk are the rows the verifier needs: row j
scores the token after draft token j - 1. The commit (``Runner._commit``, the one place a step
changes state) moves each sequence's cached length over its pending tokens and accepted drafts
(the rejected drafts' keys stay in the cache as garbage that the next pass overwrites), tells the
proposer, and appends the tokens under the stop rules.

Each phase's wall time goes to a ``StepTimes`` record beside the data path; the cost model and the
tree choice read it after the step (adaptive speculation, engine/plan.py).

A sequence with a grammar (structured.py) drafts its grammar's forced tokens where there are any
(the proposer is not asked for it then), has any other draft cut before its first token the
grammar rejects, and has every one of its rows masked to what the grammar allows after the drafts
before that row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from quickdraft.engine.plan import Acceptance, TreeChoice, plan_tree_sizes
from quickdraft.engine.sequence import Sequence, SpecStats, TokenLogprob
from quickdraft.engine.stops import StopRules
from quickdraft.models.decoder import AttentionMetadata, Decoder, tree_paths_from_parents
from quickdraft.models.kv_cache import KVCache
from quickdraft.models.pass_cost import LinearCost, key_reads
from quickdraft.proposers.base import DraftProposal, Proposer
from quickdraft.sampling import BatchSampling
from quickdraft.structured import apply_masks
from quickdraft.verify.penalties import shape_rows, shapes_logits
from quickdraft.verify.rejection import VerifyOutput
from quickdraft.verify.step import verify_step


PROMPT_LOGPROB_ROWS = 64  # prompt rows whose logits are held at once (prompt_logprobs)


def _token_logprobs(logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """logits [n, V] -> each of the n tokens' log-probability in its row, and its row's ``top``
    most likely tokens."""
    rows = torch.log_softmax(logits.float(), dim=-1)
    chosen = rows.gather(1, torch.tensor(token_ids, device=rows.device).view(-1, 1)).view(-1).tolist()
    best = rows.topk(top, dim=-1) if top else None
    return [TokenLogprob(t, lp, list(zip(best.indices[j].tolist(), best.values[j].tolist())) if best is not None else [])
            for j, (t, lp) in enumerate(zip(token_ids, chosen))]


def _tree_mask(num_pending: int, parents: list[int]) -> torch.Tensor:
    """[p + n, p + n] bool: the p pending tokens a causal chain, then node i over the pending
    tokens, its ancestors and itself."""
    p, n = num_pending, len(parents)
    mask = torch.zeros(p + n, p + n, dtype=torch.bool)
    mask[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
    for i, parent in enumerate(parents):
        mask[p + i] = mask[p - 1] if parent < 0 else mask[p + parent]
        mask[p + i, p + i] = True
    return mask


def _tree_positions(num_cached: int, num_pending: int, parents: list[int]) -> list[int]:
    """Positions of the pending tokens, then of each node (its parent's + 1)."""
    pos = list(range(num_cached, num_cached + num_pending))
    for parent in parents:
        pos.append((pos[num_pending - 1] if parent < 0 else pos[num_pending + parent]) + 1)
    return pos


class StepTimes:
    """Wall-clock seconds of each phase of one step, by name, kept beside the data path: ``with
    times("verify"): ...`` times the block (phases do not nest)."""

    PHASES = ("propose", "plan", "build", "forward", "verify", "commit")

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._phase, self._started = "", 0.0

    def __call__(self, phase: str) -> "StepTimes":
        self._phase = phase
        return self

    def __enter__(self) -> "StepTimes":
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds[self._phase] = time.perf_counter() - self._started

    def total(self, *phases: str) -> float:
        """Seconds of ``phases`` (default: the whole step)."""
        return sum(self.seconds.get(p, 0.0) for p in phases or self.seconds)


@dataclass
class VerificationPass:
    """The target's one pass over every candidate of the step."""

    proposal: DraftProposal
    chunks: list[list[int]]  # [batch] each sequence's pending tokens, then its drafts
    tokens: torch.Tensor  # [num_tokens] int64, the chunks concatenated
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    rows: torch.Tensor  # [num_draft_tokens + batch] int64: each sequence's last K_i + 1 rows, those verified
    # (hidden [num_tokens, hidden], aux [num_tokens, layers * hidden] | None) after the forward,
    # for a proposer that drafts from the target's states (``reads_target``); else None
    states: tuple[torch.Tensor, torch.Tensor | None] | None = None


@dataclass
class StepResult:
    seq: Sequence
    token_ids: list[int]  # accepted drafts + one recovered or bonus token (empty on error)
    num_drafts: int
    num_accepted: int
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one for each of token_ids, where the request asked
    forced: bool = False  # the drafts were the grammar's forced tokens, not the proposer's
    tree: tuple[int, bool, list[int]] | None = None  # a token tree's depth, whether it ended in a rejection, its path (VerifyOutput.trees)
    cap: int = 0  # the most drafts the step allowed it (the plan's K)

    @property
    def positions(self) -> int:
        """The draft positions this step filled: a chain's drafts, a tree's depth."""
        return self.num_drafts if self.tree is None else self.tree[0]

    @property
    def chain_drafts(self) -> int:
        """The drafts an acceptance model of chains sees: a chain's, or a tree's accepted path and
        the rejected node it ended at (none past a leaf)."""
        return self.num_drafts if self.tree is None else self.num_accepted + int(self.tree[1])


class Runner:
    def __init__(self, target: Decoder, kv: KVCache, proposer: Proposer, target_cost: LinearCost | None = None,
                 stops: StopRules | None = None, stats: SpecStats | None = None, acceptance: Acceptance | None = None):
        """``stops``: the rules each appended token is checked by (default: the target's ends of
        sequence, the cache's length); ``stats`` and ``acceptance``: the run's counters, which the
        commit adds each step to (the engine reads them)."""
        self.target, self.kv, self.proposer = target, kv, proposer
        self.target_cost = target_cost  # refitted with every decoding pass's rows and seconds (build to commit)
        # a proposer that grows trees (``branching``) does so while they pay, measured (adaptive only)
        self.trees = TreeChoice() if target_cost is not None and getattr(proposer, "branching", None) is not None else None
        self.stops = stops if stops is not None else StopRules(target.config.eos_token_ids, kv.max_len)
        self.stats = stats if stats is not None else SpecStats()
        self.acceptance = acceptance if acceptance is not None else Acceptance(decay=0.99)
        self.times = StepTimes()  # the last step's
        self._sampling: tuple[tuple, BatchSampling] | None = None  # (the params, their tensors) of the last sampled batch

    def step(self, seqs: list[Sequence], num_draft: list[int], forced_room: list[int] | None = None) -> list[StepResult]:
        """num_draft [batch]: the most draft tokens each sequence may take this step from the
        proposer; forced_room [batch]: the most forced grammar tokens (none if None)."""
        times = self.times = StepTimes()
        with times("propose"):
            forced, proposal = self._propose(seqs, num_draft, forced_room)
        with times("plan"):
            proposal = self._plan(seqs, proposal, forced, times.seconds["propose"])
        with times("build"):
            batch = self._build_pass(seqs, proposal)
        with times("forward"):
            logits = self._forward(seqs, batch)  # [num_draft_tokens + batch, V]
        with times("verify"):  # the verifier's one call: finiteness, uniforms, greedy, rejection, trees
            shapes = any(shapes_logits(s.params) or s.grammar is not None for s in seqs)
            outcome, ok = verify_step(
                proposal.token_ids, proposal.num_tokens, logits, [s.params for s in seqs], [s.generator for s in seqs],
                draft_probs=proposal.probs, draft_columns=proposal.probs_columns, parents=proposal.parents,
                shape=(lambda rows: self._shaped(seqs, proposal, rows)) if shapes else None,
                sampling=lambda device: self._batch_sampling(seqs, device))  # ok: [batch] bool
        with times("commit"):
            results = self._commit(seqs, batch, outcome, ok, forced, logits, num_draft)
        self._learn(batch, results, times)
        return results

    # -- the phases -------------------------------------------------------------------------
    def _propose(self, seqs, num_draft, forced_room) -> tuple[list[list[int]], DraftProposal]:
        """Each sequence's forced grammar tokens [batch] (drafted instead of the proposer's), and the
        proposer's drafts for the others. Sequences on their prompt pass (and any with K = 0 this
        step) get no draft tokens."""
        forced = [s.grammar.forced(room) if s.grammar is not None else []
                  for s, room in zip(seqs, forced_room or [0] * len(seqs))]
        if self.trees is not None:
            self.proposer.branching = self.trees.use_trees()
        num_draft = [0 if f else k for f, k in zip(forced, num_draft)]
        if not any(num_draft):
            return forced, DraftProposal.empty(len(seqs))
        return forced, self.proposer.propose(seqs, num_draft)

    def _plan(self, seqs, proposal: DraftProposal, forced, spent: float) -> DraftProposal:
        """The drafts the target scores: valued trees cut to what pays (``spent``: the seconds the
        proposer took), grammar sequences' drafts their forced tokens or cut at the grammar."""
        if proposal.values is not None and self.target_cost is not None:
            proposal = self._trim_trees(seqs, proposal, spent)
        if any(s.grammar is not None for s in seqs):
            proposal = _grammar_drafts(seqs, proposal, forced)
        return proposal

    def _build_pass(self, seqs: list[Sequence], proposal: DraftProposal) -> VerificationPass:
        drafts = proposal.token_ids.tolist()
        chunks, rows, offset, end = [], [], 0, 0
        for s, k in zip(seqs, proposal.num_tokens):
            chunk = s.pending_token_ids + drafts[offset : offset + k]
            chunks.append(chunk)
            offset, end = offset + k, end + len(chunk)
            rows.extend(range(end - k - 1, end))
        meta = AttentionMetadata.chain([s.slot for s in seqs], [s.num_cached for s in seqs], [len(c) for c in chunks])
        device = self.target.device
        tokens = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=device)
        if proposal.parents is None:
            positions = meta.positions(device)
        else:  # token trees: a mask (the torch path's) and the kernels' paths, both from the parents, and a depth
            meta.masks = [None if proposal.tree(i) is None else _tree_mask(s.num_pending, proposal.tree(i))
                          for i, s in enumerate(seqs)]
            meta.paths = [None if proposal.tree(i) is None else tree_paths_from_parents(s.num_pending, proposal.tree(i))
                          for i, s in enumerate(seqs)]
            positions = torch.tensor([p for i, s in enumerate(seqs) for p in _tree_positions(
                s.num_cached, s.num_pending, proposal.tree(i) or list(range(-1, proposal.num_tokens[i] - 1)))],
                dtype=torch.long, device=device)
        return VerificationPass(proposal, chunks, tokens, positions, meta, torch.tensor(rows, device=device))

    def _forward(self, seqs: list[Sequence], batch: VerificationPass) -> torch.Tensor:
        """The target's pass -> logits [num_draft_tokens + batch, V] of the rows verified (and the
        prompt logprobs of the requests that asked, from the prompt's rows)."""
        layers = getattr(self.proposer, "reads_target", None)  # a head that drafts from the target's states
        if layers:  # hidden [num_tokens, hidden], aux [num_tokens, len(layers) * hidden]
            hidden, aux = self.target.forward(batch.tokens, batch.positions, self.kv, batch.meta, capture=tuple(layers))
        else:
            hidden, aux = self.target.forward(batch.tokens, batch.positions, self.kv, batch.meta), None
        batch.states = None if layers is None else (hidden, aux)
        self._prompt_logprobs(seqs, batch.chunks, hidden)
        return self.target.logits(hidden[batch.rows])

    def _batch_sampling(self, seqs: list[Sequence], device: torch.device) -> BatchSampling:
        """The batch's sampling parameters as tensors, built again only when a request joined,
        left or moved: a batch keeps its requests for many steps, and their SamplingParams are
        frozen (four small tensors a step were ~35 us of a sampled step's verification)."""
        params = tuple(s.params for s in seqs)
        last = self._sampling
        if (last is None or len(last[0]) != len(params) or any(a is not b for a, b in zip(last[0], params))
                or last[1].temperature.device != device):
            self._sampling = last = (params, BatchSampling.from_params(params, device))
        return last[1]

    def _commit(self, seqs: list[Sequence], batch: VerificationPass, outcome: VerifyOutput, ok: list[bool],
                forced: list[list[int]], logits: torch.Tensor, caps: list[int]) -> list[StepResult]:
        """The step's one commit, in this order: a token tree's accepted path moved into place in
        the target's cache (``kv.keep_path``); the committed rows handed to a proposer that reads
        the target's states; the proposer told the outcome (its own rollback: before the
        sequences grow); each sequence's cached length moved over its pending tokens and accepted
        drafts; then its tokens appended under the stop rules, with their logprobs, and counted.
        A sequence whose logits were not finite (``ok`` False) commits nothing and fails alone."""
        proposal = batch.proposal
        for s, tree, good in zip(seqs, outcome.trees or [None] * len(seqs), ok):
            if tree is not None and good:
                self.kv.keep_path(s.slot, s.num_cached + s.num_pending, tree[2])
        self._hand_states(seqs, batch, outcome, ok)
        self.proposer.observe(seqs, outcome)
        results = []
        for i, (s, k, tokens, accepted, good) in enumerate(zip(seqs, proposal.num_tokens, outcome.token_ids,
                                                               outcome.num_accepted, ok)):
            if not good:
                results.append(StepResult(s, [], k, 0, "the model produced non-finite logits (NaN or inf)"))
                continue
            s.num_cached += s.num_pending + accepted
            results.append(StepResult(s, list(tokens), k, accepted, forced=bool(forced[i]),
                                      tree=outcome.trees[i] if outcome.trees else None, cap=caps[i]))
        self._logprobs(results, proposal.num_tokens, logits)
        for r in results:
            self._append(r)
        return results

    def _learn(self, batch: VerificationPass, results: list[StepResult], times: StepTimes) -> None:
        """Adaptive speculation learns from the step's measured seconds: a decoding pass (no prompt
        in it; prompt passes cost otherwise) refits the target's cost model with its rows, chains,
        key reads and the seconds from building the pass to the end of the commit, and the tree
        choice records the whole step."""
        if self.target_cost is None:
            return
        num_tokens, meta = batch.proposal.num_tokens, batch.meta
        if any(q != k + 1 for q, k in zip(meta.query_lens, num_tokens)):
            return
        self.target_cost.observe(len(num_tokens) + sum(num_tokens), times.total("build", "forward", "verify", "commit"),
                                 len(num_tokens), sum(map(key_reads, meta.context_lens, meta.query_lens)))
        if self.trees is not None and any(num_tokens):
            parents = batch.proposal.parents
            grown = parents is not None and any(p is not None for p in parents)
            self.trees.record(grown, sum(len(r.token_ids) for r in results), times.total())

    # -- inside the phases ------------------------------------------------------------------
    def _append(self, r: StepResult) -> None:
        """A step's tokens onto its sequence under the stop rules (an end of sequence is not output,
        yet clients score it: kept with its logprob), then counted."""
        seq = r.seq
        if r.error is not None:
            seq.finish("error", r.error)
            return
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        emitted = 0
        for token in r.token_ids:
            emitted += 1
            before = len(seq.output_token_ids)
            done = self.stops.append(seq, token)
            lp = r.logprobs[emitted - 1] if r.logprobs is not None else None
            if len(seq.output_token_ids) > before:
                if lp is not None:
                    seq.output_logprobs.append(lp)
            elif seq.finish_reason == "stop":
                seq.eos_token_id, seq.eos_logprob = token, lp
            if done:
                break
        # the acceptance estimates and probe counter that the engine plans K with
        if r.num_drafts and not r.forced:  # a grammar's forced tokens say nothing of the proposer
            # a tree's depths say nothing of where a chain would have stopped: its cap is its path
            cap = r.cap if r.tree is None else r.chain_drafts
            seq.acceptance.record(r.chain_drafts, r.num_accepted, cap)
            self.acceptance.record(r.chain_drafts, r.num_accepted, cap)
            seq.steps_without_drafts = 0
        else:  # a prompt pass, a step without speculation, or one where no draft was found
            seq.steps_without_drafts += 1
        seq.spec.record(r.num_drafts, r.num_accepted, emitted, r.positions)
        self.stats.record(r.num_drafts, r.num_accepted, emitted, r.positions)

    def _trim_trees(self, seqs: list[Sequence], proposal: DraftProposal, spent: float) -> DraftProposal:
        """Each tree the proposer valued cut to the nodes whose rows pay at this batch
        (plan.plan_tree_sizes), before the target scores them."""
        valued = [proposal.values[i] if proposal.tree(i) is not None else None for i in range(len(seqs))]
        chains = [0 if v is not None else k for v, k in zip(valued, proposal.num_tokens)]
        keep = plan_tree_sizes(valued, self.target_cost, sum(s.num_pending + k for s, k in zip(seqs, chains)),
                               sum(key_reads(s.num_cached, s.num_pending + k) for s, k in zip(seqs, chains)),
                               [s.num_cached + s.num_pending for s in seqs], spent)
        return proposal.trimmed(keep)

    def _hand_states(self, seqs: list[Sequence], batch: VerificationPass, outcome: VerifyOutput, ok) -> None:
        """For a proposer that drafts from the target's states (``reads_target``; EAGLE-3, Medusa):
        each sequence's rows that this step commits (its pending tokens and its accepted drafts,
        positions num_cached.. in order; a tree's accepted path gathered from its nodes' rows), the
        final hidden state [rows, hidden] and the captured layers' states [rows, layers * hidden]
        (None when it captures none)."""
        if batch.states is None:
            return
        hidden, aux = batch.states
        final, states, start = [], [], 0
        for i, (s, qlen, accepted, good) in enumerate(zip(seqs, batch.meta.query_lens, outcome.num_accepted, ok)):
            tree = outcome.trees[i] if outcome.trees else None
            if tree is None or not good:  # a chain's committed rows are contiguous: views, no copy
                rows = slice(start, start + (s.num_pending + accepted if good else 0))
            else:
                rows = torch.tensor(list(range(start, start + s.num_pending)) + [start + s.num_pending + n for n in tree[2]],
                                    device=hidden.device)
            final.append(hidden[rows])
            states.append(None if aux is None else aux[rows])
            start += qlen
        self.proposer.read_target(seqs, final, states)

    def _prompt_logprobs(self, seqs: list[Sequence], chunks: list[list[int]], hidden: torch.Tensor) -> None:
        """On a prompt's pass, for the requests that asked: each prompt token's log-probability
        given the tokens before it (row j scores token j + 1), the output head run over the
        prompt's rows in slices so that a long prompt never holds all its logits at once."""
        start = 0
        for s, chunk in zip(seqs, chunks):
            n = s.params.prompt_logprobs
            if n is not None and s.prompt_logprobs is None and s.num_cached == 0:
                prompt = s.prompt_token_ids  # the chunk's first tokens (a one-token prompt may bring drafts)
                out: list[TokenLogprob | None] = [None]
                for a in range(0, len(prompt) - 1, PROMPT_LOGPROB_ROWS):
                    b = min(a + PROMPT_LOGPROB_ROWS, len(prompt) - 1)
                    out += _token_logprobs(self.target.logits(hidden[start + a : start + b]), prompt[a + 1 : b + 1], n)
                s.prompt_logprobs = out
            start += len(chunk)

    @staticmethod
    def _logprobs(results: list[StepResult], num_tokens: list[int], logits: torch.Tensor) -> None:
        """For the requests that asked: each emitted token's log-probability in the row that
        verified it (the j-th emitted token is scored by the sequence's j-th row: the accepted
        drafts, then the recovered or bonus token), and the most likely tokens of that row."""
        start = 0
        for r, k in zip(results, num_tokens):
            n = r.seq.params.logprobs
            if n is not None and r.token_ids:
                r.logprobs = _token_logprobs(logits[start : start + len(r.token_ids)], r.token_ids, n)
            start += k + 1

    def _shaped(self, seqs: list[Sequence], proposal: DraftProposal, logits: torch.Tensor) -> torch.Tensor:
        """The logits the verifier judges by: where a request has penalties, a bias or
        min_tokens, its rows shaped by the text up to each row (verify/penalties.py), and where it
        has a grammar, each row masked to what the grammar allows after the drafts before it
        (structured.py), in a copy (the raw rows stay for logprobs); the logits themselves where
        no request has either."""
        if not any(shapes_logits(s.params) or s.grammar is not None for s in seqs):
            return logits
        shaped, drafts = logits.float().clone(), proposal.token_ids.tolist()
        eos = list(self.target.config.eos_token_ids)
        start = at = 0
        for s, k in zip(seqs, proposal.num_tokens):
            rows = shaped[start : start + k + 1]
            if shapes_logits(s.params):
                shape_rows(rows, s.params, s.prompt_token_ids, s.output_token_ids, drafts[at : at + k], eos)
            if s.grammar is not None:
                apply_masks(rows, s.grammar.masks(drafts[at : at + k]).to(rows.device), eos)
            start, at = start + k + 1, at + k
        return shaped


def _grammar_drafts(seqs: list[Sequence], proposal: DraftProposal, forced: list[list[int]]) -> DraftProposal:
    """The proposal with each grammar sequence's forced tokens as its draft (point masses: a
    one-hot q where the proposal carries q), and every other draft of a grammar sequence cut
    before its first token the grammar rejects (that token would be rejected: p = 0 there)."""
    proposal = proposal.spread()
    drafts, rows, at = [], [], 0
    for s, k, f in zip(seqs, proposal.num_tokens, forced):
        own = proposal.token_ids[at : at + k].tolist()
        if f:
            drafts.append(f)
            rows.append(None)
        else:
            keep = s.grammar.allowed_prefix(own) if s.grammar is not None else k
            drafts.append(own[:keep])
            rows.append(torch.arange(at, at + keep))
        at += k
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
    probs = proposal.probs
    if probs is not None:
        vocab = probs.shape[1]
        parts = [probs[r.to(probs.device)] if r is not None else
                 torch.nn.functional.one_hot(torch.tensor(d), vocab).to(probs) for d, r in zip(drafts, rows)]
        probs = torch.cat(parts) if parts else probs
    # trees stay trees: grammar sequences draft chains only (proposers/base.accepts_trees)
    return DraftProposal(flat, [len(d) for d in drafts], probs, proposal.parents)
