"""One speculative step over a batch: propose, score every candidate in one target pass, verify.

For sequence i the target is fed its pending tokens (the whole prompt on its first step, then the
one token emitted last step) followed by its K_i draft tokens, in one ragged pass with every other
sequence. The last K_i + 1 rows of each sequence's chunk are the rows the verifier needs: row j
scores the token after draft token j - 1. After verification the sequence's cached length moves to
cover the pending tokens and the accepted drafts; the rejected drafts' keys stay in the cache as
garbage that the next pass overwrites.

A sequence with a grammar (structured.py) drafts its grammar's forced tokens where there are any
(the proposer is not asked for it then), has any other draft cut before its first token the
grammar rejects, and has every one of its rows masked to what the grammar allows after the drafts
before that row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from quickdraft.cost import LinearCost, TreeChoice, key_reads, plan_tree_sizes
from quickdraft.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder
from quickdraft.engine.sequence import Sequence, TokenLogprob
from quickdraft.proposers.base import DraftProposal, Proposer
from quickdraft.sampling import BatchSampling, draw_uniforms
from quickdraft.structured import apply_masks
from quickdraft.verify.penalties import shape_rows, shapes_logits
from quickdraft.verify.rejection import VerifyOutput, verify
from quickdraft.verify.tree import DraftTree, verify_tree


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
    def __init__(self, target: Decoder, kv: KVCache, proposer: Proposer, target_cost: LinearCost | None = None):
        self.target, self.kv, self.proposer = target, kv, proposer
        self.target_cost = target_cost  # refitted with every pass's rows and seconds (scoring to commit)
        # a proposer that grows trees (``branching``) does so while they pay, measured (adaptive only)
        self.trees = TreeChoice() if target_cost is not None and getattr(proposer, "branching", None) is not None else None
        self._states = None  # (hidden, aux, query_lens) of the last pass, for a proposer that reads them

    def step(self, seqs: list[Sequence], num_draft: list[int], forced_room: list[int] | None = None) -> list[StepResult]:
        """num_draft [batch]: the most draft tokens each sequence may take this step from the
        proposer; forced_room [batch]: the most forced grammar tokens (none if None)."""
        forced = [s.grammar.forced(room) if s.grammar is not None else []
                  for s, room in zip(seqs, forced_room or [0] * len(seqs))]
        started = step_started = time.perf_counter()
        if self.trees is not None:
            self.proposer.branching = self.trees.use_trees()
        proposal = self._propose(seqs, [0 if f else k for f, k in zip(forced, num_draft)])
        if proposal.values is not None and self.target_cost is not None:
            proposal = self._trim_trees(seqs, proposal, time.perf_counter() - started)
        if any(s.grammar is not None for s in seqs):
            proposal = _grammar_drafts(seqs, proposal, forced)
        started = time.perf_counter()
        # a decoding pass (no prompt in it) is timed for the cost model; prompt passes cost otherwise
        timed = self.target_cost is not None and all(s.num_pending == 1 for s in seqs)
        if timed:
            keys = sum(key_reads(s.num_cached, 1 + k) for s, k in zip(seqs, proposal.num_tokens))
        logits = self._score(seqs, proposal)  # [num_draft_tokens + batch, V]
        ok = self._finite_rows(logits, proposal.num_tokens)  # [batch] bool
        uniforms = self._uniforms(seqs, proposal.num_tokens).to(logits.device)
        if proposal.parents is not None:
            outcome = self._verify_trees(seqs, proposal, logits, uniforms)
        else:
            outcome = verify(
                proposal.token_ids.to(logits.device), proposal.num_tokens, self._shaped(seqs, proposal, logits),
                None if proposal.probs is None else proposal.probs.to(logits.device),
                BatchSampling.from_params([s.params for s in seqs], logits.device), uniforms,
            )
        self._hand_states(seqs, proposal, outcome, ok)
        self.proposer.observe(seqs, outcome)
        results = self._commit(seqs, proposal, outcome, ok)
        for r, f in zip(results, forced):
            r.forced = bool(f)
        self._logprobs(results, proposal.num_tokens, logits)
        if timed:
            self.target_cost.observe(len(seqs) + sum(proposal.num_tokens), time.perf_counter() - started,
                                     len(seqs), keys)
        if self.trees is not None and timed and any(proposal.num_tokens):
            grown = proposal.parents is not None and any(p is not None for p in proposal.parents)
            self.trees.record(grown, sum(len(r.token_ids) for r in results), time.perf_counter() - step_started)
        return results

    def _propose(self, seqs, num_draft) -> DraftProposal:
        # Sequences on their prompt pass (and any with K = 0 this step) get no draft tokens.
        if not any(num_draft):
            return DraftProposal.empty(len(seqs))
        return self.proposer.propose(seqs, num_draft)

    def _trim_trees(self, seqs: list[Sequence], proposal: DraftProposal, spent: float) -> DraftProposal:
        """Each tree the proposer valued cut to the nodes whose rows pay at this batch
        (cost.plan_tree_sizes), before the target scores them."""
        valued = [proposal.values[i] if proposal.tree(i) is not None else None for i in range(len(seqs))]
        chains = [0 if v is not None else k for v, k in zip(valued, proposal.num_tokens)]
        keep = plan_tree_sizes(valued, self.target_cost, sum(s.num_pending + k for s, k in zip(seqs, chains)),
                               sum(key_reads(s.num_cached, s.num_pending + k) for s, k in zip(seqs, chains)),
                               [s.num_cached + s.num_pending for s in seqs], spent)
        return proposal.trimmed(keep)

    def _score(self, seqs: list[Sequence], proposal: DraftProposal) -> torch.Tensor:
        drafts = proposal.token_ids.tolist()
        chunks, offset = [], 0
        for s, k in zip(seqs, proposal.num_tokens):
            chunks.append(s.pending_token_ids + drafts[offset : offset + k])
            offset += k
        meta = AttentionMetadata.chain([s.slot for s in seqs], [s.num_cached for s in seqs], [len(c) for c in chunks])
        device = self.target.device
        tokens = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=device)
        if proposal.parents is None:
            positions = meta.positions(device)
        else:  # token trees: a mask and a depth for each sequence's drafts
            meta.masks = [None if proposal.tree(i) is None else _tree_mask(s.num_pending, proposal.tree(i))
                          for i, s in enumerate(seqs)]
            positions = torch.tensor([p for i, s in enumerate(seqs) for p in _tree_positions(
                s.num_cached, s.num_pending, proposal.tree(i) or list(range(-1, proposal.num_tokens[i] - 1)))],
                dtype=torch.long, device=device)
        layers = getattr(self.proposer, "reads_target", None)  # a head that drafts from the target's states
        if layers:  # hidden [num_tokens, hidden], aux [num_tokens, len(layers) * hidden]
            hidden, aux = self.target.forward(tokens, positions, self.kv, meta, capture=tuple(layers))
        else:
            hidden, aux = self.target.forward(tokens, positions, self.kv, meta), None
        # handed on by _hand_states after verification
        self._states = None if layers is None else (hidden, aux, meta.query_lens)
        self._prompt_logprobs(seqs, chunks, hidden)
        ends = torch.tensor(meta.query_lens).cumsum(0)
        rows = torch.cat([torch.arange(e - k - 1, e) for e, k in zip(ends.tolist(), proposal.num_tokens)])
        return self.target.logits(hidden[rows.to(device)])

    def _hand_states(self, seqs: list[Sequence], proposal: DraftProposal, outcome: VerifyOutput, ok) -> None:
        """For a proposer that drafts from the target's states (``reads_target``; EAGLE-3, Medusa):
        each sequence's rows that this step commits (its pending tokens and its accepted drafts,
        positions num_cached.. in order; a tree's accepted path gathered from its nodes' rows), the
        final hidden state [rows, hidden] and the captured layers' states [rows, layers * hidden]
        (None when it captures none)."""
        if self._states is None:
            return
        hidden, aux, query_lens = self._states
        self._states = None
        final, states, start = [], [], 0
        for i, (s, qlen, accepted, good) in enumerate(zip(seqs, query_lens, outcome.num_accepted, ok)):
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

    def _verify_trees(self, seqs: list[Sequence], proposal: DraftProposal, logits: torch.Tensor,
                      uniforms: torch.Tensor) -> VerifyOutput:
        """Each sequence's drafts as a tree (a chain is the tree of one branch; verify/tree.py
        gives it the chain verifier's draws), then the accepted path's keys and values moved into
        place. Proposers make trees only where proposers/base.accepts_trees allows (no shaping, grammar or logprobs)."""
        logits = self._shaped(seqs, proposal, logits)  # the chains' rows, where a request shapes them
        token_ids, accepted, shapes, row, at = [], [], [], 0, 0
        for i, (s, k) in enumerate(zip(seqs, proposal.num_tokens)):
            parents = proposal.tree(i) or list(range(-1, k - 1))
            tree = DraftTree(proposal.token_ids[at : at + k], parents,
                             None if proposal.probs is None else proposal.probs[at : at + k])
            out = verify_tree(tree, logits[row : row + k + 1], s.params, uniforms[row : row + k + 1])
            shapes.append(None)
            if proposal.tree(i) is not None:
                self.kv.keep_path(s.slot, s.num_cached + s.num_pending, out.path)
                depth = [0] * k
                for n, parent in enumerate(parents):
                    depth[n] = 1 + (depth[parent] if parent >= 0 else 0)
                end = out.path[-1] if out.path else -1
                shapes[-1] = (max(depth, default=0), end in parents, out.path)
            token_ids.append(out.token_ids)
            accepted.append(out.num_accepted)
            row, at = row + k + 1, at + k
        return VerifyOutput(token_ids, accepted, shapes)

    @staticmethod
    def _finite_rows(logits: torch.Tensor, num_tokens: list[int]) -> list[bool]:
        """A sequence whose logits hold a NaN or inf fails alone; its rows are zeroed for verify."""
        finite = torch.isfinite(logits).all(-1)  # [rows]
        ok, start = [], 0
        for k in num_tokens:
            good = bool(finite[start : start + k + 1].all())
            if not good:
                with torch.inference_mode():  # the decoder's logits are inference tensors
                    logits[start : start + k + 1] = 0.0
            ok.append(good)
            start += k + 1
        return ok

    @staticmethod
    def _uniforms(seqs: list[Sequence], num_tokens: list[int]) -> torch.Tensor:
        """[num_draft_tokens + batch] float64: K_i acceptance coins and one final draw each.
        Greedy sequences draw nothing, so their generators stay untouched."""
        parts = [
            torch.zeros(k + 1, dtype=torch.float64) if s.params.greedy else draw_uniforms(s.generator, k + 1).cpu()
            for s, k in zip(seqs, num_tokens)
        ]
        return torch.cat(parts)

    @staticmethod
    def _commit(seqs, proposal, outcome: VerifyOutput, ok) -> list[StepResult]:
        results = []
        for i, (s, k, tokens, accepted, good) in enumerate(zip(seqs, proposal.num_tokens, outcome.token_ids,
                                                               outcome.num_accepted, ok)):
            if not good:
                results.append(StepResult(s, [], k, 0, "the model produced non-finite logits (NaN or inf)"))
                continue
            s.num_cached += s.num_pending + accepted
            results.append(StepResult(s, list(tokens), k, accepted, tree=outcome.trees[i] if outcome.trees else None))
        return results


def _grammar_drafts(seqs: list[Sequence], proposal: DraftProposal, forced: list[list[int]]) -> DraftProposal:
    """The proposal with each grammar sequence's forced tokens as its draft (point masses: a
    one-hot q where the proposal carries q), and every other draft of a grammar sequence cut
    before its first token the grammar rejects (that token would be rejected: p = 0 there)."""
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
