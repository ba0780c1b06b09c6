"""The suffix structure of method "suffix" (SuffixDecoding, Oliaro et al. 2024, arXiv:2411.04975):
a trie of every window of at most ``depth`` consecutive tokens of the text inserted into it, with
counts, and the draft tree read from it.

Terms, used the same way in suffix.py and its tests:

- a node stands for a *path*, the tokens from the root to it. Its ``count`` is how many times the
  path occurs in the inserted text (each occurrence counted once, windows cut at ``depth``); its
  ``total`` is how many of those occurrences are followed by one more token inside the window, the
  sum of its children's counts.
- the *empirical probability* of a child given its parent is ``child.count / parent.total``: how
  often the parent's path went on with the child's token. (``parent.total`` rather than
  ``parent.count``: an occurrence at the very end of the text has no continuation yet, and the
  sequence being drafted always ends with the path it matched, so ``count`` would count that
  occurrence against every continuation.) A path's probability is the product along it.
- the *match* of a context is the longest suffix of it that is a path with a continuation (total
  > 0). Both properties are kept by every shorter suffix (an occurrence of a path holds an
  occurrence of each of its suffixes, with the same continuation), so the longest one is found by
  bisection over the suffix length: O(m log m) dictionary look-ups for a context of m tokens.

Cost: adding one token to a stream (``extend``) moves each of the stream's open windows one node
down, O(depth) dictionary operations; removing a stream (``remove``) costs the same per token. A
chain of L draft tokens costs O(L * c) for nodes of c children. Memory: at most ``depth`` nodes a
token inserted, fewer where the text repeats itself (repeats share nodes).

The trie can give a tree of candidates (``draft_tree``: best-first over path probability, up to
``width`` children a node); today's chain verifier takes its single most probable path
(``DraftTree.chain``).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class DraftTree:
    """Candidate tokens as a tree hanging below the matched context; node i is ``tokens[i]`` with
    parent ``parents[i]`` (-1: the context itself), in best-first order (parents before children)."""

    tokens: list[int] = field(default_factory=list)  # [num_nodes]
    parents: list[int] = field(default_factory=list)  # [num_nodes] index of the parent node, -1 = root
    probs: list[float] = field(default_factory=list)  # [num_nodes] the empirical probability of the path to it
    match_length: int = 0  # tokens of the context matched

    @property
    def score(self) -> float:
        """The expected number of accepted draft tokens, were the empirical probabilities the
        target's: each node counts with the probability of its whole path."""
        return sum(self.probs)

    def chain(self) -> list[int]:
        """The most probable path from the root: at each node, its most probable child."""
        best: dict[int, int] = {}  # parent -> its most probable child
        for i, (p, q) in enumerate(zip(self.parents, self.probs)):
            if p not in best or q > self.probs[best[p]]:
                best[p] = i
        out, at = [], -1
        while at in best:
            at = best[at]
            out.append(self.tokens[at])
        return out


class SuffixTrie:
    """Nodes are integers indexing parallel lists, not objects: a trie of a million nodes made of
    Python objects spends four fifths of its insertion time in the garbage collector, which
    scans every container it holds, while lists of ints and dicts of int to int are not scanned
    (measured here: 40 us a token of text with depth 24 as objects, 8 us with the collector off).
    ``kids[n]`` is -1 (a leaf), the one child's index (most nodes: text that does not repeat
    makes chains, and a dict apiece would triple the memory), or a dict token -> child index."""

    ROOT = 0

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2, got {depth}")
        self.depth = depth
        self.token = [-1]  # [nodes] the last token of each node's path
        self.count = [0]  # [nodes] occurrences of the node's path
        self.total = [0]  # [nodes] of those, followed by a token: the sum of the children's counts
        self.kids: list = [-1]  # [nodes] -1 | one child's index | {token: child index}
        self._free: list[int] = []  # indices of removed nodes, reused first
        self.num_nodes = 0  # nodes below the root

    # -- nodes ------------------------------------------------------------------------------
    def child(self, node: int, token: int) -> int:
        """The child of ``node`` for ``token``, or -1."""
        kids = self.kids[node]
        if type(kids) is int:
            return kids if kids >= 0 and self.token[kids] == token else -1
        return kids.get(token, -1)

    def children(self, node: int) -> list[int]:
        kids = self.kids[node]
        if type(kids) is int:
            return [kids] if kids >= 0 else []
        return list(kids.values())

    def _add_child(self, node: int, token: int) -> int:
        if self._free:
            child = self._free.pop()
            self.token[child], self.count[child], self.total[child], self.kids[child] = token, 0, 0, -1
        else:
            child = len(self.token)
            self.token.append(token)
            self.count.append(0)
            self.total.append(0)
            self.kids.append(-1)
        kids = self.kids[node]
        if type(kids) is int:
            self.kids[node] = child if kids < 0 else {self.token[kids]: kids, token: child}
        else:
            kids[token] = child
        self.num_nodes += 1
        return child

    def _drop_child(self, node: int, token: int, child: int) -> None:
        kids = self.kids[node]
        if type(kids) is int:
            self.kids[node] = -1
        else:
            del kids[token]
            if len(kids) == 1:
                self.kids[node] = next(iter(kids.values()))
        self._free.append(child)
        self.num_nodes -= 1

    # -- building ---------------------------------------------------------------------------
    def extend(self, tokens, open_nodes: list[int] | None = None) -> list[int]:
        """Add ``tokens`` to a stream whose open windows end at ``open_nodes`` (None or []: a new
        stream). Returns the stream's open windows after them: the nodes of its last 1 .. depth - 1
        tokens, shortest first, which the next call continues from. O(depth) a token."""
        count, total, child_of, add = self.count, self.total, self.child, self._add_child
        keep = self.depth - 1  # a window of depth tokens takes no more
        active = list(open_nodes or [])
        for t in tokens:
            active.insert(0, self.ROOT)
            for i, node in enumerate(active):
                child = child_of(node, t)
                if child < 0:
                    child = add(node, t)
                count[child] += 1
                total[node] += 1
                active[i] = child
            del active[keep:]
        return active

    def insert(self, tokens) -> None:
        """Every window of ``tokens`` (a whole stream)."""
        self.extend(tokens)

    def remove(self, tokens) -> None:
        """Undo ``insert(tokens)`` exactly: counts go back, nodes left unused are freed."""
        count, total, child_of = self.count, self.total, self.child
        keep = self.depth - 1
        active: list[int] = []
        for t in tokens:
            active.insert(0, self.ROOT)
            for i, node in enumerate(active):
                child = child_of(node, t)
                count[child] -= 1
                total[node] -= 1
                if count[child] == 0:  # its subtree is empty, or emptied as the walk goes on
                    self._drop_child(node, t, child)
                active[i] = child
            del active[keep:]

    # -- reading ----------------------------------------------------------------------------
    def find(self, path) -> int:
        """The node of ``path``, or -1."""
        node = self.ROOT
        for t in path:
            node = self.child(node, t)
            if node < 0:
                return -1
        return node

    def match(self, context: list[int], max_length: int) -> tuple[int, int]:
        """The longest suffix of ``context``, at most ``max_length`` tokens, that is a path with a
        continuation: (its node, its length), or (-1, 0). Bisection (see the module's note)."""
        lo, hi, best = 1, min(max_length, len(context), self.depth - 1), (-1, 0)
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self.find(context[len(context) - mid :])
            if node >= 0 and self.total[node] > 0:
                best, lo = (node, mid), mid + 1
            else:
                hi = mid - 1
        return best

    def draft_tree(self, context: list[int], max_match: int, max_nodes: int, min_prob: float,
                   width: int = 1, max_spec_factor: float | None = None) -> DraftTree:
        """The candidates that continue ``context``'s match: best-first by path probability, up to
        ``width`` children a node and ``max_nodes`` nodes, none whose path probability falls below
        ``min_prob``. With ``max_spec_factor``, no deeper than ``max_spec_factor * match length``
        (a longer match predicts further). width 1: a chain."""
        node, m = self.match(context, max_match)
        tree = DraftTree(match_length=m)
        if node < 0:
            return tree
        max_depth = self.depth - m
        if max_spec_factor is not None:
            max_depth = min(max_depth, int(max_spec_factor * m))
        count = self.count
        heap = [(-1.0, 0, -1, 1, node)]  # (-path probability, tie-break, tree index, depth below, node)
        while heap and len(tree.tokens) < max_nodes:
            neg, _, index, level, at = heapq.heappop(heap)
            if level > max_depth:
                continue
            # the most frequent first; among equals the first seen (nlargest is stable)
            for child in heapq.nlargest(width, self.children(at), key=count.__getitem__):
                prob = -neg * count[child] / self.total[at]
                if prob < min_prob or len(tree.tokens) >= max_nodes:
                    break  # the rest are less probable
                tree.tokens.append(self.token[child])
                tree.parents.append(index)
                tree.probs.append(prob)
                heapq.heappush(heap, (-prob, len(tree.tokens), len(tree.tokens) - 1, level + 1, child))
        return tree
