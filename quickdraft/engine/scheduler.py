"""Which sequences run the next step: CPU bookkeeping only, unit-tested without a model.

Each running sequence holds one KV-cache slot of ``max_model_len`` positions, so a sequence that
was admitted can always finish: there is no preemption to do. What runs out is slots; requests then
wait first-come first-served in a bounded queue, and past ``max_queue`` a new request is refused
(the server answers 429) rather than left waiting without bound.
"""

from __future__ import annotations

from collections import deque

from quickdraft.engine.sequence import Sequence, Status
from quickdraft.errors import QuickdraftError


class QueueFullError(QuickdraftError):
    status_code = 429
    error_type = "rate_limit_error"


class Scheduler:
    def __init__(self, num_slots: int, max_queue: int):
        self.num_slots = num_slots
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
            seq.slot = self._free_slots.pop()
            seq.status = Status.RUNNING
            self.running.append(seq)
        return list(self.running)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's slot at once."""
        if seq in self.running:
            self.running.remove(seq)
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
