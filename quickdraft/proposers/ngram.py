"""Method "ngram": prompt lookup decoding (Saxena 2023; vLLM's ngram proposer, HF's
``prompt_lookup_num_tokens``).

Find the most recent earlier occurrence of the sequence's last n tokens in its own prompt and
output, for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, and propose the K tokens
that followed it. The drafts are point masses (q(x) = 1), so no probabilities are handed on.
"""

from __future__ import annotations

import numpy as np
import torch

from quickdraft.proposers.base import DraftProposal, register


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


@register("ngram")
class NgramProposer:
    cost = None  # a lookup in numpy costs next to nothing beside a target pass

    def __init__(self, n_max: int, n_min: int):
        self.n_max, self.n_min = n_max, n_min

    @classmethod
    def from_config(cls, spec, ctx) -> "NgramProposer":
        return cls(spec.prompt_lookup_max, spec.prompt_lookup_min)

    def propose(self, seqs, num_tokens) -> DraftProposal:
        drafts = [
            lookup(np.asarray(s.token_ids, dtype=np.int64), k, self.n_max, self.n_min) if k > 0 else []
            for s, k in zip(seqs, num_tokens)
        ]
        flat = [t for d in drafts for t in d]
        return DraftProposal(torch.tensor(flat, dtype=torch.long), [len(d) for d in drafts], None)

    def observe(self, seqs, outcome) -> None:
        pass

    def catchup_rows(self, seq) -> int:
        return 0

    def release(self, seq) -> None:
        pass

    def close(self) -> None:
        pass
