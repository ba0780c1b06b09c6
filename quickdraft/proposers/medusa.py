"""Method "medusa": K Medusa heads (models/medusa.py) draft a chain from the target's last state.

After each verification the runner hands over the committed rows' final hidden states
(``read_target``); the last one, h at position len - 2, is what the target's own head read to
emit the newest token. Head k reads it and proposes token len + k, so K heads make a chain of K
tokens with no pass of anything but the heads. Tokens are sampled from each head's q under the
request's parameters (the argmax when greedy) and q goes to the verifier: the output is the
target's whatever the heads. Token trees from the heads' top-k are a separate issue.
"""

from __future__ import annotations

import torch

from quickdraft.models import medusa as head_file
from quickdraft.proposers.base import DraftProposal, register
from quickdraft.proposers.heads import resolve_dir, sample_rows, serving_head


@register("medusa")
class MedusaProposer:
    cost = None  # one call drafts every position, each a small block and a truncated head (Q8_0 on the CPU)
    reads_target = ()  # the final hidden state only

    def __init__(self, heads: "head_file.MedusaHeads", vocab_size: int, num_slots: int, device="cpu",
                 quantization: str | None = None):
        self.heads = serving_head(heads, quantization, device)
        self.vocab_size = vocab_size
        self.head_ids = None if heads.config.draft_vocab_size == vocab_size else self.heads.draft_ids
        self._last: list[torch.Tensor | None] = [None] * num_slots  # [H] the last committed row's state

    @classmethod
    def from_config(cls, spec, ctx) -> "MedusaProposer":
        if isinstance(spec.model, head_file.MedusaHeads):  # built in code (tests)
            heads, source = spec.model, "given"
        else:
            path = resolve_dir(spec, ctx.target, "medusa")
            heads, source = head_file.load(path), str(path)
        head_file.check_target(heads.config, ctx.target, source)
        return cls(heads, ctx.target.config.vocab_size, ctx.num_slots, ctx.device, spec.quantization)

    def read_target(self, seqs, final, states) -> None:
        for s, rows in zip(seqs, final):
            if rows.shape[0]:
                self._last[s.slot] = rows[-1].float()

    @torch.inference_mode()
    def propose(self, seqs, num_tokens) -> DraftProposal:
        k_max = self.heads.config.num_heads
        active = [i for i, k in enumerate(num_tokens) if k > 0 and self._last[seqs[i].slot] is not None]
        counts = [0] * len(seqs)
        if not active:
            return DraftProposal.empty(len(seqs))
        hidden = torch.stack([self._last[seqs[i].slot] for i in active])
        k = min(max(num_tokens[i] for i in active), k_max)
        logits = self.heads(hidden, k)  # [b, k, N]
        sampled = any(not seqs[i].params.greedy for i in active)
        rows = [(r, j) for r, i in enumerate(active) for j in range(min(num_tokens[i], k))]  # sequence-major
        flat = logits[[r for r, _ in rows], [j for _, j in rows]]  # [num_draft_tokens, N]
        # each row drawn with its sequence's generator, in order (a sequence's K draws in a row)
        ids, q, _ = sample_rows([seqs[active[r]] for r, _ in rows], flat, self.head_ids, self.vocab_size, sampled)
        for r, i in enumerate(active):
            counts[i] = min(num_tokens[i], k)
        return DraftProposal(ids.cpu().long(), counts, q)

    def observe(self, seqs, outcome) -> None:
        pass  # the committed rows' states arrive through read_target

    def catchup_rows(self, seq) -> int:
        return 0

    def reuse(self, seq, source, num_tokens) -> int:
        self.release(seq)  # the heads read only the last row's state, which the prompt pass recomputes
        return num_tokens

    def release(self, seq) -> None:
        self._last[seq.slot] = None

    def close(self) -> None:
        pass
