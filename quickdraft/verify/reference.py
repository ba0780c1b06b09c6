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
    rows = gamma + 1
    p = logits_to_probs(
        target_logits,
        torch.full((rows,), float(params.temperature), dtype=torch.float32),
        torch.full((rows,), int(params.top_k), dtype=torch.int64),
        torch.full((rows,), float(params.top_p), dtype=torch.float32),
        torch.full((rows,), float(params.min_p), dtype=torch.float32),
    )
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
