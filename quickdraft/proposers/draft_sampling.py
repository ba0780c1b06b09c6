"""A draft head's logits made draft tokens, shared by the proposers that draft from a head
(draft/model.py, draft/text.py, draft/layer_skip.py, heads/common.py): a draw under the request's sampling, the
confidence cutoff, and a truncated head's rows mapped back to the full vocabulary.
"""

from __future__ import annotations

import torch

from quickdraft.sampling import BatchSampling, argmax_rows, draw_uniforms, logits_to_probs, sample_from_probs


def draw(seqs, logits: torch.Tensor, sampled: bool):
    """logits [n, N] over the head's rows -> rows [n], and q [n, N] when any sequence of the
    batch samples (the request's temperature, top-k and top-p shape the head's N logits). Each
    sequence draws one uniform from its generator (a greedy one too, in a sampled batch). On the
    CPU the kernels shape and draw the rows (sampling.logits_to_probs and sample_from_probs), as
    the draft's native chains do: the same tokens and q."""
    if not sampled:
        return argmax_rows(logits), None
    batch = BatchSampling.from_params([s.params for s in seqs], logits.device)
    uniforms = torch.stack([draw_uniforms(s.generator, 1)[0] for s in seqs]).to(logits.device)
    return sample_draft(logits, batch, uniforms)


def confident_rows(logits: torch.Tensor, tokens: torch.Tensor, threshold: float) -> list[bool]:
    """[n] whether the draft's probability of its own token (at temperature 1) clears the
    threshold; the cutoff only shortens the draft, so any rule here keeps the output exact."""
    if threshold <= 0.0:
        return [True] * logits.shape[0]
    p = torch.softmax(logits, dim=-1).gather(1, tokens.view(-1, 1)).squeeze(1)
    return (p >= threshold).tolist()


def sample_draft(logits: torch.Tensor, batch: BatchSampling, uniforms: torch.Tensor):
    """logits [n, N] over the head's rows, the rows' sampling parameters [n] and uniforms [n]
    -> rows [n] (the argmax for greedy rows) and the q [n, N] they were drawn from."""
    q = logits_to_probs(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    return torch.where(batch.greedy, argmax_rows(logits), sample_from_probs(q, uniforms)), q


def to_vocab(rows: torch.Tensor, q: torch.Tensor | None, head_ids: torch.Tensor | None, vocab_size: int):
    """Head rows [n] and q [n, N] -> full-vocabulary ids [n] and q [n, vocab_size]. With a
    truncated head (``head_ids`` [N]) q is the distribution the draft sampled from, zero outside the
    subset, so that the verifier's p/q and max(0, p - q) see exactly what was proposed."""
    if head_ids is None:
        return rows, q
    if q is not None:
        q = q.new_zeros(q.shape[0], vocab_size).index_copy_(1, head_ids, q)
    return head_ids[rows], q
