"""Method "suffix": SuffixDecoding (Oliaro et al. 2024, arXiv:2411.04975; Arctic Inference, vLLM's
``suffix`` method), written here from the paper's design.

Two suffix tries (proposers/lookup/suffix_tree.py) are read at every step:

- the sequence's own: its prompt and output, added token by token as the sequence grows
  (O(depth) a token; built from the prompt at the sequence's first draft);
- the *global* one (``SuffixCache``): the outputs of past requests, added when a request ends
  (``release``). It is shared by every request of the engine (and so of the server), bounded by
  ``suffix_decoding_max_cached_requests`` and ``suffix_decoding_max_cached_tokens`` (the oldest
  outputs leave first), and, with ``suffix_decoding_cache_path``, loaded at start and saved
  atomically at shutdown (``close``) and, while requests finish, at most every
  ``SAVE_INTERVAL_S`` seconds, so a restarted server keeps what it learned.

Each trie matches the longest suffix of the sequence (at most depth - K tokens, so that a
continuation of K tokens fits in a window) and follows the most frequent continuation while the
path's empirical probability stays at least ``suffix_decoding_min_token_prob``, for at most
min(K, ``suffix_decoding_max_spec_factor`` * match length) tokens: a longer match speculates
further. Of the two drafts the one with the larger expected accepted length (the sum of its path
probabilities) is proposed. The drafts are point masses, like ngram's, so the verifier's rule is
exact and the output is the target's; and they cost nothing beside a target pass (``cost`` None).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections import deque
from pathlib import Path

import torch

from quickdraft.errors import ConfigError
from quickdraft.proposers.base import DraftProposal, accepts_trees, register
from quickdraft.proposers.lookup.suffix_tree import DraftTree, SuffixTrie

log = logging.getLogger("quickdraft.proposers")

CACHE_FORMAT = "quickdraft-suffix-cache"
CACHE_VERSION = 1
SAVE_INTERVAL_S = 60.0  # at most this long between a finished request and the save that keeps it


class SuffixCache:
    """The global trie over past requests' outputs, in first-in first-out order: adding an output
    that takes the cache past ``max_requests`` outputs or ``max_tokens`` tokens removes the oldest
    until both hold (an output longer than ``max_tokens`` keeps its last ``max_tokens``).
    ``max_requests`` 0: no global cache. Memory: O(depth * max_tokens) nodes at worst."""

    def __init__(self, depth: int, max_requests: int, max_tokens: int):
        self.trie = SuffixTrie(depth)
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.outputs: deque[list[int]] = deque()
        self.num_tokens = 0

    def add(self, tokens: list[int]) -> None:
        if self.max_requests == 0 or self.max_tokens == 0 or not tokens:
            return
        tokens = list(tokens[-self.max_tokens :])
        self.trie.insert(tokens)
        self.outputs.append(tokens)
        self.num_tokens += len(tokens)
        while len(self.outputs) > self.max_requests or self.num_tokens > self.max_tokens:
            old = self.outputs.popleft()
            self.trie.remove(old)
            self.num_tokens -= len(old)

    # -- persistence --------------------------------------------------------------------------
    def save(self, path: Path, vocab_size: int) -> None:
        """Write the outputs (the trie is rebuilt from them on load) to a temporary file beside
        ``path`` and rename it over ``path``: a reader sees the old file or the new one, never half."""
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "vocab_size": vocab_size,
                "outputs": list(self.outputs)}
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load(self, path: Path, vocab_size: int) -> None:
        """Add the outputs saved at ``path``, oldest first. A missing file is an empty cache; one
        that is damaged or from another vocabulary is left unread with a warning (it is only a
        cache: the next save replaces it)."""
        if path.is_dir():
            raise ConfigError(f"suffix_decoding_cache_path {str(path)!r} is a directory; give a file",
                              "suffix_decoding_cache_path")
        if not path.exists():
            return
        try:
            data = json.loads(path.read_text())
            if data.get("format") != CACHE_FORMAT or data.get("version") != CACHE_VERSION:
                raise ValueError(f"not a {CACHE_FORMAT} file of version {CACHE_VERSION}")
            if data.get("vocab_size") != vocab_size:
                raise ValueError(f"saved for a vocabulary of {data.get('vocab_size')} tokens, this model has {vocab_size}")
            outputs = data["outputs"]
            if not all(isinstance(o, list) and all(type(t) is int and 0 <= t < vocab_size for t in o) for o in outputs):
                raise ValueError("its outputs are not lists of token ids")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("suffix cache %s not loaded (%s): starting empty", path, e)
            return
        for tokens in outputs:
            self.add(tokens)


class _Stream:
    """One sequence's own trie and where its windows stand."""

    __slots__ = ("seq", "trie", "open", "seen")

    def __init__(self, seq, depth: int):
        self.seq, self.trie, self.open, self.seen = seq, SuffixTrie(depth), [], 0

    def catch_up(self) -> list[int]:
        """Add the tokens the sequence gained since the last call; returns its whole text."""
        tokens = self.seq.token_ids
        if len(tokens) > self.seen:
            self.open = self.trie.extend(tokens[self.seen :], self.open)
            self.seen = len(tokens)
        return tokens


@register("suffix")
class SuffixProposer:
    cost = None  # a few dictionary walks in Python: next to nothing beside a target pass

    def __init__(self, depth: int = 24, max_spec_factor: float = 1.0, min_prob: float = 0.1,
                 max_cached_requests: int = 10000, max_cached_tokens: int = 100_000,
                 cache_path: str | None = None, vocab_size: int = 0, branches: int = 1):
        self.depth, self.max_spec_factor, self.min_prob = depth, max_spec_factor, min_prob
        self.branches = branches  # children a node of the draft tree may have; 1: chains
        self.cache = SuffixCache(depth, max_cached_requests, max_cached_tokens)
        self.cache_path = Path(cache_path) if cache_path else None
        self.vocab_size = vocab_size
        self._streams: dict[int, _Stream] = {}  # slot -> the sequence's own trie
        self._dirty, self._saved_at = False, time.monotonic()
        if self.cache_path is not None:
            self.cache.load(self.cache_path, vocab_size)

    @classmethod
    def from_config(cls, spec, ctx) -> "SuffixProposer":
        return cls(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_spec_factor,
                   spec.suffix_decoding_min_token_prob, spec.suffix_decoding_max_cached_requests,
                   spec.suffix_decoding_max_cached_tokens, spec.suffix_decoding_cache_path,
                   ctx.target.config.vocab_size, spec.num_branches)

    def propose(self, seqs, num_tokens) -> DraftProposal:
        """Chains, or with ``num_branches`` > 1 trees valued by their paths' empirical probability
        (never above a parent's), which the runner may trim to the rows that pay (engine/plan.py, plan_tree_sizes)."""
        drafts, parents, values = [], [], []
        for s, k in zip(seqs, num_tokens):
            if k > 0 and self.branches > 1 and accepts_trees(s.params):
                tree = self.draft_tree(s, k, width=self.branches)  # best-first: parents before children
                drafts.append(tree.tokens)
                branched = tree.parents != list(range(-1, len(tree.parents) - 1))
                parents.append(tree.parents if branched else None)
                values.append(list(tree.probs) if branched else None)
            else:
                drafts.append(self.draft_tree(s, k).chain() if k > 0 else [])
                parents.append(None)
                values.append(None)
        flat = [t for d in drafts for t in d]
        trees = any(p is not None for p in parents)
        return DraftProposal(torch.tensor(flat, dtype=torch.long), [len(d) for d in drafts], None,
                             parents if trees else None, values if trees else None)

    def draft_tree(self, seq, k: int, width: int = 1) -> DraftTree:
        """The better of the two tries' candidate trees for ``seq`` (up to ``k`` nodes), by expected
        accepted length; a tie goes to the longer match, then to the sequence's own trie."""
        tokens = self._stream(seq).catch_up()
        max_match = max(1, self.depth - k)  # leave room in the window for k tokens more
        context = tokens[-max_match:]
        trees = [trie.draft_tree(context, max_match, k, self.min_prob, width, self.max_spec_factor)
                 for trie in (self._streams[seq.slot].trie, self.cache.trie)]
        return max(trees, key=lambda t: (t.score, t.match_length))  # max keeps the first of equals

    def _stream(self, seq) -> _Stream:
        stream = self._streams.get(seq.slot)
        if stream is None or stream.seq is not seq:  # a new sequence in this slot
            stream = self._streams[seq.slot] = _Stream(seq, self.depth)
        return stream

    def observe(self, seqs, outcome) -> None:
        pass  # the tries follow the sequences' growth at the next propose (_Stream.catch_up)

    def catchup_rows(self, seq) -> int:
        return 0

    def reuse(self, seq, source, num_tokens) -> int:
        return num_tokens  # no KV: its state is read from the sequence's tokens

    def release(self, seq) -> None:
        stream = self._streams.get(seq.slot)
        if stream is not None and stream.seq is seq:
            del self._streams[seq.slot]
        if seq.output_token_ids:
            self.cache.add(seq.output_token_ids)
            self._dirty = True
            if self.cache_path is not None and time.monotonic() - self._saved_at >= SAVE_INTERVAL_S:
                self.save()

    def save(self) -> None:
        """Write the global cache to ``cache_path`` now, if it has changed since the last save."""
        if self.cache_path is not None and self._dirty:
            self.cache.save(self.cache_path, self.vocab_size)
        self._dirty, self._saved_at = False, time.monotonic()

    def close(self) -> None:
        self.save()

