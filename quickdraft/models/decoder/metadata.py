"""Attention metadata: where each sequence's new tokens go in a ragged batch, and the token-tree
masks in the two forms the attention takes them (a boolean mask, or each row's path of tree tokens
for the kernels). Passed explicitly to every forward, never stored (docs/design/architecture.md, rule 2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens go. Passed explicitly to every forward, never stored."""

    slots: list[int]  # [batch] KV-cache slot of each sequence
    context_lens: list[int]  # [batch] tokens of each sequence already in the cache
    query_lens: list[int]  # [batch] new tokens of each sequence in this pass (sum = num_tokens)
    # [batch] None: causal chain among the new tokens; else [query_len, hidden + query_len] bool,
    # True = may attend (for token trees): the last ``hidden`` cached tokens (tree nodes an earlier
    # pass wrote: a draft grows its tree a level a pass), then the new tokens. The cached tokens
    # before those are always visible.
    masks: list[torch.Tensor | None] | None = None
    # [batch] the same trees in the kernels' form, (start, path) as tree_paths gives them, where
    # the caller built them straight from the parents (tree_paths_from_parents); None (for the
    # batch or a sequence): read from the mask
    paths: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None

    @classmethod
    def chain(cls, slots, context_lens, query_lens) -> "AttentionMetadata":
        return cls(list(slots), list(context_lens), list(query_lens), None)

    def positions(self, device) -> torch.Tensor:
        """[num_tokens] the position of each new token when the new tokens form chains."""
        # from one list: an arange a sequence and a cat cost more than the pass's Python (once a draft token)
        return torch.tensor([p for c, q in zip(self.context_lens, self.query_lens) for p in range(c, c + q)],
                            dtype=torch.long, device=device)

    def mask(self, i: int) -> torch.Tensor | None:
        """Sequence i's tree mask, or None for a chain."""
        return self.masks[i] if self.masks is not None else None

    def tree_path(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence i's tree (it has one) as the kernels take it: (start [qlen + 1], path)."""
        given = self.paths[i] if self.paths is not None else None
        return given if given is not None else tree_paths(self.mask(i))


def tree_paths(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A token tree's mask [qlen, hidden + qlen] -> (start [qlen + 1], path): row j's visible tree
    tokens (its ancestors and itself, in order, counted from the first hidden one) are
    path[start[j]:start[j + 1]]. The form kernels/attention.cpp's attend_tree takes."""
    rows, cols = mask.cpu().nonzero(as_tuple=True)  # row-major: each row's columns ascending
    counts = torch.bincount(rows, minlength=mask.shape[0])
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]), cols.long()


def tree_paths_from_parents(num_pending: int, parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """tree_paths of the mask that ``num_pending`` tokens in a causal chain followed by the tree
    ``parents`` (node i's parent < i, or -1: the last pending token) give, with no hidden tokens,
    built from the parents: row j < p sees pending tokens 0..j; node i the pending tokens, its
    ancestors (each before its children) and itself."""
    p = num_pending
    start, path, ancestry = [0], [], []  # ancestry[i]: node i's path of nodes, root-first
    for j in range(p):
        path += range(j + 1)
        start.append(len(path))
    for i, parent in enumerate(parents):
        ancestry.append((ancestry[parent] if parent >= 0 else []) + [p + i])
        path += range(p)
        path += ancestry[i]
        start.append(len(path))
    return torch.tensor(start, dtype=torch.long), torch.tensor(path, dtype=torch.long)


def pass_trees(meta: AttentionMetadata) -> tuple[list, list]:
    """Each sequence's token tree as tree_paths gives it, (starts, paths) a list each with None for
    a chain: computed once a pass, not once a layer."""
    paths = [meta.tree_path(i) if meta.mask(i) is not None else (None, None) for i in range(len(meta.slots))]
    return [p[0] for p in paths], [p[1] for p in paths]


def attention_mask(meta: AttentionMetadata, i: int, ctx: int, qlen: int, device) -> torch.Tensor:
    """[qlen, ctx + qlen] bool, True = may attend: the cached tokens before the tree's hidden
    nodes, then the tree mask (or a causal chain's)."""
    new = meta.mask(i)
    if new is None:
        new = torch.ones(qlen, qlen, dtype=torch.bool, device=device).tril()
    shared = ctx + qlen - new.shape[1]
    return torch.cat([torch.ones(qlen, shared, dtype=torch.bool, device=device), new.to(device)], dim=1)


def windowed_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` [rows, L] (a row's visible keys lie at consecutive positions, its own last) with
    each row's visible keys cut to its last ``window`` (0: all): a sliding window, as
    kernels/attention.h's ``windowed``."""
    if not window:
        return mask
    seen_after = mask.flip(1).cumsum(1).flip(1)  # visible keys at or after each column
    return mask & (seen_after <= window)
