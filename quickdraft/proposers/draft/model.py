"""Method "draft_model": a smaller model of the same family, with its own KV cache, proposes K
tokens by decoding autoregressively (Leviathan et al. 2023; Chen et al. 2023).

It samples from its own distribution q under the request's sampling parameters (argmax when
greedy; under a request's grammar, q masked by the grammar walked along the draft's own tokens,
structured.py) and hands q on, so that the verifier's min(1, p/q) rule keeps the output distribution the
target's. The draft's cache is indexed by the same slot as the target's. ``_cached[slot]`` counts
the sequence's tokens whose keys are in the draft cache; a pass feeds it everything after that, so
after a rejection (or after the bonus token) the draft catches up in the first pass of the next
proposal, with no copy and no recomputation of what it already holds. A finished sequence's draft
keys stay in its slot with ``_cached[slot]`` for the prefix cache (engine/prefix_cache.py): a new
prompt that shares a prefix with them keeps them (``reuse``), in place or copied like the target's.

Chains without a grammar, greedy or sampled (at any temperature, top-k, top-p and min-p), run
every draft pass in one native call where the kernels run the draft (``_native_chains``,
models/decoder/native.py's ``chains``): the same tokens, q and cache bits as the Python loop,
with no Python between the passes.

Three options trade nothing but speed: ``draft_confidence_threshold`` ends a sequence's draft
early once the draft's own probability of its token drops below it, ``quantization`` runs the
draft in int8 (models/quant.py), and ``draft_vocab_size`` (or ``draft_vocab_file``) truncates the
draft's output head to a subset of the vocabulary (proposers/draft/vocab.py): the draft's logits,
argmax and q are over the subset, mapped back to full ids, and q is handed on as the full-vocabulary
distribution it is, zero outside the subset. None of them can change the output: only the
target's verification decides.

With ``num_branches`` > 1 requests draft token trees instead (``_grow_trees``, proposers/tree_drafts.py):
a greedy request EAGLE-2's dynamic tree (its likeliest children, the most valuable nodes kept), a
sampled one a tree shaped before each draw, its children drawn from q without replacement
(SpecInfer's), each node handed on with the q it was drawn from. A level is a draft pass for the
whole batch, each node over its ancestors' keys in the draft cache (the tree attention's hidden
keys), and after verification the accepted path's keys are moved into place
(``KVCache.keep_path``), so the next proposal catches up exactly as after a chain.

A draft with another tokenizer is refused here (``check_same_vocabulary``), unless the config asks
for ``cross_tokenizer``: then ``from_config`` builds proposers/draft/text.py's proposer, which drafts
through text. Both load and run the draft through proposers/draft/load.py.
"""

from __future__ import annotations

import time

import torch
from torch.nn.utils.rnn import pad_sequence

from quickdraft.models.decoder import MAX_ROW_BY_ROW, AttentionMetadata, Decoder
from quickdraft.models.kv_cache import KVCache
from quickdraft.models.pass_cost import calibrate, key_reads
from quickdraft.proposers.base import DraftProposal, register
from quickdraft.proposers.draft.load import MAX_OBSERVED_FEED, draft_pass, load_draft
from quickdraft.proposers.draft_sampling import confident_rows, draw, to_vocab
from quickdraft.proposers.tree_drafts import (DraftTreeState, EdgeCalibration, chains_and_trees, sampled_children,
                                              top_children, tree_requests)
from quickdraft.sampling import draw_uniforms, head_columns


@register("draft_model")
class DraftModelProposer:
    def __init__(self, draft: Decoder, num_slots: int, max_len: int, confidence_threshold: float = 0.0,
                 calibrate_cost: bool = False, head_ids: torch.Tensor | None = None, num_branches: int = 1):
        """``head_ids`` [N] int64: the full-vocabulary id of each row of ``draft``'s output head when
        the head is truncated (draft_load.py's ``truncated_head``); None: the head has every row.
        ``num_branches`` > 1: greedy requests draft token trees (``_grow_trees``)."""
        self.model = draft
        self.branches = num_branches
        self._trees: dict[int, DraftTreeState] = {}  # slot -> the tree proposed this step, for observe
        self.edge_scale = EdgeCalibration()
        # trees this step (None: never; the runner turns them off while chains are measured faster)
        self.branching: bool | None = True if num_branches > 1 else None
        self.vocab_size = draft.config.vocab_size
        self.head_ids = None if head_ids is None else head_ids.to(draft.device)
        self.head_columns = None if head_ids is None else head_columns(self.head_ids, self.vocab_size)
        self.threshold = confidence_threshold
        self.kv = KVCache(draft.config, num_slots, max_len, draft.dtype, draft.device)
        self._cached = [0] * num_slots
        # one draft pass's seconds by rows, for the engine's K planning; refitted on every pass
        self.cost = calibrate(draft, self.kv) if calibrate_cost else None
        # greedy chains in one native call, where the kernels take the draft's table and head
        self.native_chains = draft.native is not None and draft.native.set_head(draft, self.head_ids)

    @classmethod
    def from_config(cls, spec, ctx):
        if spec.cross_tokenizer:  # a draft of any vocabulary, proposing through text
            from quickdraft.proposers.draft.text import TextDraftProposer

            return TextDraftProposer.from_config(spec, ctx)
        draft, config, weights, quantize, head_ids = load_draft(spec, ctx, check_vocabulary=True)
        return cls(Decoder(config, weights, quantize=quantize, cuda_graphs=ctx.cuda_graphs), ctx.num_slots, ctx.max_model_len,
                   spec.draft_confidence_threshold, calibrate_cost=spec.adaptive, head_ids=head_ids,
                   num_branches=spec.num_branches)

    def propose(self, seqs, num_tokens) -> DraftProposal:
        """Chains, and with ``num_branches`` > 1 a token tree for each request that takes one
        (base.accepts_trees), greedy or sampled."""
        return chains_and_trees(seqs, num_tokens, tree_requests(seqs, num_tokens, self.branching, sampled=True),
                                self._propose_chains, self._grow_trees)

    def _propose_chains(self, seqs, num_tokens) -> DraftProposal:
        num_tokens = list(num_tokens)  # shortened below where the draft loses confidence
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        sampled = any(not seqs[i].params.greedy for i in active)
        feed = {i: seqs[i].token_ids[self._cached[seqs[i].slot] :] for i in active}
        # a grammar walks along the draft's own tokens, so that each is drawn under its mask; it
        # steps back before verification (structured.py, "draft masks")
        grammars = {i: seqs[i].grammar for i in active if seqs[i].grammar is not None}
        if (self.native_chains and self.model.native.one_call and active and not grammars
                and max(len(feed[i]) for i in active) <= MAX_ROW_BY_ROW):
            return self._native_chains(seqs, num_tokens, active, feed, sampled)
        walked = dict.fromkeys(grammars, 0)
        try:
            for step in range(max(num_tokens, default=0)):
                active = [i for i in active if num_tokens[i] > step]
                if not active:
                    break
                started = time.perf_counter()
                timed = self.cost is not None and max(len(feed[i]) for i in active) <= MAX_OBSERVED_FEED
                if timed:
                    rows = sum(len(feed[i]) for i in active)
                    keys = sum(key_reads(self._cached[seqs[i].slot], len(feed[i])) for i in active)
                logits = self._forward([seqs[i] for i in active], [feed[i] for i in active])  # [len(active), N]
                ended = set()
                if grammars:
                    logits, ended = self._grammar_mask(logits, active, grammars)
                tokens, q = draw([seqs[i] for i in active], logits, sampled)  # rows of the head
                confident = confident_rows(logits, tokens, self.threshold)  # [len(active)] bool
                tokens, q = to_vocab(tokens, q, self.head_ids, self.vocab_size)  # ids [len(active)], q [len(active), V]
                tokens = tokens.tolist()
                if timed:
                    self.cost.observe(rows, time.perf_counter() - started, len(active), keys)
                for row, i in enumerate(active):
                    if i in ended:  # its grammar allows nothing more (or nothing the head has)
                        num_tokens[i] = step
                        continue
                    drafts[i].append(tokens[row])
                    if q is not None:
                        probs[i].append(q[row])
                    feed[i] = [tokens[row]]
                    if not confident[row]:
                        num_tokens[i] = step + 1  # this token is proposed, no more after it
                    if i in grammars:
                        if not grammars[i].advance(tokens[row]):
                            raise RuntimeError(f"the grammar refused draft token {tokens[row]} drawn under its mask: "
                                               f"{grammars[i].error}")
                        walked[i] += 1
        finally:
            for i, g in grammars.items():
                g.rollback(walked[i])
        flat = [t for d in drafts for t in d]
        q_all = torch.stack([p for ps in probs for p in ps]) if sampled and flat else None
        return DraftProposal(torch.tensor(flat, dtype=torch.long), [len(d) for d in drafts], q_all)

    def _native_chains(self, seqs, num_tokens: list[int], active: list[int], feed: dict[int, list[int]],
                       sampled: bool) -> DraftProposal:
        """The chains of ``active`` in one native call: the Python loop's tokens, q, cache and
        generators, and its cost observations, each pass timed inside the call. Sampled, each
        sequence's uniforms are drawn from its generator as the loop would draw them (one a pass,
        a greedy sequence's too), all before the call; where the confidence threshold may cut a
        chain short, each generator is then put back and advanced by the passes its chain ran."""
        slots = [seqs[i].slot for i in active]
        cached = [self._cached[slot] for slot in slots]
        feeds = [feed[i] for i in active]
        ks = [num_tokens[i] for i in active]
        temps = uniforms = states = filters = None
        if sampled:
            generators = [seqs[i].generator for i in active]
            states = [g.get_state() for g in generators] if self.threshold > 0 else None
            # a generator's k uniforms in one draw: the values of k single draws (torch's CPU
            # generator fills a float64 tensor one 64-bit number after another; the native chains
            # against the Python loop in tests/models/test_native_chains.py hold it to that)
            uniforms = pad_sequence([draw_uniforms(g, k).cpu() for g, k in zip(generators, ks)], batch_first=True)
            temps = [float(seqs[i].params.temperature) for i in active]
            filters = ([int(seqs[i].params.top_k) for i in active], [float(seqs[i].params.top_p) for i in active],
                       [float(seqs[i].params.min_p) for i in active])
        drafted, seconds, q = self.model.native.chains(self.kv, slots, cached, feeds, ks, self.threshold, temps, uniforms,
                                                       filters)
        if states is not None:  # the uniforms of passes a cut chain did not run go back
            for a, (g, state) in enumerate(zip(generators, states)):
                if len(drafted[a]) < ks[a]:
                    g.set_state(state)
                    if drafted[a]:
                        draw_uniforms(g, len(drafted[a]))
        if self.cost is not None:  # pass 0 read the feeds; each later pass one token of each chain still drafting
            ctx, rows = list(cached), [len(f) for f in feeds]
            for p, spent in enumerate(seconds):
                on = [a for a, d in enumerate(drafted) if len(d) > p]
                if max(rows[a] for a in on) <= MAX_OBSERVED_FEED:
                    self.cost.observe(sum(rows[a] for a in on), spent, len(on), sum(key_reads(ctx[a], rows[a]) for a in on))
                for a in on:
                    ctx[a] += rows[a]
                    rows[a] = 1
        drafts: list[list[int]] = [[] for _ in seqs]
        for a, (i, slot) in enumerate(zip(active, slots)):
            drafts[i] = drafted[a]
            self._cached[slot] += len(feeds[a]) + len(drafted[a]) - 1  # the last draft token is not read
        q_all = None
        if q is not None:  # each drafted token's distribution, sequence by sequence, over the head's rows
            if all(len(d) == q.shape[1] for d in drafted[:-1]):  # the rows already in order (one sequence: always)
                q_all = q.view(-1, q.shape[2])[: sum(map(len, drafted))]
            else:
                q_all = torch.cat([q[a, : len(d)] for a, d in enumerate(drafted)])
        return DraftProposal(torch.tensor([t for d in drafts for t in d], dtype=torch.long), [len(d) for d in drafts], q_all,
                             probs_columns=self.head_columns if q_all is not None else None)

    def _grow_trees(self, seqs, budgets: list[int]) -> list[tuple]:
        """A token tree for each sequence. A greedy request's is grown as EAGLE-2 does (Li et al.
        2024, "dynamic draft trees"): a node's value is the draft's confidence in its whole path
        (the product of its edges' probabilities, scaled by ``edge_scale`` to what the target
        accepts); each level expands the ``num_branches`` most valuable nodes of the last one, each
        with its ``num_branches`` likeliest tokens, and stops when no frontier node could still
        enter the best N; the best N nodes are proposed (a node's value never exceeds its parent's,
        so they form a tree). With one branch this is the greedy chain, token for token. A sampled
        request's expands the most valuable node of each level, drawing its children from q
        without replacement, at most N nodes in all, and proposes every node with its q
        (tree_drafts.sampled_children, DraftTreeState.to_expand_sampled). ``budgets`` [n]: the
        planned chain length K, which bounds the depth; N is K x num_branches, within the context.
        Each level is one draft pass for the batch. -> (tokens, parents, values[, q rows]) each."""
        B = self.branches
        feeds = [s.token_ids[self._cached[s.slot]:] for s in seqs]
        trees = [DraftTreeState(self._cached[s.slot] + len(f)) for s, f in zip(seqs, feeds)]
        room = [self.kv.max_len - t.base - 1 for t in trees]
        sizes = [max(1, min(k * B, r)) for k, r in zip(budgets, room)]
        sampled = [not s.params.greedy for s in seqs]
        started = time.perf_counter()
        logits = self._forward(seqs, feeds)  # [n, N] after each sequence's last committed token
        self._observe_pass(started, seqs, feeds)
        self._attach(trees, seqs, [(i, -1, min(B, sizes[i]) if sampled[i] else B) for i in range(len(seqs))], logits)
        for depth in range(1, max(budgets)):
            grow = []  # (sequence, [(node to expand, children to draw)])
            for i, t in enumerate(trees):
                if depth < budgets[i]:
                    picks = (t.to_expand_sampled(depth, B, sizes[i], room[i]) if sampled[i] else
                             [(n, B) for n in t.to_expand(depth, B, sizes[i], room[i])])
                    if picks:
                        grow.append((i, picks))
            if not grow:
                break
            started = time.perf_counter()
            levels = [[n for n, _ in picks] for _, picks in grow]
            logits = tree_pass(self.model, self.kv, [seqs[i].slot for i, _ in grow], [trees[i] for i, _ in grow], levels)
            if self.cost is not None:
                rows = sum(len(nodes) for nodes in levels)
                keys = sum(key_reads(trees[i].base + trees[i].written - len(nodes), len(nodes))
                           for (i, _), nodes in zip(grow, levels))
                self.cost.observe(rows, time.perf_counter() - started, len(grow), keys)
            self._attach(trees, seqs, [(i, node, count) for i, picks in grow for node, count in picks], logits)
        for s, t in zip(seqs, trees):
            self._trees[s.slot] = t
        return [t.drawn() if sampled[i] else t.best(n) for i, (t, n) in enumerate(zip(trees, sizes))]

    def _attach(self, trees: list[DraftTreeState], seqs, parents: list[tuple[int, int, int]],
                logits: torch.Tensor) -> None:
        """Children from the draft's ``logits`` [rows, N], a row for each of ``parents`` (tree,
        node or -1 for the root, children to draw) in order: a greedy request's node its
        ``num_branches`` likeliest tokens (one top-k for all such rows), a sampled one's its count
        drawn from q."""
        greedy = [r for r, (i, _, _) in enumerate(parents) if seqs[i].params.greedy]
        top = dict(zip(greedy, top_children(logits[greedy], self.branches, self.head_ids))) if greedy else {}
        for r, (i, node, count) in enumerate(parents):
            if r in top:
                trees[i].add_children(node, top[r], self.edge_scale)
            else:
                children, q = sampled_children(logits[r], seqs[i], count, self.head_ids, self.vocab_size)
                trees[i].add_children(node, children, self.edge_scale, q)

    def _observe_pass(self, started: float, seqs, feeds) -> None:
        """A draft pass that fed ``feeds`` timed for the cost model (unless it read a long catch-up)."""
        if self.cost is not None and max(len(f) for f in feeds) <= MAX_OBSERVED_FEED:
            keys = sum(key_reads(self._cached[s.slot] - len(f), len(f)) for s, f in zip(seqs, feeds))
            self.cost.observe(sum(len(f) for f in feeds), time.perf_counter() - started, len(seqs), keys)

    def _grammar_mask(self, logits: torch.Tensor, active: list[int], grammars: dict) -> tuple[torch.Tensor, set[int]]:
        """logits [n, N] with each grammar row's disallowed tokens at -inf (a copy), and the
        sequences whose grammar allows none of the head's tokens (their row is left as it was)."""
        allowed = torch.ones(logits.shape, dtype=torch.bool)  # [n, N]
        ended = set()
        for row, i in enumerate(active):
            if i in grammars:
                m = grammars[i].mask()  # [V]
                m = m if self.head_ids is None else m[self.head_ids.cpu()]
                if m.any():
                    allowed[row] = m
                else:
                    ended.add(i)
        return logits.masked_fill(~allowed.to(logits.device), float("-inf")), ended

    def _forward(self, seqs, feeds: list[list[int]]) -> torch.Tensor:
        """Run the draft over each sequence's unseen tokens; logits of each one's last row."""
        slots = [s.slot for s in seqs]
        logits = draft_pass(self.model, self.kv, slots, [self._cached[slot] for slot in slots], feeds)
        for slot, f in zip(slots, feeds):
            self._cached[slot] += len(f)
        return logits

    def observe(self, seqs, outcome) -> None:
        # Keys of draft tokens past the accepted prefix are stale; the next pass overwrites them.
        for s, accepted, tokens in zip(seqs, outcome.num_accepted, outcome.token_ids):
            tree = self._trees.pop(s.slot, None)
            if tree is None:
                self._cached[s.slot] = min(self._cached[s.slot], len(s) + accepted)
                continue
            # The target's token at each row the walk visited (its greedy choices: the accepted
            # nodes, then the bonus) against the draft's children there: the confidence calibration;
            # the accepted nodes the draft has keys for (those it expanded) moved into place.
            path = tree.walk(list(tokens), accepted)
            self.edge_scale.record(tree, path, list(tokens))
            fed = [tree.fed[n] for n in path if tree.fed[n] >= 0]
            self.kv.keep_path(s.slot, tree.base, fed)
            self._cached[s.slot] = tree.base + len(fed)

    def read_prompt(self, seqs) -> None:
        """Read the prompt tokens of ``seqs`` (on their prompt pass) that the draft has not seen,
        in one pass (engine._draft_reads_prompts): the first decoding step then drafts from one row."""
        feeds = [s.token_ids[self._cached[s.slot] :] for s in seqs]
        todo = [i for i, f in enumerate(feeds) if f]
        if todo:
            self._forward([seqs[i] for i in todo], [feeds[i] for i in todo])

    def catchup_rows(self, seq) -> int:
        # after a draft with no rejection, or steps without drafting, the draft is behind by more than 1
        return max(len(seq) - self._cached[seq.slot] - 1, 0)

    def reuse(self, seq, source, num_tokens) -> int:
        # The source slot's draft keys cover its first _cached[source] committed tokens (clamped
        # to the committed ones by observe), of which the prompt shares num_tokens.
        held = min(self._cached[source], num_tokens)
        self.kv.copy_prefix(source, seq.slot, held)
        self._cached[seq.slot] = held
        return num_tokens

    def release(self, seq) -> None:
        self._trees.pop(seq.slot, None)  # the slot's draft keys stay for reuse; _cached[slot] says how many are valid

    def close(self) -> None:
        pass


def tree_pass(model: Decoder, kv: KVCache, slots: list[int], trees: list[DraftTreeState],
              nodes: list[list[int]]) -> torch.Tensor:
    """One draft pass over the next level of each tree: ``nodes[i]`` (just marked fed, so at
    ``base + fed``) each over the sequence's committed tokens, its ancestors (written by earlier
    passes: hidden keys, models/decoder/metadata.py's AttentionMetadata) and itself -> logits [rows, N]."""
    tokens, positions, masks, contexts = [], [], [], []
    for t, level in zip(trees, nodes):
        before = t.written - len(level)  # the tree's keys already in the cache
        mask = torch.zeros(len(level), before + len(level), dtype=torch.bool)
        for r, n in enumerate(level):
            a = t.parents[n]
            while a >= 0:
                mask[r, t.fed[a]] = True
                a = t.parents[a]
            mask[r, before + r] = True
            tokens.append(t.tokens[n])
            positions.append(t.base + t.depth[n] - 1)
        masks.append(mask)
        contexts.append(t.base + before)
    meta = AttentionMetadata(list(slots), contexts, [len(level) for level in nodes], masks)
    device = model.device
    hidden = model.forward(torch.tensor(tokens, dtype=torch.long, device=device),
                           torch.tensor(positions, dtype=torch.long, device=device), kv, meta)
    return model.logits(hidden)
