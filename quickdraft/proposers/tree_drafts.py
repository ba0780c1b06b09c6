"""Token trees a proposer grows from its own probabilities (the draft model's, proposers/draft/model.py;
Medusa's heads, proposers/heads/medusa.py), EAGLE-2's way: a node's value is the calibrated confidence in
its whole path, the most valuable nodes of a level are expanded, and the most valuable nodes overall
are proposed (a node's value never exceeds its parent's, so they form a tree). The runner may trim
them further to the rows that pay (engine/plan.py, plan_tree_sizes).

That is for greedy requests. For a sampled one the tree verifier (verify/tree.py) tests each child
as a draw from q, the siblings drawn one after another without replacement, so a tree whose shape
were chosen by the probabilities of its own draws (keep the likeliest children, trim the unlikely
ones) would bias that test. A sampled tree (``sampled_children``, ``to_expand_sampled``; the draft
model grows them) is shaped before each draw instead, SpecInfer's way (Miao et al. 2024): which
node gets children, and how many, is decided from the nodes already drawn (their values), then the
children are drawn from the node's q without replacement, and every node drawn is proposed, with
the q it was drawn from, untrimmed.
"""

from __future__ import annotations

import torch

from quickdraft.proposers.base import DraftProposal, accepts_trees, most_valuable
from quickdraft.sampling import BatchSampling, draw_uniforms, logits_to_probs, sample_from_probs


class DraftTreeState:
    """One sequence's draft tree while a proposer grows it, kept until ``observe``. Nodes are
    numbered in the order they were made (a parent before its children); ``fed[n]`` numbers the
    nodes expanded, in order (a draft model's keys of node n are at ``base + fed[n]`` in its cache)."""

    def __init__(self, base: int = 0):
        self.base = base  # the sequence's tokens in the draft cache: the tree's first level goes at this position
        self.tokens: list[int] = []
        self.parents: list[int] = []  # node -> parent node, -1 for the root (the last committed token)
        self.depth: list[int] = []  # 1 for the root's children
        self.probs: list[float] = []  # the draft's probability of the node's token after its parent
        self.values: list[float] = []  # the product of the calibrated probabilities on its path
        self.fed: list[int] = []  # node -> index among the nodes expanded (written to a draft cache), or -1
        self.q: list[torch.Tensor | None] = []  # node -> the q [vocab] it was drawn from (sampled trees), or None
        self.kids: dict[int, list[int]] = {}  # node (-1: the root) -> its children
        self.written = 0

    def add_children(self, parent: int, row: list[tuple[int, float]], calibration: "EdgeCalibration",
                     q: torch.Tensor | None = None) -> None:
        """Children of ``parent`` from the draft's (token, probability) pairs, likeliest first (or in
        the order drawn, from ``q``: a sampled tree), each edge's probability scaled by
        ``calibration`` at its depth; a token the draft gives no probability is left out."""
        value = 1.0 if parent < 0 else self.values[parent]
        depth = 1 if parent < 0 else self.depth[parent] + 1
        scale = calibration.scale(depth)
        for token, p in row:
            if p <= 0.0:
                continue
            self.kids.setdefault(parent, []).append(len(self.tokens))
            self.tokens.append(token)
            self.parents.append(parent)
            self.depth.append(depth)
            self.probs.append(p)
            self.values.append(value * min(1.0, scale * p))
            self.fed.append(-1)
            self.q.append(q)

    def to_expand(self, depth: int, branches: int, size: int, room: int) -> list[int]:
        """The nodes of level ``depth`` to expand next (marked fed, in feeding order): the
        ``branches`` most valuable ones that could still place a child among the ``size`` best
        nodes (a child's value is at most its parent's) and that the cache has ``room`` for."""
        ranked = sorted(self.values, reverse=True)
        bar = ranked[size - 1] if len(ranked) >= size else 0.0
        frontier = sorted((n for n, d in enumerate(self.depth) if d == depth), key=lambda n: (-self.values[n], n))
        pick = [n for n in frontier[:branches] if self.values[n] > bar][: max(0, room - self.written)]
        for n in pick:
            self.fed[n] = self.written
            self.written += 1
        return pick

    def to_expand_sampled(self, depth: int, branches: int, size: int, room: int) -> list[tuple[int, int]]:
        """A sampled tree's next level, decided before any of it is drawn: (node, children to draw)
        for the most valuable node of level ``depth`` (marked fed), ``branches`` children while the
        tree stays within ``size`` nodes and the cache's ``room``. One node a level makes the tree a
        chain of K levels with ``branches`` candidates at each, a second chance at every position
        where a wide tree would spend its N nodes near the root. Every node drawn is proposed
        (``drawn``), so the size is kept here, not by a trim."""
        left = size - len(self.tokens)
        frontier = [n for n, d in enumerate(self.depth) if d == depth]
        if left <= 0 or not frontier or self.written >= room:
            return []
        n = min(frontier, key=lambda n: (-self.values[n], n))
        self.fed[n] = self.written
        self.written += 1
        return [(n, min(branches, left))]

    def drawn(self) -> tuple[list[int], list[int], None, list[torch.Tensor]]:
        """A sampled tree's proposal: every node, in the order drawn (a parent before its children),
        no values (the runner trims nothing of it) and the q each node was drawn from."""
        return list(self.tokens), list(self.parents), None, list(self.q)

    def best(self, size: int) -> tuple[list[int], list[int], list[float]]:
        """The ``size`` most valuable nodes in the order they were made (ties to the earlier node,
        so that every kept node's parent is kept): (tokens, parents among them, values)."""
        keep = most_valuable(self.values, size)
        index = {n: j for j, n in enumerate(keep)}
        return ([self.tokens[n] for n in keep], [index[self.parents[n]] if self.parents[n] >= 0 else -1 for n in keep],
                [self.values[n] for n in keep])

    def walk(self, tokens: list[int], accepted: int) -> list[int]:
        """The nodes of the accepted path: the first ``accepted`` of ``tokens``, child by child
        (siblings hold distinct tokens: each is one of its parent's likeliest, or drawn without
        replacement)."""
        path, node = [], -1
        for token in tokens[:accepted]:
            node = next(c for c in self.kids.get(node, []) if self.tokens[c] == token)
            path.append(node)
        return path


def next_level(trees: list[DraftTreeState], depth: int, branches: int, sizes: list[int], rooms: list[int],
               budgets: list[int]) -> list[tuple[int, list[int]]]:
    """(tree index, its nodes of level ``depth`` to expand, marked fed) for each tree that grows
    a level more: below its planned depth ``budgets[i]``, and with a node that could still place a
    child among its ``sizes[i]`` best (DraftTreeState.to_expand)."""
    grow = [(i, t.to_expand(depth, branches, sizes[i], rooms[i]) if depth < budgets[i] else [])
            for i, t in enumerate(trees)]
    return [(i, nodes) for i, nodes in grow if nodes]


def attach_level(trees: list[DraftTreeState], grow: list[tuple[int, list[int]]],
                 children: list[list[tuple[int, float]]], calibration: "EdgeCalibration") -> None:
    """Each expanded node's children (``children``: one row of (token, probability) pairs per node
    of ``grow``, in its order) added to its tree."""
    rows = iter(children)
    for i, nodes in grow:
        for node in nodes:
            trees[i].add_children(node, next(rows), calibration)


class EdgeCalibration:
    """How far the draft's confidence in a child is the chance that the target takes it: at each
    row a greedy verification visited (the root, then each accepted node) the target's own token
    is known (the accepted tokens, then the bonus), so the children the draft made there are
    checked whether or not a planner trimmed them. ``scale(depth)`` = decayed hits / decayed
    summed probabilities of the children at that depth (``levels`` > 1: one scale a depth, the
    last for all deeper; Medusa's heads grow less sure with their offset), which a node's value
    multiplies its edge by (EAGLE-2 finds a draft's confidence close to its acceptance rate; this
    keeps it so for a weaker draft)."""

    def __init__(self, levels: int = 1, decay: float = 0.98, prior: float = 2.0):
        self.hits = [prior] * levels
        self.expected = [prior] * levels
        self.decay = decay

    def _level(self, depth: int) -> int:
        return min(depth, len(self.hits)) - 1

    def scale(self, depth: int) -> float:
        j = self._level(depth)
        return self.hits[j] / self.expected[j]

    def record(self, tree: DraftTreeState, path: list[int], tokens: list[int]) -> None:
        for row, chosen in zip([-1] + path, tokens):
            if row >= 0 and tree.fed[row] < 0:
                break  # a leaf never expanded: no children there
            kids = tree.kids.get(row, [])
            if not kids:
                continue
            j = self._level(tree.depth[kids[0]])
            self.hits[j] = self.decay * self.hits[j] + sum(1.0 for c in kids if tree.tokens[c] == chosen)
            self.expected[j] = self.decay * self.expected[j] + sum(tree.probs[c] for c in kids)


def merged_proposal(chains: DraftProposal, trees: dict[int, tuple], batch: int) -> DraftProposal:
    """One proposal: sequence i's tree where ``trees`` has it (tokens, parents, values[, q rows]),
    else its chain from ``chains``. A greedy request's tree is verified without q: where the
    proposal carries q, its nodes' rows are their tokens' point masses. A sampled request's tree
    carries the q [vocab] each node was drawn from (DraftTreeState.drawn); then every row needs q,
    and a greedy chain's, never read, is left zero."""
    chains = chains.spread()
    sampled = [t[3] for t in trees.values() if len(t) > 3 and t[3]]
    like = chains.probs if chains.probs is not None else (sampled[0][0] if sampled else None)
    flat, counts, parents, values, probs, at = [], [], [], [], [], 0
    for i in range(batch):
        k = chains.num_tokens[i]
        if i in trees:
            tokens, tree, value, *q = trees[i]
            flat += tokens
            parents.append(tree)
            values.append(value)
            if like is not None:
                probs.append(torch.stack(q[0]).to(like) if q and q[0] else
                             torch.nn.functional.one_hot(torch.tensor(tokens), like.shape[-1]).to(like))
        else:
            flat += chains.token_ids[at : at + k].tolist()
            parents.append(None)
            values.append(None)
            if like is not None:
                probs.append(chains.probs[at : at + k] if chains.probs is not None else like.new_zeros(k, like.shape[-1]))
        counts.append(len(flat) - sum(counts))
        at += k
    return DraftProposal(torch.tensor(flat, dtype=torch.long), counts, torch.cat(probs) if probs else None,
                         parents, values)


def tree_requests(seqs, num_tokens: list[int], branching: bool | None, sampled: bool = False) -> list[int]:
    """The sequences that draft a tree this step: those with drafts to make, while the proposer
    is ``branching``, free of what needs chains (base.accepts_trees), and greedy unless the
    proposer grows ``sampled`` trees too."""
    return [i for i, k in enumerate(num_tokens) if k > 0 and branching and (sampled or seqs[i].params.greedy)
            and accepts_trees(seqs[i].params)]


def sampled_children(logits: torch.Tensor, seq, count: int, head_ids: torch.Tensor | None,
                     vocab_size: int) -> tuple[list[tuple[int, float]], torch.Tensor]:
    """``count`` children of a sampled tree's node: drawn one after another without replacement
    from the draft's q after it (``logits`` [N] over the draft head's rows, shaped by the request's
    temperature, top-k, top-p and min-p), with the request's generator. -> ((token, q(token)) in
    the order drawn, fewer where q has fewer tokens; q over the vocabulary, zero outside a
    truncated head), the distribution verify/tree.py tests the first child against, taking each
    rejected one out of it for the next."""
    rows = BatchSampling.from_params([seq.params], logits.device)
    q = logits_to_probs(logits.unsqueeze(0), rows.temperature, rows.top_k, rows.top_p, rows.min_p)[0]
    left, out = q.clone(), []
    for u in draw_uniforms(seq.generator, count):
        if not bool(left.gt(0).any()):
            break
        row = int(sample_from_probs(left.unsqueeze(0), u.view(1).to(left.device))[0])
        out.append((row if head_ids is None else int(head_ids[row]), float(q[row])))
        left[row] = 0.0
    if head_ids is not None:
        q = q.new_zeros(vocab_size).index_copy_(0, head_ids.to(q.device), q)
    return out, q


def chains_and_trees(seqs, num_tokens: list[int], grow: list[int], chains, trees) -> DraftProposal:
    """One proposal of chains (``chains(seqs, num_tokens)``) for every sequence but those of
    ``grow``, which get ``trees(their seqs, their budgets)``'s (tokens, parents, values)."""
    if not grow:
        return chains(seqs, num_tokens)
    proposal = chains(seqs, [0 if i in grow else k for i, k in enumerate(num_tokens)])
    grown = trees([seqs[i] for i in grow], [num_tokens[i] for i in grow])
    return merged_proposal(proposal, dict(zip(grow, grown)), len(seqs))


def top_children(logits: torch.Tensor, branches: int, head_ids: torch.Tensor | None) -> list[list[tuple[int, float]]]:
    """logits [n, N] over a draft's head rows -> each row's ``branches`` likeliest tokens
    (full-vocabulary ids through ``head_ids`` where the head is truncated) with the draft's
    probability of each (at temperature 1), likeliest first."""
    probs, rows = torch.softmax(logits.float(), dim=-1).topk(branches, dim=-1)
    ids = rows if head_ids is None else head_ids[rows.to(head_ids.device)]
    return [list(zip(r, p)) for r, p in zip(ids.tolist(), probs.tolist())]
