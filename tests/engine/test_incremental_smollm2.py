"""A step's bookkeeping does not grow with the output (SmolLM2-135M-Instruct, real generations):
the text is decoded a few tokens a step, yet equals a decode of the whole output after every
step; stop strings cut where a search of the whole text would; ``Sequence.token_ids`` is one
list, appended to."""

from __future__ import annotations

import pytest

from quickdraft import LLM, SamplingParams

PROMPTS = [
    "<|im_start|>user\nWrite a short poem about the sea in French, with emojis.<|im_end|>\n<|im_start|>assistant\n",
    "日本の首都は",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), max_num_seqs=4)


def counting_decode(llm: LLM) -> list[int]:
    """Make the engine's tokenizer count the token ids it decodes: one entry a decode call."""
    calls: list[int] = []
    decode = llm.tokenizer.decode
    llm.tokenizer.decode = lambda ids, **kw: calls.append(len(ids)) or decode(ids, **kw)
    return calls


def steps(llm: LLM, prompts: list[str], params: SamplingParams):
    """Yield each step's outputs, with the number of token ids decoded in that step."""
    engine = llm.engine
    calls = counting_decode(llm)
    try:
        for p in prompts:
            engine.add_request(llm.tokenizer.encode(p), params)
        while engine.has_unfinished():
            calls.clear()
            outs = engine.step()
            yield outs, sum(calls)
    finally:
        del llm.tokenizer.decode


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_text_equals_a_whole_decode_after_every_step(llm, temperature):
    params = SamplingParams(max_tokens=120, temperature=temperature, seed=7)
    seen = 0
    for outs, _ in steps(llm, PROMPTS, params):
        for o in outs:
            assert o.text == llm.tokenizer.decode(o.token_ids)
            seen += 1
    assert seen > 100


def test_decoded_tokens_per_step_stay_bounded(llm):
    """A 600-token generation decodes a bounded number of tokens a step; decoding the whole
    output every step (as before) would decode up to 600 in one step, 180,000 in all."""
    params = SamplingParams(max_tokens=600, ignore_eos=True, temperature=1.0, seed=1)
    per_step = [(len(outs[0].token_ids), n) for outs, n in steps(llm, PROMPTS[:1], params)]
    assert per_step[-1][0] == 600
    assert max(n for _, n in per_step) <= 16
    assert sum(n for _, n in per_step) <= 4 * 600


def test_stop_strings_per_step_stay_bounded(llm):
    """With stop strings the text is brought up to date token by token: still a bounded number of
    decoded tokens a step."""
    params = SamplingParams(max_tokens=300, ignore_eos=True, temperature=1.0, seed=2, stop=("@@@never@@@",))
    per_step = [n for _, n in steps(llm, PROMPTS[:1], params)]
    assert len(per_step) == 300 and max(per_step) <= 16


def _first_stop(tokenizer, token_ids: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(tokens kept, text) where the whole-text search of each prefix first finds a stop string."""
    for t in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:t])
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return t, text[: min(hits)]
    return None


def test_stop_strings_cut_where_a_whole_text_search_does(llm):
    base = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    for p, out in zip(PROMPTS, llm.generate(PROMPTS, base)):
        t = out.text
        assert len(t) > 40
        # one character, a span that crosses tokens, one near the end, and one never there
        stops = (t[len(t) // 3], t[len(t) // 2 : len(t) // 2 + 5], t[-8:-4], "\u00a7never\u00a7")
        for stop_set in [stops[:1], stops[1:2], stops[2:3], stops[1:]]:
            want = _first_stop(llm.tokenizer, out.token_ids, stop_set)
            got = llm.generate([p], SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True, stop=stop_set))[0]
            assert want is not None and got.finish_reason == "stop"
            assert (len(got.token_ids), got.text) == want
            assert got.token_ids == out.token_ids[: want[0]]


def test_token_ids_is_one_list_appended(llm):
    engine = llm.engine
    rid = engine.add_request(llm.tokenizer.encode(PROMPTS[2]), SamplingParams(max_tokens=30, ignore_eos=True))
    seq = engine.scheduler.find(rid)
    first = seq.token_ids
    while engine.has_unfinished():
        engine.step()
        assert seq.token_ids is first and first == seq.prompt_token_ids + seq.output_token_ids
    assert len(first) == len(seq.prompt_token_ids) + 30
