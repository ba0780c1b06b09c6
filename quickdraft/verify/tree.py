"""Lossless verification of a token tree: several continuations scored in one target pass.

A draft tree has n nodes in topological order (a node's parent comes before it). Node i holds one
draft token; its parent is another node or the root (-1), the last committed token. The target
scores the tree in one pass with a tree attention mask, which gives n + 1 rows: row 0 is the
distribution after the root, row i + 1 the distribution after node i (the distribution its
children are judged by, or the bonus token's after a leaf).

* Greedy (temperature 0): from the root, step to the child whose token is the target's argmax at
  the current row (the first such child if siblings repeat a token), until no child matches; then
  emit the argmax itself. Equal to the chain rule on the path it takes, so the output equals plain
  greedy decoding.
* Sampling: recursive rejection sampling over a node's children (SpecInfer, Miao et al. 2024,
  "multi-step speculative sampling"; Sequoia, Chen et al. 2024, for drafts drawn without
  replacement). At a node with target distribution p the residual starts as r = p; each child x
  in turn, drawn from the draft's q, is accepted when u < r(x) / q(x), and the walk descends into
  it. A rejected child turns the residual into r = normalize(max(0, r - q)); when the siblings
  were drawn without replacement, q then loses x (q(x) = 0, renormalized), because that is the
  distribution the next sibling was drawn from. When every child is rejected, the final token is
  drawn from r. Each test is the single-draft rule of rejection.py against the current residual,
  with a candidate that, given everything before it, is distributed as the current q; so each
  stage emits exactly the residual it was handed, and the root emits exactly p. Point-mass drafts
  (n-gram or suffix lookups: q = one-hot on x) are the same rule: accept x with probability
  r(x), else take x out of r.

The functions are pure: randomness comes in as ``uniforms`` [n + 1] float64, node i's coin at i
and the final draw's at n, so a seeded request replays exactly. ``reference.reference_verify_tree``
is the slow version tested against this one, draw by draw. The caller keeps the accepted path's
keys and values (``TreeVerifyOutput.path``) and drops the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from quickdraft.sampling import BatchSampling, SamplingParams, logits_to_probs, sample_from_probs


@dataclass
class DraftTree:
    """One sequence's draft tree. Siblings are drawn from one distribution: ``probs`` rows of
    siblings are equal (that distribution, before any sibling is taken out of it)."""

    token_ids: Tensor  # [n] int64, node i's token
    parents: list[int]  # [n] node i's parent (< i), or -1 for a child of the root
    probs: Tensor | None = None  # [n, V] q node i was drawn from; None = point masses (lookups)
    replacement: bool = False  # siblings drawn i.i.d. from q (True) or without replacement (False)

    def __post_init__(self):
        n = self.token_ids.shape[0]
        if len(self.parents) != n:
            raise ValueError(f"{n} tokens but {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent {parent} is not an earlier node or the root (-1)")
        if self.probs is not None and self.probs.shape[0] != n:
            raise ValueError(f"probs has {self.probs.shape[0]} rows for {n} nodes")

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    def children(self) -> list[list[int]]:
        """[n + 1] the children of each row's node, in node order: row 0 the root, row i + 1 node i."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            kids[parent + 1].append(i)
        return kids


@dataclass
class TreeVerifyOutput:
    token_ids: list[int]  # the accepted path's tokens + one recovered or bonus token
    path: list[int]  # the accepted nodes, root to leaf: their keys and values are the ones to keep

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def verify_tree(tree: DraftTree, target_logits: Tensor, params: SamplingParams, uniforms: Tensor) -> TreeVerifyOutput:
    """Verify one sequence's tree: target_logits [n + 1, V] (row i + 1 after node i), uniforms
    [n + 1] float64 (see the module docstring)."""
    n = len(tree)
    if target_logits.shape[0] != n + 1:
        raise ValueError(f"a tree of {n} nodes needs {n + 1} target rows, got {target_logits.shape[0]}")
    if uniforms.shape[0] != n + 1:
        raise ValueError(f"a tree of {n} nodes needs {n + 1} uniforms, got {uniforms.shape[0]}")
    tokens = tree.token_ids.tolist()
    kids = tree.children()
    if params.greedy:
        return _greedy(tokens, kids, target_logits.argmax(-1).tolist())
    rows = BatchSampling.from_params([params], target_logits.device).select(
        torch.zeros(n + 1, dtype=torch.int64, device=target_logits.device))
    p = logits_to_probs(target_logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p).double()  # [n + 1, V]
    coins = uniforms.double().tolist()
    path, row = [], 0
    while True:
        residual = p[row]
        q = None  # the distribution the next child was drawn from
        for child in kids[row]:
            x = tokens[child]
            if tree.probs is None:
                q = _point_mass(x, residual)
            elif q is None or tree.replacement:
                q = tree.probs[child].double()
            if coins[child] < float(residual[x]) / float(q[x]):
                path.append(child)
                row = child + 1
                break
            residual = _residual(residual, q)
            if tree.probs is not None and not tree.replacement:
                q = _without(q, x)
        else:
            final = int(sample_from_probs(residual.unsqueeze(0), uniforms[n : n + 1])[0])
            return TreeVerifyOutput([tokens[i] for i in path] + [final], path)


def _greedy(tokens: list[int], kids: list[list[int]], argmax: list[int]) -> TreeVerifyOutput:
    path, row = [], 0
    while True:
        match = next((c for c in kids[row] if tokens[c] == argmax[row]), None)
        if match is None:
            return TreeVerifyOutput([tokens[i] for i in path] + [argmax[row]], path)
        path.append(match)
        row = match + 1


def _point_mass(x: int, like: Tensor) -> Tensor:
    q = torch.zeros_like(like)
    q[x] = 1.0
    return q


def _residual(r: Tensor, q: Tensor) -> Tensor:
    """normalize(max(0, r - q)) [V]. A rejection implies r(x) < q(x), so the mass is positive when
    both sum to 1; only rounding can empty it, and then r itself is what is being matched."""
    out = (r - q).clamp_(min=0.0)
    total = float(out.sum())
    return r if total <= 0.0 else out / total


def _without(q: Tensor, x: int) -> Tensor:
    """q with x taken out, renormalized: the distribution of the next sibling drawn without replacement."""
    out = q.clone()
    out[x] = 0.0
    total = float(out.sum())
    return q if total <= 0.0 else out / total
