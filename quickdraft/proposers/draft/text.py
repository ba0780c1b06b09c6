"""Method "draft_model" with ``cross_tokenizer``: a draft model whose vocabulary is not the
target's proposes through text (transformers' universal assisted generation; Timor et al. 2025).

Each sequence's slot holds a ``DraftView`` (proposers/draft/retokenize.py): the draft's own tokenization
of the target's committed text, special tokens and chat template included, and the ids whose keys
the draft's KV cache holds. Before a proposal the view follows the target's new tokens (a window
of its tail encoded again with the new text; the cache keeps its common prefix with the new ids),
the draft decodes greedily from there, batched over sequences like proposers/draft/model.py, and
stops at its own end-of-text token (proposed as the target's), or once its text makes more than K
target tokens. Its tokens are converted to target ids through their bytes, at most K of them.

The drafts are point masses (``DraftProposal.probs`` None) for every request, greedy or sampled:
the verifier accepts a draft token x with probability p(x) and otherwise samples from p without x,
which is exactly p (Leviathan et al. 2023 with q one-hot), so the output is the target's. Under a
grammar the runner cuts the drafts at the first token the grammar rejects (engine/runner.py); the
draft's own logits are not masked, the grammar speaking the target's ids.

A view's keys stay in its slot after the sequence ends: a new prompt that shares a prefix with it
keeps the draft tokens whose text lies inside the shared target tokens (``reuse``).
"""

from __future__ import annotations

import bisect
import time

import torch

from quickdraft.errors import ConfigError
from quickdraft.models.decoder import Decoder
from quickdraft.models.kv_cache import KVCache
from quickdraft.models.pass_cost import calibrate, key_reads
from quickdraft.proposers.base import DraftProposal
from quickdraft.proposers.draft.load import MAX_OBSERVED_FEED, draft_pass, load_draft
from quickdraft.proposers.draft.retokenize import Bridge, common_prefix
from quickdraft.proposers.draft_sampling import confident_rows
from quickdraft.sampling import argmax_rows

# The draft's tokens of a text may outnumber the target's (a smaller vocabulary): its cache holds
# up to this many times the target's context, within the draft's own.
DRAFT_LEN_FACTOR = 2
# A draft with a smaller vocabulary spells a text in more tokens than the target (SmolLM2's 49k
# against Qwen's 152k: 1.17 of its tokens a Qwen token over 200 installed Python files): it
# drafts until its text makes more than K whole target tokens (the K + 1-th may still grow, so K
# are final), up to this many of its own tokens a target token.
DRAFT_PER_TARGET = 2


class TextDraftProposer:
    method = "draft_model"

    def __init__(self, draft: Decoder, bridge: Bridge, num_slots: int, max_len: int, confidence_threshold: float = 0.0,
                 calibrate_cost: bool = False, head_ids: torch.Tensor | None = None):
        """``max_len``: the draft tokens a slot holds; ``head_ids`` [N]: the draft id of each row
        of a truncated output head (proposers/draft/vocab.py), None: every row."""
        self.model, self.bridge = draft, bridge
        self.head_ids = None if head_ids is None else head_ids.to(draft.device)
        self.threshold = confidence_threshold
        self.max_len = max_len
        self.kv = KVCache(draft.config, num_slots, max_len, draft.dtype, draft.device)
        self.views = [bridge.new_view() for _ in range(num_slots)]
        self.cost = calibrate(draft, self.kv) if calibrate_cost else None

    @classmethod
    def from_config(cls, spec, ctx) -> "TextDraftProposer":
        draft, config, weights, quantize, head_ids = load_draft(spec, ctx, check_vocabulary=False)
        if ctx.target.tokenizer is None or draft.tokenizer is None:
            raise ConfigError("cross_tokenizer drafts through text: the target and the draft both need a tokenizer "
                              f"({ctx.target.source if ctx.target.tokenizer is None else draft.source} has none)",
                              "cross_tokenizer")
        max_len = min(ctx.max_model_len * DRAFT_LEN_FACTOR, draft.config.max_position_embeddings)
        return cls(Decoder(config, weights, quantize=quantize, cuda_graphs=ctx.cuda_graphs), Bridge(ctx.target.tokenizer, draft.tokenizer),
                   ctx.num_slots, max_len, spec.draft_confidence_threshold, calibrate_cost=spec.adaptive,
                   head_ids=head_ids)

    def propose(self, seqs, num_tokens) -> DraftProposal:
        budget = list(num_tokens)  # draft tokens each sequence may still take
        for i, (s, k) in enumerate(zip(seqs, num_tokens)):
            if k > 0:
                view = self.views[s.slot]
                self.bridge.follow(view, s.token_ids)
                if len(view.kv) >= len(view.ids):  # all read already: read the last token again, for its logits
                    view.kv = view.ids[: len(view.ids) - 1]
                # room in the draft's cache, for up to DRAFT_PER_TARGET of its tokens a target token
                budget[i] = max(0, min(k * DRAFT_PER_TARGET, self.max_len - len(view.ids))) if view.ids else 0
        active = [i for i, k in enumerate(budget) if k > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        proposed: list[list[int]] = [[] for _ in seqs]  # target ids of each draft so far
        feed = {i: self.views[seqs[i].slot].ids[len(self.views[seqs[i].slot].kv) :] for i in active}
        for step in range(max(budget, default=0)):
            active = [i for i in active if budget[i] > step]
            if not active:
                break
            views = [self.views[seqs[i].slot] for i in active]
            started = time.perf_counter()
            timed = self.cost is not None and max(len(feed[i]) for i in active) <= MAX_OBSERVED_FEED
            if timed:
                rows = sum(len(feed[i]) for i in active)
                keys = sum(key_reads(len(v.kv), len(feed[i])) for v, i in zip(views, active))
            logits = draft_pass(self.model, self.kv, [seqs[i].slot for i in active], [len(v.kv) for v in views],
                                [feed[i] for i in active])  # [len(active), N]
            rows_ = argmax_rows(logits)  # greedy: the drafts are point masses
            sure = confident_rows(logits, rows_, self.threshold)
            tokens = (rows_ if self.head_ids is None else self.head_ids[rows_]).tolist()
            if timed:
                self.cost.observe(rows, time.perf_counter() - started, len(active), keys)
            for row, (i, view) in enumerate(zip(active, views)):
                view.kv += feed[i]
                drafts[i].append(tokens[row])
                feed[i] = [tokens[row]]
                proposed[i] = self.bridge.to_target(view, seqs[i].token_ids, drafts[i])
                if not sure[row] or tokens[row] in self.bridge.draft_stops or len(proposed[i]) > num_tokens[i]:
                    budget[i] = step + 1  # this token is proposed, no more after it
        out = [p[:k] for p, k in zip(proposed, num_tokens)]
        flat = [t for d in out for t in d]
        return DraftProposal(torch.tensor(flat, dtype=torch.long), [len(d) for d in out], None)

    def read_prompt(self, seqs) -> None:
        """Read each prompt's draft tokens in the step the target reads the prompt
        (engine._draft_reads_prompts), in one pass, all but the view's last: its logits start the
        first draft, and the target's next token may tokenize the text's tail anew (the view
        then keeps the keys of the common prefix, as at every proposal)."""
        todo = []
        for s in seqs:
            view = self.views[s.slot]
            self.bridge.follow(view, s.token_ids)
            if len(view.kv) < len(view.ids) - 1 and len(view.ids) <= self.max_len:
                todo.append((s.slot, view, view.ids[len(view.kv) : len(view.ids) - 1]))
        if todo:
            draft_pass(self.model, self.kv, [slot for slot, _, _ in todo], [len(view.kv) for _, view, _ in todo],
                       [feed for _, _, feed in todo])
            for _, view, feed in todo:
                view.kv += feed

    def observe(self, seqs, outcome) -> None:
        pass  # the view follows the committed tokens at the next proposal, and cuts its stale keys then

    def catchup_rows(self, seq) -> int:
        # roughly one draft token a target token the view has not read yet, and the ids it has not fed
        view = self.views[seq.slot]
        return max(len(view.ids) - len(view.kv) + len(seq) - view.num_target - 1, 0)

    def reuse(self, seq, source, num_tokens) -> int:
        """Keep the source view's draft tokens whose text lies inside the first ``num_tokens``
        target tokens (the prefix both prompts share), and their keys."""
        src, view = self.views[source], self.bridge.new_view()
        if num_tokens > 0:
            shared = min(num_tokens, src.num_target)
            view.text = bytearray(self.bridge.target_bytes(seq.prompt_token_ids[:shared], 0))
            view.num_target = shared
            keep = max(bisect.bisect_right(src.ends, len(view.text)), view.fixed) if src.exact else view.fixed
            view.ids, view.ends = src.ids[:keep], src.ends[:keep]
            view.kv = view.ids[: common_prefix(src.kv, view.ids)]
            self.kv.copy_prefix(source, seq.slot, len(view.kv))
        self.views[seq.slot] = view
        return num_tokens

    def release(self, seq) -> None:
        pass  # the view and its keys stay in the slot for reuse

    def close(self) -> None:
        pass
