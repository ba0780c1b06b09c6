"""The scheduler without a model: admission into free slots, the slot budget, refusal past the
queue bound, first-come first-served order, and aborts of waiting and running sequences. Then the
same through ``Engine.abort_request`` on a tiny random model: an abort frees the slot at once."""

from __future__ import annotations

import pytest
import torch

from quickdraft.config import EngineConfig
from quickdraft.engine.engine import Engine
from quickdraft.engine.scheduler import QueueFullError, Scheduler
from quickdraft.engine.sequence import Sequence, Status
from quickdraft.models.loader import LoadedModel
from quickdraft.models.tiny import random_weights, tiny_config
from quickdraft.sampling import SamplingParams


def seq(i: int) -> Sequence:
    return Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), torch.Generator())


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def test_admission_fills_free_slots_in_arrival_order():
    s = Scheduler(num_slots=2, max_queue=4)
    for i in range(3):
        s.add(seq(i))
    running = s.schedule()
    assert ids(running) == ["r0", "r1"] and ids(s.waiting) == ["r2"]
    assert sorted(x.slot for x in running) == [0, 1]
    assert all(x.status == Status.RUNNING for x in running) and s.waiting[0].status == Status.WAITING
    assert s.num_free_slots == 0


def test_slot_budget_is_never_exceeded():
    s = Scheduler(num_slots=3, max_queue=10)
    for i in range(8):
        s.add(seq(i))
    for _ in range(5):
        running = s.schedule()
        assert len(running) <= 3
        assert len({x.slot for x in running}) == len(running)  # no slot shared
        s.finish(running[0])
    assert s.num_free_slots + len(s.running) == 3


def test_queue_refusal_past_max_queue():
    s = Scheduler(num_slots=2, max_queue=1)
    for i in range(3):  # two will take the free slots, one waits
        s.add(seq(i))
    with pytest.raises(QueueFullError) as e:
        s.add(seq(3))
    assert e.value.status_code == 429 and e.value.error_type == "rate_limit_error"
    s.schedule()
    with pytest.raises(QueueFullError):  # running 2, waiting 1: still full
        s.add(seq(4))
    s.finish(s.running[0])  # a slot frees: room for one more
    s.add(seq(5))
    with pytest.raises(QueueFullError):
        s.add(seq(6))


def test_max_queue_zero_admits_only_into_free_slots():
    s = Scheduler(num_slots=2, max_queue=0)
    s.add(seq(0))
    s.add(seq(1))
    with pytest.raises(QueueFullError):
        s.add(seq(2))
    assert ids(s.schedule()) == ["r0", "r1"] and not s.waiting


def test_fifo_fairness_oldest_waiting_gets_the_next_slot():
    s = Scheduler(num_slots=1, max_queue=10)
    for i in range(4):
        s.add(seq(i))
    order = []
    while s.has_unfinished():
        (running,) = s.schedule()
        order.append(running.request_id)
        if len(order) == 1:
            s.add(seq(9))  # a late arrival queues behind the earlier ones
        s.finish(running)
    assert order == ["r0", "r1", "r2", "r3", "r9"]


def test_abort_waiting_and_running():
    s = Scheduler(num_slots=1, max_queue=5)
    a, b, c = seq(0), seq(1), seq(2)
    for x in (a, b, c):
        s.add(x)
    s.schedule()
    s.finish(b)  # abort of a waiting sequence: it leaves the queue, no slot changes hands
    assert ids(s.waiting) == ["r2"] and s.num_free_slots == 0 and s.find("r1") is None
    s.finish(a)  # abort of a running one: its slot is free at once
    assert s.num_free_slots == 1 and not s.running
    s.finish(a)  # twice is harmless
    assert s.num_free_slots == 1
    assert ids(s.schedule()) == ["r2"] and s.running[0].slot == 0


def test_find_and_has_unfinished():
    s = Scheduler(num_slots=1, max_queue=2)
    assert not s.has_unfinished()
    s.add(seq(0))
    s.add(seq(1))
    s.schedule()
    assert s.find("r0").status == Status.RUNNING and s.find("r1").status == Status.WAITING
    assert s.find("nope") is None and s.has_unfinished()


CONFIG = tiny_config("llama", vocab_size=64, hidden_size=32, num_layers=1)
TINY = LoadedModel(CONFIG, random_weights(CONFIG, seed=0), None, "tiny")


def test_engine_abort_frees_the_slot_immediately():
    engine = Engine(EngineConfig(model="tiny", dtype="float32", max_num_seqs=2, max_queue=4), target=TINY)
    p = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    r0, r1, r2 = (engine.add_request([1, 2, 3], p) for _ in range(3))
    engine.step()
    assert engine.scheduler.num_free_slots == 0 and len(engine.scheduler.waiting) == 1
    out = engine.abort_request(r0)  # running
    assert out.finished and out.finish_reason == "abort"
    assert engine.scheduler.num_free_slots == 1
    assert engine.abort_request(r2).finish_reason == "abort"  # waiting
    assert not engine.scheduler.waiting and engine.abort_request("unknown") is None
    outs = engine.step()
    assert [o.request_id for o in outs] == [r1]
