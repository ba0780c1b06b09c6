"""Lossless chain verification over a ragged batch: greedy matching and rejection sampling.

Speculative sampling as in Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", Algorithm 1, and Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling". ``quickdraft.verify.reference`` is the slow, paper-faithful
version the code here is tested against, draw by draw.

Terms, for one sequence with K draft tokens x_0..x_{K-1}, target distributions p_0..p_K (p_j scores
the token after x_{j-1}; p_0 the token after the last committed one) and draft distributions
q_0..q_{K-1}:

* accepted: a draft token that is kept. x_j is accepted when x_0..x_{j-1} were and
  u_j < min(1, p_j(x_j) / q_j(x_j)).
* recovered: at the first rejection, at position n, the token that replaces x_n, drawn from
  normalize(max(0, p_n - q_n)).
* bonus: after all K draft tokens are accepted, one more token drawn from p_K.

Every step therefore emits the n accepted tokens plus exactly one recovered or bonus token, and the
emitted sequence is distributed exactly as sampling from p one token at a time.

Acceptance is the strict ``u < p/q`` (the paper rejects when r > p/q; the two differ only on a
set of measure zero): with u in [0, 1) a token with p(x) = 0 is never accepted, not even at u = 0,
and p(x) >= q(x) always is. Greedy sequences (temperature 0) accept the longest prefix equal to the
target argmax and emit the argmax at the first mismatch (or as the bonus); they use no uniforms.

The function is pure: randomness comes in as ``uniforms``, laid out like the target rows (per
sequence K coins, then one for the final draw), so a seeded request replays exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from quickdraft import sampling as sampling_module
from quickdraft.sampling import BatchSampling, argmax_rows, logits_to_probs, sample_from_probs, spread_probs


@dataclass
class VerifyOutput:
    """What one verification step emits, per sequence."""

    token_ids: list[list[int]]  # [batch][num_accepted + 1]: accepted draft tokens + one recovered or bonus token
    num_accepted: list[int]  # [batch] draft tokens accepted, 0..K_i
    # [batch] for a token tree (verify/step.py's _verify_trees): its depth, whether the accepted path ended
    # in a rejection (at a node with children) rather than at a leaf, and the path's nodes; None for a chain
    trees: list[tuple[int, bool, list[int]] | None] | None = None


@dataclass
class _Layout:
    """Offsets of a ragged batch. Sequence i owns draft tokens [draft_start_i, draft_start_i + K_i)
    and target rows (and uniforms) [row_start_i, row_start_i + K_i + 1)."""

    num_draft: Tensor  # [batch] int64, K_i
    draft_start: Tensor  # [batch] int64
    row_start: Tensor  # [batch] int64
    draft_seq: Tensor  # [num_draft_tokens] int64, the sequence of each draft token
    draft_pos: Tensor  # [num_draft_tokens] int64, its position j within the sequence
    draft_row: Tensor  # [num_draft_tokens] int64, the target row (and uniform) that scores it
    row_seq: Tensor  # [num_draft_tokens + batch] int64, the sequence of each target row

    @classmethod
    def build(cls, num_draft_tokens: list[int], device: torch.device) -> _Layout:
        num_draft = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)  # [batch]
        batch = torch.arange(len(num_draft_tokens), device=device)  # [batch]
        draft_start = torch.cumsum(num_draft, 0) - num_draft  # [batch]
        draft_seq = torch.repeat_interleave(batch, num_draft)  # [num_draft_tokens]
        draft_index = torch.arange(draft_seq.shape[0], device=device)  # [num_draft_tokens]
        return cls(
            num_draft=num_draft,
            draft_start=draft_start,
            row_start=draft_start + batch,
            draft_seq=draft_seq,
            draft_pos=draft_index - draft_start[draft_seq],
            draft_row=draft_index + draft_seq,
            row_seq=torch.repeat_interleave(batch, num_draft + 1),
        )


def verify(
    draft_token_ids: Tensor,  # [num_draft_tokens] int64, the sequences' drafts concatenated
    num_draft_tokens: list[int],  # [batch] K_i >= 0; K_i = 0 is plain decoding / sampling
    target_logits: Tensor,  # [num_draft_tokens + batch, V]; sequence i owns K_i + 1 consecutive rows
    draft_probs: Tensor | None,  # [num_draft_tokens, V] q, shaped by the same params; None = point masses
    sampling: BatchSampling,  # [batch]
    uniforms: Tensor,  # [num_draft_tokens + batch] float64 in [0, 1): per sequence K_i coins, then 1
    draft_columns: Tensor | None = None,  # [V] int32 (sampling.head_columns): draft_probs is then [num_draft_tokens, N]
) -> VerifyOutput:
    """Verify a ragged batch of draft chains against the target (see the module docstring).

    Row j of sequence i's target rows scores the token after draft token j - 1 (row 0: after the
    last committed token). ``draft_probs`` None means point-mass drafts (n-gram lookup): q(x) = 1
    for the proposed token. With ``draft_columns`` (a draft's truncated head) q is given over
    the head's rows alone and is 0 for the ids it lacks. Vectorized over the batch: all-greedy
    batches need one argmax per row (then a walk along lists); sampled ones shape p (one softmax
    per row), gather p(x) and q(x) for every draft token at once and touch the whole vocabulary
    again only for the final draw, once per sequence. On the CPU the kernels run the same rule
    (``_native``), shaping a row only once the drafts before it were accepted.
    """
    if min(num_draft_tokens, default=0) < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    _check_shapes(draft_token_ids, len(num_draft_tokens), sum(num_draft_tokens), target_logits, draft_probs, sampling,
                  uniforms, draft_columns)
    if bool(sampling.greedy.all()):
        return greedy_walk(draft_token_ids, num_draft_tokens, target_logits)
    device = target_logits.device
    if not any(num_draft_tokens):
        return _plain_draws(target_logits, sampling.to(device), uniforms)
    kernels = sampling_module.row_kernels(target_logits)
    if kernels is not None and (draft_probs is None or (draft_probs.device.type == "cpu"
                                                        and draft_probs.dtype == torch.float32)):
        return _native(kernels, draft_token_ids, num_draft_tokens, target_logits, draft_probs, sampling, uniforms,
                       draft_columns)
    if draft_columns is not None:  # torch's rule reads q over the vocabulary
        draft_probs = spread_probs(draft_probs, draft_columns)
    layout = _Layout.build(num_draft_tokens, device)
    draft_token_ids = draft_token_ids.to(device=device, dtype=torch.int64)
    uniforms = uniforms.to(device=device, dtype=torch.float64)
    sampling = sampling.to(device)
    greedy = sampling.greedy  # [batch]
    accepted = torch.zeros_like(draft_token_ids, dtype=torch.bool)  # [num_draft_tokens]
    final = torch.zeros_like(layout.num_draft)  # [batch]
    if bool(greedy.any()):
        accepted, final = _greedy_step(draft_token_ids, target_logits, layout)
    s_accepted, s_final = _sampled_step(draft_token_ids, target_logits, draft_probs, sampling, uniforms, layout)
    accepted = torch.where(greedy[layout.draft_seq], accepted, s_accepted)
    final = torch.where(greedy, final, s_final)
    return _to_lists(draft_token_ids, layout, _num_accepted(accepted, layout), final)


def _native(kernels, draft_token_ids: Tensor, num_draft_tokens: list[int], target_logits: Tensor,
            draft_probs: Tensor | None, sampling: BatchSampling, uniforms: Tensor,
            draft_columns: Tensor | None = None) -> VerifyOutput:
    """The same rule in the CPU kernels (kernels/verify.cpp's verify_chains): the tokens the torch
    path below emits, with each target row shaped only once the drafts before it were accepted and
    none of the ragged layout's small tensors: a sequence of K = 4 at temperature 0.7 took
    0.41-0.46 ms against the torch path's 1.55-1.59 (Intel Xeon)."""
    drafts = draft_token_ids.to(torch.int64).contiguous()
    accepted, final = kernels.verify_chains(
        target_logits.contiguous(), None if draft_probs is None else draft_probs.contiguous(), drafts,
        list(num_draft_tokens), sampling.temperature.float().contiguous(), sampling.top_k.long().contiguous(),
        sampling.top_p.float().contiguous(), sampling.min_p.float().contiguous(),
        uniforms.to(torch.float64).cpu().contiguous(), None if draft_columns is None else draft_columns.to(torch.int32).contiguous())
    flat, counts, token_ids, at = drafts.tolist(), accepted.tolist(), [], 0
    for k, n, last in zip(num_draft_tokens, counts, final.tolist()):
        token_ids.append(flat[at : at + n] + [last])
        at += k
    return VerifyOutput(token_ids=token_ids, num_accepted=counts)


def greedy_walk(draft_token_ids: Tensor, num_draft_tokens: list[int], target_logits: Tensor,
                argmax: Tensor | None = None) -> VerifyOutput:
    """An all-greedy batch: _greedy_step's rule on lists, one argmax and one host transfer for
    the batch (the ragged layout's dozen small tensors cost more than the walk, plain decoding's
    one row above all). ``argmax``: the logits' argmax_rows where the caller has it already."""
    argmax = (argmax_rows(target_logits) if argmax is None else argmax).tolist()  # [num_rows], lowest id on ties
    drafts = draft_token_ids.tolist()
    token_ids, counts, row, at = [], [], 0, 0
    for k in num_draft_tokens:
        n = 0
        while n < k and drafts[at + n] == argmax[row + n]:
            n += 1
        token_ids.append(drafts[at : at + n] + [argmax[row + n]])
        counts.append(n)
        row, at = row + k + 1, at + k
    return VerifyOutput(token_ids=token_ids, num_accepted=counts)


def _greedy_step(draft_token_ids: Tensor, target_logits: Tensor, layout: _Layout) -> tuple[Tensor, Tensor]:
    """Greedy acceptance [num_draft_tokens] bool and final tokens [batch] for every sequence."""
    target_argmax = argmax_rows(target_logits)  # [num_rows], lowest id on ties
    accepted = draft_token_ids == target_argmax[layout.draft_row]  # [num_draft_tokens]
    num_accepted = _num_accepted(accepted, layout)  # [batch]
    return accepted, target_argmax[layout.row_start + num_accepted]


def _sampled_step(
    draft_token_ids: Tensor,  # [num_draft_tokens]
    target_logits: Tensor,  # [num_rows, V]
    draft_probs: Tensor | None,  # [num_draft_tokens, V]
    sampling: BatchSampling,  # [batch]
    uniforms: Tensor,  # [num_rows] float64
    layout: _Layout,
) -> tuple[Tensor, Tensor]:
    """Rejection-sampling acceptance [num_draft_tokens] bool and final tokens [batch] for every sequence."""
    rows = sampling.select(layout.row_seq)  # [num_rows]
    p = logits_to_probs(target_logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p)  # [num_rows, V]
    p_draft = p[layout.draft_row, draft_token_ids]  # [num_draft_tokens]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)  # [num_draft_tokens]
    else:
        q_draft = draft_probs[torch.arange(draft_token_ids.shape[0], device=p.device), draft_token_ids].float()
    accepted = _accept_mask(uniforms[layout.draft_row], p_draft, q_draft)  # [num_draft_tokens]
    num_accepted = _num_accepted(accepted, layout)  # [batch]
    final_probs = _final_probs(p, draft_token_ids, draft_probs, layout, num_accepted)  # [batch, V]
    final_uniforms = uniforms[layout.row_start + layout.num_draft]  # [batch], the last uniform of each sequence
    return accepted, sample_from_probs(final_probs, final_uniforms)


def _plain_draws(target_logits: Tensor, sampling: BatchSampling, uniforms: Tensor) -> VerifyOutput:
    """No sequence drafted (plain sampled decoding): each one's token drawn from its p with its one
    uniform, what the general path gives (a greedy row's p is one-hot at its argmax, which every
    uniform draws) without its layout and gathers: a plain sampled step's verification 1.5 -> ~0.6
    ms a row (AMD EPYC Zen 1)."""
    p = logits_to_probs(target_logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    tokens = sample_from_probs(p, uniforms).tolist()
    return VerifyOutput(token_ids=[[t] for t in tokens], num_accepted=[0] * len(tokens))


def _accept_mask(coins: Tensor, p_draft: Tensor, q_draft: Tensor) -> Tensor:
    """u_j < min(1, p(x_j) / q(x_j)), in float64, for coins, p_draft, q_draft [num_draft_tokens].
    q(x) = 0 cannot happen for a token the draft sampled; if given, 0/0 rejects and p/0 accepts."""
    return coins < p_draft.double() / q_draft.double()


def _num_accepted(accepted: Tensor, layout: _Layout) -> Tensor:
    """Per sequence, the length of the accepted prefix [batch]: the position of its first
    rejection, or K_i when there is none (a segment minimum)."""
    first_reject = torch.where(accepted, layout.num_draft[layout.draft_seq], layout.draft_pos)  # [num_draft_tokens]
    return layout.num_draft.clone().scatter_reduce_(0, layout.draft_seq, first_reject, reduce="amin")


def _final_probs(
    p: Tensor,  # [num_rows, V]
    draft_token_ids: Tensor,  # [num_draft_tokens]
    draft_probs: Tensor | None,  # [num_draft_tokens, V]
    layout: _Layout,
    num_accepted: Tensor,  # [batch]
) -> Tensor:
    """The distribution of each sequence's final token [batch, V] (unnormalized): the bonus
    distribution p_K after a full accept, else the recovery distribution at the rejection."""
    p_final = p[layout.row_start + num_accepted]  # [batch, V]
    rejected = num_accepted < layout.num_draft  # [batch]
    if draft_token_ids.shape[0] == 0 or not bool(rejected.any()):
        return p_final
    # Sequences without a rejection index a valid but unused draft row; torch.where drops it.
    rejected_index = (layout.draft_start + num_accepted).clamp(max=draft_token_ids.shape[0] - 1)  # [batch]
    if draft_probs is None:
        q_final = torch.zeros_like(p_final).scatter_(1, draft_token_ids[rejected_index].unsqueeze(1), 1.0)
    else:
        q_final = draft_probs[rejected_index].float()  # [batch, V]
    return torch.where(rejected.unsqueeze(1), _recovery_probs(p_final, q_final), p_final)


def _recovery_probs(p: Tensor, q: Tensor) -> Tensor:
    """max(0, p - q) [n, V] for p, q [n, V], left unnormalized (``sample_from_probs`` draws
    proportionally). A rejection implies p(x) < q(x), so the residual has mass
    sum(max(0, q - p)) >= q(x) - p(x) > 0 when p and q each sum to 1; it can be all zero only when
    rounding leaves p's sum below q's. Then p itself is used: it is the distribution being matched."""
    residual = (p - q).clamp_(min=0.0)  # [n, V]
    empty = residual.sum(dim=-1, keepdim=True) == 0  # [n, 1]
    return torch.where(empty, p, residual)


def _to_lists(draft_token_ids: Tensor, layout: _Layout, num_accepted: Tensor, final: Tensor) -> VerifyOutput:
    """Lay the emitted tokens out like the target rows (sequence i's accepted drafts, then its final
    token, from row_start_i), then one host transfer and one slice per sequence."""
    emitted = torch.empty_like(layout.row_seq)  # [num_rows]; rows after each final token stay unused
    emitted[layout.draft_row] = draft_token_ids
    emitted[layout.row_start + num_accepted] = final
    flat = emitted.tolist()
    counts = num_accepted.tolist()
    token_ids = [flat[s : s + n + 1] for s, n in zip(layout.row_start.tolist(), counts)]
    return VerifyOutput(token_ids=token_ids, num_accepted=counts)


def _check_shapes(
    draft_token_ids: Tensor,
    batch: int,
    total: int,  # draft tokens in all
    target_logits: Tensor,
    draft_probs: Tensor | None,
    sampling: BatchSampling,
    uniforms: Tensor,
    draft_columns: Tensor | None = None,
) -> None:
    """Shape errors are the caller's bug: raise ValueError with the sizes that disagree."""
    if tuple(draft_token_ids.shape) != (total,):
        raise ValueError(f"draft_token_ids has shape {tuple(draft_token_ids.shape)}, expected ({total},)")
    if target_logits.dim() != 2 or target_logits.shape[0] != total + batch:
        raise ValueError(f"target_logits has shape {tuple(target_logits.shape)}, expected ({total + batch}, V)")
    vocab = target_logits.shape[1]
    if draft_columns is not None and (draft_probs is None or tuple(draft_columns.shape) != (vocab,)):
        raise ValueError(f"draft_columns needs draft_probs and has shape ({vocab},), got {tuple(draft_columns.shape)}")
    if draft_probs is not None and (draft_probs.dim() != 2 or draft_probs.shape[0] != total
                                    or draft_columns is None and draft_probs.shape[1] != vocab):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, expected ({total}, "
                         f"{vocab if draft_columns is None else 'N'})")
    if len(sampling) != batch:
        raise ValueError(f"sampling has {len(sampling)} rows, expected {batch}")
    if tuple(uniforms.shape) != (total + batch,):
        raise ValueError(f"uniforms has shape {tuple(uniforms.shape)}, expected ({total + batch},)")


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification yields with k drafts each accepted i.i.d. at rate alpha (this rule
    keeps a chain's prefix up to its first rejection, then adds one token): 1 + alpha + ... +
    alpha^k (Leviathan et al. 2023, eq. 1)."""
    return sum(alpha**j for j in range(k + 1))
