"""Penalties and biases on the target's logits, row by row, for a verification pass.

A pass scores K + 1 positions of a sequence at once. A rule that depends on the text so far must
see, at row j, the text up to that position: the sequence's tokens and its draft tokens before j,
which is what plain decoding would have seen had it produced them. The verifier then accepts
against these shaped rows, so the output is lossless with respect to the shaped distribution
(Leviathan et al.'s rule holds for any target p). The draft's q needs no shaping: it only has to
be what the draft proposed from.

The rules, as vLLM and OpenAI define them (in this order):
- ``min_tokens``: the end-of-sequence ids are impossible until that many tokens are out;
- ``repetition_penalty`` r (vLLM, after CTRL, Keskar et al. 2019): a token already in the prompt
  or the output has its logit divided by r where positive, multiplied by r where negative;
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI): a token's logit loses
  f * (times it is in the output) + p * (whether it is in the output);
- ``logit_bias``: a fixed amount added to given tokens' logits.
"""

from __future__ import annotations

import torch

from quickdraft.sampling import SamplingParams


def shapes_logits(params: SamplingParams) -> bool:
    """Whether any rule above applies to a request."""
    return bool(params.min_tokens or params.repetition_penalty != 1.0 or params.frequency_penalty
                or params.presence_penalty or params.logit_bias)


def shape_rows(rows: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int], drafts: list[int],
               eos_ids: tuple[int, ...] | list[int]) -> None:
    """``rows`` [len(drafts) + 1, V] float32, in place: row j scores the token after ``output``
    and ``drafts[:j]`` (``output``: the tokens emitted so far, the last of them pending)."""
    vocab, device = rows.shape[1], rows.device
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).to(device, torch.float32)
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor(prompt + output, dtype=torch.long, device=device)] = True
    bias_ids = bias = None
    if params.logit_bias:
        bias_ids = torch.tensor([i for i, _ in params.logit_bias], dtype=torch.long, device=device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device) if params.min_tokens and eos_ids else None
    for j in range(rows.shape[0]):
        if j:  # the draft token before this row is now part of the text
            counts[drafts[j - 1]] += 1
            if seen is not None:
                seen[drafts[j - 1]] = True
        row = rows[j]
        if eos is not None and len(output) + j < params.min_tokens:
            row[eos] = float("-inf")
        if seen is not None:
            hit = row[seen]
            row[seen] = torch.where(hit > 0, hit / params.repetition_penalty, hit * params.repetition_penalty)
        if params.frequency_penalty:
            row -= params.frequency_penalty * counts
        if params.presence_penalty:
            row -= params.presence_penalty * (counts > 0).float()
        if bias is not None:
            row.index_add_(0, bias_ids, bias)
