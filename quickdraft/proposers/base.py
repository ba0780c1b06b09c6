"""The Proposer protocol and the registry that picks one by method name.

A proposer guesses up to K tokens for each running sequence (``propose``) and hears how many the
verifier kept (``observe``), like Hugging Face's ``CandidateGenerator`` (``get_candidates``,
``update_candidate_strategy``). The engine never asks which proposer it holds: a method is a name
in ``REGISTRY`` (a table of module paths, imported on demand) and a class with ``from_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from quickdraft.errors import ConfigError
from quickdraft.sampling import spread_probs
from quickdraft.verify.penalties import shapes_logits

if TYPE_CHECKING:
    from quickdraft.config import SpeculativeConfig
    from quickdraft.models.pass_cost import LinearCost
    from quickdraft.engine.sequence import Sequence
    from quickdraft.models.kv_cache import KVCache
    from quickdraft.models.decoder import Decoder
    from quickdraft.models.loader import LoadedModel
    from quickdraft.verify.rejection import VerifyOutput


@dataclass
class DraftProposal:
    token_ids: torch.Tensor  # [num_draft_tokens] int64, sequences' drafts concatenated
    num_tokens: list[int]  # [batch] draft tokens of each sequence (0 allowed)
    probs: torch.Tensor | None  # [num_draft_tokens, vocab] the draft's q; None = point-mass drafts
    # [batch] each sequence's draft tokens as a token tree: node i's parent (< i, or -1 for the
    # last committed token); None (for the batch or a sequence): a chain
    parents: list[list[int] | None] | None = None
    # [batch] each tree node's value: the proposer's estimate of the chance that the target accepts
    # it (its whole path), where the proposer has one (the draft model's trees); a node's value
    # never exceeds its parent's. None (for the batch or a sequence): no estimate, kept as proposed
    values: list[list[float] | None] | None = None
    # [vocab] int32 where probs is [num_draft_tokens, N] over a draft model's truncated head:
    # each vocabulary id's column of probs, -1 where q is 0 (sampling.head_columns). The CPU
    # kernels verify such rows as they are, where spreading them over the vocabulary took ~0.4 ms
    # a step; None: probs spans the vocabulary
    probs_columns: torch.Tensor | None = None

    def tree(self, i: int) -> list[int] | None:
        """Sequence i's parents when its drafts form a tree, else None."""
        return None if self.parents is None else self.parents[i]

    def trimmed(self, keep: list[int]) -> "DraftProposal":
        """Each valued tree cut to its ``keep[i]`` most valuable nodes (ties to the earlier node, so
        every kept node's parent is kept), in their order; other sequences as they are."""
        flat, counts, parents, values, rows, at = [], [], [], [], [], 0
        for i, k in enumerate(self.num_tokens):
            nodes = list(range(k))
            value = None if self.values is None else self.values[i]
            if value is not None and self.tree(i) is not None:
                nodes = most_valuable(value, keep[i])
            index = {n: j for j, n in enumerate(nodes)}
            flat += [at + n for n in nodes]
            counts.append(len(nodes))
            tree = self.tree(i)
            parents.append(None if tree is None else [index[tree[n]] if tree[n] >= 0 else -1 for n in nodes])
            values.append(None if value is None else [value[n] for n in nodes])
            at += k
        rows = torch.tensor(flat, dtype=torch.long)
        probs = None if self.probs is None else self.probs[rows.to(self.probs.device)]
        return DraftProposal(self.token_ids[rows], counts, probs, parents, values, self.probs_columns)

    def spread(self) -> "DraftProposal":
        """The proposal with probs over the whole vocabulary (itself where it already is): for
        every use but the chains' verification (trees, forced grammar tokens)."""
        if self.probs_columns is None:
            return self
        return DraftProposal(self.token_ids, self.num_tokens, spread_probs(self.probs, self.probs_columns), self.parents,
                             self.values)

    @classmethod
    def empty(cls, batch: int, device="cpu") -> "DraftProposal":
        return cls(torch.zeros(0, dtype=torch.long, device=device), [0] * batch, None)


@dataclass
class ProposerContext:
    """What a proposer may need from the engine to build itself; each takes only its part."""

    target: "LoadedModel"
    dtype: torch.dtype
    device: str
    num_slots: int  # KV-cache slots: sequences are identified by Sequence.slot
    max_model_len: int
    # name or path -> model in the engine's dtype, on the engine's device unless device= names
    # another (and requantize= as load_model's); a model handed to the engine loaded comes back as it is
    load_model: Callable[..., "LoadedModel"]
    # the target's decoder and KV cache, for a proposer that drafts with the target itself (layer_skip)
    decoder: "Decoder | None" = None
    kv: "KVCache | None" = None
    cuda_graphs: bool = True  # a draft decoder on CUDA replays graphs of its passes (models/decoder/graphs.py)


class Proposer(Protocol):
    # What one draft pass costs (models/pass_cost.py), for planning K; None: drafts are free to make.
    cost: "LinearCost | None"

    def propose(self, seqs: list["Sequence"], num_tokens: list[int]) -> DraftProposal:
        """At most ``num_tokens[i]`` draft tokens for each sequence (fewer is allowed)."""

    def observe(self, seqs: list["Sequence"], outcome: "VerifyOutput") -> None:
        """Called after verification, before the sequences grow by ``outcome.token_ids``."""

    def catchup_rows(self, seq: "Sequence") -> int:
        """Tokens the proposer must read for this sequence before its first draft token."""

    def reuse(self, seq: "Sequence", source: int, num_tokens: int) -> int:
        """``seq`` was just admitted to ``seq.slot``, and its first ``num_tokens`` prompt tokens are
        those whose keys slot ``source`` holds (the prefix cache, engine/prefix_cache.py; ``source``
        is ``seq.slot`` when reused in place, and ``num_tokens`` 0 on a miss). A proposer with its
        own KV cache keeps (or copies) what it holds of that prefix and forgets the rest of the slot.
        -> the prefix the sequence starts from: ``num_tokens``, or fewer where the proposer needs
        the target's pass over the prefix's last rows (eagle3 reads the target's states of every
        row); the engine then reuses only that many of the target's keys."""

    def release(self, seq: "Sequence") -> None:
        """The sequence finished or was aborted: drop its per-sequence state (a proposer's KV
        stays, for ``reuse``)."""

    def close(self) -> None:
        """The engine is shutting down: write what must outlive the process (suffix's cache)."""

    # Optional, for proposers with a model of their own (draft_model): ``read_prompt(seqs)``, called
    # in the step of each sequence's prompt pass, before the target's, to read the prompt tokens
    # it has not seen (engine._draft_reads_prompts).
    #
    # Optional, for proposers that draft from the target's own states (EAGLE-3, Medusa): a class
    # attribute ``reads_target`` = the target layers whose entering states it needs (an empty
    # tuple: the final hidden state only), and ``read_target(seqs, final, states)``, called after
    # each verification, before ``observe``, with each sequence's committed rows (runner._hand_states).


class BaseProposer:
    """The protocol's no-op defaults, for a proposer that keeps no state between steps (none,
    ngram): drafts cost nothing to plan with, it learns nothing from the verifier, reads no rows to
    catch up, holds no KV (so a reused prefix is reused whole), and has nothing to drop or write."""

    cost: "LinearCost | None" = None

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


def most_valuable(values: list[float], n: int) -> list[int]:
    """The indices of the ``n`` largest ``values``, ties to the earlier index, in index order: of a
    tree whose nodes come after their parents and are worth no more than them, a tree again."""
    return sorted(sorted(range(len(values)), key=lambda j: (-values[j], j))[:n])


def accepts_trees(params) -> bool:
    """Whether a request's drafts may form a token tree: the runner shapes logits (penalties,
    biases, a grammar's masks) and reads logprobs along chains only, so such requests draft chains."""
    return params.logprobs is None and params.structured is None and not shapes_logits(params)


# method name -> (module, class): an explicit table, so that this module imports no proposer and
# a method's module is imported only when an engine asks for it
REGISTRY: dict[str, tuple[str, str]] = {
    "none": ("quickdraft.proposers.none", "NoProposer"),
    "ngram": ("quickdraft.proposers.lookup.ngram", "NgramProposer"),
    "suffix": ("quickdraft.proposers.lookup.suffix", "SuffixProposer"),
    "draft_model": ("quickdraft.proposers.draft.model", "DraftModelProposer"),
    "eagle3": ("quickdraft.proposers.heads.eagle3", "Eagle3Proposer"),
    "medusa": ("quickdraft.proposers.heads.medusa", "MedusaProposer"),
    "layer_skip": ("quickdraft.proposers.draft.layer_skip", "LayerSkipProposer"),
}


def register(name: str):
    """Marks a proposer class as REGISTRY's ``name`` (its ``method``); the table says where it lives."""
    def wrap(cls):
        if REGISTRY.get(name) != (cls.__module__, cls.__name__):
            raise ValueError(f"proposer {name!r}: add {cls.__module__}.{cls.__name__} to proposers/base.py's REGISTRY")
        cls.method = name
        return cls

    return wrap


def proposer_class(method: str) -> type:
    """The class of ``method``, its module imported now."""
    import importlib

    if method not in REGISTRY:
        raise ConfigError(f"unknown speculative method {method!r}; valid: {', '.join(sorted(REGISTRY))}")
    module, name = REGISTRY[method]
    return getattr(importlib.import_module(module), name)


def create_proposer(spec: "SpeculativeConfig", ctx: ProposerContext) -> Proposer:
    return proposer_class(spec.method).from_config(spec, ctx)
