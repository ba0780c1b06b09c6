"""The verifier's one entry point a step (as vLLM's ``RejectionSampler.forward``): the engine's
runner hands it the step's drafts, the target's logits of the rows that verify them and each
request's sampling, and gets back what each sequence emits and whether its rows were finite.

Inside, in this order: each row's finiteness (a sequence whose logits hold a NaN or an inf fails
alone, its rows zeroed), the uniforms each sampled request draws from its own generator (K_i
acceptance coins and one final draw; greedy requests draw nothing), then one of three rules:

* an all-greedy batch of chains: ``rejection.greedy_walk``, along the argmax of the rows (taken
  with their finiteness in one read where no request shapes its rows);
* chains: ``rejection.verify``, greedy matching and rejection sampling over the ragged batch;
* token trees: ``tree.verify_tree`` a sequence at a time (a chain in such a batch is the tree of
  one branch, with the chain verifier's draws).

The function is pure but for the generators it draws from: what it reads of the requests (their
penalties, biases and grammars) comes in as ``shape``, a function of the rows.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor

from quickdraft.sampling import BatchSampling, SamplingParams, argmax_finite, draw_uniforms, row_kernels, spread_probs
from quickdraft.verify.rejection import VerifyOutput, greedy_walk, verify
from quickdraft.verify.tree import DraftTree, verify_tree


def verify_step(
    draft_token_ids: Tensor,  # [num_draft_tokens] int64, the sequences' drafts concatenated
    num_draft_tokens: list[int],  # [batch] K_i >= 0
    target_logits: Tensor,  # [num_draft_tokens + batch, V]: sequence i's K_i + 1 rows, raw (for logprobs too)
    params: list[SamplingParams],  # [batch]
    generators: list[torch.Generator | None],  # [batch] each sampled request's own (seeded) generator
    draft_probs: Tensor | None = None,  # [num_draft_tokens, V] q (or [.., N] with draft_columns); None = point masses
    draft_columns: Tensor | None = None,  # [V] int32 (sampling.head_columns), where q is over a truncated head
    parents: list[list[int] | None] | None = None,  # [batch] a tree's parents (None: a chain); None: all chains
    shape: Callable[[Tensor], Tensor] | None = None,  # logits -> the rows the requests' rules judge by; None: as they are
    sampling: Callable[[torch.device], BatchSampling] | None = None,  # the batch's sampling tensors on a device
) -> tuple[VerifyOutput, list[bool]]:
    """-> (what each sequence emits, [batch] whether its rows were finite: a sequence whose rows
    were not emits what the zeroed rows give, and the caller fails it). ``target_logits`` rows of
    such a sequence are zeroed in place."""
    greedy = all(p.greedy for p in params)
    walks = parents is None and greedy and shape is None  # the argmax of the rows as they are is the walk's
    # the rows' check in one read where the kernels run (sampling.argmax_finite: 0.06 ms for 5 rows
    # of 151,936 logits against numpy's sum's 0.21, Intel Xeon), and with it the walk's argmax
    argmax, fine = argmax_finite(target_logits) if walks or row_kernels(target_logits) is not None else (None, None)
    if not walks:
        argmax = None
    ok = finite_rows(target_logits, num_draft_tokens, fine, argmax)
    shaped = (lambda logits: logits) if shape is None else shape
    if parents is None and greedy:
        # what verify does for an all-greedy batch, without the coins and sampling tensors it
        # would not read: the engine's own time a plain step of the 1.5B 0.93-1.16 -> 0.70-0.77 ms
        # (AMD EPYC Zen 1, docs/design/verifier.md)
        return greedy_walk(draft_token_ids, num_draft_tokens, shaped(target_logits), argmax), ok
    uniforms = step_uniforms(params, generators, num_draft_tokens).to(target_logits.device)
    if parents is not None:
        if draft_columns is not None:  # the tree rule reads q over the vocabulary
            draft_probs = spread_probs(draft_probs, draft_columns)
        return _verify_trees(draft_token_ids, num_draft_tokens, shaped(target_logits), params, draft_probs, parents,
                             uniforms), ok
    device = target_logits.device
    if sampling is None:
        sampling = lambda device: BatchSampling.from_params(params, device)  # noqa: E731
    return verify(
        draft_token_ids.to(device), num_draft_tokens, shaped(target_logits),
        None if draft_probs is None else draft_probs.to(device), sampling(device), uniforms,
        None if draft_columns is None else draft_columns.to(device),
    ), ok


def step_uniforms(params: list[SamplingParams], generators: list[torch.Generator | None],
                  num_draft_tokens: list[int]) -> Tensor:
    """[num_draft_tokens + batch] float64: K_i acceptance coins and one final draw each, from each
    request's generator. Greedy requests draw nothing, so their generators stay untouched."""
    parts = [
        torch.zeros(k + 1, dtype=torch.float64) if p.greedy else draw_uniforms(g, k + 1).cpu()
        for p, g, k in zip(params, generators, num_draft_tokens)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _verify_trees(draft_token_ids: Tensor, num_draft_tokens: list[int], logits: Tensor, params: list[SamplingParams],
                  draft_probs: Tensor | None, parents: list[list[int] | None], uniforms: Tensor) -> VerifyOutput:
    """Each sequence's drafts as a tree (a chain is the tree of one branch; tree.py gives it the
    chain verifier's draws); the caller moves the accepted path's keys and values into place.
    Proposers make trees only where proposers/base.accepts_trees allows (no shaping, grammar or
    logprobs)."""
    token_ids, accepted, shapes, row, at = [], [], [], 0, 0
    for i, (p, k) in enumerate(zip(params, num_draft_tokens)):
        tree_parents = parents[i]
        chain = tree_parents is None
        nodes = list(range(-1, k - 1)) if chain else tree_parents
        tree = DraftTree(draft_token_ids[at : at + k], nodes, None if draft_probs is None else draft_probs[at : at + k])
        out = verify_tree(tree, logits[row : row + k + 1], p, uniforms[row : row + k + 1])
        shapes.append(None)
        if not chain:
            depth = [0] * k
            for n, parent in enumerate(nodes):
                depth[n] = 1 + (depth[parent] if parent >= 0 else 0)
            end = out.path[-1] if out.path else -1
            shapes[-1] = (max(depth, default=0), end in nodes, out.path)
        token_ids.append(out.token_ids)
        accepted.append(out.num_accepted)
        row, at = row + k + 1, at + k
    return VerifyOutput(token_ids, accepted, shapes)


def finite_rows(logits: Tensor, num_tokens: list[int], fine: Tensor | None = None,
                argmax: Tensor | None = None) -> list[bool]:
    """[batch] whether each sequence's rows of ``logits`` [num_draft_tokens + batch, V] are all
    finite; a sequence whose logits hold a NaN or inf fails alone, its rows zeroed for verify (and
    its rows of ``argmax``, the greedy walk's, set to 0: the zeroed rows' argmax).

    ``fine`` [rows] bool: each row's finiteness where the caller has it (sampling.argmax_finite).
    Otherwise a row's sum is finite only where every logit in it is (a NaN or an inf makes it NaN
    or inf), so one sum a row clears the rows (~11 us for 151,936 logits where first measured,
    50-70 us on an AMD EPYC Zen 1, against ~0.3 ms for torch.isfinite's mask and its threads); a
    row whose sum is not finite is checked logit by logit, since a sum of finite logits can
    overflow."""
    if fine is not None:
        if all(fine.tolist()):  # the usual case, without numpy: its code is cold after a pass (~40 us)
            return [True] * len(num_tokens)
        fine = fine.numpy()
    elif logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is checked below
            fine = np.isfinite(logits.numpy().sum(-1))  # [rows]
    else:
        fine = np.isfinite(logits.float().sum(-1).cpu().numpy())
    if fine.all():
        return [True] * len(num_tokens)
    ok, start = [], 0
    for k in num_tokens:
        rows = logits[start : start + k + 1]
        good = bool(fine[start : start + k + 1].all()) or bool(torch.isfinite(rows).all())
        if not good:
            with torch.inference_mode():  # the decoder's logits are inference tensors
                rows.zero_()
            if argmax is not None:
                argmax[start : start + k + 1] = 0
        ok.append(good)
        start += k + 1
    return ok
