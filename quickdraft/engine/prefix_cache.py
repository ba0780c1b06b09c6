"""Prefix caching: a new prompt starts from the longest prefix it shares with what a KV slot holds.

The field shares KV between requests in two ways, both through an indirection that the attention
kernel reads:

- vLLM (``vllm/v1/core/kv_cache_manager.py``, ``block_pool.py``): the cache is paged; a full block
  of tokens is named by a hash of its tokens and of its parent block's hash, a request's block table
  points at shared physical blocks (reference-counted), and unreferenced blocks leave LRU-first.
- SGLang (``radix_cache.py``): a radix tree over token ids whose nodes own token-level indices into
  a KV pool; a lookup walks the tree, and leaves leave LRU-first when the pool runs low.

quickdraft's cache has no indirection: a sequence's keys are one contiguous row of its *slot*
(kv_cache.py), which the hand-written attention kernels read directly. So the unit cached here is
the slot. A slot keeps what its last sequence committed after that sequence ends; the index is each
slot's token list (a running sequence's slot: its committed tokens, growing). A lookup compares the
prompt with at most ``num_slots`` lists in numpy, the radix tree's job without the tree: there are
at most ``num_slots`` paths and they share no memory, so a tree would save nothing. Where the best
prefix sits in a free slot, the new sequence takes that slot and the prefix costs nothing; where it
sits in a running sequence's slot (a system prompt shared by concurrent requests), its rows are
copied into a free slot, one copy a layer, far cheaper than computing them again.

*Memory pressure* is slots: cached prefixes live only in free slots, in memory the engine has
allocated anyway. A sequence that needs a slot and shares nothing with the free ones takes the least
recently used one, whose prefix is then *evicted* (vLLM's and SGLang's LRU rule, at slot grain).

*Correct with speculation*: a slot's index holds only committed tokens
(``token_ids[:num_cached]``). Rejected drafts' keys lie past the committed length and are never
indexed; a token tree's accepted path is moved into place before it is committed
(``KVCache.keep_path``). A reused prefix is at most the prompt less its last token, so every prompt
has a pass that computes the logits of its first output token, as without the cache.

This module is CPU bookkeeping only (the scheduler calls it; the engine does the copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from quickdraft.engine.sequence import Sequence

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Placement:
    """Where an admitted sequence goes: ``slot``; and the first ``num_tokens`` tokens of its prompt,
    whose keys and values slot ``source`` holds (``source == slot``: in place, nothing to copy)."""

    slot: int
    source: int
    num_tokens: int


@dataclass
class PrefixStats:
    """Counted over admitted requests: prompt tokens looked up (``queries``), of those found cached
    (``hits``), of those copied from another slot (``copied``), and cached tokens given up when a slot
    was taken by a sequence that did not share them (``evicted``)."""

    queries: int = 0
    hits: int = 0
    copied: int = 0
    evicted: int = 0
    requests: int = 0
    requests_hit: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D int arrays."""
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixCache:
    """Which tokens each KV slot holds, and where a new prompt should go. ``enabled`` False: every
    sequence starts from nothing in the slot freed last (the engine's behaviour without a cache)."""

    def __init__(self, num_slots: int, enabled: bool = True):
        self.enabled = enabled
        self.stats = PrefixStats()
        self._held: list[np.ndarray] = [_EMPTY] * num_slots  # a free slot's committed tokens
        self._running: dict[int, "Sequence"] = {}  # slot -> the sequence decoding in it
        self._used = [0] * num_slots  # LRU clock: when a slot was last taken or released
        self._clock = 0

    def held(self, slot: int) -> np.ndarray:
        """The tokens whose keys and values ``slot`` holds now, committed ones only."""
        seq = self._running.get(slot)
        if seq is None:
            return self._held[slot]
        return np.asarray(seq.token_ids[: min(seq.num_cached, len(seq))], dtype=np.int64)

    def place(self, seq: "Sequence", free: list[int]) -> Placement:
        """Choose a free slot for ``seq`` (``free`` non-empty) and the prefix it reuses."""
        slot, source, n = self._choose(seq, free)
        if self.enabled:
            s = self.stats
            s.queries, s.hits, s.requests = s.queries + len(seq.prompt_token_ids), s.hits + n, s.requests + 1
            s.requests_hit += n > 0
            s.copied += n if source != slot else 0
            s.evicted += int(self._held[slot].shape[0]) - (n if source == slot else 0)
        self._held[slot] = _EMPTY
        self._running[slot] = seq
        self._clock += 1
        self._used[slot] = self._clock
        return Placement(slot, source, n)

    def shorten(self, placed: Placement, num_tokens: int) -> None:
        """The sequence placed by ``placed`` reuses only ``num_tokens`` of its prefix (the proposer
        needs the target's pass over the rest, Proposer.reuse): the stats count what was reused."""
        s, lost = self.stats, placed.num_tokens - num_tokens
        s.hits -= lost
        s.copied -= lost if placed.source != placed.slot else 0
        s.requests_hit -= num_tokens == 0

    def _choose(self, seq: "Sequence", free: list[int]) -> tuple[int, int, int]:
        """(slot, source, num_tokens). The source is the slot, free or running, holding the longest
        prefix of the prompt (a free one on ties). A free source whose held tokens are at least half
        that prefix is taken in place; otherwise the prefix is copied into an empty free slot if
        there is one, else into the least recently used (which may be the source: then in place)."""
        if not self.enabled:
            return free[-1], free[-1], 0
        lru = min(free, key=lambda s: self._used[s])
        # A request that asks for its prompt's logprobs needs every prompt row computed.
        if seq.params.prompt_logprobs is not None or len(seq.prompt_token_ids) < 2:
            return lru, lru, 0
        prompt = np.asarray(seq.prompt_token_ids[:-1], dtype=np.int64)  # the last prompt token is always fed
        source, n = lru, 0
        for slot in [*free, *self._running]:
            m = common_prefix(prompt, self.held(slot))
            if m > n:
                source, n = slot, m
        if source in self._running or 2 * n < int(self._held[source].shape[0]):
            empty = [s for s in free if self._held[s].shape[0] == 0]
            return (empty[-1] if empty else lru), source, n
        return source, source, n

    def release(self, seq: "Sequence", keep: bool = True) -> None:
        """``seq`` left its slot; with ``keep`` (it ended without an error) the slot keeps its
        committed tokens for the next prompt that shares them."""
        slot = seq.slot
        if self._running.get(slot) is not seq:
            return
        self._held[slot] = self.held(slot) if keep and self.enabled else _EMPTY
        del self._running[slot]
        self._clock += 1
        self._used[slot] = self._clock
