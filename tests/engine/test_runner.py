"""The runner's step as its phases, on a tiny random model: each phase timed beside the data path,
the step's one commit, and the check that fails a sequence whose logits are not finite."""

from __future__ import annotations

import pytest
import torch

from quickdraft.config import EngineConfig, SpeculativeConfig
from quickdraft.engine.engine import Engine
from quickdraft.engine.runner import StepTimes
from quickdraft.verify.step import finite_rows
from quickdraft.models.loader import LoadedModel
from quickdraft.models.tiny import random_weights, tiny_config
from quickdraft.sampling import SamplingParams, argmax_finite, argmax_rows

CONFIG = tiny_config("qwen2", vocab_size=96, hidden_size=64, num_layers=2)
TARGET = LoadedModel(CONFIG, random_weights(CONFIG, seed=1, scale=2.0), None, "tiny-target")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_logit_fails_its_sequence_alone(bad):
    logits = torch.randn(7, 151936)  # sequences of 2, 0 and 2 drafts: rows 0-2, 3, 4-6
    logits[5, 1234] = bad
    walk = logits.clone()
    assert finite_rows(logits, [2, 0, 2]) == [True, True, False]
    assert torch.count_nonzero(logits[4:7]) == 0 and torch.count_nonzero(logits[:4]) > 0  # its rows zeroed for verify
    # the greedy walk's way: the argmax and the rows' check in one read, and a failed sequence's
    # argmax is its zeroed rows' (0)
    argmax, fine = argmax_finite(walk)
    assert torch.equal(argmax, argmax_rows(walk))
    if fine is not None:  # the kernels run here
        assert fine.tolist() == [True] * 5 + [False, True]
    want = argmax.clone()
    want[4:7] = 0
    assert finite_rows(walk, [2, 0, 2], fine, argmax) == [True, True, False]
    assert torch.equal(walk, logits) and torch.equal(argmax, want)


def test_finite_logits_whose_sum_overflows_pass():
    logits = torch.full((2, 1000), 3e38)  # every logit finite; a row's float32 sum is inf
    assert finite_rows(logits, [1]) == [True]
    assert finite_rows(logits, [1], *argmax_finite(logits)) == [True]
    assert torch.all(logits == 3e38)


def test_finite_logits_of_another_dtype():
    assert finite_rows(torch.randn(3, 50, dtype=torch.bfloat16), [0, 0, 0]) == [True] * 3


def test_step_times_each_phase_beside_the_data_path():
    times = StepTimes()
    with times("verify"):
        pass
    with times("commit"):
        pass
    assert set(times.seconds) == {"verify", "commit"} and times.total() == pytest.approx(sum(times.seconds.values()))
    assert times.total("verify") == times.seconds["verify"]


def _engine(spec):
    config = EngineConfig(model="tiny", dtype="float32", max_num_seqs=2, speculative=SpeculativeConfig.parse(spec))
    return Engine(config, target=TARGET)


def test_a_step_is_its_phases_and_one_commit():
    """Each phase timed; the commit moves the cached length over the pending token and the accepted
    drafts, appends the tokens and counts them (the run's counters are the engine's)."""
    engine = _engine({"method": "draft_model", "model": TARGET, "num_speculative_tokens": 3, "adaptive": False,
                      "quantization": None})
    engine.add_request([5, 17, 33, 2, 9], SamplingParams(max_tokens=20, temperature=0))
    engine.step()  # the prompt's pass
    seq = engine.scheduler.running[0]
    cached, out = seq.num_cached, len(seq.output_token_ids)
    engine.step()
    times = engine.runner.times.seconds
    assert set(times) == set(StepTimes.PHASES) and all(t >= 0 for t in times.values())
    # the draft is the target: all 3 drafts accepted, and a bonus token
    assert len(seq.output_token_ids) == out + 4 and seq.num_cached == cached + 1 + 3
    assert engine.stats is engine.runner.stats and engine.stats.num_accepted_tokens == 3
    assert seq.spec.num_emitted_tokens == 1 + 4


def test_the_draft_reads_the_prompt_in_the_prompts_step(trace_draft_passes):
    """A draft model reads each prompt in the step the target does (engine._draft_reads_prompts),
    so that the first decoding step drafts from one row, not from the whole prompt; a request
    that takes no drafts leaves the draft unread. The output is plain decoding's either way."""
    import quickdraft.proposers.draft.model as draft_model

    fed = trace_draft_passes(draft_model)
    engine = _engine({"method": "draft_model", "model": TARGET, "num_speculative_tokens": 3, "adaptive": False,
                      "quantization": None})
    prompts = [[5, 17, 33, 2, 9, 40, 41], [7, 8, 9]]
    drafted = engine.add_request(prompts[0], SamplingParams(max_tokens=12, temperature=0))
    engine.add_request(prompts[1], SamplingParams(max_tokens=12, temperature=0, num_speculative_tokens=0))
    engine.step()  # the prompts' pass
    assert fed == [[7]]  # one draft pass: the first prompt, whole; the second not read
    assert engine.proposer.catchup_rows(engine.scheduler.running[0]) == 0
    fed.clear()
    engine.step()
    assert fed[0] == [1]  # the first draft pass of decoding reads the token the prompt's pass chose
    outs = {}
    while engine.has_unfinished():
        outs |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    plain = _engine(None).generate_ids([prompts[0]], [SamplingParams(max_tokens=12, temperature=0)])[0]
    assert outs[drafted] == plain.token_ids and len(outs) == 2


def test_a_nan_logit_ends_its_request_with_an_error():
    engine = _engine(None)
    forward = engine.runner._forward

    def poisoned(seqs, batch):
        logits = forward(seqs, batch)
        with torch.inference_mode():
            logits[0, 3] = float("nan")
        return logits

    engine.runner._forward = poisoned
    engine.add_request([5, 17, 33], SamplingParams(max_tokens=8, temperature=0))
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "error" and "non-finite" in out.error
    assert not engine.has_unfinished()  # its slot released
