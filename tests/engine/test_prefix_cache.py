"""Prefix caching (engine/prefix_cache.py): which slot a prompt takes and what it reuses, unit by unit
without a model; then on SmolLM2's real weights, that outputs (and every speculative counter) are the
same with the cache on and off: plain greedy decoding, ngram and suffix (greedy), a draft model
(seeded sampling) and a truncated-head draft (greedy), over chat turns, a prefix shared by concurrent
requests, and eviction."""

from __future__ import annotations

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.engine.prefix_cache import PrefixCache, common_prefix
from quickdraft.engine.scheduler import Scheduler
from quickdraft.engine.sequence import Sequence
from quickdraft.models.loader import load_model
from quickdraft.sampling import make_generator

import numpy as np
import torch


def seq(prompt, output=(), num_cached=None, **params) -> Sequence:
    s = Sequence(f"r{id(prompt)}", list(prompt), SamplingParams(**params), make_generator(None, "cpu"))
    s.output_token_ids = list(output)
    s.num_cached = len(s) - 1 if num_cached is None else num_cached
    return s


def admit(cache: PrefixCache, s: Sequence, free: list[int]):
    placed = cache.place(s, free)
    free.remove(placed.slot)
    s.slot, s.num_cached = placed.slot, placed.num_tokens
    return placed


def finish(cache: PrefixCache, s: Sequence, free: list[int], output=(), keep=True) -> None:
    s.output_token_ids = list(output)
    s.num_cached = len(s) - 1  # the last emitted token is never fed
    cache.release(s, keep=keep)
    free.append(s.slot)


def test_common_prefix():
    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, np.array([1, 2, 9])) == 2
    assert common_prefix(a, np.array([1, 2])) == 2
    assert common_prefix(a, np.zeros(0, dtype=np.int64)) == 0
    assert common_prefix(a, a) == 4


def test_next_turn_reuses_its_slot_in_place_and_never_its_last_prompt_token():
    cache, free = PrefixCache(2), [1, 0]
    a = seq(range(10))
    assert admit(cache, a, free).num_tokens == 0
    finish(cache, a, free, output=[10, 11, 12])  # the slot holds tokens 0..11 (12 was never fed)
    nxt = seq(list(range(13)) + [50, 51])
    placed = admit(cache, nxt, free)
    assert (placed.slot, placed.source, placed.num_tokens) == (a.slot, a.slot, 12)
    again = seq(range(12))  # the whole prompt is cached: its last token is fed all the same
    other = PrefixCache(1)
    other._held[0] = np.arange(20)
    assert other.place(again, [0]).num_tokens == 11
    assert cache.stats.hits == 12 and cache.stats.requests_hit == 1 and cache.stats.queries == 10 + 15


def test_a_running_sequences_prefix_is_copied_into_an_empty_slot():
    cache, free = PrefixCache(3), [2, 1, 0]
    a = seq(list(range(100, 120)))
    admit(cache, a, free)
    a.num_cached = 20  # its prompt pass ran
    a.output_token_ids = [7]
    b = seq(list(range(100, 112)) + [1, 2, 3])
    placed = admit(cache, b, free)
    assert placed.source == a.slot and placed.slot != a.slot and placed.num_tokens == 12
    assert cache.stats.copied == 12
    # a third request reads the second's slot as it will be after the copy: 12 tokens, no more
    c = seq(list(range(100, 120)) + [5])
    assert admit(cache, c, free).source == a.slot  # a's 20 committed tokens beat b's 12


def test_least_recently_used_prefix_is_evicted_and_errors_are_not_kept():
    cache, free = PrefixCache(2), [1, 0]
    a, b = seq([1] * 8), seq([2] * 8)
    admit(cache, a, free), admit(cache, b, free)
    finish(cache, a, free, output=[3, 3])
    finish(cache, b, free, output=[4, 4])
    c = seq([9] * 8)  # shares nothing: takes a's slot, the least recently used
    assert admit(cache, c, free).slot == a.slot and cache.stats.evicted == 9
    finish(cache, c, free, output=[5], keep=False)  # an error: the slot keeps nothing
    assert admit(cache, seq([2] * 8 + [4, 4, 6]), free).num_tokens == 9  # b's turn 2: cached
    assert admit(cache, seq([1] * 8 + [3, 3, 6]), free).num_tokens == 0  # a's turn 2: evicted


def test_a_long_prefix_is_not_given_up_for_a_short_shared_one():
    """A free slot holding a long conversation that shares only a system prompt with the new one
    lends it by copy; the conversation stays for its own next turn."""
    cache, free = PrefixCache(2), [1, 0]
    a = seq(list(range(40)))
    admit(cache, a, free)
    finish(cache, a, free, output=list(range(40, 60)))
    b = seq(list(range(5)) + [99] * 5)
    placed = admit(cache, b, free)
    assert placed.source == a.slot and placed.slot != a.slot and placed.num_tokens == 5
    assert cache.held(a.slot).shape[0] == 59


def test_prompt_logprobs_and_a_disabled_cache_reuse_nothing():
    cache, free = PrefixCache(2), [1, 0]
    a = seq(range(10))
    admit(cache, a, free)
    finish(cache, a, free, output=[10])
    assert admit(cache, seq(range(12), prompt_logprobs=1), free).num_tokens == 0
    off, free = PrefixCache(2, enabled=False), [1, 0]
    a = seq(range(10))
    assert admit(off, a, free).slot == 0  # the slot popped last, as without a cache
    finish(off, a, free, output=[10])
    assert admit(off, seq(range(12)), free).num_tokens == 0 and off.stats.queries == 0


def test_scheduler_sets_the_cached_length_and_hands_the_copies_over():
    sched = Scheduler(2, 4, PrefixCache(2))
    a = seq(range(10), num_cached=0)
    sched.add(a)
    sched.schedule()
    [(s, p)] = sched.take_placements()
    assert s is a and p.num_tokens == 0 and not sched.take_placements()
    a.num_cached = 10
    b = seq(list(range(6)) + [42], num_cached=0)
    sched.add(b)
    sched.schedule()
    [(s, p)] = sched.take_placements()
    assert s is b and b.num_cached == b.num_reused == 6 and p.source == a.slot != p.slot


# -- on real weights ------------------------------------------------------------------------

SYSTEM = ("You are a careful assistant. Answer in one short sentence. Prefer plain words. "
          "Never use lists. Always name one concrete example.")
QUESTIONS = ["What is a prime number?", "Why is the sky blue?", "What does a compiler do?"]


@pytest.fixture(scope="module")
def model(smollm2_path):
    return load_model(str(smollm2_path), torch.bfloat16)


def chats(llm: LLM, params: SamplingParams, questions=QUESTIONS[:2]):
    """Two turns of each conversation, the conversations batched; all outputs in order."""
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions]
    first = llm.chat(convs, params)
    convs = [c + [{"role": "assistant", "content": o.text}, {"role": "user", "content": "Say it again, shorter."}]
             for c, o in zip(convs, first)]
    return first + llm.chat(convs, params)


def counters(o) -> tuple:
    s = o.spec
    return s.num_target_passes, s.num_draft_tokens, s.num_accepted_tokens, tuple(s.accepted_per_position)


@pytest.mark.parametrize("spec, temperature", [
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}, 0.0),
    # sampled, through the draft model's cache too. The draft is the target itself (q = p, bit for
    # bit): every draft token is accepted unless the draft's own cache is wrong, so the counters show
    # that the draft's reused keys are right (the output alone could not: it is lossless either way)
    ({"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False, "quantization": None}, 0.8),
    # a truncated draft head (the 8192 lowest ids, proposers/draft/vocab.py) reads the same cache
    ({"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False, "quantization": None,
      "draft_vocab_file": "ids"}, 0.0),
    ({"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}, 0.0),
])
def test_outputs_equal_with_the_cache_on_and_off(model, spec, temperature, tmp_path):
    if spec["method"] == "draft_model":
        spec = {**spec, "model": model}
    if spec.get("draft_vocab_file"):
        ids = tmp_path / "ids.json"
        ids.write_text(str(list(range(8192))))
        spec = {**spec, "draft_vocab_file": str(ids)}
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=3 if temperature else None)
    runs = {}
    for on in (False, True):
        llm = LLM(model, speculative_config=spec, max_num_seqs=2, max_model_len=256, enable_prefix_caching=on)
        outs = chats(llm, params)
        runs[on] = outs, llm.engine.prefix_cache.stats
    (off, _), (on, stats) = runs[False], runs[True]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [counters(o) for o in on] == [counters(o) for o in off]
    assert all(o.num_cached_tokens == 0 for o in off)
    # turn 1: nothing is cached yet (admitted together, neither has computed anything); turn 2:
    # each conversation reuses its own first turn, answer included
    assert on[0].num_cached_tokens == on[1].num_cached_tokens == 0
    assert all(o.num_cached_tokens > len(a.prompt_token_ids) for o, a in zip(on[2:], on[:2]))
    assert stats.hits == sum(o.num_cached_tokens for o in on)
    if spec["method"] == "draft_model" and not spec.get("draft_vocab_file"):
        assert sum(o.spec.num_accepted_tokens for o in on) == sum(o.spec.num_draft_tokens for o in on) > 0


def test_a_prefix_shared_under_continuous_batching(model):
    """Requests that arrive while another with the same system prompt decodes copy its prefix
    from its running slot; with speculation, their outputs are the cache-off ones."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = [
        model.tokenizer.encode(model.tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], add_generation_prompt=True))
        for q in QUESTIONS]
    results = {}
    for on in (False, True):
        engine = LLM(model, speculative_config=spec, max_num_seqs=3, max_model_len=256,
                     enable_prefix_caching=on).engine
        ids = [engine.add_request(prompts[0], params)]
        final = {}
        for step in range(40):
            if step == 2:  # the first is decoding now
                ids += [engine.add_request(p, params) for p in prompts[1:]]
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            if len(final) == 3:
                break
        results[on] = [final[i] for i in ids], engine.prefix_cache.stats
    (off, _), (on, stats) = results[False], results[True]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert stats.copied > 40 and all(o.num_cached_tokens > 20 for o in on[1:])


def test_evicted_prefixes_are_recomputed_correctly(model):
    """One slot: a second conversation takes it (evicting the first one's turn, but for the system
    prompt they share), then the first conversation's next turn recomputes what was evicted; outputs
    stay the cache-off ones."""
    params = SamplingParams(max_tokens=6, temperature=0)
    tok = model.tokenizer
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS[:2]]
    encode = lambda c: tok.encode(tok.apply_chat_template(c, add_generation_prompt=True))
    runs = {}
    for on in (False, True):
        llm = LLM(model, max_num_seqs=1, max_model_len=256, enable_prefix_caching=on)
        first = llm.generate([encode(c) for c in convs], params)  # one slot: the second evicts the first
        nxt = convs[0] + [{"role": "assistant", "content": first[0].text}, {"role": "user", "content": "Why?"}]
        runs[on] = first + llm.generate([encode(nxt)], params), llm.engine.prefix_cache.stats
    (off, _), (on, stats) = runs[False], runs[True]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    shared = on[1].num_cached_tokens  # the system prompt, found in the first conversation's slot
    assert shared > 20 and stats.evicted > 0
    assert on[2].num_cached_tokens == shared < len(on[0].prompt_token_ids)  # its own turn was evicted
