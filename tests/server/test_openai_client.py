"""The real ``openai`` client, sync and async, streaming and not, against ``quickdraft serve``."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from qd_server import API_KEY, MODEL

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def aclient_url(ngram_server):
    return ngram_server.url + "/v1"


def _spec(usage) -> dict:
    return usage.model_extra["speculative"] if usage.model_extra else usage.speculative


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["speculative"]["method"] == "ngram"


def test_sync_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    spec = _spec(r.usage)
    assert spec["method"] == "ngram" and spec["num_target_passes"] >= 1
    assert set(spec) >= {"num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "mean_accepted_length"}


def test_sync_completion_stream_equals_plain(client):
    kw = dict(model=MODEL, prompt="The three primary colors are", max_tokens=16, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_stop_and_seed(client):
    kw = dict(model=MODEL, prompt="List: apples, pears,", max_tokens=12, temperature=1.0, top_k=50, seed=7, n=3)
    kw["extra_body"] = {"top_k": kw.pop("top_k")}
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # choices use seeds seed, seed+1, ...
    s = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7"])
    assert s.choices[0].finish_reason == "stop" and " 7" not in s.choices[0].text and s.choices[0].text


def test_errors_are_openai_exceptions(client, ngram_server):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=5)
    bad = openai.OpenAI(base_url=ngram_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_async_stream_and_plain(aclient_url):
    async def run():
        client = openai.AsyncOpenAI(base_url=aclient_url, api_key=API_KEY, max_retries=0, timeout=120)
        plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
        stream = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                                      stream=True, stream_options={"include_usage": True})
        parts, roles, usage = [], [], None
        async for ch in stream:
            if ch.usage is not None:
                usage = ch.usage
            for c in ch.choices:
                roles += [c.delta.role] if c.delta.role else []
                parts.append(c.delta.content or "")
        whole = await plain
        await client.close()
        return whole, "".join(parts), roles, usage

    whole, text, roles, usage = asyncio.run(run())
    assert roles == ["assistant"]
    assert text == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert _spec(usage)["num_draft_tokens"] == _spec(whole.usage)["num_draft_tokens"]


def test_a_request_caps_its_own_speculation(client):
    """quickdraft's ``"speculative": {"num_speculative_tokens": N}`` body extension: 0 turns
    speculation off for that request, a smaller N bounds its drafts a step, a larger one is capped
    at the server's K (4 here); usage reports the cap it ran under; the text never changes."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count from one to twenty in words."}],
              max_tokens=24, temperature=0)
    base = client.chat.completions.create(**kw)
    runs = {k: client.chat.completions.create(**kw, extra_body={"speculative": {"num_speculative_tokens": k}})
            for k in (0, 1, 9)}
    assert {r.choices[0].message.content for r in runs.values()} == {base.choices[0].message.content}
    spec = {k: _spec(r.usage) for k, r in runs.items()}
    assert _spec(base.usage)["num_draft_tokens"] > 0 and spec[1]["num_draft_tokens"] > 0  # a text that drafts
    assert _spec(base.usage)["num_speculative_tokens"] == 4 and spec[9]["num_speculative_tokens"] == 4
    assert spec[0]["num_speculative_tokens"] == 0 and spec[0]["num_draft_tokens"] == 0
    assert spec[1]["num_speculative_tokens"] == 1 and len(spec[1]["accepted_per_position"]) <= 1
    assert spec[0]["num_target_passes"] == runs[0].usage.completion_tokens
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"speculative": {"num_speculative_tokens": 0}}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == base.choices[0].message.content
    assert _spec(chunks[-1].usage)["num_draft_tokens"] == 0
    for bad in ({"num_speculative_tokens": -1}, {"num_speculative_tokens": "2"}, {"k": 2}, 3):
        with pytest.raises(openai.BadRequestError, match="speculative"):
            client.chat.completions.create(**kw, extra_body={"speculative": bad})


def test_logprobs_are_plain_decodings_under_speculation(client, plain_client):
    """Chat ``logprobs`` + ``top_logprobs`` and the completions API's ``logprobs``: each token's
    log-probability is taken from the pass that verified it, so a speculating server reports
    exactly what a plain one does, streamed or not."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count from one to twenty in words."}],
              max_tokens=24, temperature=0, logprobs=True, top_logprobs=3)
    spec, base = client.chat.completions.create(**kw), plain_client.chat.completions.create(**kw)
    assert _spec(spec.usage)["num_draft_tokens"] > 0
    got, want = spec.choices[0].logprobs.content, base.choices[0].logprobs.content
    assert [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs]) for t in got] == \
        [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs]) for t in want]
    assert len(got) == spec.usage.completion_tokens and "".join(t.token for t in got) == spec.choices[0].message.content
    for t in got:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob and t.logprob <= 0.0
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in got]

    ckw = dict(model=MODEL, prompt="One, two, three, four,", max_tokens=16, temperature=0, logprobs=2)
    c_spec, c_base = client.completions.create(**ckw), plain_client.completions.create(**ckw)
    lp = c_spec.choices[0].logprobs
    assert lp.token_logprobs == c_base.choices[0].logprobs.token_logprobs and lp.tokens == c_base.choices[0].logprobs.tokens
    assert "".join(lp.tokens) == c_spec.choices[0].text and all(len(d) <= 2 for d in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    none = client.completions.create(**{**ckw, "logprobs": None})
    assert none.choices[0].logprobs is None and none.choices[0].text == c_spec.choices[0].text


def test_echo_gives_the_prompts_logprobs(client, plain_client):
    """``echo`` with ``logprobs`` (what lm-evaluation-harness's log-likelihood tasks send): the
    text starts with the prompt, and the logprobs cover the prompt's tokens (the first has none)
    and then the output's, the same with speculation as without."""
    kw = dict(model=MODEL, prompt="The capital of France is Paris. The capital of Italy is", max_tokens=4,
              temperature=0, logprobs=1, echo=True)
    r, p = client.completions.create(**kw), plain_client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(kw["prompt"]) and r.choices[0].text == p.choices[0].text
    prompt_len = r.usage.prompt_tokens
    assert len(lp.tokens) == prompt_len + r.usage.completion_tokens and "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0.0 for x in lp.token_logprobs[1:]) and lp.token_logprobs == p.choices[0].logprobs.token_logprobs
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # " Rome" after "The capital of Italy is" is the greedy continuation: its logprob is its row's best
    first_out = prompt_len
    assert lp.token_logprobs[first_out] == pytest.approx(max(lp.top_logprobs[first_out].values()))
    # the prompt's logprobs are plain decoding's too: what generating the prompt's own tokens would score
    head = client.completions.create(model=MODEL, prompt=kw["prompt"].split(" Paris")[0], max_tokens=1, temperature=0,
                                     logprobs=1)
    assert head.choices[0].text == " Paris"
    paris = lp.tokens.index(" Paris")
    assert lp.token_logprobs[paris] == head.choices[0].logprobs.token_logprobs[0]


def test_echo_streams_the_prompt_first(client):
    """With stream, echo sends each choice's prompt (and its logprobs) as its first chunk; the
    chunks together are the unstreamed reply, text and logprobs alike."""
    kw = dict(model=MODEL, prompt="The capital of France is Paris. The capital of Italy is", max_tokens=6,
              temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].text == kw["prompt"]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    lps = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert tokens == whole.choices[0].logprobs.tokens and lps == whole.choices[0].logprobs.token_logprobs
    offsets = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset


def test_tokenizer_routes_and_an_lm_eval_loglikelihood_request(ngram_server):
    """vLLM's /tokenizer_info, /tokenize and /detokenize (lm-evaluation-harness's remote tokenizer),
    and the body its log-likelihood requests send (token ids, echo, logprobs=1, max_tokens=1),
    read the way it reads the answer: the continuation's logprobs and whether each was the best."""
    url, headers = ngram_server.url, ngram_server.headers
    info = httpx.get(url + "/tokenizer_info", headers=headers).json()
    assert info["eos_token"] and info["chat_template"] and info["model_max_length"] > 0
    assert httpx.get(url + "/tokenizer_info").status_code == 401  # the API key guards it as it guards /v1
    context, continuation = "The capital of France is", " Paris"
    ctx = httpx.post(url + "/tokenize", headers=headers, json={"prompt": context, "add_special_tokens": False}).json()
    whole = httpx.post(url + "/tokenize", headers=headers, json={"prompt": context + continuation}).json()
    assert whole["tokens"][: ctx["count"]] == ctx["tokens"] and whole["count"] > ctx["count"]
    back = httpx.post(url + "/detokenize", headers=headers, json={"tokens": whole["tokens"]}).json()
    assert back["prompt"] == context + continuation
    bad = httpx.post(url + "/detokenize", headers=headers, json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(url + "/tokenize", headers=headers, json={"model": "gpt-5", "prompt": "x"}).status_code == 404
    body = {"model": MODEL, "prompt": [whole["tokens"]], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    choice = httpx.post(url + "/v1/completions", headers=headers, json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == whole["count"] + 1  # the prompt's tokens and the one generated
    scored, tops = lp["token_logprobs"][ctx["count"] : -1], lp["top_logprobs"][ctx["count"] : -1]
    assert scored and all(x < 0.0 for x in scored)
    assert all(t == max(top.values()) for t, top in zip(scored, tops))  # " Paris" is the greedy continuation


def test_penalties_and_bias_are_plain_decodings_under_speculation(client, plain_client, plain_server):
    """presence/frequency penalties, logit_bias and vLLM's repetition_penalty and min_tokens: the
    speculating server's text is the plain server's, and the rules do change it."""
    text = "the quick brown fox jumps over the lazy dog. " * 3
    kw = dict(model=MODEL, messages=[{"role": "user", "content": f"Repeat this text exactly: {text}"}], max_tokens=32,
              temperature=0)
    base = client.chat.completions.create(**kw).choices[0].message.content
    banned = plain_client.completions.create(model=MODEL, prompt="One, two,", max_tokens=1, temperature=0, logprobs=1)
    ban_id = httpx.post(plain_server.url + "/tokenize", headers=plain_server.headers,
                        json={"prompt": banned.choices[0].text, "add_special_tokens": False}).json()["tokens"][0]
    # the base's first token banned too: the rules change the text whatever the CPU's kernel path
    # rounds (mild penalties alone left AVX2's text as it was); the penalties mild enough that the
    # text still repeats the prompt, so that the n-gram proposer finds drafts under them
    first = httpx.post(plain_server.url + "/tokenize", headers=plain_server.headers,
                       json={"prompt": base, "add_special_tokens": False}).json()["tokens"][0]
    rules = dict(frequency_penalty=0.2, presence_penalty=0.1, logit_bias={str(ban_id): -100, str(first): -100},
                 extra_body={"repetition_penalty": 1.05, "min_tokens": 20})
    spec = client.chat.completions.create(**kw, **rules)
    ref = plain_client.chat.completions.create(**kw, **rules)
    assert spec.choices[0].message.content == ref.choices[0].message.content != base
    assert _spec(spec.usage)["num_draft_tokens"] > 0 and spec.usage.completion_tokens >= 20
    c = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0,
                                  logit_bias={str(ban_id): -100})
    assert not c.choices[0].text.startswith(banned.choices[0].text)


def test_min_p_of_one_is_greedy_under_speculation(client):
    """vLLM's min_p: at 1.0 only the most likely token survives, so sampling at any temperature is
    greedy decoding, speculation or not."""
    kw = dict(model=MODEL, prompt="The three primary colors are", max_tokens=16)
    greedy = client.completions.create(**kw, temperature=0)
    hot = client.completions.create(**kw, temperature=1.5, seed=3, extra_body={"min_p": 1.0})
    assert hot.choices[0].text == greedy.choices[0].text
