"""Method "eagle3": an EAGLE-3 head (models/eagle3.py) drafts from the target's own states.

The head's pair at position t is (feature of t, embedding of token t + 1) and it predicts token
t + 2. The target's states reach the proposer after every verification pass (the runner's
``read_target``): the states entering the head's three layers, for each committed row. They wait
in ``_features[slot]`` until the next proposal, whose first step feeds every waiting pair (the
catch-up) and drafts one token from the last; each later step feeds one pair, the head's own
output as the feature and its last draft token's embedding, as in the training-time test.

The head keeps its own KV cache by slot, like the draft model: ``_cached[slot]`` pairs (positions
0 .. cached - 1) are real; the keys a proposal's later steps write past them are overwritten by
the next proposal. The head's rows and its waiting features together always cover the target's
committed rows, and both stay in the slot after the sequence ends, for the prefix cache
(engine/prefix_cache.py): a new prompt that shares a prefix keeps what of them lies inside it
(``reuse``). Draft tokens are sampled from the head's q under the request's parameters (the
argmax when greedy) and q goes to the verifier, so the output is the target's whatever the head.
"""

from __future__ import annotations

import time

import torch

from quickdraft.models import eagle3 as head_file
from quickdraft.models.pass_cost import LinearCost, calibrate
from quickdraft.proposers.base import DraftProposal, register
from quickdraft.proposers.heads.common import embed_rows, head_bytes, resolve_dir, sample_rows, serving_head
from quickdraft.proposers.tree_drafts import (DraftTreeState, EdgeCalibration, attach_level, chains_and_trees, next_level,
                                              top_children, tree_requests)


@register("eagle3")
class Eagle3Proposer:
    def __init__(self, head: "head_file.Eagle3Head", target_weights: dict, vocab_size: int, num_slots: int,
                 max_len: int, device="cpu", quantization: str | None = None, confidence_threshold: float = 0.0,
                 target_cost: "LinearCost | None" = None, target_bytes: int = 0, num_branches: int = 1):
        """``confidence_threshold``: a sequence stops drafting after a token the head gives less
        probability than this (draft_model's rule). ``target_cost``: the target's pass cost, which
        prices a head step by the share of the target's bytes (``target_bytes``) the head reads
        until the head's own timed steps correct it; None: drafts are priced as free."""
        c = head.config
        self.head = serving_head(head, quantization, device)
        self.threshold = confidence_threshold
        self.cost = None if target_cost is None else target_cost.scaled(head_bytes(self.head) / target_bytes)
        self.reads_target = tuple(c.aux_layers)
        self.weights = target_weights
        self.vocab_size = vocab_size
        self.head_ids = None if c.draft_vocab_size == vocab_size else self.head.draft_ids
        self.keys = torch.zeros(num_slots, max_len + 16, c.num_kv_heads, c.head_dim, device=device)
        self.values = torch.zeros_like(self.keys)
        self._cached = [0] * num_slots
        self._features: list[torch.Tensor | None] = [None] * num_slots  # [m, layers * H] float32
        self.branches = num_branches
        # trees this step (None: never; the runner turns them off while chains are measured faster)
        self.branching: bool | None = True if num_branches > 1 else None
        self._trees: dict[int, DraftTreeState] = {}  # slot -> the tree proposed this step, for observe
        self.edge_scale = EdgeCalibration()

    @classmethod
    def from_config(cls, spec, ctx) -> "Eagle3Proposer":
        if isinstance(spec.model, head_file.Eagle3Head):  # built in code (tests)
            head, source = spec.model, "given"
        else:
            path = resolve_dir(spec, ctx.target, "eagle3")
            head, source = head_file.load(path, ctx.target.config.num_layers), str(path)
        head_file.check_target(head.config, ctx.target, source)
        timed = spec.adaptive and ctx.decoder is not None
        return cls(head, ctx.target.weights, ctx.target.config.vocab_size, ctx.num_slots, ctx.max_model_len, ctx.device,
                   spec.quantization, spec.draft_confidence_threshold,
                   calibrate(ctx.decoder, ctx.kv) if timed else None,
                   ctx.decoder.weight_bytes_per_token() if timed else 0, spec.num_branches)

    def read_target(self, seqs, final, states) -> None:
        for s, rows in zip(seqs, states):
            if rows is None or rows.shape[0] == 0:
                continue
            # positions num_cached.., where the head's rows and waiting features end (reuse starts each so)
            waiting = self._features[s.slot]
            rows = rows.float()
            self._features[s.slot] = rows if waiting is None else torch.cat([waiting, rows])

    @torch.inference_mode()
    def propose(self, seqs, num_tokens) -> DraftProposal:
        """Chains, and with ``num_branches`` > 1 a token tree for each greedy request that takes
        one (base.accepts_trees; why greedy only: proposers/tree_drafts.py)."""
        ready = [k if self._features[s.slot] is not None else 0 for s, k in zip(seqs, num_tokens)]
        return chains_and_trees(seqs, num_tokens, tree_requests(seqs, ready, self.branching),
                                self._propose_chains, self._grow_trees)

    def _propose_chains(self, seqs, num_tokens) -> DraftProposal:
        num_tokens = list(num_tokens)
        active = [i for i, k in enumerate(num_tokens) if k > 0 and self._features[seqs[i].slot] is not None]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        sampled = any(not seqs[i].params.greedy for i in active)
        if active:
            out, tokens, q, confident = self._first_step([seqs[i] for i in active], sampled)
            for step in range(max(num_tokens[i] for i in active)):
                if step > 0:
                    keep = [r for r, i in enumerate(active) if num_tokens[i] > step]
                    if not keep:
                        break
                    active, out, tokens = [active[r] for r in keep], out[keep], tokens[keep]
                    started = time.perf_counter()
                    out, tokens, q, confident = self._next_step([seqs[i] for i in active], out, tokens, step, sampled)
                    if self.cost is not None:
                        self.cost.observe(len(active), time.perf_counter() - started, len(active))
                for row, i in enumerate(active):
                    drafts[i].append(int(tokens[row]))
                    if q is not None:
                        probs[i].append(q[row])
                    if not confident[row]:
                        num_tokens[i] = step + 1  # this token is proposed, no more after it
        flat = [t for d in drafts for t in d]
        q_all = torch.stack([p for ps in probs for p in ps]) if sampled and flat else None
        return DraftProposal(torch.tensor(flat, dtype=torch.long), [len(d) for d in drafts], q_all)

    def _grow_trees(self, seqs, budgets: list[int]) -> list[tuple[list[int], list[int], list[float]]]:
        """Each sequence's tree, grown as the draft model grows its own (proposers/draft/model.py's
        ``_grow_trees``): a node is the head's pair (its parent's output as the feature, its token's
        embedding) at its depth's position, written to the head's cache past the committed rows,
        over which it attends with its ancestors and itself. Nothing is kept of the tree after
        verification: the committed rows' pairs come from the target's states (read_target)."""
        B = self.branches
        out, *_ = self._first_step(seqs, False)  # [n, H] after each sequence's last committed token
        trees = [DraftTreeState(self._cached[s.slot]) for s in seqs]
        room = [self.keys.shape[1] - t.base for t in trees]
        sizes = [max(1, k * B) for k in budgets]
        outs = [{-1: row} for row in out]  # node -> the head's output at it
        for t, row in zip(trees, self._children(self.head.logits(out))):
            t.add_children(-1, row, self.edge_scale)
        for depth in range(1, max(budgets)):
            grow = next_level(trees, depth, B, sizes, room, budgets)
            if not grow:
                break
            started = time.perf_counter()
            rows = self._tree_layer([(seqs[i], trees[i], nodes, outs[i]) for i, nodes in grow])
            if self.cost is not None:
                self.cost.observe(rows.shape[0], time.perf_counter() - started, len(grow))
            expanded = [(i, n) for i, nodes in grow for n in nodes]
            for (i, n), row in zip(expanded, rows):
                outs[i][n] = row
            attach_level(trees, grow, self._children(self.head.logits(rows)), self.edge_scale)
        for s, t in zip(seqs, trees):
            self._trees[s.slot] = t
        return [t.best(n) for t, n in zip(trees, sizes)]

    def _children(self, logits: torch.Tensor) -> list[list[tuple[int, float]]]:
        return top_children(logits, self.branches, self.head_ids)

    def _tree_layer(self, levels) -> torch.Tensor:
        """One head pass over the next level of each tree: ``levels`` [(seq, tree, nodes just
        marked fed, outputs by node)] -> the head's outputs [rows, H], in order."""
        device = self.keys.device
        feats, toks, pos = [], [], []
        for _, t, nodes, outs in levels:
            for n in nodes:
                feats.append(outs[t.parents[n]])
                toks.append(t.tokens[n])
                pos.append(t.base - 1 + t.depth[n])
        emb = embed_rows(self.weights, torch.tensor(toks, dtype=torch.long)).to(device)
        q, k, v, residual = self.head.project(emb, torch.stack(feats), torch.tensor(pos, device=device))
        attn, start = [], 0
        for s, t, nodes, _ in levels:
            m, before = len(nodes), t.written - len(nodes)
            at = t.base + before  # where this level's keys go
            self.keys[s.slot, at : at + m] = k[start : start + m]
            self.values[s.slot, at : at + m] = v[start : start + m]
            mask = torch.zeros(m, at + m, dtype=torch.bool, device=device)
            mask[:, : t.base] = True  # the committed rows
            for r, n in enumerate(nodes):
                a = t.parents[n]
                while a >= 0:
                    mask[r, t.base + t.fed[a]] = True
                    a = t.parents[a]
                mask[r, at + r] = True
            attn.append(self.head.attend(q[start : start + m], self.keys[s.slot, : at + m],
                                         self.values[s.slot, : at + m], at, mask))
            start += m
        return self.head.finish(torch.cat(attn), residual)

    def _first_step(self, seqs, sampled):
        """Feed each sequence's waiting pairs; -> the last row's output [b, H], draft ids [b], q,
        and whether each draft token clears the confidence threshold."""
        h = self.head
        feats, toks, pos, lens = [], [], [], []
        for s in seqs:
            f, c = self._features[s.slot], self._cached[s.slot]
            nxt = s.token_ids[c + 1 : c + 1 + f.shape[0]]  # token t + 1 of each waiting position t
            f = f[: len(nxt)]  # (always all of them: the states cover positions up to len - 2)
            feats.append(f)
            toks += nxt
            pos.append(torch.arange(c, c + len(nxt)))
            lens.append(len(nxt))
        device = self.keys.device
        feature = h.fc(torch.cat(feats).to(device))
        emb = embed_rows(self.weights, torch.tensor(toks, dtype=torch.long)).to(device)
        out = self._layer(seqs, emb, feature, torch.cat(pos).to(device), lens)
        last = torch.tensor(lens).cumsum(0) - 1
        for s, n in zip(seqs, lens):
            self._cached[s.slot] += n
            self._features[s.slot] = None
        out = out[last.to(device)]
        return (out, *sample_rows(seqs, h.logits(out), self.head_ids, self.vocab_size, sampled, self.threshold))

    def _next_step(self, seqs, out, tokens, step, sampled):
        """One pair a sequence: the previous output as feature, the last draft token's embedding."""
        device = self.keys.device
        emb = embed_rows(self.weights, tokens.cpu()).to(device)
        pos = torch.tensor([self._cached[s.slot] - 1 + step for s in seqs], device=device)
        out = self._layer(seqs, emb, out, pos, [1] * len(seqs))
        return (out, *sample_rows(seqs, self.head.logits(out), self.head_ids, self.vocab_size, sampled, self.threshold))

    def _layer(self, seqs, emb, feature, positions, lens) -> torch.Tensor:
        """The head's layer over ragged rows (each sequence's ``lens[i]`` rows at consecutive
        positions), its keys and values written to the sequence's slot first."""
        q, k, v, residual = self.head.project(emb, feature, positions)
        attn, start = [], 0
        for s, n in zip(seqs, lens):
            p0 = int(positions[start])
            self.keys[s.slot, p0 : p0 + n] = k[start : start + n]
            self.values[s.slot, p0 : p0 + n] = v[start : start + n]
            attn.append(self.head.attend(q[start : start + n], self.keys[s.slot, : p0 + n],
                                         self.values[s.slot, : p0 + n], p0))
            start += n
        return self.head.finish(torch.cat(attn), residual)

    def observe(self, seqs, outcome) -> None:
        # the committed rows' states arrive through read_target; a tree's path calibrates the head
        for s, accepted, tokens in zip(seqs, outcome.num_accepted, outcome.token_ids):
            tree = self._trees.pop(s.slot, None)
            if tree is not None:
                self.edge_scale.record(tree, tree.walk(list(tokens), accepted), list(tokens))

    def catchup_rows(self, seq) -> int:
        f = self._features[seq.slot]
        return 0 if f is None else max(f.shape[0] - 1, 0)

    def reuse(self, seq, source, num_tokens) -> int:
        """Keep the source slot's head rows and waiting features that lie inside the shared prefix.
        The head's row t reads token t + 1, so only rows t <= num_tokens - 2 are the new prompt's;
        a waiting feature of position t reads tokens 0 .. t only, so those t < num_tokens are. Where
        the head's rows reach into the prefix's last position (a shared system prompt, followed by
        another text than the new prompt's), the feature that row was built from is gone: the
        prefix is one token shorter, and the target's prompt pass computes that row's states again.
        -> the prefix's length: the head's kept rows and features, which the target's prompt pass
        continues (read_target)."""
        cached, waiting = self._cached[source], self._features[source]
        keep = min(cached, max(num_tokens - 1, 0))
        # the waiting features continue the head's rows only where it keeps all of them
        features = waiting[: num_tokens - cached] if cached < num_tokens and waiting is not None else None
        if source != seq.slot:
            self.keys[seq.slot, :keep] = self.keys[source, :keep]
            self.values[seq.slot, :keep] = self.values[source, :keep]
        self._cached[seq.slot], self._features[seq.slot] = keep, features
        return keep + (0 if features is None else features.shape[0])

    def release(self, seq) -> None:
        # The slot's head rows and waiting features stay for reuse (the features: the last step's
        # rows, or a whole prompt's where the sequence ended before it drafted).
        pass

    def close(self) -> None:
        pass
