"""Method "medusa": K Medusa heads (models/medusa.py) draft a chain from the target's last state.

After each verification the runner hands over the committed rows' final hidden states
(``read_target``); the last one, h at position len - 2, is what the target's own head read to
emit the newest token. Head k reads it and proposes token len + k, so K heads make a chain of K
tokens with no pass of anything but the heads. Tokens are sampled from each head's q under the
request's parameters (the argmax when greedy) and q goes to the verifier: the output is the
target's whatever the heads.

With ``num_branches`` B > 1, greedy requests draft token trees (proposers/tree_drafts.py), as
Medusa's own tree attention does but sized per step instead of a fixed tree: head k's B likeliest
tokens are the children of each of the B most valuable nodes at depth k, a node's value is the
product of its tokens' probabilities under their heads (each scaled by how often the target takes
that head's tokens: a head further out is less sure), and the best K x B nodes are proposed, all
from the one call of the heads. The runner hands over the state of the accepted path's last node.
"""

from __future__ import annotations

import torch

from quickdraft.models import medusa as head_file
from quickdraft.proposers.base import DraftProposal, register
from quickdraft.proposers.heads.common import resolve_dir, sample_rows, serving_head
from quickdraft.proposers.tree_drafts import DraftTreeState, EdgeCalibration, merged_proposal, top_children, tree_requests


@register("medusa")
class MedusaProposer:
    cost = None  # one call drafts every position, each a small block and a truncated head (Q8_0 on the CPU)
    reads_target = ()  # the final hidden state only

    def __init__(self, heads: "head_file.MedusaHeads", vocab_size: int, num_slots: int, device="cpu",
                 quantization: str | None = None, num_branches: int = 1):
        self.heads = serving_head(heads, quantization, device)
        self.vocab_size = vocab_size
        self.head_ids = None if heads.config.draft_vocab_size == vocab_size else self.heads.draft_ids
        self._last: list[torch.Tensor | None] = [None] * num_slots  # [H] the last committed row's state
        self.branches = num_branches
        self._trees: dict[int, DraftTreeState] = {}  # slot -> the tree proposed this step, for observe
        self.edge_scale = EdgeCalibration(levels=heads.config.num_heads)
        # trees this step (None: never; the runner turns them off while chains are measured faster)
        self.branching: bool | None = True if num_branches > 1 else None

    @classmethod
    def from_config(cls, spec, ctx) -> "MedusaProposer":
        if isinstance(spec.model, head_file.MedusaHeads):  # built in code (tests)
            heads, source = spec.model, "given"
        else:
            path = resolve_dir(spec, ctx.target, "medusa")
            heads, source = head_file.load(path), str(path)
        head_file.check_target(heads.config, ctx.target, source)
        return cls(heads, ctx.target.config.vocab_size, ctx.num_slots, ctx.device, spec.quantization, spec.num_branches)

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
        grow = tree_requests([seqs[i] for i in active], [num_tokens[i] for i in active], self.branching)
        chains = [r for r in range(len(active)) if r not in grow]
        sampled = any(not seqs[active[r]].params.greedy for r in chains)
        rows = [(r, j) for r in chains for j in range(min(num_tokens[active[r]], k))]  # sequence-major
        ids, q = torch.zeros(0, dtype=torch.long), None
        if rows:
            flat = logits[[r for r, _ in rows], [j for _, j in rows]]  # [num_draft_tokens, N]
            # each row drawn with its sequence's generator, in order (a sequence's K draws in a row)
            ids, q, _ = sample_rows([seqs[active[r]] for r, _ in rows], flat, self.head_ids, self.vocab_size, sampled)
        for r in chains:
            counts[active[r]] = min(num_tokens[active[r]], k)
        proposal = DraftProposal(ids.cpu().long(), counts, q)
        if not grow:
            return proposal
        return merged_proposal(proposal, {active[r]: self._tree(seqs[active[r]], logits[r], min(num_tokens[active[r]], k))
                                          for r in grow}, len(seqs))

    def _tree(self, seq, logits: torch.Tensor, depth: int) -> tuple[list[int], list[int], list[float]]:
        """logits [k, N] of the heads for one sequence -> its tree, ``depth`` deep (tokens, parents, values)."""
        levels = top_children(logits[:depth], self.branches, self.head_ids)  # each head's B likeliest
        size = depth * self.branches
        tree = DraftTreeState()
        tree.add_children(-1, levels[0], self.edge_scale)
        for d in range(1, depth):
            for node in tree.to_expand(d, self.branches, size, room=size):
                tree.add_children(node, levels[d], self.edge_scale)
        self._trees[seq.slot] = tree
        return tree.best(size)

    def observe(self, seqs, outcome) -> None:
        # the committed rows' states arrive through read_target; a tree's path calibrates the heads
        for s, accepted, tokens in zip(seqs, outcome.num_accepted, outcome.token_ids):
            tree = self._trees.pop(s.slot, None)
            if tree is not None:
                self.edge_scale.record(tree, tree.walk(list(tokens), accepted), list(tokens))

    def catchup_rows(self, seq) -> int:
        return 0

    def reuse(self, seq, source, num_tokens) -> int:
        self.release(seq)  # the heads read only the last row's state, which the prompt pass recomputes
        return num_tokens

    def release(self, seq) -> None:
        self._last[seq.slot] = None
        self._trees.pop(seq.slot, None)

    def close(self) -> None:
        pass
