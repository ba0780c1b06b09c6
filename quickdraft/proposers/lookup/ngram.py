"""Method "ngram": prompt lookup decoding (Saxena 2023; vLLM's ngram proposer, HF's
``prompt_lookup_num_tokens``).

Find the most recent earlier occurrence of the sequence's last n tokens in its own prompt and
output, for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, and propose the K tokens
that followed it. The drafts are point masses (q(x) = 1), so no probabilities are handed on.

With ``num_branches`` > 1 the distinct continuations of several earlier matches (the most recent
first, longest n first) are merged into a token tree of at most K nodes, all verified in one pass
(verify/tree.py): where text repeats with variations, the branch that fits is still there after the
first guess fails. Requests that ask for logprobs or shape the logits (penalties, biases) keep chains.
"""

from __future__ import annotations

import numpy as np
import torch

from quickdraft.proposers.base import BaseProposer, DraftProposal, accepts_trees, register


def lookup(tokens: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """tokens [length] -> up to k tokens that followed the latest earlier match of the last n."""
    length = tokens.shape[0]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = tokens[length - n :]
        # windows starting at 0 .. length - n - 1: every match that has a continuation
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


def continuations(tokens: np.ndarray, k: int, n_max: int, n_min: int, branches: int) -> list[list[int]]:
    """Up to ``branches`` distinct continuations (of up to k tokens, none a prefix of an earlier
    one) of the latest earlier matches of the last n tokens, longest n first, latest first."""
    length, found = tokens.shape[0], []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = tokens[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        for hit in np.flatnonzero((windows == pattern).all(axis=1))[::-1]:
            cont = tokens[int(hit) + n : int(hit) + n + k].tolist()
            if cont and not any(f[: len(cont)] == cont for f in found):
                found.append(cont)
                if len(found) == branches:
                    return found
    return found


def merge(paths: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """Continuations -> a token tree (tokens, parents; -1 = the root) of at most ``budget`` nodes,
    shared prefixes merged, the first continuation first (so one path is a plain chain)."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for path in paths:
        node = -1
        for t in path:
            if (node, t) not in children:
                if len(tokens) == budget:
                    return tokens, parents
                children[(node, t)] = len(tokens)
                tokens.append(t)
                parents.append(node)
            node = children[(node, t)]
    return tokens, parents


@register("ngram")
class NgramProposer(BaseProposer):
    cost = None  # a lookup in numpy costs next to nothing beside a target pass

    def __init__(self, n_max: int, n_min: int, branches: int = 1):
        self.n_max, self.n_min, self.branches = n_max, n_min, branches

    @classmethod
    def from_config(cls, spec, ctx) -> "NgramProposer":
        return cls(spec.prompt_lookup_max, spec.prompt_lookup_min, spec.num_branches)

    def propose(self, seqs, num_tokens) -> DraftProposal:
        drafts, parents = [], []
        for s, k in zip(seqs, num_tokens):
            tokens = np.asarray(s.token_ids, dtype=np.int64)
            if k > 0 and self.branches > 1 and accepts_trees(s.params):
                nodes, tree = merge(continuations(tokens, k, self.n_max, self.n_min, self.branches), k)
                drafts.append(nodes)
                parents.append(tree if tree != list(range(-1, len(tree) - 1)) else None)  # a lone chain stays one
            else:
                drafts.append(lookup(tokens, k, self.n_max, self.n_min) if k > 0 else [])
                parents.append(None)
        flat = [t for d in drafts for t in d]
        return DraftProposal(torch.tensor(flat, dtype=torch.long), [len(d) for d in drafts], None,
                             parents if any(p is not None for p in parents) else None)
