"""End to end on a tiny random model, float32: speculative greedy output equals plain greedy output
token for token, with a draft that always agrees, one that never agrees, and one in between; for
single requests and for ragged batches. Exact equality, no tolerance: the decoder is batch
invariant (models/decoder/), so a verification pass rounds exactly like single-token passes."""

from __future__ import annotations


import pytest

from quickdraft.config import EngineConfig, SpeculativeConfig
from quickdraft.engine.engine import Engine
from quickdraft.engine.plan import TRUSTED_PASSES
from quickdraft.errors import ConfigError
from quickdraft.models.loader import LoadedModel
from quickdraft.models.pass_cost import LinearCost
from quickdraft.models.tiny import never_agreeing, perturbed, random_weights, tiny_config
from quickdraft.sampling import SamplingParams

CONFIG = tiny_config("qwen2", vocab_size=96, hidden_size=64, num_layers=2)
TARGET = LoadedModel(CONFIG, random_weights(CONFIG, seed=1, scale=2.0), None, "tiny-target")
PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 42, 43, 44, 45, 46, 47, 1, 2, 3], [7]]


DRAFTS = {"always": TARGET, "never": never_agreeing(TARGET), "between": perturbed(TARGET, 0.6, seed=3)}


class FrozenCost(LinearCost):
    """Costs that timings do not move: what the plan sees on a CPU where a row costs 1% of a pass."""

    def __init__(self, a=0.1, b=0.001):
        super().__init__([(1, a + b), (33, a + 33 * b)])

    def observe(self, *args):
        pass

    def observed(self, min_rows: int = 1) -> int:
        return TRUSTED_PASSES  # known costs: the plan is trusted from the start


def run(spec: dict | None, prompts, params, max_num_seqs=4, costs: tuple | None = None):
    """Speculation with a fixed K unless ``spec`` asks for the adaptive plan: the tests of the
    verifier's path must not depend on how fast this machine is today (the plan reads timings)."""
    if spec is not None:
        spec = {"adaptive": False, **spec}
    config = EngineConfig(model="tiny", dtype="float32", max_num_seqs=max_num_seqs,
                          speculative=SpeculativeConfig.parse(spec))
    engine = Engine(config, target=TARGET)
    if costs is not None:  # (target, draft)
        engine.runner.target_cost, engine.proposer.cost = costs
    outs = engine.generate_ids(prompts, params)
    return outs, engine.stats


@pytest.fixture(scope="module")
def plain():
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    return [o.token_ids for o in run(None, PROMPTS, params)[0]]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("kind", ["always", "never", "between"])
def test_draft_model_greedy_equals_plain(plain, kind, k):
    spec = {"method": "draft_model", "model": DRAFTS[kind], "num_speculative_tokens": k}
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    outs, stats = run(spec, PROMPTS, params)
    assert [o.token_ids for o in outs] == plain
    rate = stats.acceptance_rate
    if kind == "always":
        assert rate == 1.0
        # every decoding pass but those near max_tokens emits K + 1 tokens
        assert stats.mean_accepted_length > 1 + 0.6 * k
    elif kind == "never":
        assert stats.num_accepted_tokens == 0 and stats.num_draft_tokens > 0
    else:
        assert 0.0 < rate < 1.0


def test_batch_composition_changes_nothing(plain):
    """Each prompt alone, and all together with other lengths and limits, give the same tokens."""
    alone = [run(None, [p], [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)])[0][0].token_ids
             for p in PROMPTS]
    assert alone == plain
    spec = {"method": "draft_model", "model": DRAFTS["between"], "num_speculative_tokens": 4}
    mixed = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (24, 9, 17)]
    outs, _ = run(spec, PROMPTS, mixed, max_num_seqs=2)  # 3 prompts through 2 slots: one waits
    assert [o.token_ids for o in outs] == [plain[0], plain[1][:9], plain[2][:17]]


@pytest.mark.parametrize("threshold", [0.8, 0.95])
def test_confidence_cutoff_changes_only_the_speed(plain, threshold):
    spec = {"method": "draft_model", "model": DRAFTS["between"], "num_speculative_tokens": 6,
            "draft_confidence_threshold": threshold}
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    outs, stats = run(spec, PROMPTS, params)
    assert [o.token_ids for o in outs] == plain
    full, _ = run({**spec, "draft_confidence_threshold": 0.0}, PROMPTS, params)
    assert stats.num_draft_tokens < sum(o.spec.num_draft_tokens for o in full)  # drafts were cut short


def test_failing_drafts_stop_being_proposed(plain):
    """With a draft that is never right, a sequence soon stops speculating (and probes now and
    then); the output is unchanged."""
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    spec = {"method": "draft_model", "model": DRAFTS["never"], "num_speculative_tokens": 3}
    adaptive, stats = run({**spec, "adaptive": True}, PROMPTS, params, costs=(FrozenCost(), FrozenCost(0.01)))
    always, always_stats = run(spec, PROMPTS, params)
    assert [o.token_ids for o in adaptive] == [o.token_ids for o in always] == plain
    assert 0 < stats.num_draft_tokens < always_stats.num_draft_tokens / 4


def test_good_drafts_are_verified_in_full_while_rows_are_cheap(plain):
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    spec = {"method": "draft_model", "model": DRAFTS["always"], "num_speculative_tokens": 3, "adaptive": True,
            "draft_confidence_threshold": 0.0}
    outs, stats = run(spec, PROMPTS, params, costs=(FrozenCost(), FrozenCost(0.01)))
    assert [o.token_ids for o in outs] == plain
    _, fixed = run({**spec, "adaptive": False}, PROMPTS, params)
    # all but the first drafts, planned before any was seen, are full length
    assert stats.num_draft_tokens >= 0.9 * fixed.num_draft_tokens and stats.acceptance_rate == 1.0


def test_dear_rows_turn_speculation_off(plain):
    """When a verified row costs half a pass and a draft pass as much as the target's, no draft pays.
    (Prompts of several tokens: a one-token prompt decodes in its first step, beside the others'
    prompt rows, and a draft there may pay for itself within that dear step.)"""
    prompts = PROMPTS[:2]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(prompts)
    spec = {"method": "draft_model", "model": DRAFTS["always"], "num_speculative_tokens": 3, "adaptive": True}
    outs, stats = run(spec, prompts, params, costs=(FrozenCost(0.1, 0.05), FrozenCost(0.1, 0.05)))
    assert [o.token_ids for o in outs] == plain[:2]
    assert stats.num_draft_tokens == 0


def test_a_calibration_that_prices_drafts_out_is_probed_and_corrected(plain):
    """A draft calibrated at 10 s a pass (a busy machine's timing, kept in the cache) would never
    draft, and so never be timed again; until the refit has timed enough passes, a due probe drafts
    its cap anyway, and the timings it brings pull the draft's cost down."""
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    spec = {"method": "draft_model", "model": DRAFTS["always"], "num_speculative_tokens": 3, "adaptive": True,
            "probe_interval": 4}
    poisoned = LinearCost([(1, 10.0), (33, 10.0)])
    config = EngineConfig(model="tiny", dtype="float32", max_num_seqs=4, speculative=SpeculativeConfig.parse(spec))
    engine = Engine(config, target=TARGET)
    engine.proposer.cost = poisoned
    outs = engine.generate_ids(PROMPTS, params)
    assert [o.token_ids for o in outs] == plain
    assert engine.stats.num_draft_tokens > 0 and poisoned.observed() > 0
    assert poisoned(1) < 10.0 * 0.9  # the timed passes (milliseconds) moved the fit


def test_ngram_greedy_equals_plain(plain):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    outs, stats = run(spec, PROMPTS, params)
    assert [o.token_ids for o in outs] == plain
    assert stats.num_draft_tokens > 0


def test_suffix_greedy_equals_plain(plain):
    """Its own text first (tiny random models repeat themselves), then, run again on one engine,
    the first run's outputs from the global cache: the second run drafts more and keeps more."""
    spec = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0}
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    config = EngineConfig(model="tiny", dtype="float32", max_num_seqs=2,  # 3 prompts through 2 slots
                          speculative=SpeculativeConfig.parse({"adaptive": False, **spec}))
    engine = Engine(config, target=TARGET)
    first = engine.generate_ids(PROMPTS, params)
    assert [o.token_ids for o in first] == plain
    second = engine.generate_ids(PROMPTS, params)
    assert [o.token_ids for o in second] == plain
    accepted = [sum(o.spec.num_accepted_tokens for o in outs) for outs in (first, second)]
    assert accepted[1] > accepted[0] and accepted[1] > 0.5 * sum(len(o.token_ids) for o in second)
    assert engine.proposer.cache.num_tokens == 2 * 3 * 24


@pytest.mark.parametrize("spec", [None, {"method": "draft_model", "model": DRAFTS["between"], "num_speculative_tokens": 3},
                                  {"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "suffix", "num_speculative_tokens": 3}])
def test_seeded_sampling_is_reproducible(spec):
    params = [SamplingParams(max_tokens=20, temperature=4.0, top_p=0.95, seed=s) for s in (1, 2, 1)]
    a = [o.token_ids for o in run(spec, PROMPTS[:1] * 3, params)[0]]
    b = [o.token_ids for o in run(spec, PROMPTS[:1] * 3, params)[0]]
    assert a == b
    assert a[0] == a[2]  # same seed, same tokens, whatever else is in the batch
    assert a[0] != a[1]


def test_stats_count_passes_and_positions():
    spec = {"method": "draft_model", "model": DRAFTS["always"], "num_speculative_tokens": 3}
    outs, stats = run(spec, [PROMPTS[0]], [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)])
    s = outs[0].spec
    # prompt pass emits 1 token; then passes of K + 1 = 4 tokens: 1 + 4 + 4 = 9 tokens in 3 passes
    assert (s.num_target_passes, s.num_draft_tokens, s.num_accepted_tokens) == (3, 6, 6)
    assert s.accepted_per_position == [2, 2, 2] and s.drafts_per_position == [2, 2, 2]
    assert s.mean_accepted_length == 3.0


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_request_caps_its_own_speculation(plain, adaptive):
    """``SamplingParams.num_speculative_tokens``: 0 turns speculation off for that request alone, a
    smaller cap bounds its drafts a step, a larger one is capped at the engine's K; the other
    requests of the batch draft as before, and every output is plain decoding's."""
    caps = [0, 1, 9]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, num_speculative_tokens=k) for k in caps]
    spec = {"method": "draft_model", "model": DRAFTS["always"], "num_speculative_tokens": 3, "adaptive": adaptive,
            "draft_confidence_threshold": 0.0}
    outs, _ = run(spec, PROMPTS, params, costs=(FrozenCost(), FrozenCost(0.01)) if adaptive else None)
    assert [o.token_ids for o in outs] == plain
    assert outs[0].spec.num_draft_tokens == 0 and outs[0].spec.num_target_passes == 24
    assert outs[1].spec.num_draft_tokens > 0 and len(outs[1].spec.drafts_per_position) == 1
    assert len(outs[2].spec.drafts_per_position) == 3  # 9 asked, the engine's 3 given
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)


def test_logprobs_are_plain_decodings():
    """Each output token's log-probability comes from the row that verified it and each prompt
    token's from the prompt's pass: with speculation they are plain decoding's, bit for bit, in a
    ragged batch."""
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)] * len(PROMPTS)
    base, _ = run(None, PROMPTS, params)
    spec, stats = run({"method": "draft_model", "model": DRAFTS["between"], "num_speculative_tokens": 3}, PROMPTS, params)
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # drafts both accepted and rejected
    for prompt, a, b in zip(PROMPTS, base, spec):
        assert a.token_ids == b.token_ids and [t.token_id for t in a.logprobs] == a.token_ids
        assert [(t.logprob, t.top) for t in a.logprobs] == [(t.logprob, t.top) for t in b.logprobs]
        assert all(len(t.top) == 2 and t.top[0][1] >= t.logprob for t in b.logprobs)
        assert a.prompt_logprobs[0] is None and [t.token_id for t in a.prompt_logprobs[1:]] == prompt[1:]
        assert [(t.logprob, t.top) for t in a.prompt_logprobs[1:]] == [(t.logprob, t.top) for t in b.prompt_logprobs[1:]]
    plain = run(None, PROMPTS[:1], [SamplingParams(max_tokens=4, temperature=0)])[0][0]
    assert plain.logprobs is None and plain.prompt_logprobs is None


@pytest.mark.parametrize("kind", ["always", "never", "between"])
def test_penalties_and_bias_under_speculation_equal_plain(kind):
    """Frequency, presence and repetition penalties and a logit bias change the output; with
    speculation (each verified row shaped by the drafts before it) it is plain decoding's."""
    shaped = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.4,
                            repetition_penalty=1.3, logit_bias={5: 2.0, 17: -3.0})
    params = [shaped] * len(PROMPTS)
    base = [o.token_ids for o in run(None, PROMPTS, params)[0]]
    unshaped = [o.token_ids for o in run(None, PROMPTS, [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * 3)[0]]
    assert base != unshaped  # the rules do something here
    spec = {"method": "draft_model", "model": DRAFTS[kind], "num_speculative_tokens": 3}
    outs, stats = run(spec, PROMPTS, params)
    assert [o.token_ids for o in outs] == base and stats.num_draft_tokens > 0


def test_a_batch_size_the_switch_turned_off_decodes_plainly_and_reads_no_prompts(plain):
    """Where the speculation switch (engine/plan.py) has measured speculating losing at a batch size,
    steps of that size draft nothing and the draft reads no prompt; steps of a smaller batch still
    draft, and the output is the plain output either way."""
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    spec = {"method": "draft_model", "model": DRAFTS["always"], "num_speculative_tokens": 3, "adaptive": True}
    config = EngineConfig(model="tiny", dtype="float32", max_num_seqs=4, speculative=SpeculativeConfig.parse(spec))
    engine = Engine(config, target=TARGET)
    engine.runner.target_cost, engine.proposer.cost = FrozenCost(), FrozenCost(0.01)
    switch = engine.switch
    for _ in range(40):  # batches of 2 and more measured slower speculating than decoding plainly
        for batch in (2, 3):
            on = switch.speculate(batch, lambda: 100.0)
            switch.record(batch, on, batch * (1 if on else 2), 1.0)
    assert not switch.preferred(2) and not switch.preferred(3) and switch.preferred(1)
    switch.speculate = lambda batch, estimate: switch.preferred(batch)  # no probes during the test
    reads, drafted = [], []
    read, step = engine.proposer.read_prompt, engine.runner.step
    engine.proposer.read_prompt = lambda seqs: (reads.append(len(seqs)), read(seqs))[1]
    engine.runner.step = lambda seqs, ks, forced=None: (drafted.append((len(seqs), sum(ks))), step(seqs, ks, forced))[1]
    outs = engine.generate_ids(PROMPTS, params)
    assert [o.token_ids for o in outs] == plain
    assert reads == [] and all(k == 0 for n, k in drafted if n > 1)
    # a new prompt alone is read, and drafts
    engine.generate_ids([[11, 12, 13, 14, 15, 16]], params[:1])
    assert reads and any(k > 0 for n, k in drafted if n == 1)


def test_steps_the_plan_gave_no_drafts_count_as_plain_decoding(plain):
    """Where the plan drafts nothing (a draft pass priced at 10 s), the switch measures plain
    decoding, not speculation that paid: it never says speculating pays there, and a new batch of
    prompts is not read into the draft (which it was, 0.38 s of a 10 s run of four clients on the
    Qwen pair, while 6 draft tokens were proposed in all)."""
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    spec = {"method": "draft_model", "model": DRAFTS["always"], "num_speculative_tokens": 3, "adaptive": True}
    config = EngineConfig(model="tiny", dtype="float32", max_num_seqs=4, speculative=SpeculativeConfig.parse(spec))
    engine = Engine(config, target=TARGET)
    engine.runner.target_cost, engine.proposer.cost = FrozenCost(), FrozenCost(a=10.0)
    reads = []
    read = engine.proposer.read_prompt
    engine.proposer.read_prompt = lambda seqs: (reads.append(len(seqs)), read(seqs))[1]
    for _ in range(2):  # the second batch of prompts arrives after the first was measured
        assert [o.token_ids for o in engine.generate_ids(PROMPTS, params)] == plain
    assert engine.stats.num_draft_tokens == 0
    measured = engine.switch.to_dict()
    assert measured and all(m["speculative_tok_s"] is None and m["plain_tok_s"] for m in measured.values())
    assert not any(engine.switch.pays(b) for b in measured) and reads == []


def test_free_drafters_have_no_switch():
    """n-gram and suffix drafts cost only the rows they add, which the target's refitted model
    prices: no switch second-guesses them."""
    for method in ("ngram", "suffix"):
        config = EngineConfig(model="tiny", dtype="float32", max_num_seqs=2,
                              speculative=SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 3}))
        assert Engine(config, target=TARGET).switch is None


def test_a_drafters_acceptance_carries_to_the_next_process(plain, tmp_cache, monkeypatch):
    """An adaptive engine keeps its drafter's acceptance in the cache when its requests are done;
    the next engine with the same target and drafter starts its plan from it, weighed as a few
    steps (engine.HISTORY_STEPS); another drafter does not, and a damaged file is ignored. The
    output is the target's either way."""
    from quickdraft.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "HISTORY_STEPS", 8)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": DRAFTS["always"], "num_speculative_tokens": 3})

    def engine(spec):
        return Engine(EngineConfig(model="tiny", dtype="float32", max_num_seqs=4, speculative=spec), target=TARGET)

    first = engine(spec)
    assert not first.acceptance.depths  # nothing kept yet
    assert [o.token_ids for o in first.generate_ids(PROMPTS, params)] == plain
    path = first._history
    assert path.parent == tmp_cache / "acceptance" and path.exists()
    second = engine(spec)
    assert second.acceptance.depths[0][0] == pytest.approx(8.0)
    assert second.acceptance.odds(3, 0.5).accept == pytest.approx(first.acceptance.odds(3, 0.5, prior_weight=0.0).accept, rel=0.2)
    assert [o.token_ids for o in second.generate_ids(PROMPTS, params)] == plain
    other = engine(SpeculativeConfig.parse({"method": "draft_model", "model": DRAFTS["never"], "num_speculative_tokens": 3}))
    assert other._history != path and not other.acceptance.depths
    path.write_text("{not json")
    assert not engine(spec).acceptance.depths
