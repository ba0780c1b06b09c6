"""Which sequences run the next step: CPU bookkeeping only, unit-tested without a model.

Each running sequence holds one KV-cache slot of ``max_model_len`` positions, so a sequence that
was admitted can always finish: there is no preemption to do. What runs out is slots; requests then
wait first-come first-served in a bounded queue, and past ``max_queue`` a new request is refused
(the server answers 429) rather than left waiting without bound.

Which free slot a sequence takes is the prefix cache's choice (engine/prefix_cache.py): the one
that holds the longest prefix of its prompt, or a copy of it. The scheduler sets the sequence's
cached length; the engine copies the keys (``take_placements``) before the next pass.
"""

from __future__ import annotations

from collections import deque

from quickdraft.engine.prefix_cache import Placement, PrefixCache
from quickdraft.engine.sequence import Sequence, Status
from quickdraft.errors import QuickdraftError


class QueueFullError(QuickdraftError):
    status_code = 429
    error_type = "rate_limit_error"


class Scheduler:
    def __init__(self, num_slots: int, max_queue: int, prefix: PrefixCache | None = None):
        self.num_slots = num_slots
        self.prefix = prefix if prefix is not None else PrefixCache(num_slots, enabled=False)
        self._placed: list[tuple[Sequence, Placement]] = []  # admitted since the last take_placements
        self.max_queue = max_queue
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(num_slots - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        # A request that a free slot will take at the next ``schedule`` is not waiting for one:
        # only the rest count against ``max_queue`` (so max_queue=0 still admits up to num_slots).
        if len(self.waiting) >= self.max_queue + len(self._free_slots):
            raise QueueFullError(f"the request queue is full ({self.max_queue} waiting); retry later")
        self.waiting.append(seq)

    def schedule(self) -> list[Sequence]:
        """Admit waiting sequences into free slots (FIFO), then return everything running."""
        while self.waiting and self._free_slots:
            seq = self.waiting.popleft()
            placed = self.prefix.place(seq, self._free_slots)
            self._free_slots.remove(placed.slot)
            seq.slot, seq.num_cached, seq.num_reused = placed.slot, placed.num_tokens, placed.num_tokens
            self._placed.append((seq, placed))
            seq.status = Status.RUNNING
            self.running.append(seq)
        return list(self.running)

    def take_placements(self) -> list[tuple[Sequence, Placement]]:
        """The sequences admitted since the last call and where their prefixes come from, in
        admission order (a later one may copy from a slot an earlier one was copied into)."""
        placed, self._placed = self._placed, []
        return placed

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's slot at once; it keeps the sequence's
        committed tokens for the prefix cache unless the sequence ended in an error."""
        if seq in self.running:
            self.running.remove(seq)
            self.prefix.release(seq, keep=seq.finish_reason != "error")
            self._free_slots.append(seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running + list(self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
