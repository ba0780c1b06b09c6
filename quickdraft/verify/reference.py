"""Slow, paper-faithful reference for ``quickdraft.verify.rejection.verify``, one sequence at a time.

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1
(SpeculativeDecodingStep), with the paper's variable names:

    gamma          number of draft tokens (the paper's guesses x_1..x_gamma)
    q_i            the draft's distribution for x_i, i = 1..gamma (one-hot for point-mass drafts)
    p_i            the target's distribution after x_1..x_{i-1}, i = 1..gamma + 1
    r_i            the acceptance coin for x_i
    n              the number of accepted guesses
    p'             the distribution of the one token the target adds
    t              that token (recovered when n < gamma, bonus when n = gamma)

Python lists here are 0-based, so p_i is ``p[i - 1]``. Two conventions are the fast path's, so the
two agree draw by draw for the same uniforms: a guess is accepted when r_i < p_i(x_i) / q_i(x_i)
(the paper rejects when r_i > p_i / q_i, which differs only on a set of measure zero), and t is
drawn with ``sample_from_probs`` from the *last* uniform of the sequence, whatever n is. Used only
by tests; nothing here is fast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quickdraft.sampling import SamplingParams, logits_to_probs, sample_from_probs


def reference_verify(
    x: list[int],  # [gamma] the draft tokens x_1..x_gamma
    target_logits: Tensor,  # [gamma + 1, V] the target's logits for p_1..p_{gamma+1}
    draft_probs: Tensor | None,  # [gamma, V] q_1..q_gamma; None = point masses on x
    params: SamplingParams,
    uniforms: Tensor,  # [gamma + 1] float64: r_1..r_gamma, then the uniform that draws t
) -> tuple[list[int], int]:
    """Returns (x_1..x_n + [t], n) for one sequence."""
    gamma = len(x)
    if params.greedy:
        return _reference_greedy(x, target_logits)
    p = _probs(target_logits, params)
    q = [_q_i(x, draft_probs, i, p.shape[1]) for i in range(1, gamma + 1)]
    r = uniforms[:gamma]

    n = gamma
    for i in range(1, gamma + 1):
        x_i = x[i - 1]
        ratio = p[i - 1][x_i].double() / q[i - 1][x_i].double()
        if not bool(r[i - 1] < ratio):  # the paper: r_i > p_i(x) / q_i(x) rejects
            n = i - 1
            break

    if n < gamma:
        p_prime = torch.clamp(p[n] - q[n], min=0.0)  # norm(max(0, p_{n+1} - q_{n+1})), normalized by the draw
        if float(p_prime.sum()) == 0.0:  # only through rounding (see rejection._recovery_probs)
            p_prime = p[n]
    else:
        p_prime = p[gamma]  # p_{gamma+1}
    t = int(sample_from_probs(p_prime.unsqueeze(0), uniforms[gamma : gamma + 1])[0])
    return list(x[:n]) + [t], n


def _probs(target_logits: Tensor, params: SamplingParams) -> Tensor:
    """One request's params on every row: probs [rows, V] float32."""
    rows = target_logits.shape[0]
    return logits_to_probs(
        target_logits,
        torch.full((rows,), float(params.temperature), dtype=torch.float32),
        torch.full((rows,), int(params.top_k), dtype=torch.int64),
        torch.full((rows,), float(params.top_p), dtype=torch.float32),
        torch.full((rows,), float(params.min_p), dtype=torch.float32),
    )


def _q_i(x: list[int], draft_probs: Tensor | None, i: int, vocab: int) -> Tensor:
    """q_i [V] float32: the given draft distribution, or a point mass on x_i."""
    if draft_probs is not None:
        return draft_probs[i - 1].float()
    q_i = torch.zeros(vocab, dtype=torch.float32)
    q_i[x[i - 1]] = 1.0
    return q_i


def _reference_greedy(x: list[int], target_logits: Tensor) -> tuple[list[int], int]:
    """Temperature 0: keep guesses while they equal the target's argmax; then add the argmax."""
    gamma = len(x)
    for i in range(1, gamma + 1):
        t = int(target_logits[i - 1].argmax())
        if x[i - 1] != t:
            return list(x[: i - 1]) + [t], i - 1
    return list(x) + [int(target_logits[gamma].argmax())], gamma


def reference_verify_tree(
    tokens: list[int],  # [n] node i's token
    parents: list[int],  # [n] node i's parent (< i) or -1, the root
    target_logits: Tensor,  # [n + 1, V]: row 0 after the root, row i + 1 after node i
    draft_probs: Tensor | None,  # [n, V] the q node i was drawn from; None = point masses
    params: SamplingParams,
    uniforms: Tensor,  # [n + 1] float64: node i's coin at i, the final draw's at n
    replacement: bool = False,  # siblings drawn i.i.d. (True) or without replacement (False)
) -> tuple[list[int], list[int]]:
    """Slow recursive rejection sampling over a token tree (verify/tree.py), in plain Python
    floats: returns (the accepted path's tokens + the final token, the path's nodes)."""
    n = len(tokens)
    if params.greedy:
        node, path = -1, []
        while True:
            t = int(target_logits[node + 1].argmax())
            match = [c for c in range(n) if parents[c] == node and tokens[c] == t]
            if not match:
                return [tokens[c] for c in path] + [t], path
            node = match[0]
            path.append(node)
    p = _probs(target_logits, params).double().tolist()
    vocab = len(p[0])

    def q_of(c: int) -> list[float]:
        if draft_probs is None:
            return [1.0 if v == tokens[c] else 0.0 for v in range(vocab)]
        return draft_probs[c].double().tolist()

    def normalized(v: list[float], fallback: list[float]) -> list[float]:
        total = sum(v)
        return fallback if total <= 0.0 else [a / total for a in v]

    node, path = -1, []
    while True:
        r = p[node + 1]
        q = None
        accepted = None
        for c in [c for c in range(n) if parents[c] == node]:
            x = tokens[c]
            if q is None or replacement or draft_probs is None:
                q = q_of(c)
            if float(uniforms[c]) < r[x] / q[x]:
                accepted = c
                break
            r = normalized([max(0.0, a - b) for a, b in zip(r, q)], r)
            if draft_probs is not None and not replacement:
                q = normalized([0.0 if v == x else a for v, a in enumerate(q)], q)
        if accepted is None:
            t = int(sample_from_probs(torch.tensor([r], dtype=torch.float64), uniforms[n : n + 1])[0])
            return [tokens[c] for c in path] + [t], path
        path.append(accepted)
        node = accepted
