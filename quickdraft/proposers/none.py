"""Method "none": no draft tokens. Plain decoding through the same engine and the same verifier
(every step is a K = 0 verification), the baseline every speedup is measured against."""

from __future__ import annotations

from quickdraft.proposers.base import BaseProposer, DraftProposal, register


@register("none")
class NoProposer(BaseProposer):
    cost = None  # it makes no drafts

    @classmethod
    def from_config(cls, spec, ctx) -> "NoProposer":
        return cls()

    def propose(self, seqs, num_tokens) -> DraftProposal:
        return DraftProposal.empty(len(seqs))
