"""Method "none": no draft tokens. Plain decoding through the same engine and the same verifier
(every step is a K = 0 verification), the baseline every speedup is measured against."""

from __future__ import annotations

from quickdraft.proposers.base import DraftProposal, register


@register("none")
class NoProposer:
    cost = None  # it makes no drafts

    @classmethod
    def from_config(cls, spec, ctx) -> "NoProposer":
        return cls()

    def propose(self, seqs, num_tokens) -> DraftProposal:
        return DraftProposal.empty(len(seqs))

    def observe(self, seqs, outcome) -> None:
        pass

    def catchup_rows(self, seq) -> int:
        return 0

    def reuse(self, seq, source, num_tokens) -> int:
        return num_tokens  # no KV: its state is read from the sequence's tokens

    def release(self, seq) -> None:
        pass

    def close(self) -> None:
        pass
